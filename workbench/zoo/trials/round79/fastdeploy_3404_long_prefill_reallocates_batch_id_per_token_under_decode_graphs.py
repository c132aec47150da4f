"""A long prefill's ``copy_`` into the under-sized ``batch_id_per_token`` buffer makes Paddle give it a new holder; the decode graphs keep reading the old one.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/3404 ("[Excutor] Increase buffer size to prevent address
corruption; add forward metadata debug tool", PaddlePaddle/FastDeploy, merged 2025-08-18, commit ea4a3b479).
Symptom: with CUDA graphs on, decoding goes wrong once a prefill (or mixed) step has carried more tokens than the
capture-time dummy prefill did: the replayed attention kernels see stale or foreign token-to-request ids ("address
corruption": wrong K/V writes, wrong output, or CUDA error 700). ``use_cudagraph=False`` is correct.
Mechanism: ``GPUModelRunner._init_share_inputs`` (fastdeploy/worker/gpu_model_runner.py) allocated
``share_inputs["batch_id_per_token"]`` as ``paddle.full([max_num_seqs, 1], ...)`` (and ``cu_seqlens_q`` /
``cu_seqlens_k`` with ``max_num_seqs`` entries), although ``pre_process`` (``get_padding_offset``) returns one id
per token (``token_num`` entries) and ``bsz + 1`` offsets. Every step ``_prepare_inputs`` copies them in with
``self.share_inputs[...].copy_(x, False)``. Paddle's ``Tensor::copy_`` (paddle/phi/api/lib/tensor_method.cc)
runs ``UnchangedInferMeta`` (dst takes src's dims) and ``phi::Copy`` -> ``dev_ctx.Alloc(dst)``;
``DenseTensor::AllocateFrom`` keeps the holder only while ``holder_->size()`` covers the bytes, otherwise it
installs a new allocation and the old one goes back to the allocator. ``capture_model`` runs ``_dummy_run`` per
capture size: an eager dummy prefill of ``bs * int(min(max_num_batched_tokens // bs, max_model_len - 2) *
kv_cache_ratio)`` tokens (this already moved the buffers once, before any capture; the full-buffer
``seq_lens_this_time`` also gives ``cu_seqlens_*`` their ``max_num_seqs + 1`` entries there), then one decode step
that ``CudaGraphPiecewiseBackend`` warms up, captures and replays; the append-attention kernels of the decode
graphs keep the addresses of ``batch_id_per_token`` (and the other ``ForwardMeta`` tensors) as they were then. In
serving, a prefill or mixed step runs eagerly (``step_use_cudagraph`` is False when a prefill exists); when it has
more tokens than the dummy prefill had, its ``copy_`` gives ``batch_id_per_token`` a new holder and frees the one
the graphs read. Later decode steps write their ids into the new holder, but ``entry.cuda_graph.replay()`` reads
the old, released block: what a stale step or the allocator's next user left there.
Doctor: undersized-buffer, at _init_share_inputs (it sizes the static ``batch_id_per_token`` buffer, read by every
decode graph, at ``max_num_seqs`` entries while a step's data has one entry per token; the first step whose data
does not fit makes ``copy_`` re-allocate the buffer out from under the captured graphs; the dangling read at
replay is the consequence. The fix only changes the sizes allocated here).
Fix (upstream): allocate ``batch_id_per_token`` at ``max_num_seqs * max_model_len`` entries and ``cu_seqlens_q`` /
``cu_seqlens_k`` at ``max_num_seqs + 1``, so no step's ``copy_`` ever outgrows the holder and the addresses the
graphs captured stay valid (the same PR's forward-meta debug printer and the ``kv_num_blocks_x_cpu`` place fix in
``get_block_shape_and_split_kv_block`` are not modelled).
Modelled: one decoder layer (embedding, one attention, no MLP/norm), a toy ``append_attention`` over a per-slot KV
cache (slot = block table row; a learned position embedding in place of RoPE; slots and positions picked by
one-hot matching, so a foreign id selects nothing rather than faulting); ``pre_process`` on the host; no sampling
parameters, stop sequences or speculative decoding; greedy sampling; capture sizes 1..4, so a decode step is never
padded. ``paddle_copy_`` spells out Paddle's re-allocating ``copy_`` (torch's ``copy_`` never re-allocates). The
graphs read the released block as it was left (``on_freed="reuse"``: on the CPU the bytes it held when the last
capture ended; on CUDA whatever the caching allocator's next user, or the last write, left there): either way not
the ids of the three requests decoding after the long prefill.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/3404"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_init_share_inputs"
SYMPTOM = "after the first prefill longer than the capture dummy, CUDA-graph decode reads a freed batch_id_per_token"

VOCAB, HIDDEN = 32, 16
MAX_NUM_SEQS, MAX_MODEL_LEN = 4, 24
MAX_NUM_BATCHED_TOKENS = 16
KV_CACHE_RATIO = 0.75
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 3, 4]
CUDAGRAPH_NUM_OF_WARMUPS = 1


# --- Paddle semantics ----------------------------------------------------------------------------

def paddle_full(shape, fill_value, dtype, device):
    return torch.full(shape, fill_value, dtype=dtype, device=device)


def paddle_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Paddle ``Tensor.copy_(src, False)`` on a DenseTensor: ``UnchangedInferMeta`` gives ``dst`` the dims of
    ``src``; ``phi::Copy`` then calls ``dev_ctx.Alloc(dst)``, and ``DenseTensor::AllocateFrom`` keeps the holder
    only if ``holder_->size() >= numel * sizeof(dtype)``: otherwise it installs a fresh allocation and releases the
    old one. The Python tensor object (the ``share_inputs`` entry) stays the same; its address may not."""
    needed = src.numel() * src.element_size()
    if dst.untyped_storage().nbytes() < needed:          # holder too small: ResetHolder(allocator->Allocate(bytes))
        holder = torch.empty(src.numel(), dtype=dst.dtype, device=dst.device).untyped_storage()
        dst.set_(holder, 0, src.shape)                   # the old holder's last reference goes away here
    else:                                                # same holder, new dims
        dst.set_(dst.untyped_storage(), 0, src.shape)
    dst.copy_(src)


