"""sgl-kernel's merge_state_v2 launched its kernel on the legacy default stream: in an EAGLE (topk > 1) target-verify graph the merge runs once at capture and no node writes the merged attention output.

Upstream: https://github.com/sgl-project/sglang/pull/5419 ("bugfix: fix merge_state_v2 cuda graph", DefTruth, merged;
opened 2025-04-15), fixing https://github.com/sgl-project/sglang/issues/5404; shipped in sgl-kernel 0.0.9.post1
(https://github.com/sgl-project/sglang/pull/5436, "support CUDA Graph for merge_state_v2", 2025-04-15). The kernel came
in the day before with https://github.com/sgl-project/sglang/pull/5381 ("kernel: support slightly faster
merge_state_v2 cuda kernel"); the FA3 backend's EAGLE topk > 1 cascade (https://github.com/sgl-project/sglang/pull/5318,
"Add Speculative Decoding Eagle3 topk > 1", ``merge_state_v2_wrapper``) merges with it inside captured graphs. Sibling
fix: https://github.com/vllm-project/vllm/pull/16693 (vLLM's ``merge_attn_states``, preventive).
Symptom: with ``merge_state_v2`` under CUDA graphs the attention output is silently wrong: a gsm8k accuracy drop (the
PR runs gsm8k without and with the fix, with and without speculative decoding; the stored excerpt of the thread ends
before its numbers); no error is raised. Without graphs the merge is right.
Mechanism: ``sgl-kernel/csrc/attention/merge_attn_states.cu``: ``merge_state_v2`` (the op behind
``sgl_kernel.merge_state_v2``) dispatches to ``merge_attn_states_launcher``, whose ``LAUNCH_MERGE_ATTN_STATES`` macro
launched ``merge_attn_states_kernel<scalar_t, NUM_THREADS><<<grid, block>>>``: no stream argument, so the legacy
default stream 0. SGLang's ``CudaGraphRunner`` captures on a side stream from PyTorch's pool, which is non-blocking:
a launch on stream 0 neither joins the graph nor invalidates the capture, it executes once, eagerly, during capture.
In ``FlashAttentionBackend.forward_extend`` for TARGET_VERIFY with ``topk > 1`` the attention is a cascade: one
``flash_attn_with_kvcache`` over the committed prefix (``causal=False``, ``return_softmax_lse=True``), one over each
draft token's tree ancestors (``forward_metadata_spec_decode_expand``), then ``merge_state_v2_wrapper(o,
softmax_lse.T.contiguous(), o_expand, softmax_lse_expand.T.contiguous())``. Both attentions and ``o_proj`` are graph
nodes; the merge is not, and its output ``v_merged`` (``torch.empty_like(v_a)`` in the wrapper: a block of the
graph's pool) is written by no node. Every replay's ``o_proj`` reads whatever that block holds (on CUDA the
capture-time merge of unexecuted buffers, or a later node's data once the block is handed on; in the CPU emulation
the poison of memory the graph never wrote), so every verify step's logits are wrong and acceptance is garbage.
Eagerly the launch on stream 0 is ordered after the producers on the (legacy) current stream, so eager is right.
A launch on stream 0 is modelled as a launch from another thread (whose current stream is the default one): the CPU
engine records only the capturing thread, as CUDA captures only the capturing stream.
Doctor: host-work-frozen, at ``merge_attn_states_launcher`` (its kernel ran once, outside the graph, during capture;
replays repeat only the captured kernels, so the merged attention output the captured ``o_proj`` reads is never
recomputed; the launcher is where the fix changed code).
Fix (upstream): ``merge_attn_states_launcher`` takes ``const c10::cuda::OptionalCUDAGuard
device_guard(prefix_output.device()); auto stream = at::cuda::getCurrentCUDAStream();`` and the macro launches
``<<<grid, block, 0, stream>>>``, so under capture the merge is a node of the graph. (Read: both stored versions of
``merge_attn_states.cu``, 2112e0e5 without a stream argument and 6614f984 with it; the PR and issue threads were not
stored in full.)
Modelled: one Llama decoder layer (no RoPE, float32 instead of bfloat16, page size 1) served by EAGLE target
verification with a fixed 5-token draft tree (root, two children, one grandchild each: topk 2, 2 steps), batch 2,
one verify graph; ``flash_attn_with_kvcache`` is torch code over gathered pages; the merge kernel is torch code
with the kernel's arithmetic. Draft tokens are drawn from a generator (no draft model); greedy tree acceptance on
the host. Which upstream caller first served the buggy kernel under graphs (the PR tested a flashinfer backend
patched to call ``merge_state_v2``) is not stored; the FA3 cascade is the in-tree captured caller. Eager work runs on
the default stream, as SGLang's forward does with EAGLE (overlap scheduler off); a forward on the overlap scheduler's
non-blocking stream would race with a stream-0 launch eagerly too, which is not modelled.
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/5419"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "merge_attn_states_launcher"
SYMPTOM = ("EAGLE topk>1 target-verify graph: merge_state_v2's kernel ran on stream 0 at capture and is no node; "
           "replayed steps read a merged attention output no node writes: wrong logits, accuracy drop")

VOCAB, NUM_HEADS, HEAD_DIM, BS, STEPS, EPS = 32, 2, 8, 2, 4, 1e-6
HIDDEN = NUM_HEADS * HEAD_DIM
PARENTS = [-1, 0, 0, 1, 2]                  # the draft tree: root, two children (topk 2), a grandchild each
NUM_DRAFT_TOKENS = len(PARENTS)
MAX_CONTEXT, KV_POOL_SIZE = 32, 64          # req_to_token width; KV slots (slot 0: the padding slot)
PREFIX_LENS = [6, 9]


def _ancestors():
    """Row j: the draft tokens that token j attends to (its ancestors and itself), padded with index 0."""
    table, counts = [], []
    for j in range(NUM_DRAFT_TOKENS):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = PARENTS[node]
        counts.append(len(path))
        table.append(path + [0] * (NUM_DRAFT_TOKENS - len(path)))
    return table, counts


ANCESTORS, ANCESTOR_COUNTS = _ancestors()


# -------------------------------------------------------------------------------------------------- sgl-kernel
def legacy_stream_launch(kernel, *args):
    """``kernel<<<grid, block>>>``: stream 0, the legacy default stream. It orders itself only with blocking streams;
    the capture's side stream is non-blocking, so the launch executes now and is not captured (another thread)."""
    worker = threading.Thread(target=kernel, args=args)
    worker.start()
    worker.join()


