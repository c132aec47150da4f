"""transformers' continuous batching (CB) runs each ``ContinuousBatchingManager``'s generation loop in a background
thread, and with CUDA graphs on it captures lazily: the first batch of each padded shape ``(padded_q, padded_kv)`` runs
``_forward_process_and_sample`` once eagerly (the warmup, which computes the step) and is then captured inside
``ContinuousBatchProcessor._generation_step``. That capture used ``torch.cuda.graph(graph, stream=compute_stream,
pool=self.graph_pool)``, torch's default ``capture_error_mode="global"``: while it is open, *every* thread of the
process is forbidden to wait for the device. With two managers in one process (two model instances, one thread
each), the other manager's ordinary end of step -- reading its sampled tokens back to the host -- fails with
CUDA's "operation not permitted when stream is capturing", and the open capture is invalidated too ("operation
failed due to a previous error during capture"): both generation loops die and every request fails. One manager alone,
or either without graphs, never meets it. The fix captures with ``capture_error_mode="thread_local"``, which only
restricts the capturing thread.

Upstream: https://github.com/huggingface/transformers/pull/44924 ("Continuous batching thread safety", huggingface/
transformers, author Qubitium, description 2026-03-22, merged; merge date and commit not known to me). Read: the PR
description (its first of two fixes: "Continus Batching crashes with torch graph errors with 2 threads on 2 separate
model instances (same model path, but two distinct instances). Cause is missing `capture_error_mode="thread_local"`");
the PR's hunk in ``src/transformers/generation/continuous_batching/continuous_api.py`` (blob 0019b2df1a7d ->
08be21022d73, ``ContinuousBatchProcessor._generation_step``: ``with torch.cuda.graph(graph, stream=compute_stream,
pool=self.graph_pool):`` becomes the same call with ``capture_error_mode="thread_local"`` and the comment "Continuous
batching can run multiple manager threads concurrently in one process. PyTorch's default capture mode ("global") errors
on CUDA actions from other threads, which invalidates unrelated captures even when each manager uses a different
device"), read as a stored third-party patch script that applies exactly that hunk; a stored later ``continuous_api.py``
(after the fix: ``ContinuousBatchProcessor.__init__``, ``prepare_next_batch``, ``update_batch``, ``_generation_step``
with its warmup / capture / replay branches and ``retrieve_device_outputs``, ``_forward_process_and_sample``,
``_model_forward``, ``_process_logit``, ``_sample``; ``ContinuousBatchingManager.start`` (one
``threading.Thread(target=self._run_generation_loop)`` per manager), ``add_request``, ``get_result``, ``stop``,
``_run_generation_loop``, ``_inner_generation_loop``, ``_handle_critical_error``); a stored older ``continuous_api.py``
(graphs keyed by ``(padded_q, padded_read_index_size)``, capture without pool or mode); and stored ``input_outputs.py``
versions (``retrieve_device_outputs``: ``compute_stream.synchronize()``; ``prepare_batch_update``:
``self.output_ids[0, :len(self.requests_in_batch)].tolist()``; ``_reset_static_tensors`` filling the attention mask
with the dtype's min and the read/write indices with a trash index; ``get_model_kwargs``); and the current
``model_runner.py`` (``ModelRunner._capture_graph``: warmup, then capture in ``"thread_local"`` mode).
Not read: the PR's second fix (``tie_weights`` state made context-local for concurrent loading; not modelled), its
review thread, the whole pre-fix file (only the hunk and the versions around it), any traceback of the crash (the PR
quotes none), ``cache.py``/``scheduler.py``/the paged attention kernels (stand-ins below).
Symptom: the PR's words above: with two CB managers generating concurrently in two threads, generation "crashes with
torch graph errors"; requests fail (each loop's ``_handle_critical_error`` fails all its requests).
Mechanism: manager B is decoding, replaying a graph captured earlier; manager A meets a new padded shape and captures
in global mode. While A's capture is open, B's step ends with ``update_batch`` -> ``prepare_batch_update``, whose
``.tolist()`` of B's device output buffer waits for the device: CUDA refuses it in B's thread and marks A's capture
failed, which A sees when the capture closes. Which of B's waits met the capture upstream is my guess: the PR names no
call; in the sync IOs the end of a step waits twice (``compute_stream.synchronize()``, then ``.tolist()``), and the
model keeps the second (the engine has one stream, so ``compute_stream`` is None here, as on a CPU run upstream).
Doctor: sync-in-capture, at _generation_step. A host synchronisation (another thread's read of values) happens while
the global-mode capture opened there is in progress; ``ContinuousBatchProcessor._generation_step`` chooses the capture
mode, and it is the function the fix changes.
Fix (upstream): ``capture_error_mode="thread_local"`` on that capture (later versions moved it, with the same mode, to
``ModelRunner._capture_graph``).
Modelled: ``ContinuousBatchingManager`` (``start``, ``add_request``, ``get_result``, ``stop``, ``_generation_step``,
``_run_generation_loop``, ``_inner_generation_loop``, ``_handle_critical_error``), ``ContinuousBatchProcessor``
(``prepare_next_batch``, ``_generation_step``, ``_forward_process_and_sample``, ``_model_forward``,
``_process_logit``, ``_sample``, ``update_batch``, ``_handle_request_error``, ``fail_all_requests``, ``graph_pool``),
``ContinuousBatchingIOs`` (``prepare_batch_tensors``, ``_reset_static_tensors``, ``get_model_kwargs``,
``get_cb_kwargs``, ``get_graph``, ``set_graph``, ``retrieve_device_outputs``, ``prepare_batch_update``),
``pad_to_interval``, ``RequestState``, ``FutureRequestState``, ``FIFOScheduler.schedule_batch``,
``PagedAttentionCache`` and ``traced``.
Stand-ins: the model is mine (2 layers of width 16, one head, SiLU MLP of 32, vocabulary 32, learned positions,
float64, greedy), with ``paged|eager`` attention over a flat paged cache (block size 4) read and written through the
batch's read/write indices, padded entries pointing at a trash slot and masked with the dtype's min. The scheduler
prefills whole prompts then decodes one token per request; no sliding window, prefix sharing, async IOs, decode fast
path, compile or LRU eviction of graphs; logits processors are an empty list. ``@traced`` spans (OpenTelemetry
upstream) are where the workload's thread schedule takes its turns -- a stand-in for the OS timing of the PR's two
threads: the two loops take whole iterations in turn (the engine emulates one device, where one manager's replay
during the other's capture is refused in any mode, as torch refuses it on one GPU; the fix's comment speaks of managers
on different devices), except once: B's third ``update_batch`` runs while A's first capture is open, the collision the
PR describes (its timing is the workload's choice).
Workload: two instances of the same model; manager B gets prompts of 3 and 2 tokens (6 new tokens each) and runs two
steps (each capturing its shape) and replays its third before A starts; A gets prompts of 4 and 3 tokens (5 new
each). Padding: Q to 4 tokens, KV to 8. Outputs: every request's generated tokens, A's then B's. The run without
graphs is the same two managers with ``use_cuda_graph=False`` (unpadded, no capture), threads and schedule alike.
Measured: the check printed
  transformers_44924_cb_global_capture_broken_by_other_managers_output_read [bug] on cpu: misbehaves (raised
    RuntimeError: request A-0 failed: operation failed due to a previous error during capture: Tensor.tolist() at
    workbench/zoo/trials/round148/transformers_44924_cb_global_capture_broken_by_other_managers_output_read.py:365 in
    prepare_batch_update: new_tokens = self.output_ids[0, : len(self.requests_in_batch)].tolist(), on another thread,
    waited for the device while A q8 kv0 was being captured in 'global' mode, and CUDA invalidated the capture.)
  transformers_44924_cb_global_capture_broken_by_other_managers_output_read [fix] on cpu: equals eager (max |graph -
    eager| = 0)
With the bug B's loop fails at its third step's read (CaptureError) and A's at its first capture's end; every request
of both managers fails. With the fix both managers finish and all 4 requests' tokens equal the run without graphs.
"""
from __future__ import annotations

