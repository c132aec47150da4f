"""MTP with CUDA-graph padding: padded token rows carry ``batch_id_per_token == -1`` and the speculative C8 write-cache kernel writes their K/V with it.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/4545 ("[Graph Optimization] Support CUDAGraph Padding +
MTP", commit 9dc5c3e37, 2025-10-23; release cherry-pick #4546: "CUDAGraph supports padding batch for MTP + C8
scenarios").
Symptom: MTP speculative decoding with a C8 (int8) KV cache and CUDA graphs: as soon as the running decode batch
is padded up to a larger captured token count (a request in the middle of the batch finishes, 6 tokens are served
by the 8-token graph), the write-cache kernel runs on the padded token rows and indexes the per-request arrays
(``cu_seqlens_q``, ``seq_lens``, ``seq_lens_encoder``, ``block_tables``, the rope tables) with batch id -1: it
reads the memory before each array, which gives an illegal access (error 700) or K/V written into some cache
block, so the output is corrupted (the PR names no symptom beyond "support"; this is what the guard prevents).
Eager decoding is right.
Mechanism: ``GPUModelRunner._prepare_inputs`` (fastdeploy/worker/gpu_model_runner.py) runs ``pre_process`` on the
real batch, sets ``share_inputs["batch_id_per_token"][:] = -1`` ("marking illegal positions", since #3886) and
copies the real token->request ids over the front. With graphs, ``CudaGraphPiecewiseBackend.__call__`` maps the
real token count to ``real_shape_to_captured_size`` and replays the graph captured at that padded count, so every
captured kernel runs over the padded token rows too. In append_attention,
``SpeculateWriteCacheWithRoPEKernel`` -> ``append_speculate_cache_int8_rope_kernel``
(custom_ops/gpu_ops/append_attn/speculate_write_cache_with_rope_impl.cuh) launches one block per token and reads
``bid = batch_id_per_token[token_id]``, then ``cu_seqlens_q[bid]``, ``seq_lens_encoder[bid]``, ``seq_lens[bid]``,
``block_tables + bid * max_blocks_per_seq`` and quantises the token's K/V into ``key_cache``/``value_cache`` at
that block: for a padded row, ``bid == -1``. The padded rows' qkv comes from the stale ``ids_remove_padding``
rows the step never wrote. The attention that follows reads the cache, so real requests see foreign K/V. Eager
launches the kernel over the real tokens only: no row has -1.
Doctor: stale-padding, at ``append_speculate_cache_int8_rope_kernel`` (the real requests' outputs come to depend
on what the padded rows hold: the -1 sentinel sends the padded rows' K/V, built from the stale padded
``ids_remove_padding`` rows, into a live request's cache; the fix changes only this kernel and its siblings).
Fix (upstream): ``if (bid == -1) return;  // NOTE(gongshaotian): For CUDAGraph padding`` right after reading
``batch_id_per_token`` in ``append_speculate_cache_int8_rope_kernel`` and in the other speculative write-cache
kernels (``append_speculate_cache_T_rope_qk_norm_kernel``, ``append_speculate_cache_rope_kernel``,
``append_speculate_cache_neox_rope_kernel``, the fp8-dynamic, int8-neox and int4 kernels,
``append_clear_cache_int8_block``/``int4_block``).
Modelled: one attention layer, one q/kv head of ``HEAD_DIM`` 8, a paged cache of ``BLOCK_SIZE`` 4; the C8
quantisation (cache scales, round/clamp) is left out (the cache holds the rope'd K and the V as floats). The
kernel is written with torch indexing: a -1 index wraps to the last row (the last request slot, the last
cu_seqlens_q entry = the real token count), where CUDA reads the memory before each array -- here the padded rows'
K/V land on the last slot's two new cache positions. The per-token blocks write in token order (one write per
token), so a padded row's write follows the real row's it collides with; ``return`` is a write-back of the
current value. MTP with one speculative token: the target verifies ``[last token, draft]`` per request (greedy
accept), the MTP draft model is reduced to a head on the target's hidden state (left out of the graphs). Capture
(``_dummy_run``) uses decode-shaped dummy requests at token counts 8, 4, 2; the prefill runs eagerly. The scheduler
is fixed: four requests, the one in slot 1 stops after two decode steps, the others continue padded (6 -> 8).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/4545"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "append_speculate_cache_int8_rope_kernel"
SYMPTOM = ("MTP + C8 with CUDA-graph padding: padded token rows have batch id -1 and the speculative write-cache "
           "kernel writes their stale K/V into a live request's cache, corrupting its output")

VOCAB, HIDDEN, HEAD_DIM = 32, 16, 8
BLOCK_SIZE, MAX_BLOCKS_PER_SEQ = 4, 8
MAX_SEQ_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_SEQ
MAX_NUM_SEQS, NUM_SPECULATIVE_TOKENS = 4, 1
MAX_NUM_BATCHED_TOKENS = 32
NUM_GPU_BLOCKS = MAX_NUM_SEQS * MAX_BLOCKS_PER_SEQ
# MTP: capture sizes are token counts up to max_num_seqs * (k + 1); the target skips the odd size 1
CUDAGRAPH_CAPTURE_SIZES = [8, 4, 2]
PROMPTS = [[3, 17, 9, 25, 4], [11, 2, 30], [7, 7, 19, 1, 28, 13], [5, 22, 16, 8]]
MAX_DEC_STEPS = [5, 2, 5, 5]          # decode steps each request runs before it stops


def _real_shape_to_captured_size():
    sizes, table = sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True), {}
    for end, start in zip(sizes, sizes[1:] + [0]):
        for bs in range(start, end):
            table[bs] = start if bs == start else end
    table[sizes[0]] = sizes[0]
    return table


# --- custom_ops/gpu_ops (pre_process, append_attention) ----------------------------------------------------------

def pre_process(input_ids, seq_lens_this_time):
    """Remove padding: the batch's tokens back to back, each token's request id, cu_seqlens_q (host lists)."""
    ids_remove_padding, batch_id_per_token, cu_seqlens_q = [], [], [0]
    for bid, n in enumerate(seq_lens_this_time):
        ids_remove_padding += input_ids[bid][:n]
        batch_id_per_token += [bid] * n
        cu_seqlens_q.append(cu_seqlens_q[-1] + n)
    return ids_remove_padding, batch_id_per_token, cu_seqlens_q


def _rope(x, cos, sin):
    left, right = x[:, 0::2], x[:, 1::2]
    return torch.stack([left * cos - right * sin, right * cos + left * sin], -1).flatten(1)


def _write_cache_rows(key_cache, value_cache, rows, k, v, write):
    """One block per token, in token order: the token's K/V at its cache row, or nothing (``return``)."""
    flat_k, flat_v = key_cache.view(-1, HEAD_DIM), value_cache.view(-1, HEAD_DIM)
    rows = torch.where(write, rows, torch.zeros_like(rows))
    for token_id in range(rows.shape[0]):
        row, w = rows[token_id:token_id + 1], write[token_id:token_id + 1, None]
        flat_k.index_copy_(0, row, torch.where(w, k[token_id:token_id + 1], flat_k[row]))
        flat_v.index_copy_(0, row, torch.where(w, v[token_id:token_id + 1], flat_v[row]))