def stream_launch(stream, kernel, *args):
    """``kernel<<<grid, block, 0, stream>>>`` on the current stream: recorded when that stream is capturing."""
    kernel(*args)


def merge_attn_states_kernel(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    """Section 2.2 of arXiv:2501.01005: merge two partial attention states by their log-sum-exps ([n, h])."""
    p_lse = prefix_lse.masked_fill(prefix_lse.isinf(), float("-inf"))
    s_lse = suffix_lse.masked_fill(suffix_lse.isinf(), float("-inf"))
    max_lse = torch.maximum(p_lse, s_lse)
    p_se, s_se = torch.exp(p_lse - max_lse), torch.exp(s_lse - max_lse)
    out_se = p_se + s_se
    output.copy_(prefix_output * (p_se / out_se).unsqueeze(-1) + suffix_output * (s_se / out_se).unsqueeze(-1))
    output_lse.copy_(torch.log(out_se) + max_lse)


def current_cuda_stream(t):
    """``at::cuda::getCurrentCUDAStream()`` (the capturing stream while capturing)."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else "current stream"


def merge_attn_states_launcher(variant, prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse):
    head_size, pack_size = output.size(2), 16 // output.element_size()
    assert head_size % pack_size == 0, f"headsize must be multiple of pack_size: {pack_size}"
    if variant == "fix":     # auto stream = at::cuda::getCurrentCUDAStream(); <<<grid, block, 0, stream>>>
        stream = current_cuda_stream(prefix_output)
        stream_launch(stream, merge_attn_states_kernel, output, output_lse, prefix_output, prefix_lse,
                      suffix_output, suffix_lse)
    else:                    # LAUNCH_MERGE_ATTN_STATES: merge_attn_states_kernel<...><<<grid, block>>>
        legacy_stream_launch(merge_attn_states_kernel, output, output_lse, prefix_output, prefix_lse,
                             suffix_output, suffix_lse)


def merge_state_v2(variant, v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """``sgl_kernel.merge_state_v2`` (python/sgl_kernel/attention.py) and the op it calls."""
    s_a = s_a.to(torch.float32)
    s_b = s_b.to(torch.float32)
    if v_merged is None:
        v_merged = torch.empty_like(v_a)
    if s_merged is None:
        s_merged = torch.empty_like(s_a)
    merge_attn_states_launcher(variant, v_a, s_a, v_b, s_b, v_merged, s_merged)   # torch.ops.sgl_kernel.merge_state_v2
    return v_merged, s_merged


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q,
                            softmax_scale, causal=False, return_softmax_lse=False):
    """FA3 varlen paged attention, page size 1: query row i of request b (``cu_seqlens_q``) attends to the slots
    ``page_table[b, :cache_seqlens[b]]``. Returns out [tokens, heads, dim] and softmax_lse [heads, tokens]."""
    rows = torch.arange(q.shape[0], device=q.device)
    batch = torch.searchsorted(cu_seqlens_q, rows, right=True) - 1
    slots = page_table[batch]
    k, v = k_cache[slots], v_cache[slots]                                  # [tokens, pages, heads, dim]
    scores = torch.einsum("thd,tphd->thp", q, k) * softmax_scale
    pages = torch.arange(slots.shape[1], device=q.device)
    valid = pages.unsqueeze(0) < cache_seqlens[batch].unsqueeze(-1)
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    out = torch.einsum("thp,tphd->thd", torch.softmax(scores, -1), v)
    if not return_softmax_lse:
        return out
    return out, torch.logsumexp(scores, -1).T.contiguous()


# ---------------------------------------------------------------------------------------------------- SGLang
class ForwardMode:
    TARGET_VERIFY = "target_verify"


class ForwardBatch:
    def __init__(self, forward_mode, batch_size, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                 token_to_kv_pool, attn_backend):
        self.forward_mode, self.batch_size, self.input_ids = forward_mode, batch_size, input_ids
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.token_to_kv_pool, self.attn_backend = token_to_kv_pool, attn_backend


class FlashAttentionMetadata:
    def __init__(self, cache_seqlens_int32, cu_seqlens_q, max_seq_len_q, page_table):
        self.cache_seqlens_int32, self.cu_seqlens_q = cache_seqlens_int32, cu_seqlens_q
        self.max_seq_len_q, self.page_table = max_seq_len_q, page_table


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(KV_POOL_SIZE, NUM_HEADS, HEAD_DIM, device=device)
        self.v_buffer = torch.zeros(KV_POOL_SIZE, NUM_HEADS, HEAD_DIM, device=device)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[loc] = cache_k
        self.v_buffer[loc] = cache_v


class FlashAttentionBackend:
    """The FA3 backend's TARGET_VERIFY path with ``topk > 1`` (a cascade: prefix, then the draft tree, merged)."""

    def __init__(self, variant, model_runner):
        self.variant, self.device = variant, model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.topk = 2
        self.ancestors = torch.tensor(ANCESTORS, device=self.device)
        self.ancestor_counts = torch.tensor(ANCESTOR_COUNTS, dtype=torch.int32, device=self.device)
        self.forward_metadata = self.forward_metadata_spec_decode_expand = None

    # ---- metadata
    def _normal(self, bs, req_pool_indices, seq_lens):
        return (seq_lens.to(torch.int32),
                torch.arange(0, bs * NUM_DRAFT_TOKENS + 1, NUM_DRAFT_TOKENS, dtype=torch.int32, device=self.device),
                self.req_to_token[req_pool_indices, :MAX_CONTEXT])

    def _expand(self, bs, out_cache_loc):
        """Each draft token is its own query: it attends to its tree ancestors' KV slots (from the custom mask)."""
        page_table = out_cache_loc.view(bs, NUM_DRAFT_TOKENS)[:, self.ancestors].reshape(bs * NUM_DRAFT_TOKENS, -1)
        return (self.ancestor_counts.repeat(bs),
                torch.arange(0, bs * NUM_DRAFT_TOKENS + 1, dtype=torch.int32, device=self.device), page_table)

    def init_forward_metadata(self, forward_batch):
        bs = forward_batch.batch_size
        normal = self._normal(bs, forward_batch.req_pool_indices, forward_batch.seq_lens)
        expand = self._expand(bs, forward_batch.out_cache_loc)
        self.forward_metadata = FlashAttentionMetadata(normal[0], normal[1], NUM_DRAFT_TOKENS, normal[2])
        self.forward_metadata_spec_decode_expand = FlashAttentionMetadata(expand[0], expand[1], 1, expand[2])

    def init_cuda_graph_state(self, max_bs):
        num_tokens = max_bs * NUM_DRAFT_TOKENS
        z = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=self.device)  # noqa: E731
        self.target_verify_metadata_topk_normal = FlashAttentionMetadata(
            z(max_bs), z(max_bs + 1), NUM_DRAFT_TOKENS, z(max_bs, MAX_CONTEXT, dtype=torch.long))
        self.target_verify_metadata_topk_expand = FlashAttentionMetadata(
            z(num_tokens), z(num_tokens + 1), 1, z(num_tokens, NUM_DRAFT_TOKENS, dtype=torch.long))

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, out_cache_loc):
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, out_cache_loc)
        self.forward_metadata = self.target_verify_metadata_topk_normal
        self.forward_metadata_spec_decode_expand = self.target_verify_metadata_topk_expand

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, out_cache_loc):
        for metadata, (cache_seqlens, cu_seqlens_q, page_table) in (
                (self.target_verify_metadata_topk_normal, self._normal(bs, req_pool_indices, seq_lens)),
                (self.target_verify_metadata_topk_expand, self._expand(bs, out_cache_loc))):
            metadata.cache_seqlens_int32.copy_(cache_seqlens)
            metadata.cu_seqlens_q.copy_(cu_seqlens_q)
            metadata.page_table.copy_(page_table)

    # ---- attention
    def merge_state_v2_wrapper(self, o, s_a, o_exp, s_b):
        # (@torch._dynamo.disable() upstream)
        return merge_state_v2(self.variant, o, s_a, o_exp, s_b)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        metadata = self.forward_metadata
        use_cascade_attn = forward_batch.forward_mode == ForwardMode.TARGET_VERIFY and self.topk > 1
        key_cache = forward_batch.token_to_kv_pool.k_buffer
        value_cache = forward_batch.token_to_kv_pool.v_buffer
        q = q.contiguous().view(-1, NUM_HEADS, HEAD_DIM)
        result = flash_attn_with_kvcache(
            q, key_cache, value_cache, page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32,
            cu_seqlens_q=metadata.cu_seqlens_q, max_seqlen_q=metadata.max_seq_len_q, softmax_scale=layer.scaling,
            causal=False, return_softmax_lse=use_cascade_attn)
        if use_cascade_attn:
            o, softmax_lse = result
            expand = self.forward_metadata_spec_decode_expand
            o_expand, softmax_lse_expand = flash_attn_with_kvcache(
                q, key_cache, value_cache, page_table=expand.page_table, cache_seqlens=expand.cache_seqlens_int32,
                cu_seqlens_q=expand.cu_seqlens_q, max_seqlen_q=expand.max_seq_len_q, softmax_scale=layer.scaling,
                causal=False, return_softmax_lse=True)
            o, _ = self.merge_state_v2_wrapper(o, softmax_lse.T.contiguous(), o_expand,
                                               softmax_lse_expand.T.contiguous())
        else:
            o = result
        return o.view(-1, HIDDEN)