import functools
import math
import queue
import threading

import torch
from torch import nn

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, remember_step, replay

UPSTREAM = "https://github.com/huggingface/transformers/pull/44924"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_generation_step"
SYMPTOM = ("two continuous-batching managers generating in two threads of one process: one captures a CUDA graph for a "
           "new padded shape in torch's default global capture mode while the other reads its sampled tokens back, "
           "which CUDA refuses and which invalidates the capture: both generation loops crash and all requests fail")

DTYPE = torch.float64
VOCAB, DIM, FFN, LAYERS = 32, 16, 32, 2
BLOCK, NUM_BLOCKS, MAX_BATCH_TOKENS, MAX_POS = 4, 16, 16, 32
Q_INTERVAL, KV_INTERVAL = 4, 8
WAIT_S = 30.0
_variant = "bug"


# --- tracing spans (OpenTelemetry upstream): the workload's thread schedule takes its turns here ---------------------

class _TicketLock:
    """A fair lock: the loops' iterations take turns in the order they asked (no idle loop starves a busy one)."""

    def __init__(self):
        self.cond, self.next_ticket, self.serving = threading.Condition(), 0, 0

    def acquire(self) -> None:
        with self.cond:
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
            if not self.cond.wait_for(lambda: self.serving == ticket, WAIT_S):
                raise RuntimeError("thread schedule timed out")

    def release(self) -> None:
        with self.cond:
            self.serving += 1
            self.cond.notify_all()


