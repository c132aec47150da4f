"""PyTorch engine VLM serving: the ImageEncoder thread's ``.cpu()`` lands while the LLM engine lazily captures a decode graph in the default ``"global"`` capture mode, and CUDA invalidates the capture.

Upstream: https://github.com/InternLM/lmdeploy/pull/2560 ("set capture mode thread_local", InternLM/lmdeploy, merged
2024-10, fixes issue #2544). Read: the PR's one-hunk diff of ``lmdeploy/pytorch/backends/cuda/graph_runner.py``
(``CUDASingleGraphRunner.capture`` passes ``capture_error_mode='thread_local'`` to ``torch.cuda.graph``, with the
comment "unsafe kernel call in other thread might invalid the capture"), the issue thread (#2544: InternVL2-1B on
lmdeploy v0.6.0 in a loop of batched image+text requests dies with "RuntimeError: CUDA error: operation not permitted
when stream is capturing"; the reporters confirm the PR branch fixes it), and at the parent commit
``graph_runner.py`` (``CUDAGraphRunner.__call__``, ``CUDASingleGraphRunner.capture/forward``),
``models/utils/cudagraph.py`` (``CudaGraphMixin``) and ``vl/engine.py`` (``ImageEncoder``). Not read: any test.
Symptom: VLM serving with the PyTorch engine and CUDA graphs on: a request with an image arriving while the engine
meets a new decode batch size crashes the server with "operation not permitted when stream is capturing"
(and the capture fails with "operation failed due to a previous error during capture"). Eager mode is fine.
Mechanism: ``CUDAGraphRunner.__call__`` captures lazily: the first decode step whose ``next_power_of_2(num_tokens)``
has no runner yet builds a ``CUDASingleGraphRunner`` and calls ``capture`` (warm up once, then
``torch.cuda.graph(self._graph, pool=..., stream=...)``) in the middle of serving. ``ImageEncoder`` runs the vision
model on its own thread (``_forward_loop`` -> ``run_in_executor(None, self.forward, ...)``) and its ``forward`` ends
with ``outputs = [x.cpu() for x in outputs]``, a device-to-host read. ``torch.cuda.graph`` defaults to
``capture_error_mode="global"``, in which *every* thread is forbidden to wait for the device while a capture is
open, so the encoder's ``.cpu()`` is refused and CUDA invalidates the engine's capture.
Doctor: sync-in-capture, at capture. A host synchronisation (another thread's ``.cpu()``) is attempted while the
capture that ``CUDASingleGraphRunner.capture`` opened in global mode is in progress; the fix goes in that call.
Fix (upstream): capture with ``capture_error_mode='thread_local'``, so only the capturing thread is restricted and
the encoder thread may read its features while the engine captures.
Modelled: ``CUDAGraphRunner`` (``get_graph_key``, lazy ``__call__``), ``CUDASingleGraphRunner`` (``capture``,
``forward``), ``CudaGraphMixin`` (``make_buffers_cudagraph``, ``fill_buffers_cudagraph``,
``update_context_cudagraph``), an ``ImageEncoder`` with a worker thread whose ``forward`` ends in ``.cpu()``, and a
tiny one-layer LM over a paged KV cache (block size 4). Stand-ins: only decode steps are graphed (0.6 also graphs
prefills of <= 256 tokens; the workload's prefills run eagerly); the encoder thread's timing: in the served process
the ViT forward of a newly arrived image request simply runs concurrently with the engine's step; here the model
forward hands the encoder thread its turn (once per step, at the forward whose result the step uses: the captured
one when the step captures, the only one in eager mode) and waits for it, so the overlap lands at the same place on
every run. Sizes: hidden 8, vocab 16, 2 image tokens per image.
Workload: request A (text) is prefilled and decodes alone (graph key 1 captured, no image in flight). Request B
(image) is encoded with the engine idle, prefilled, and A+B decode: the first batch-2 step captures graph key 2
while request C's image is being encoded on the encoder thread; its ``.cpu()`` is refused and the capture fails.
With the fix the capture succeeds; C is prefilled and A+B+C decode through graph key 4 (3 real rows, 1 padded).
"""
from __future__ import annotations

import queue
import threading

import torch

from workbench.engine import graph_pool_handle, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/2560"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "capture"
SYMPTOM = ("VLM serving with CUDA graphs: an image request's ImageEncoder thread calls .cpu() while the engine "
           "lazily captures a new decode batch size in global capture mode; 'operation not permitted when stream "
           "is capturing' and the capture fails")