# --- fastdeploy/model_executor/forward_meta.py -----------------------------------------------------

class ForwardMeta:
    def __init__(self, ids_remove_padding, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
                 batch_id_per_token, cu_seqlens_q, cu_seqlens_k, caches):
        self.ids_remove_padding = ids_remove_padding
        self.seq_lens_encoder, self.seq_lens_decoder = seq_lens_encoder, seq_lens_decoder
        self.seq_lens_this_time = seq_lens_this_time
        self.batch_id_per_token = batch_id_per_token
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.caches = caches
        self.step_use_cudagraph = False


# --- fastdeploy/model_executor/pre_and_post_process.py ---------------------------------------------

def pre_process(input_ids, seq_lens_this_time, device):
    """``get_padding_offset``: the tokens of this step in one row, each token's request (slot), and the
    cumulative token offsets of the ``bsz = seq_lens_this_time.shape[0]`` slots (new tensors every step)."""
    ids, batch_ids, cu = [], [], [0]
    rows = input_ids.tolist()
    for bi, n in enumerate(seq_lens_this_time.tolist()):
        ids += rows[bi][:n]
        batch_ids += [bi] * n
        cu.append(cu[-1] + n)
    ids_remove_padding = torch.tensor(ids, dtype=torch.int64, device=device)
    batch_id_per_token = torch.tensor(batch_ids, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    return ids_remove_padding, batch_id_per_token, cu_seqlens_q, cu_seqlens_q.clone()


def rebuild_padding(hidden_states, cu_seqlens_q, seq_lens_this_time):
    """The last token of every slot that ran this step."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens_this_time.tolist()
    rows = [cu[bi + 1] - 1 for bi, n in enumerate(lens) if n > 0]
    return hidden_states[torch.tensor(rows, device=hidden_states.device)]


def post_process(next_tokens, share_inputs):
    """Greedy token into ``input_ids[:, 0]``; prefill -> decode; stop at ``max_dec_len``."""
    si = share_inputs
    n = si["seq_lens_this_time"].shape[0]
    active = si["seq_lens_this_time"] > 0
    rows = active.nonzero().flatten()
    si["input_ids"][rows, 0] = next_tokens
    si["step_idx"][:n] += active.long()
    si["seq_lens_decoder"][:n] += si["seq_lens_this_time"]
    si["seq_lens_encoder"][:n] = 0
    si["stop_flags"][:n] |= active & (si["step_idx"][:n] >= si["max_dec_len"][:n])
    si["seq_lens_this_time"].copy_(torch.where(si["stop_flags"][:n], 0, active.int()))


# --- the model: one ERNIE-like layer with append attention -------------------------------------------

def append_attention(q, k, v, cache_k, cache_v, pos_emb, forward_meta: ForwardMeta):
    """Write each token's K/V at its position in its request's cache and attend over that request's cache.
    Token ``t`` belongs to slot ``batch_id_per_token[t]``; its position is the slot's decoded length plus its
    offset inside the slot's tokens of this step (``t - cu_seqlens_q[slot]``). Slots and positions are
    selected by matching (one-hot), so an id that names no slot selects nothing instead of faulting."""
    tokens = q.shape[0]
    bsz = forward_meta.cu_seqlens_q.shape[0] - 1
    slot = (forward_meta.batch_id_per_token.unsqueeze(1)
            == torch.arange(bsz, device=q.device).unsqueeze(0)).float()                 # [tokens, bsz]
    start = slot @ forward_meta.cu_seqlens_q[:-1].float()
    decoded = slot @ forward_meta.seq_lens_decoder[:bsz].float()
    pos = decoded + torch.arange(tokens, device=q.device).float() - start                  # [tokens]
    at = (pos.unsqueeze(1) == torch.arange(MAX_MODEL_LEN, device=q.device).unsqueeze(0)).float()
    q, k = q + at @ pos_emb, k + at @ pos_emb
    write = slot.unsqueeze(2) * at.unsqueeze(1)                                            # [tokens, bsz, len]
    kept = (1 - write.sum(0)).unsqueeze(-1)
    cache_k[:bsz].copy_(cache_k[:bsz] * kept + torch.einsum("tsl,th->slh", write, k))
    cache_v[:bsz].copy_(cache_v[:bsz] * kept + torch.einsum("tsl,th->slh", write, v))
    keys = torch.einsum("ts,slh->tlh", slot, cache_k[:bsz])
    values = torch.einsum("ts,slh->tlh", slot, cache_v[:bsz])
    scores = (q.unsqueeze(1) * keys).sum(-1) * HIDDEN ** -0.5                               # [tokens, len]
    future = torch.arange(MAX_MODEL_LEN, device=q.device).unsqueeze(0) > pos.unsqueeze(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (probs.unsqueeze(-1) * values).sum(1)


class Ernie4_5_Model:
    def __init__(self, device):
        gen = generator(3404)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.pos_emb = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def forward(self, ids_remove_padding, forward_meta: ForwardMeta):
        h = self.embed_tokens[ids_remove_padding]
        q, k, v = (h @ self.qkv_proj).split(HIDDEN, dim=-1)
        cache_k, cache_v = forward_meta.caches
        attn = append_attention(q, k, v, cache_k, cache_v, self.pos_emb, forward_meta)
        return h + attn @ self.o_proj

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py ---------------------

class ConcreteSizeEntry:
    def __init__(self, runtime_bs):
        self.runtime_bs = runtime_bs
        self.cuda_graph = None
        self.output_buffer = None


class CudaGraphPiecewiseBackend:
    """Capture and replay per token count (``ids_remove_padding.shape[0]``)."""

    def __init__(self, runnable, device, static_buffers, state):
        self.runnable, self.device = runnable, device
        self.static_buffers, self.state = static_buffers, state
        self.concrete_size_entries = {bs: ConcreteSizeEntry(bs) for bs in CUDAGRAPH_CAPTURE_SIZES}

    def __call__(self, **kwargs):
        batch_size = kwargs["ids_remove_padding"].shape[0]
        entry = self.concrete_size_entries[batch_size]          # capture sizes 1..4: never padded here
        if entry.cuda_graph is None:
            entry.cuda_graph, entry.output_buffer = capture(
                lambda: self.runnable(**kwargs), device=self.device, warmups=CUDAGRAPH_NUM_OF_WARMUPS,
                name=f"decode bs={batch_size}", owner="CudaGraphPiecewiseBackend",
                static=self.static_buffers(), state=self.state(), on_freed="reuse")
        # Replay (the kwargs of this call are not looked at: the graph reads what it captured)
        return replay(entry.cuda_graph, entry.output_buffer)


class GraphOptBackend:
    def __init__(self, runnable, cudagraph_piecewise_backend):
        self.runnable = runnable
        self.cudagraph_piecewise_backend = cudagraph_piecewise_backend
        self.max_captre_batch = max(CUDAGRAPH_CAPTURE_SIZES)

    def __call__(self, **kwargs):
        batch_size = kwargs["forward_meta"].ids_remove_padding.shape[0]
        if (not kwargs["forward_meta"].step_use_cudagraph) or (batch_size > self.max_captre_batch):
            return self.runnable(**kwargs)
        return self.cudagraph_piecewise_backend(**kwargs)


# --- fastdeploy/worker/gpu_model_runner.py ---------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, variant, use_cudagraph):
        self.device, self.variant, self.use_cudagraph = device, variant, use_cudagraph
        self.model = Ernie4_5_Model(device)
        self._init_share_inputs(MAX_NUM_SEQS)
        backend = CudaGraphPiecewiseBackend(self.model.forward, device, self._graph_static_buffers,
                                            lambda: {"cache_k": self.share_inputs["caches"][0],
                                                     "cache_v": self.share_inputs["caches"][1]})
        self.graph_opt_backend = GraphOptBackend(self.model.forward, backend)

    def _init_share_inputs(self, max_num_seqs: int):
        """Initialize all share buffers for model inputs."""
        d = self.device
        self.share_inputs = {}
        self.share_inputs["input_ids"] = paddle_full([max_num_seqs, MAX_MODEL_LEN], 0, torch.int64, d)
        self.seq_lens_this_time_buffer = paddle_full([max_num_seqs], 0, torch.int32, d)
        self.share_inputs["seq_lens_encoder"] = paddle_full([max_num_seqs], 0, torch.int32, d)
        self.share_inputs["seq_lens_decoder"] = paddle_full([max_num_seqs], 0, torch.int32, d)
        self.share_inputs["step_idx"] = paddle_full([max_num_seqs], 0, torch.int64, d)
        self.share_inputs["max_dec_len"] = paddle_full([max_num_seqs], 0, torch.int64, d)
        self.share_inputs["stop_flags"] = paddle_full([max_num_seqs], True, torch.bool, d)
        self.share_inputs["caches"] = (paddle_full([max_num_seqs, MAX_MODEL_LEN, HIDDEN], 0.0, torch.float32, d),
                                       paddle_full([max_num_seqs, MAX_MODEL_LEN, HIDDEN], 0.0, torch.float32, d))
        self.share_inputs["ids_remove_padding"] = paddle_full([max_num_seqs * MAX_MODEL_LEN], 0, torch.int64, d)
        if self.variant == "bug":
            self.share_inputs["batch_id_per_token"] = paddle_full([max_num_seqs, 1], 0, torch.int32, d)
            self.share_inputs["cu_seqlens_q"] = paddle_full([max_num_seqs, 1], 0, torch.int32, d)
            self.share_inputs["cu_seqlens_k"] = paddle_full([max_num_seqs, 1], 0, torch.int32, d)
        else:
            self.share_inputs["batch_id_per_token"] = paddle_full([max_num_seqs * MAX_MODEL_LEN, 1], 0, torch.int32, d)
            self.share_inputs["cu_seqlens_q"] = paddle_full([max_num_seqs + 1, 1], 0, torch.int32, d)
            self.share_inputs["cu_seqlens_k"] = paddle_full([max_num_seqs + 1, 1], 0, torch.int32, d)
        self.share_inputs["seq_lens_this_time"] = self.seq_lens_this_time_buffer

    def _graph_static_buffers(self):
        si = self.share_inputs
        return {name: si[name] for name in ("ids_remove_padding", "batch_id_per_token", "cu_seqlens_q",
                                            "seq_lens_decoder")}

    def exist_prefill(self):
        return int(self.share_inputs["seq_lens_encoder"].max()) != 0

    def insert_prefill_inputs(self, req_dicts, num_running_requests):
        for request in req_dicts:
            idx, prompt = request["idx"], request["prompt_token_ids"]
            self.share_inputs["input_ids"][idx, :len(prompt)] = torch.tensor(prompt)
            self.seq_lens_this_time_buffer[idx] = len(prompt)
            self.share_inputs["seq_lens_encoder"][idx] = len(prompt)
            self.share_inputs["seq_lens_decoder"][idx] = 0
            self.share_inputs["step_idx"][idx] = 0
            self.share_inputs["max_dec_len"][idx] = MAX_MODEL_LEN - len(prompt)
            self.share_inputs["stop_flags"][idx] = False
        self.share_inputs["seq_lens_this_time"] = self.seq_lens_this_time_buffer[:num_running_requests]

    def _dummy_prefill_inputs(self, num_tokens: int, batch_size: int, expected_decode_len: int):
        max_dec_len = expected_decode_len + 1
        full_length = min(num_tokens // batch_size, MAX_MODEL_LEN - max_dec_len)
        input_length = int(full_length * KV_CACHE_RATIO)
        for idx in range(batch_size):
            self.share_inputs["input_ids"][idx, :input_length] = 5
            self.seq_lens_this_time_buffer[idx] = input_length
            self.share_inputs["seq_lens_encoder"][idx] = input_length
            self.share_inputs["seq_lens_decoder"][idx] = 0
            self.share_inputs["step_idx"][idx] = 0
            self.share_inputs["max_dec_len"][idx] = max_dec_len
            self.share_inputs["stop_flags"][idx] = False
        self.share_inputs["seq_lens_this_time"] = self.seq_lens_this_time_buffer

    def _prepare_inputs(self):
        si = self.share_inputs
        ids_remove_padding, batch_id_per_token, cu_seqlens_q, cu_seqlens_k = pre_process(
            si["input_ids"], si["seq_lens_this_time"], self.device)
        paddle_copy_(si["ids_remove_padding"], ids_remove_padding)
        paddle_copy_(si["batch_id_per_token"], batch_id_per_token)
        paddle_copy_(si["cu_seqlens_q"], cu_seqlens_q)
        paddle_copy_(si["cu_seqlens_k"], cu_seqlens_k)
        self.initialize_forward_meta()

    def initialize_forward_meta(self):
        si = self.share_inputs
        self.forward_meta = ForwardMeta(
            ids_remove_padding=si["ids_remove_padding"], seq_lens_encoder=si["seq_lens_encoder"],
            seq_lens_decoder=si["seq_lens_decoder"], seq_lens_this_time=si["seq_lens_this_time"],
            batch_id_per_token=si["batch_id_per_token"], cu_seqlens_q=si["cu_seqlens_q"],
            cu_seqlens_k=si["cu_seqlens_k"], caches=si["caches"])
        self.forward_meta.step_use_cudagraph = self.use_cudagraph and not self.exist_prefill()

    def _step(self):
        """Run the model on the prepared inputs, sample, post-process; the last tokens' logits."""
        si = self.share_inputs
        model_output = self.graph_opt_backend(ids_remove_padding=si["ids_remove_padding"],
                                              forward_meta=self.forward_meta)
        hidden_states = rebuild_padding(model_output, si["cu_seqlens_q"], si["seq_lens_this_time"])
        logits = self.model.compute_logits(hidden_states)
        post_process(logits.argmax(-1), si)
        return logits

    def _dummy_run(self, num_tokens, batch_size, expected_decode_len=1, in_capturing=False):
        self._dummy_prefill_inputs(num_tokens, batch_size, expected_decode_len)
        while True:
            self._prepare_inputs()
            self.forward_meta.step_use_cudagraph = in_capturing and self.forward_meta.step_use_cudagraph
            self._step()
            if int((self.share_inputs["seq_lens_this_time"] > 0).sum()) == 0:
                break

    def capture_model(self):
        if not self.use_cudagraph:
            return
        for batch_size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(num_tokens=MAX_NUM_BATCHED_TOKENS, batch_size=batch_size, in_capturing=True)

    def execute_model(self):
        self._prepare_inputs()
        return self._step().clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(34040)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 4, 14)]
    # (step, requests arriving) -- at most MAX_NUM_BATCHED_TOKENS tokens per step
    arrivals = {0: [0, 1], 3: [2]}

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, use_cudagraph=graphed)
        runner.capture_model()
        outs, running = [], 0
        for step in range(7):
            new = arrivals.get(step, [])
            if new:
                running = max(running, max(new) + 1)
                runner.insert_prefill_inputs([{"idx": i, "prompt_token_ids": prompts[i]} for i in new], running)
            outs.append(runner.execute_model())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