class _Schedule:
    """(stand-in for the OS) The loops take whole iterations in turn, one device; once, B's pending update_batch runs
    while A's first capture is open."""

    def __init__(self, meet_at_forward: int):
        self.lock = _TicketLock()
        self.meet_at_forward = meet_at_forward      # A's model_forward that is its first capture (1 without graphs)
        self.b_ready, self.a_open, self.b_read = threading.Event(), threading.Event(), threading.Event()
        self.a_forwards = self.b_updates = 0

    @staticmethod
    def _wait(event: threading.Event) -> None:
        if not event.wait(WAIT_S):
            raise RuntimeError("thread schedule timed out")

    def enter(self, span: str, who: str) -> None:
        if span == "generation_loop":
            if who == "A" and not self.b_ready.is_set():
                self._wait(self.b_ready)
            self.lock.acquire()
        elif span == "update_batch" and who == "B":
            self.b_updates += 1
            if self.b_updates == 3:                 # B's third step has replayed; its read waits for A's capture
                self.lock.release()
                self.b_ready.set()
                self._wait(self.a_open)
        elif span == "model_forward" and who == "A":
            self.a_forwards += 1
            if self.a_forwards == self.meet_at_forward:
                self.a_open.set()
                self._wait(self.b_read)

    def exit(self, span: str, who: str) -> None:
        if span == "generation_loop":
            self.lock.release()
        elif span == "update_batch" and who == "B" and self.b_updates == 3 and not self.b_read.is_set():
            self.b_read.set()
            self.lock.acquire()


_SCHEDULE: _Schedule | None = None


def traced(func=None, *, span_name: str | None = None):
    if func is None:
        return functools.partial(traced, span_name=span_name)
    name = span_name or func.__name__

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        who = (self.model.config if hasattr(self, "model") else self.config).name_or_path
        if _SCHEDULE is not None:
            _SCHEDULE.enter(name, who)
        try:
            return func(self, *args, **kwargs)
        finally:
            if _SCHEDULE is not None:
                _SCHEDULE.exit(name, who)
    return wrapper


# --- model (stand-in): a tiny causal LM with paged|eager attention ------------------------------------------------