HIDDEN, VOCAB, PATCH = 8, 16, 6
BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 4
MAX_LEN = BLOCK_SIZE * BLOCKS_PER_SEQ
NUM_SLOTS = (1 + 4 * BLOCKS_PER_SEQ) * BLOCK_SIZE          # block 0: dummy (padded rows write there)
IMAGE_TOKEN, IMAGE_TOKENS = 0, 2

_variant = "bug"


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class _Overlap:
    """Timing stand-in: the encoder thread's pending ``.cpu()`` runs while the engine is in the step's forward."""

    def __init__(self):
        self.job, self.eager = None, True

    def during_forward(self):
        if self.job is not None and (self.eager or is_capturing()):
            self.release()

    def release(self):
        job, self.job = self.job, None
        if job is not None:
            job["go"].set()
            job["done"].wait(10)


class AttnMetadata:
    def __init__(self, is_decoding, block_offsets, q_start_loc, q_seqlens, kv_seqlens):
        self.is_decoding, self.block_offsets = is_decoding, block_offsets
        self.q_start_loc, self.q_seqlens, self.kv_seqlens = q_start_loc, q_seqlens, kv_seqlens


class CudaGraphMeta:
    def __init__(self, max_batchs, max_tokens, num_blocks, is_decoding, device):
        self.max_batchs, self.max_tokens, self.num_blocks = max_batchs, max_tokens, num_blocks
        self.is_decoding, self.device = is_decoding, device
        self.input_buffers, self.output_buffers = {}, {}


class TinyVLForCausalLM:
    """One attention layer over a paged KV cache, plus the lm head (``CudaGraphMixin`` methods below)."""

    def __init__(self, device, overlap):
        gen = generator(2560)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.overlap = overlap
        self.ctx = {}

    def __call__(self, input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds=None):
        self.overlap.during_forward()
        x = self.embed[input_ids[0]] if inputs_embeds is None else inputs_embeds[0]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        kv = past_key_values
        m = attn_metadata
        if m.is_decoding:                                         # one token per row: capture-safe tensor ops
            pos = position_ids[0]
            slot = m.block_offsets.gather(1, (pos // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + pos % BLOCK_SIZE
            slot = torch.where(m.q_seqlens > 0, slot, torch.zeros_like(slot))      # padded rows: dummy block
            kv[0, slot], kv[1, slot] = k, v
            j = torch.arange(MAX_LEN, device=x.device)
            slots = m.block_offsets[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
            valid = j[None, :] < m.kv_seqlens[:, None]
        else:                                                     # eager prefill: per-sequence causal rows
            lens = m.q_seqlens.tolist()
            b = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)]).to(x.device)
            pos = position_ids[0]
            slot = m.block_offsets[b, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            kv[0, slot], kv[1, slot] = k, v
            j = torch.arange(MAX_LEN, device=x.device)
            slots = m.block_offsets[b][:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
            valid = j[None, :] <= pos[:, None]
        scores = (kv[0, slots] * q[:, None]).sum(-1) * HIDDEN ** -0.5
        scores = torch.where(valid, scores, torch.full_like(scores, -1e9))
        out = (torch.softmax(scores, -1)[..., None] * kv[1, slots]).sum(1) @ self.wo
        return ((x + out) @ self.lm_head)[None]

    def support_cuda_graph(self, attn_metadata, **kwargs):
        return attn_metadata.is_decoding

    def make_buffers_cudagraph(self, graph_meta, **kwargs):
        mb, mt, dev = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=dev)  # noqa: E731
        return {"input_ids": z(1, mt), "position_ids": z(1, mt), "block_offsets": z(mb, graph_meta.num_blocks),
                "q_start_loc": z(mb), "q_seqlens": z(mb), "kv_seqlens": z(mb)}

    def fill_buffers_cudagraph(self, graph_meta, input_ids, position_ids, past_key_values, attn_metadata,
                               inputs_embeds=None, **kwargs):
        buf, m = graph_meta.input_buffers, attn_metadata
        batch_size, num_blocks = m.block_offsets.size()
        num_tokens = input_ids.size(-1)
        buf["input_ids"][:, :num_tokens] = input_ids
        buf["position_ids"][:, :num_tokens] = position_ids
        buf["block_offsets"][:batch_size, :num_blocks] = m.block_offsets
        if m.q_seqlens.data_ptr() != buf["q_seqlens"].data_ptr():
            buf["q_seqlens"].zero_()
        buf["q_seqlens"][:batch_size] = m.q_seqlens
        if m.kv_seqlens.data_ptr() != buf["kv_seqlens"].data_ptr():
            buf["kv_seqlens"].zero_()
        buf["kv_seqlens"][:batch_size] = m.kv_seqlens
        buf["q_start_loc"][:batch_size] = m.q_start_loc
        n = next_power_of_2(batch_size)
        meta = AttnMetadata(True, buf["block_offsets"][:n], buf["q_start_loc"][:n], buf["q_seqlens"][:n],
                            buf["kv_seqlens"][:n])
        return dict(input_ids=buf["input_ids"][:, :n], position_ids=buf["position_ids"][:, :n],
                    past_key_values=past_key_values, attn_metadata=meta)

    def update_context_cudagraph(self, graph_meta, context):
        buf = graph_meta.input_buffers
        context.update(block_offsets=buf["block_offsets"], q_seqlens=buf["q_seqlens"], kv_seqlens=buf["kv_seqlens"])


class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, num_blocks, is_decoding, pool, device):
        self.model, self.pool, self.device = model, pool, device
        self.meta = CudaGraphMeta(max_batches, max_tokens, num_blocks, is_decoding, device)
        self._graph = None

    def capture(self, **kwargs):
        """Capture graph (the hazard site: the capture mode decides which threads may read the device)."""
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self.model.update_context_cudagraph(self.meta, self.model.ctx)
        # upstream fix: "unsafe kernel call in other thread might invalid the capture"
        mode = "thread_local" if _variant == "fix" else "global"
        self._graph, output = capture(lambda: self.model(**padded_kwargs), device=self.device, pool=self.pool,
                                      warmups=1, name=f"decode [{self.meta.max_batchs}]",
                                      static=self.meta.input_buffers,
                                      state={"past_key_values": kwargs["past_key_values"]},
                                      owner="CUDASingleGraphRunner", capture_error_mode=mode)
        self.meta.output_buffers = dict(logits=output)
        return output

    def forward(self, **kwargs):
        num_tokens = kwargs["input_ids"].size(-1)
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self.model.update_context_cudagraph(self.meta, self.model.ctx)
        buf, size = self.meta.input_buffers, self.meta.max_batchs
        logits = replay(self._graph, self.meta.output_buffers["logits"], real=num_tokens, size=size,
                        padded={"block_offsets": buf["block_offsets"]},
                        padded_columns={"input_ids": (buf["input_ids"], num_tokens),
                                        "position_ids": (buf["position_ids"], num_tokens)})
        return logits[:, :num_tokens]