def encoder_write_cache_with_rope(qkv, key_cache, value_cache, fm):
    """Prefill (encoder) path: every prompt token's rope'd K and V at its position (no padding: run eagerly)."""
    token_num = qkv.shape[0]
    bid = fm.batch_id_per_token[:token_num].long()
    write_seq_id = (fm.seq_lens_decoder.long()[bid] + torch.arange(token_num, device=qkv.device)
                    - fm.cu_seqlens_q.long()[bid])
    block_idx = fm.block_tables.long()[bid, write_seq_id // BLOCK_SIZE]
    q = _rope(qkv[:, 0], fm.cos_emb[write_seq_id], fm.sin_emb[write_seq_id])
    k = _rope(qkv[:, 1], fm.cos_emb[write_seq_id], fm.sin_emb[write_seq_id])
    rows = block_idx * BLOCK_SIZE + write_seq_id % BLOCK_SIZE
    _write_cache_rows(key_cache, value_cache, rows, k, qkv[:, 2], torch.ones_like(bid, dtype=torch.bool))
    return q, write_seq_id


def append_speculate_cache_int8_rope_kernel(qkv, key_cache, value_cache, block_tables, batch_id_per_token,
                                            cu_seqlens_q, seq_lens, seq_lens_encoder, cos_emb, sin_emb,
                                            cudagraph_padding_exit):
    """grid.x = token_num (the captured, padded count under a graph); returns qkv_out's q and each token's position."""
    token_num = qkv.shape[0]
    token_id = torch.arange(token_num, device=qkv.device)
    bid = batch_id_per_token[:token_num].long()
    write = torch.ones_like(bid, dtype=torch.bool)
    if cudagraph_padding_exit:
        write &= bid != -1                                    # if (bid == -1) return;  (#4545)
    start_token_idx = cu_seqlens_q.long()[bid]
    write &= seq_lens_encoder[bid] == 0                       # if (seq_lens_encoder[bid] > 0) return;
    write_seq_id = seq_lens.long()[bid] + token_id - start_token_idx
    write &= write_seq_id != 0                                # if (write_seq_id == 0) return;
    block_table_now = block_tables.long()[bid]                # block_tables + bid * max_blocks_per_seq
    block_idx = block_table_now.gather(1, (write_seq_id // BLOCK_SIZE)[:, None]).squeeze(1)
    block_offset = write_seq_id % BLOCK_SIZE
    cos, sin = cos_emb[write_seq_id], sin_emb[write_seq_id]
    q_out = _rope(qkv[:, 0], cos, sin)
    k = _rope(qkv[:, 1], cos, sin)
    _write_cache_rows(key_cache, value_cache, block_idx * BLOCK_SIZE + block_offset, k, qkv[:, 2], write)
    return q_out, write_seq_id


def cascade_append_attention(q, key_cache, value_cache, fm, write_seq_id):
    """Each token of a request attends to its request's cache up to its own position; padded rows (bid -1) are
    never visited by the decoder attention, their output stays 0."""
    token_num = q.shape[0]
    bid = fm.batch_id_per_token[:token_num].long()
    valid = bid != -1
    table = fm.block_tables.long()[torch.where(valid, bid, torch.zeros_like(bid))]          # [T, max_blocks]
    pos = torch.arange(MAX_SEQ_LEN, device=q.device)
    rows = table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE                      # [T, max_seq_len]
    rows = rows.clamp(min=0)
    keys = key_cache.view(-1, HEAD_DIM)[rows]
    values = value_cache.view(-1, HEAD_DIM)[rows]
    scores = (keys @ q[:, :, None]).squeeze(-1) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(pos[None, :] > write_seq_id[:, None], float("-inf"))
    out = (torch.softmax(scores, -1)[:, :, None] * values).sum(1)
    return torch.where(valid[:, None], out, torch.zeros_like(out))


# --- fastdeploy/model_executor --------------------------------------------------------------------------------

class ForwardMeta:
    def __init__(self, share_inputs, is_prefill, step_use_cudagraph):
        si = share_inputs
        self.ids_remove_padding = si["ids_remove_padding"]
        self.batch_id_per_token, self.cu_seqlens_q = si["batch_id_per_token"], si["cu_seqlens_q"]
        self.seq_lens_encoder, self.seq_lens_decoder = si["seq_lens_encoder"], si["seq_lens_decoder"]
        self.block_tables, self.caches = si["block_tables"], si["caches"]
        self.cos_emb, self.sin_emb = si["rope_emb"]
        self.is_prefill, self.step_use_cudagraph = is_prefill, step_use_cudagraph


class AppendAttentionBackend:
    def __init__(self, variant):
        self.variant = variant

    def forward_mixed(self, qkv, forward_meta):
        key_cache, value_cache = forward_meta.caches
        if forward_meta.is_prefill:
            q, write_seq_id = encoder_write_cache_with_rope(qkv, key_cache, value_cache, forward_meta)
        else:   # SpeculateWriteCacheWithRoPEKernel -> append_speculate_cache_int8_rope (cache_int8)
            q, write_seq_id = append_speculate_cache_int8_rope_kernel(
                qkv, key_cache, value_cache, forward_meta.block_tables, forward_meta.batch_id_per_token,
                forward_meta.cu_seqlens_q, forward_meta.seq_lens_decoder, forward_meta.seq_lens_encoder,
                forward_meta.cos_emb, forward_meta.sin_emb, cudagraph_padding_exit=self.variant == "fix")
        return cascade_append_attention(q, key_cache, value_cache, forward_meta, write_seq_id)


class ConcreteSizeEntry:
    def __init__(self, real_shape):
        self.real_shape, self.cuda_graph, self.output_buffers = real_shape, None, []


class CudaGraphPiecewiseBackend:
    def __init__(self, runnable, device):
        self.runnable, self.device, self.warm_up_size = runnable, device, 1
        self.real_shape_to_captured_size = _real_shape_to_captured_size()
        self.unique_memory_pool_id = graph_pool_handle(device)
        self.concrete_size_entries = {s: ConcreteSizeEntry(s) for s in CUDAGRAPH_CAPTURE_SIZES}

    def __call__(self, real_shape, forward_meta):
        padding_real_shape = self.real_shape_to_captured_size[real_shape]
        entry = self.concrete_size_entries[padding_real_shape]
        if entry.cuda_graph is None:
            fm = forward_meta
            g, out = capture(lambda: self.runnable(padding_real_shape, fm), device=self.device,
                             pool=self.unique_memory_pool_id, warmups=self.warm_up_size,
                             name=f"target num_tokens={padding_real_shape}", owner="CudaGraphPiecewiseBackend",
                             static={"ids_remove_padding": fm.ids_remove_padding,
                                     "batch_id_per_token": fm.batch_id_per_token, "cu_seqlens_q": fm.cu_seqlens_q,
                                     "seq_lens_encoder": fm.seq_lens_encoder,
                                     "seq_lens_decoder": fm.seq_lens_decoder, "block_tables": fm.block_tables},
                             state={"key_cache": fm.caches[0], "value_cache": fm.caches[1]})
            entry.cuda_graph, entry.output_buffers = g, [out]
        # the step wrote -1 into batch_id_per_token's padded rows; ids_remove_padding's are left as they were
        return replay(entry.cuda_graph, entry.output_buffers[0], real=real_shape, size=padding_real_shape,
                      padded={"ids_remove_padding": forward_meta.ids_remove_padding[:padding_real_shape]})


class Ernie4_5_Model(torch.nn.Module):                      # @support_graph_optimization
    def __init__(self, device, variant, use_cudagraph):
        super().__init__()
        gen = generator(4545)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, 3 * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.o_proj = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.mtp_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.attn = AppendAttentionBackend(variant)
        self.use_cudagraph = use_cudagraph
        self.cudagraph_piecewise_backend = CudaGraphPiecewiseBackend(self.forward, device) if use_cudagraph else None

    def forward(self, num_tokens, forward_meta):
        h = self.embed_tokens[forward_meta.ids_remove_padding[:num_tokens]]
        qkv = (h @ self.qkv_proj).view(num_tokens, 3, HEAD_DIM)
        return h + self.attn.forward_mixed(qkv, forward_meta) @ self.o_proj

    def __call__(self, num_tokens, forward_meta):
        if self.use_cudagraph and forward_meta.step_use_cudagraph:
            return self.cudagraph_piecewise_backend(num_tokens, forward_meta)
        return self.forward(num_tokens, forward_meta)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- fastdeploy/worker/gpu_model_runner.py ----------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, variant, use_cudagraph):
        self.device, self.use_cudagraph = device, use_cudagraph
        i32 = dict(dtype=torch.int32, device=device)
        inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        freqs = torch.arange(MAX_SEQ_LEN, dtype=torch.float32)[:, None] * inv[None, :]
        self.share_inputs = {
            "ids_remove_padding": torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device),
            "batch_id_per_token": torch.zeros(MAX_NUM_BATCHED_TOKENS, **i32),
            "cu_seqlens_q": torch.zeros(MAX_NUM_SEQS + 1, **i32),
            "seq_lens_encoder": torch.zeros(MAX_NUM_SEQS, **i32),
            "seq_lens_decoder": torch.zeros(MAX_NUM_SEQS, **i32),
            "block_tables": torch.full((MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ), -1, **i32),
            "caches": [torch.zeros(NUM_GPU_BLOCKS, BLOCK_SIZE, HEAD_DIM, device=device) for _ in range(2)],
            "rope_emb": (freqs.cos().to(device), freqs.sin().to(device)),
        }
        self.seq_lens_this_time = [0] * MAX_NUM_SEQS          # host mirror of seq_lens_this_time
        self.input_ids = [[] for _ in range(MAX_NUM_SEQS)]      # this step's tokens per slot
        self.model = Ernie4_5_Model(device, variant, use_cudagraph)
        self.capture_model()

    def _prepare_inputs(self, is_prefill):
        ids, batch_ids, cu_seqlens_q = pre_process(self.input_ids, self.seq_lens_this_time)
        si, t = self.share_inputs, lambda xs, dt: torch.tensor(xs, dtype=dt).to(self.device)
        si["ids_remove_padding"][:len(ids)].copy_(t(ids, torch.long))
        # NOTE: (changwenbin) Initialized to max_num_seq '-1' before copying, marking illegal positions
        si["batch_id_per_token"][:] = -1
        si["batch_id_per_token"][:len(batch_ids)].copy_(t(batch_ids, torch.int32))
        si["cu_seqlens_q"].copy_(t(cu_seqlens_q, torch.int32))
        step_use_cudagraph = self.use_cudagraph and not is_prefill           # only_decode_use_cudagraph
        self.forward_meta = ForwardMeta(si, is_prefill, step_use_cudagraph)
        return len(ids)

    def _execute(self, is_prefill):
        real_token_num = self._prepare_inputs(is_prefill)
        model_output = self.model(real_token_num, self.forward_meta)
        return model_output[:real_token_num].clone()

    def _dummy_run(self, num_tokens):
        batch_size = num_tokens // (NUM_SPECULATIVE_TOKENS + 1)
        si = self.share_inputs
        for idx in range(batch_size):
            self.input_ids[idx], self.seq_lens_this_time[idx] = [5, 5], NUM_SPECULATIVE_TOKENS + 1
            si["seq_lens_decoder"][idx] = BLOCK_SIZE
            si["block_tables"][idx] = torch.arange(idx * MAX_BLOCKS_PER_SEQ, (idx + 1) * MAX_BLOCKS_PER_SEQ,
                                                  dtype=torch.int32, device=self.device)
        self._execute(is_prefill=False)
        for idx in range(batch_size):                                           # clear the dummy requests
            self.input_ids[idx], self.seq_lens_this_time[idx] = [], 0
        si["seq_lens_decoder"].zero_()
        si["block_tables"].fill_(-1)

    def capture_model(self):
        if not self.use_cudagraph:
            return
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(num_tokens)

    def insert_prefill_tasks(self, prompts):
        si = self.share_inputs
        for idx, prompt in enumerate(prompts):
            self.input_ids[idx], self.seq_lens_this_time[idx] = list(prompt), len(prompt)
            si["seq_lens_encoder"][idx], si["seq_lens_decoder"][idx] = len(prompt), 0
            si["block_tables"][idx] = torch.arange(idx * MAX_BLOCKS_PER_SEQ, (idx + 1) * MAX_BLOCKS_PER_SEQ,
                                                  dtype=torch.int32, device=self.device)

    def execute_model(self, is_prefill):
        return self._execute(is_prefill)


def speculate_verify(runner, hidden, last_positions_only):
    """Greedy MTP verification on the host: emit tokens, advance seq_lens_decoder, propose the next draft.
    Returns the step's logits and emitted tokens."""
    model, si = runner.model, runner.share_inputs
    logits = model.compute_logits(hidden)
    argmax = logits.argmax(-1).tolist()
    emitted, row = [], 0
    seq_lens_decoder = si["seq_lens_decoder"].tolist()
    for idx in range(MAX_NUM_SEQS):
        n = runner.seq_lens_this_time[idx]
        if n == 0:
            continue
        if last_positions_only:                               # after the prefill: first token + first draft
            last, accept_num = row + n - 1, n
            tokens = [argmax[last]]
        else:                                                  # [last token, draft]: accept the draft or not
            draft = runner.input_ids[idx][1]
            accepted = argmax[row] == draft
            last, accept_num = (row + 1, 2) if accepted else (row, 1)
            tokens = [draft, argmax[row + 1]] if accepted else [argmax[row]]
        next_draft = int((hidden[last] @ model.mtp_head).argmax())
        runner.input_ids[idx], runner.seq_lens_this_time[idx] = [tokens[-1], next_draft], NUM_SPECULATIVE_TOKENS + 1
        seq_lens_decoder[idx] += accept_num
        emitted += tokens + [-1] * (2 - len(tokens))
        row += n
    si["seq_lens_decoder"].copy_(torch.tensor(seq_lens_decoder, dtype=torch.int32).to(runner.device))
    si["seq_lens_encoder"].zero_()
    return [logits, torch.tensor(emitted, dtype=torch.float32)]


def run(variant: str, device: str = "cpu"):
    def serve(use_cudagraph: bool):
        runner = GPUModelRunner(device, variant, use_cudagraph)
        runner.insert_prefill_tasks(PROMPTS)
        outs = speculate_verify(runner, runner.execute_model(is_prefill=True), last_positions_only=True)
        for step in range(max(MAX_DEC_STEPS)):
            for idx, steps in enumerate(MAX_DEC_STEPS):
                if step == steps and runner.seq_lens_this_time[idx]:      # the request stops; its slot is freed
                    runner.seq_lens_this_time[idx], runner.input_ids[idx] = 0, []
                    runner.share_inputs["seq_lens_decoder"][idx] = 0
                    runner.share_inputs["block_tables"][idx] = -1
            outs += speculate_verify(runner, runner.execute_model(is_prefill=False), last_positions_only=False)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