class Config:
    def __init__(self, name_or_path: str):
        self.name_or_path = name_or_path


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class TinyCausalLM(nn.Module):
    def __init__(self, name: str, device):
        super().__init__()
        self.config, self.device = Config(name), torch.device(device)
        gen = generator(44924)                       # the same model path: two instances, the same weights

        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.embed, self.pos = w(VOCAB, DIM, scale=1.0), w(MAX_POS, DIM, scale=0.5)
        self.layers = [dict(wq=w(DIM, DIM, scale=DIM ** -0.5), wk=w(DIM, DIM, scale=DIM ** -0.5),
                            wv=w(DIM, DIM, scale=DIM ** -0.5), wo=w(DIM, DIM, scale=DIM ** -0.5),
                            w1=w(DIM, FFN, scale=DIM ** -0.5), w2=w(FFN, DIM, scale=FFN ** -0.5),
                            n1=w(DIM, scale=0.1) + 1, n2=w(DIM, scale=0.1) + 1) for _ in range(LAYERS)]
        self.lm_head = w(DIM, VOCAB, scale=2.0)

    def forward(self, input_ids, position_ids, attention_mask, read_index, write_index, cache, **_):
        h = self.embed[input_ids[0]] + self.pos[position_ids[0]]                        # [q, dim]
        for i, lay in enumerate(self.layers):
            x = rms_norm(h, lay["n1"])
            k_all, v_all = cache.update(i, x @ lay["wk"], x @ lay["wv"], read_index, write_index)
            scores = (x @ lay["wq"]) @ k_all.T / math.sqrt(DIM) + attention_mask[0, 0]
            h = h + torch.softmax(scores, -1) @ v_all @ lay["wo"]
            x = rms_norm(h, lay["n2"])
            g = x @ lay["w1"]
            h = h + (g * torch.sigmoid(g)) @ lay["w2"]
        return type("Out", (), {"logits": (h @ self.lm_head)[None]})()


class PagedAttentionCache:
    """(stand-in) A flat paged K/V store per layer; the last slot is the trash slot padded indices point at."""

    def __init__(self, device):
        self.num_slots = NUM_BLOCKS * BLOCK
        self.trash = self.num_slots
        self.keys = torch.zeros(LAYERS, self.num_slots + 1, DIM, dtype=DTYPE, device=device)
        self.values = torch.zeros_like(self.keys)
        self.free_blocks = list(range(NUM_BLOCKS))
        self.blocks: dict[str, list[int]] = {}

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        table = self.blocks.setdefault(request_id, [])
        while len(table) * BLOCK < end:
            table.append(self.free_blocks.pop(0))
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]

    def update(self, layer, k, v, read_index, write_index):
        self.keys[layer].index_copy_(0, write_index, k)
        self.values[layer].index_copy_(0, write_index, v)
        return self.keys[layer][read_index], self.values[layer][read_index]


# --- requests and scheduler ------------------------------------------------------------------------------------

class RequestState:
    def __init__(self, request_id, initial_tokens, max_new_tokens):
        self.request_id, self.initial_tokens, self.max_new_tokens = request_id, list(initial_tokens), max_new_tokens
        self.generated_tokens: list[int] = []
        self.status, self.error = "PENDING", None

    def length(self) -> int:
        return len(self.initial_tokens) + len(self.generated_tokens)


class FutureRequestState:
    def __init__(self, state, query_length):
        self.state, self.query_length = state, query_length


class FIFOScheduler:
    def __init__(self):
        self.waiting_requests: list[RequestState] = []
        self.active_requests: dict[str, RequestState] = {}

    def has_pending_requests(self) -> bool:
        return bool(self.waiting_requests or self.active_requests)

    def schedule_batch(self):
        while self.waiting_requests:                   # prefill: whole prompts
            state = self.waiting_requests.pop(0)
            state.status = "PREFILLING"
            self.active_requests[state.request_id] = state
        batch = [FutureRequestState(s, len(s.initial_tokens) if s.status == "PREFILLING" else 1)
                 for s in self.active_requests.values()]
        num_q_tokens = sum(f.query_length for f in batch)
        max_kv_read = sum(f.state.length() - f.query_length for f in batch)
        return batch, num_q_tokens, max_kv_read