class CUDAGraphRunner:
    def __init__(self, model, eager_mode, device):
        self.model, self.eager_mode, self.device = model, eager_mode, device
        self.num_blocks = BLOCKS_PER_SEQ
        self.graph_pool_handle = None if eager_mode else graph_pool_handle(device)
        self._runner_map = {}

    def get_graph_key(self, input_ids, attn_metadata, **kwargs):
        return (next_power_of_2(input_ids.numel()), attn_metadata.is_decoding)

    def __call__(self, **kwargs):
        if self.eager_mode or not self.model.support_cuda_graph(**kwargs):
            return self.model(**kwargs)
        graph_key = self.get_graph_key(**kwargs)
        if graph_key not in self._runner_map:
            runner = CUDASingleGraphRunner(self.model, graph_key[0], graph_key[0], self.num_blocks, graph_key[1],
                                           self.graph_pool_handle, self.device)
            runner.capture(**kwargs)                    # lazily, in the middle of serving
            self._runner_map[graph_key] = runner
        return self._runner_map[graph_key].forward(**kwargs)


class ImageEncoder:
    """Vision model on its own worker thread (``_create_thread_safe_task`` / ``_forward_loop``)."""

    def __init__(self, device, overlap):
        self.w = randn(PATCH, HIDDEN, gen=generator(2544), device=device).double()
        self.overlap, self._que = overlap, queue.Queue()
        self._thread = threading.Thread(target=self._forward_loop, daemon=True)
        self._thread.start()

    def _forward_loop(self):
        while (job := self._que.get()) is not None:
            try:
                job["result"] = self.forward(job)
            except Exception as e:  # noqa: BLE001 - re-raised by the requester (_raise_exception_on_finish)
                job["error"] = e
            finally:
                job["done"].set()

    def forward(self, job):
        outputs = [torch.tanh(p @ self.w) for p in job["inputs"]]      # the vision model
        job["go"].wait(10)                                               # (timing stand-in, see header)
        return [x.cpu() for x in outputs]

    def async_infer(self, pixels):
        job = {"inputs": [pixels], "go": threading.Event(), "done": threading.Event()}
        self.overlap.job = job
        self._que.put(job)
        return job

    @staticmethod
    def result(job):
        job["done"].wait(10)
        if "error" in job:
            raise job["error"]
        return job["result"][0]

    def close(self):
        self._que.put(None)
        self._thread.join(10)