class RadixAttention:
    def __init__(self, layer_id):
        self.layer_id, self.scaling = layer_id, HEAD_DIM ** -0.5

    def __call__(self, q, k, v, forward_batch):
        return forward_batch.attn_backend.forward_extend(q, k, v, self, forward_batch)


class LlamaForCausalLM:
    """Embedding, RMSNorm, qkv_proj, the FA3 attention, o_proj, residual, final norm, LM head."""

    def __init__(self, device):
        gen = generator(5404)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.input_layernorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.attn = RadixAttention(layer_id=0)

    @staticmethod
    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def forward(self, input_ids, forward_batch):
        hidden = self.embed_tokens[input_ids]
        q, k, v = (self.rms_norm(hidden, self.input_layernorm) @ self.qkv_proj).split(HIDDEN, -1)
        attn_output = self.attn(q, k.reshape(-1, NUM_HEADS, HEAD_DIM), v.reshape(-1, NUM_HEADS, HEAD_DIM),
                                forward_batch)
        hidden = hidden + attn_output @ self.o_proj
        return self.rms_norm(hidden, self.norm) @ self.lm_head


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros(BS, MAX_CONTEXT, dtype=torch.long, device=device)


class ModelRunner:
    def __init__(self, variant, device):
        self.device = device
        self.model = LlamaForCausalLM(device)
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = MHATokenToKVPool(device)
        self.attn_backend = FlashAttentionBackend(variant, self)

    def forward_extend(self, forward_batch):
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch)