def pad_to_interval(x: int, interval: int, maximum: int) -> int:
    return min(-(-x // interval) * interval, maximum)


# --- inputs and outputs: the static tensors the graphs read and write ----------------------------------------------

class ContinuousBatchingIOs:
    def __init__(self, cache: PagedAttentionCache, device):
        self.cache, self.device, self.compute_stream = cache, device, None    # (one stream: the engine's)
        q, kv = MAX_BATCH_TOKENS, MAX_BATCH_TOKENS + NUM_BLOCKS * BLOCK
        z = functools.partial(torch.zeros, dtype=torch.long, device=device)
        self.input_ids, self.position_ids = z(1, q), z(1, q)
        self.attention_mask = torch.zeros(1, 1, q, kv, dtype=DTYPE, device=device)
        self.write_index_storage, self.read_index_storage, self.logits_indices = z(q), z(kv), z(q)
        self.output_ids = z(1, q + 1)
        self.graphs: dict[tuple, object] = {}
        self.requests_in_batch: list[FutureRequestState] = []

    def _reset_static_tensors(self) -> None:
        self.input_ids.zero_()
        self.position_ids.zero_()
        self.attention_mask.fill_(torch.finfo(DTYPE).min)
        self.write_index_storage.fill_(self.cache.trash)
        self.read_index_storage.fill_(self.cache.trash)
        self.logits_indices.zero_()

    def prepare_batch_tensors(self, requests_in_batch, num_q_tokens, max_kv_read) -> None:
        self._reset_static_tensors()
        self.requests_in_batch, self.padded = requests_in_batch, (num_q_tokens, max_kv_read)
        ids, pos, writes, reads, logits_idx, allowed = [], [], [], [], [], []
        for f in requests_in_batch:
            s, start = f.state, f.state.length() - f.query_length
            tokens = (s.initial_tokens + s.generated_tokens)[start:]
            q0 = len(ids)
            ids += tokens
            pos += list(range(start, s.length()))
            writes += self.cache.slots(s.request_id, start, s.length())
            k0 = len(reads)
            reads += self.cache.slots(s.request_id, 0, s.length())
            allowed += [(q0 + j, k0 + kk) for j in range(f.query_length) for kk in range(start + j + 1)]
            logits_idx.append(len(ids) - 1)
        n, m = len(ids), len(reads)

        def put(dst, data):
            dst[:len(data)].copy_(torch.tensor(data, dtype=dst.dtype).to(self.device))
        put(self.input_ids[0], ids)
        put(self.position_ids[0], pos)
        put(self.write_index_storage, writes)
        put(self.read_index_storage, reads)
        put(self.logits_indices, logits_idx)
        mask = torch.full((n, m), torch.finfo(DTYPE).min, dtype=DTYPE)
        qi, ki = zip(*allowed)
        mask[list(qi), list(ki)] = 0.0
        self.attention_mask[0, 0, :n, :m].copy_(mask.to(self.device))
        self.actual = (n, m)

    def get_model_kwargs(self, use_padding: bool) -> dict:
        q, kv = self.padded if use_padding else self.actual
        kv_len = q + kv if use_padding else kv
        return dict(input_ids=self.input_ids[:, :q], position_ids=self.position_ids[:, :q],
                    attention_mask=self.attention_mask[:, :, :q, :kv_len], read_index=self.read_index_storage[:kv_len],
                    write_index=self.write_index_storage[:q], logits_indices=self.logits_indices[:q],
                    cache=self.cache)

    def get_cb_kwargs(self):
        return None, None, self.output_ids

    def get_graph(self):
        return self.graphs.get(self.padded)

    def set_graph(self, g) -> None:
        self.graphs[self.padded] = g

    def retrieve_device_outputs(self) -> None:
        if self.compute_stream is not None:
            self.compute_stream.synchronize()

    def prepare_batch_update(self):
        requests_in_batch = self.requests_in_batch
        new_tokens = self.output_ids[0, : len(self.requests_in_batch)].tolist()
        return requests_in_batch, new_tokens


# --- batch processor and manager ---------------------------------------------------------------------------------

class ContinuousBatchProcessor:
    def __init__(self, model, output_queue, use_cuda_graph: bool, device):
        self.config, self.output_queue, self.use_cuda_graph = model.config, output_queue, use_cuda_graph
        self.cache = PagedAttentionCache(device)
        self.scheduler = FIFOScheduler()
        self.inputs_and_outputs = ContinuousBatchingIOs(self.cache, device)
        self._pad_inputs = use_cuda_graph
        self.graph_pool = graph_pool_handle(device) if use_cuda_graph else None
        self.device = device
        if use_cuda_graph:
            io, owner = self.inputs_and_outputs, f"transformers CB manager {model.config.name_or_path}"
            events.static_buffers(owner, {"input_ids": io.input_ids, "position_ids": io.position_ids,
                                          "attention_mask": io.attention_mask, "write_index": io.write_index_storage,
                                          "read_index": io.read_index_storage, "logits_indices": io.logits_indices})
            events.persistent_state(owner, {"key_cache": self.cache.keys, "value_cache": self.cache.values})

    @traced
    def prepare_next_batch(self) -> bool:
        if not self.scheduler.has_pending_requests():
            return False
        requests_in_batch, num_q_tokens, max_kv_read = self.scheduler.schedule_batch()
        if self._pad_inputs:
            num_q_tokens = pad_to_interval(num_q_tokens, Q_INTERVAL, MAX_BATCH_TOKENS)
            max_kv_read = pad_to_interval(max_kv_read, KV_INTERVAL, NUM_BLOCKS * BLOCK)
        self.inputs_and_outputs.prepare_batch_tensors(requests_in_batch, num_q_tokens, max_kv_read)
        return True

    @traced
    def update_batch(self) -> None:
        requests_in_batch, new_tokens = self.inputs_and_outputs.prepare_batch_update()
        for future_state, token in zip(requests_in_batch, new_tokens):
            state = future_state.state
            state.status = "DECODING"
            state.generated_tokens.append(token)
            if len(state.generated_tokens) >= state.max_new_tokens:
                state.status = "FINISHED"
                del self.scheduler.active_requests[state.request_id]
                self.output_queue.put(state)

    def _handle_request_error(self, error, state) -> None:
        state.status, state.error = "FAILED", str(error)
        self.output_queue.put(state)

    def fail_all_requests(self, error) -> None:
        for state in list(self.scheduler.active_requests.values()) + self.scheduler.waiting_requests:
            self._handle_request_error(error, state)
        self.scheduler.active_requests.clear()
        self.scheduler.waiting_requests.clear()

    @traced
    @torch.no_grad()
    def _generation_step(self, model, logit_processor) -> None:
        batch_data = self.inputs_and_outputs.get_model_kwargs(use_padding=self._pad_inputs)
        carry_over_ids, prev_output_ids, output_ids = self.inputs_and_outputs.get_cb_kwargs()
        forward_fn = self._forward_process_and_sample
        args = (model, batch_data, logit_processor, carry_over_ids, prev_output_ids, output_ids)
        if not self.use_cuda_graph:
            forward_fn(*args)
        else:
            g = self.inputs_and_outputs.get_graph()
            if g is not None:
                replay(g, output_ids)
            else:
                with events.warmup(real=True):           # the warmup computes this step's result
                    forward_fn(*args)
                g = new_graph(self.device)
                q, kv = self.inputs_and_outputs.padded
                if _variant == "bug":
                    with graph(g, pool=self.graph_pool, name=f"{self.config.name_or_path} q{q} kv{kv}"):
                        forward_fn(*args)
                else:
                    # Continuous batching can run multiple manager threads concurrently in one process. PyTorch's
                    # default capture mode ("global") errors on CUDA actions from other threads.
                    with graph(g, pool=self.graph_pool, name=f"{self.config.name_or_path} q{q} kv{kv}",
                               capture_error_mode="thread_local"):
                        forward_fn(*args)
                remember_step(g, functools.partial(forward_fn, *args))
                self.inputs_and_outputs.set_graph(g)
        self.inputs_and_outputs.retrieve_device_outputs()

    def _forward_process_and_sample(self, model, batch_data, logit_processor, carry_over_ids, prev_output_ids,
                                    output_ids) -> None:
        logits = self._model_forward(model, batch_data)
        probs = self._process_logit(batch_data, logits, logit_processor)
        self._sample(probs, batch_data["logits_indices"], output_ids)

    @traced(span_name="model_forward")
    def _model_forward(self, model, batch_data):
        return model(**batch_data).logits

    def _process_logit(self, batch_data, logits, logit_processor):
        batch_size, seq_len, vocab_size = logits.shape
        logits_2d = logits.view(batch_size * seq_len, vocab_size)
        for processor in logit_processor:                  # (an empty list here)
            logits_2d = processor(batch_data["input_ids"].view(-1), logits_2d)
        return logits_2d.view(batch_size, seq_len, vocab_size)

    def _sample(self, probs, logits_indices, output_ids) -> None:
        next_tokens = torch.argmax(probs.squeeze(0), dim=-1)       # greedy
        tokens = next_tokens.size(0)
        next_tokens = next_tokens[logits_indices[:tokens]]
        output_ids[0, :tokens].copy_(next_tokens)


class ContinuousBatchingManager:
    def __init__(self, model, use_cuda_graph: bool):
        self.model, self.use_cuda_graph = model, use_cuda_graph
        self.logit_processor: list = []
        self.output_queue: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.batch_processor = ContinuousBatchProcessor(model, self.output_queue, use_cuda_graph, model.device)
        self._generation_thread = None

    def start(self) -> None:
        self._generation_thread = threading.Thread(target=self._run_generation_loop)
        self._generation_thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self._generation_thread.join(2 * WAIT_S)

    def add_request(self, input_ids, request_id, max_new_tokens) -> None:
        self.batch_processor.scheduler.waiting_requests.append(RequestState(request_id, input_ids, max_new_tokens))

    def get_result(self, timeout: float):
        return self.output_queue.get(timeout=timeout)

    def _generation_step(self) -> None:
        self.batch_processor._generation_step(self.model, self.logit_processor)

    def _run_generation_loop(self) -> None:
        batch_processor = self.batch_processor
        try:
            while (not self.stop_event.is_set()) or batch_processor.scheduler.has_pending_requests():
                self._inner_generation_loop(batch_processor)
        except Exception as e:  # noqa: BLE001 - upstream logs it and fails every request
            self._handle_critical_error(e, batch_processor)

    @traced(span_name="generation_loop")
    def _inner_generation_loop(self, batch_processor) -> None:
        if not batch_processor.prepare_next_batch():
            return
        self._generation_step()
        batch_processor.update_batch()

    def _handle_critical_error(self, error, batch_processor) -> None:
        self.stop_event.set()
        batch_processor.fail_all_requests(error)


# --- workload ----------------------------------------------------------------------------------------------------

PROMPTS = {"A": ([5, 9, 1, 7], [12, 3, 30]), "B": ([2, 17, 8], [21, 4])}
NEW_TOKENS = {"A": 5, "B": 6}


def serve(device, use_cuda_graph: bool) -> list:
    global _SCHEDULE
    _SCHEDULE = _Schedule(meet_at_forward=2 if use_cuda_graph else 1)   # warmup, then capture: A's second forward
    managers = {name: ContinuousBatchingManager(TinyCausalLM(name, device), use_cuda_graph) for name in ("B", "A")}
    try:
        for name, manager in managers.items():
            for i, prompt in enumerate(PROMPTS[name]):
                manager.add_request(prompt, f"{name}-{i}", NEW_TOKENS[name])
            manager.start()
        results = {}
        for name, manager in managers.items():
            for _ in PROMPTS[name]:
                state = manager.get_result(timeout=2 * WAIT_S)
                results[state.request_id] = state
        for manager in managers.values():
            manager.stop()
    finally:
        _SCHEDULE = None
    outputs = []
    for request_id in sorted(results):
        state = results[request_id]
        if state.error is not None:
            raise RuntimeError(f"request {request_id} failed: {state.error.splitlines()[0]}")
        outputs.append(torch.tensor(state.generated_tokens, dtype=DTYPE))
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