class Engine:
    def __init__(self, device, eager_mode):
        self.device = device
        self.overlap = _Overlap()
        self.overlap.eager = eager_mode
        self.model = TinyVLForCausalLM(device, self.overlap)
        self.kv = torch.zeros(2, NUM_SLOTS, HIDDEN, dtype=torch.float64, device=device)
        self.runner = CUDAGraphRunner(self.model, eager_mode, device)
        self.encoder = ImageEncoder(device, self.overlap)
        self.seqs, self.outs = {}, []

    def prefill(self, rid, slot, ids, image=None):
        n = len(ids)
        blocks = torch.arange(1 + slot * BLOCKS_PER_SEQ, 1 + (slot + 1) * BLOCKS_PER_SEQ, device=self.device)
        input_ids = torch.tensor([ids], device=self.device)
        embeds = None
        if image is not None:
            embeds = self.model.embed[input_ids[0]].clone()
            embeds[[i for i, t in enumerate(ids) if t == IMAGE_TOKEN]] = image.to(self.device)
            embeds = embeds[None]
        meta = AttnMetadata(False, blocks[None], torch.zeros(1, dtype=torch.long, device=self.device),
                            torch.tensor([n], device=self.device), torch.tensor([n], device=self.device))
        logits = self.runner(input_ids=input_ids, position_ids=torch.arange(n, device=self.device)[None],
                             past_key_values=self.kv, attn_metadata=meta, inputs_embeds=embeds)
        self.seqs[rid] = {"blocks": blocks, "len": n, "next": int(logits[0, -1].argmax())}
        self.outs.append(logits[0, -1].clone())

    def decode(self, rids):
        s = [self.seqs[r] for r in rids]
        b = len(rids)
        meta = AttnMetadata(True, torch.stack([x["blocks"] for x in s]),
                            torch.arange(b, device=self.device), torch.ones(b, dtype=torch.long, device=self.device),
                            torch.tensor([x["len"] + 1 for x in s], device=self.device))
        logits = self.runner(input_ids=torch.tensor([[x["next"] for x in s]], device=self.device),
                             position_ids=torch.tensor([[x["len"] for x in s]], device=self.device),
                             past_key_values=self.kv, attn_metadata=meta)
        self.overlap.release()                           # an encode not yet run completes after the step
        for x, row in zip(s, logits[0]):
            x["len"] += 1
            x["next"] = int(row.argmax())
        self.outs.append(logits[0].clone())


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2561)
    pixels_b, pixels_c = randn(IMAGE_TOKENS, PATCH, gen=gen, device=device), randn(IMAGE_TOKENS, PATCH, gen=gen,
                                                                                   device=device)

    def serve(eager_mode: bool):
        eng = Engine(device, eager_mode)
        try:
            eng.prefill("A", 0, [3, 5, 7])
            for _ in range(2):
                eng.decode(["A"])                        # graph key 1: captured with no image in flight
            job = eng.encoder.async_infer(pixels_b.double())
            eng.overlap.release()                        # B's image encoded with the engine idle
            eng.prefill("B", 1, [2, IMAGE_TOKEN, IMAGE_TOKEN, 9], ImageEncoder.result(job))
            job_c = eng.encoder.async_infer(pixels_c.double())
            for _ in range(2):
                eng.decode(["A", "B"])                   # first step captures key 2 while C's image is encoded
            eng.prefill("C", 2, [IMAGE_TOKEN, IMAGE_TOKEN, 4], ImageEncoder.result(job_c))
            for _ in range(2):
                eng.decode(["A", "B", "C"])              # key 4: 3 real rows, 1 padded
            return eng.outs
        finally:
            eng.overlap.release()
            eng.encoder.close()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