class CudaGraphRunner:
    """The target model's graph runner, captured in TARGET_VERIFY mode (``num_tokens_per_bs`` draft tokens)."""

    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        num_tokens = BS * NUM_DRAFT_TOKENS
        self.input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        self.req_pool_indices = torch.zeros(BS, dtype=torch.long, device=self.device)
        self.seq_lens = torch.full((BS,), 1, dtype=torch.long, device=self.device)     # seq_len_fill_value
        self.out_cache_loc = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        self.model_runner.attn_backend.init_cuda_graph_state(BS)
        self.graph = self.output = None

    def capture(self):
        self.graph, self.output = self.capture_one_batch_size(BS, graph_pool_handle(self.device))

    def capture_one_batch_size(self, bs, pool):
        backend = self.model_runner.attn_backend
        forward_batch = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, self.input_ids, self.req_pool_indices,
                                     self.seq_lens, self.out_cache_loc, self.model_runner.token_to_kv_pool, backend)
        backend.init_forward_metadata_capture_cuda_graph(bs, self.req_pool_indices, self.seq_lens,
                                                         self.out_cache_loc)
        normal, expand = backend.target_verify_metadata_topk_normal, backend.target_verify_metadata_topk_expand
        static = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                  "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                  "cache_seqlens_int32": normal.cache_seqlens_int32, "page_table": normal.page_table,
                  "expand.cache_seqlens_int32": expand.cache_seqlens_int32, "expand.page_table": expand.page_table}
        kv = self.model_runner.token_to_kv_pool
        return capture(lambda: self.model_runner.model.forward(self.input_ids, forward_batch), device=self.device,
                       pool=pool, warmups=2, name=f"target verify bs {bs}", owner="SGLang CudaGraphRunner",
                       static=static, state={"k_buffer": kv.k_buffer, "v_buffer": kv.v_buffer})

    def replay(self, forward_batch):
        self.input_ids.copy_(forward_batch.input_ids)
        self.req_pool_indices.copy_(forward_batch.req_pool_indices)
        self.seq_lens.copy_(forward_batch.seq_lens)
        self.out_cache_loc.copy_(forward_batch.out_cache_loc)
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            forward_batch.batch_size, self.req_pool_indices, self.seq_lens, self.out_cache_loc)
        return replay(self.graph, self.output)


def verify_tree_greedy(logits, draft_tokens, bs):
    """Host side: follow the children whose draft token is the target's greedy choice at their parent."""
    preds = logits.argmax(-1).view(bs, NUM_DRAFT_TOKENS).tolist()
    drafts = draft_tokens.view(bs, NUM_DRAFT_TOKENS).tolist()
    accepted, bonus = [], []
    for b in range(bs):
        path, node = [0], 0
        while True:
            child = next((c for c, p in enumerate(PARENTS) if p == node and drafts[b][c] == preds[b][node]), None)
            if child is None:
                break
            path.append(child)
            node = child
        accepted.append(path)
        bonus.append(preds[b][node])
    return accepted, bonus


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph: bool):
        model_runner, gen, outs = ModelRunner(variant, device), generator(5419), []
        kv, req_to_token = model_runner.token_to_kv_pool, model_runner.req_to_token_pool.req_to_token
        free_slot, seq_lens = 1, list(PREFIX_LENS)
        for b, n in enumerate(PREFIX_LENS):                       # the prompts' prefill, done before serving
            req_to_token[b, :n] = torch.arange(free_slot, free_slot + n)
            kv.k_buffer[free_slot:free_slot + n] = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen).to(device)
            kv.v_buffer[free_slot:free_slot + n] = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen).to(device)
            free_slot += n
        if use_cuda_graph:                                         # ModelRunner.init_cuda_graphs
            runner = CudaGraphRunner(model_runner)
            runner.capture()
        roots = torch.randint(0, VOCAB, (BS,), generator=gen).tolist()
        for _ in range(STEPS):
            drafts = torch.randint(0, VOCAB, (BS, NUM_DRAFT_TOKENS), generator=gen)
            drafts[:, 0] = torch.tensor(roots)
            num_tokens = BS * NUM_DRAFT_TOKENS
            out_cache_loc = torch.arange(free_slot, free_slot + num_tokens)
            free_slot += num_tokens
            forward_batch = ForwardBatch(ForwardMode.TARGET_VERIFY, BS, drafts.view(-1).to(device),
                                         torch.arange(BS).to(device), torch.tensor(seq_lens).to(device),
                                         out_cache_loc.to(device), kv, model_runner.attn_backend)
            if use_cuda_graph:
                logits = runner.replay(forward_batch).clone()
            else:
                logits = model_runner.forward_extend(forward_batch)
            accepted, roots = verify_tree_greedy(logits, forward_batch.input_ids, BS)
            for b, path in enumerate(accepted):                   # commit the accepted tokens' KV slots
                slots = out_cache_loc.view(BS, NUM_DRAFT_TOKENS)[b, path]
                req_to_token[b, seq_lens[b]:seq_lens[b] + len(path)] = slots.to(device)
                seq_lens[b] += len(path)
            outs += [logits, torch.tensor(roots), torch.tensor(seq_lens)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
