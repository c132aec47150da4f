"""GDN spec decode pads for a FULL graph by request count: a step with more tokens than any graph overruns the table.

Upstream: https://github.com/vllm-project/vllm/pull/24667 ("[Qwen3Next] Fixes the cuda graph capture conditions
under large batch sizes (#24660)", merged 2025-09-12, commit 8226dd56b as cherry-picked into HabanaAI/vllm-fork),
fixing https://github.com/vllm-project/vllm/issues/24660.
Symptom: Qwen3-Next with MTP speculative decoding and FULL CUDA graphs crashes under large batch sizes (high
concurrency): once a pure spec-decode step schedules more tokens than the largest CUDA-graph capture size, the
step dies in the GDN metadata builder with ``IndexError: list index out of range`` (from
``VllmConfig.pad_for_cudagraph``). Small batches serve fine, and ``--enforce-eager`` serves large batches fine.
Mechanism: CUDA graphs are captured per token count, up to ``max_capture_size``; with MTP a spec-decode request
carries ``num_spec + 1`` tokens. ``GPUModelRunner._preprocess`` pads a step to a captured size only if
``num_scheduled_tokens <= cudagraph_batch_sizes[-1]`` and otherwise runs it without a graph.
``GDNAttentionMetadataBuilder.build`` (vllm/v1/attention/backends/gdn_attn.py) decides on its own whether the step
will replay a FULL graph ("prepare tensors for cudagraph"): ``use_full_cuda_graph and num_prefills == 0 and
num_decodes == 0 and num_spec_decodes <= decode_cudagraph_max_bs``, with ``decode_cudagraph_max_bs =
min(max_num_seqs, max_capture_size)``. That compares a request count with a capture size counted in tokens. A
step of 5 spec-decode requests (10 tokens, largest capture size 8) passes it. The branch then calls
``vllm_config.pad_for_cudagraph(m.num_actual_tokens)``, i.e. ``compilation_config.bs_to_padded_graph_size[10]``,
a table with ``max_capture_size + 1`` entries whose own comment says callers must stay within the captured range.
It raises before the step runs, although the runner would have run this step without a graph. With FULL graphs off
the branch is skipped and the builder keeps the unpadded metadata, so eager is correct.
Doctor: undersized-buffer, at build (the builder's graph-padding branch asks the capture-size padding table, and
its persistent metadata buffers sized for the largest captured graph, to serve a step with more tokens than any
captured graph has; the fix changes only this predicate in ``build``).
Fix (upstream): the branch also requires ``m.num_actual_tokens <= self.decode_cudagraph_max_bs``, so a step with
more tokens than that keeps the unpadded, non-persistent metadata (the runner serves it without a graph). A
follow-up (#24957) later made ``decode_cudagraph_max_bs`` itself a token count (``max_num_seqs * (num_spec + 1)``
capped by ``max_capture_size``).
Modelled: one Qwen3-Next GDN layer (q, k, v, gate ``g``, ``beta`` from small projections; one head, K = V = 4;
no conv1d, output gate or norm) between an embedding and an LM head, MTP with 1 speculative token (2 tokens per
request: every request is scheduled with its one draft), FULL_DECODE_ONLY graphs for uniform decode at 2, 4
and 8 tokens, the capture sizes [1, 2, 4, 8] with ``max_num_seqs`` = 8 (upstream: the 512-token cap under
1024-way concurrency). With ``max_num_seqs >= max_capture_size`` the fix's token bound is exactly the runner's graph
bound; with a smaller ``max_num_seqs`` it would also drop the persistent branch for some captured sizes, the gap
#24957 closed, which is not modelled. The exact error text is inferred from the code (the issue's traceback was
not read).
The recurrent kernel (``fused_recurrent_gated_delta_rule`` with ``cu_seqlens = spec_query_start_loc``) is vectorised
over sequences; a padded sequence has zero length, so it loads and stores no state, as the kernel's early return.
The builder keeps only the spec-decode path (no prefills, no non-spec decodes, no conv metadata). Requests start
from fixed recurrent states (their prefill is not modelled); the accepted-token count per request comes from the
workload. The runner models only the pieces of ``_preprocess``, ``_dummy_run``, ``capture_model`` and dispatch
that decide padding and graph use.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/24667"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = ("Qwen3-Next + MTP with FULL CUDA graphs crashes at high concurrency: a spec-decode step with more tokens "
           "than the largest capture size enters the GDN graph-padding branch and pad_for_cudagraph raises IndexError")

PAD_SLOT_ID = -1
VOCAB, HIDDEN, K, V = 16, 8, 4, 4
NUM_SPEC = 1                                   # MTP: one draft token, so a spec-decode request has 2 tokens
MAX_NUM_SEQS = 8                               # scheduler_config.max_num_seqs
CUDA_GRAPH_SIZES = [1, 2, 4, 8]                # token counts; max_capture_size = 8 (upstream 512)
MAX_NUM_TOKENS = MAX_NUM_SEQS * (NUM_SPEC + 1)
NUM_BLOCKS = 1 + MAX_NUM_SEQS * (NUM_SPEC + 1)   # block 0: the null block; a request holds NUM_SPEC + 1 blocks


# --- vllm/config/compilation.py, vllm/config/__init__.py ------------------------------------------------------------

class CompilationConfig:
    def __init__(self, full_decode_graphs: bool):
        self.full_decode_graphs = full_decode_graphs       # cudagraph_mode == FULL_DECODE_ONLY (else NONE)
        self.init_with_cudagraph_sizes(CUDA_GRAPH_SIZES)

    def has_full_cudagraphs(self) -> bool:
        return self.full_decode_graphs

    def init_with_cudagraph_sizes(self, cudagraph_capture_sizes):
        self.cudagraph_capture_sizes = sorted(cudagraph_capture_sizes, reverse=True)
        self.max_capture_size = self.cudagraph_capture_sizes[0] if self.cudagraph_capture_sizes else 0
        # pre-compute the mapping from batch size to padded graph size
        self.bs_to_padded_graph_size = [0 for _ in range(self.max_capture_size + 1)]
        for end, start in zip(self.cudagraph_capture_sizes, self.cudagraph_capture_sizes[1:] + [0]):
            for bs in range(start, end):
                self.bs_to_padded_graph_size[bs] = start if bs == start else end
        self.bs_to_padded_graph_size[self.max_capture_size] = self.max_capture_size


class VllmConfig:
    def __init__(self, full_decode_graphs: bool):
        self.compilation_config = CompilationConfig(full_decode_graphs)
        self.max_num_seqs = MAX_NUM_SEQS
        self.num_speculative_tokens = NUM_SPEC

    def pad_for_cudagraph(self, batch_size: int) -> int:
        # if batch_size > self.compilation_config.max_capture_size,
        # it should raise an IndexError.
        # the caller should make sure the batch_size is within the range,
        # i.e., batch_size <= self.compilation_config.max_capture_size
        return self.compilation_config.bs_to_padded_graph_size[batch_size]


# --- vllm/v1/attention/backends/utils.py ----------------------------------------------------------------------------

class CommonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, num_computed_tokens_cpu, num_reqs, num_actual_tokens, max_query_len,
                 block_table_tensor):
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens
        self.num_computed_tokens_cpu = num_computed_tokens_cpu
        self.num_reqs, self.num_actual_tokens, self.max_query_len = num_reqs, num_actual_tokens, max_query_len
        self.block_table_tensor = block_table_tensor


# --- vllm/v1/attention/backends/gdn_attn.py -------------------------------------------------------------------------

class GDNAttentionMetadata:
    def __init__(self, num_spec_decodes, num_spec_decode_tokens, spec_query_start_loc, spec_state_indices_tensor,
                 spec_sequence_masks, spec_token_masks, num_accepted_tokens):
        self.num_spec_decodes, self.num_spec_decode_tokens = num_spec_decodes, num_spec_decode_tokens
        self.spec_query_start_loc = spec_query_start_loc
        self.spec_state_indices_tensor = spec_state_indices_tensor
        self.spec_sequence_masks, self.spec_token_masks = spec_sequence_masks, spec_token_masks
        self.num_accepted_tokens = num_accepted_tokens


class GDNAttentionMetadataBuilder:
    def __init__(self, vllm_config: VllmConfig, device, variant):
        self.vllm_config, self.variant = vllm_config, variant
        self.compilation_config = vllm_config.compilation_config
        self.num_spec = vllm_config.num_speculative_tokens
        self.use_full_cuda_graph = self.compilation_config.has_full_cudagraphs()
        self.decode_cudagraph_max_bs = min(vllm_config.max_num_seqs, self.compilation_config.max_capture_size)
        max_bs = self.decode_cudagraph_max_bs
        self.spec_state_indices_tensor = torch.empty(max_bs, self.num_spec + 1, dtype=torch.int32, device=device)
        self.spec_sequence_masks = torch.empty(max_bs, dtype=torch.bool, device=device)
        self.spec_token_masks = torch.empty(max_bs * (self.num_spec + 1), dtype=torch.bool, device=device)
        self.spec_query_start_loc = torch.empty(max_bs + 1, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.empty(max_bs, dtype=torch.int32, device=device)

    def build(self, common_prefix_len, common_attn_metadata: CommonAttentionMetadata, num_accepted_tokens=None,
              num_draft_tokens=None) -> GDNAttentionMetadata:
        m = common_attn_metadata
        query_start_loc = m.query_start_loc
        context_lens_tensor = m.num_computed_tokens_cpu.to(query_start_loc.device)
        seq_lens_tensor = m.seq_lens

        spec_sequence_masks = (num_draft_tokens > 0) & (context_lens_tensor + (num_draft_tokens + 1)
                                                        == seq_lens_tensor)
        num_spec_decodes = spec_sequence_masks.sum().item()
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        non_spec_query_lens = query_lens[~spec_sequence_masks]
        num_decodes = (non_spec_query_lens == 1).sum().item()
        num_prefills = non_spec_query_lens.size(0) - num_decodes
        assert num_prefills == 0 and num_decodes == 0, "modelled: pure spec-decode steps only"
        spec_token_masks = torch.ones(min(num_spec_decodes * (self.num_spec + 1), query_start_loc[-1].item()),
                                      dtype=torch.bool, device=query_start_loc.device)
        spec_state_indices_tensor = m.block_table_tensor[:, :self.num_spec + 1]
        spec_query_start_loc = query_start_loc
        num_spec_decode_tokens = min(num_spec_decodes * (self.num_spec + 1), spec_token_masks.size(0))
        num_accepted_tokens = num_accepted_tokens[spec_sequence_masks]

        # prepare tensors for cudagraph
        graphable = (self.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
                     and num_spec_decodes <= self.decode_cudagraph_max_bs)
        if self.variant == "fix":
            graphable = graphable and m.num_actual_tokens <= self.decode_cudagraph_max_bs
        if graphable:
            num_total_tokens = self.vllm_config.pad_for_cudagraph(m.num_actual_tokens)
            batch_size = num_total_tokens // (self.num_spec + 1)

            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor, non_blocking=True)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)

            self.spec_sequence_masks[:num_spec_decodes].copy_(spec_sequence_masks, non_blocking=True)
            spec_sequence_masks = self.spec_sequence_masks[:batch_size]
            spec_sequence_masks[num_spec_decodes:].fill_(False)

            self.spec_token_masks[:spec_token_masks.size(0)].copy_(spec_token_masks, non_blocking=True)
            spec_token_masks = self.spec_token_masks[:m.num_actual_tokens]
            spec_token_masks[spec_token_masks.size(0):].fill_(False)

            self.spec_query_start_loc[:num_spec_decodes + 1].copy_(spec_query_start_loc, non_blocking=True)
            spec_num_query_tokens = spec_query_start_loc[-1]
            spec_query_start_loc = self.spec_query_start_loc[:batch_size + 1]
            spec_query_start_loc[num_spec_decodes + 1:].fill_(spec_num_query_tokens)

            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens, non_blocking=True)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)

        return GDNAttentionMetadata(num_spec_decodes, num_spec_decode_tokens, spec_query_start_loc,
                                    spec_state_indices_tensor, spec_sequence_masks, spec_token_masks,
                                    num_accepted_tokens)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """Metadata for FULL capture: decode-only (uniform spec decode) batches."""
        m = common_attn_metadata
        assert (m.num_reqs * (self.num_spec + 1) <= m.num_actual_tokens
                and (m.num_reqs + 1) * (self.num_spec + 1) >= m.num_actual_tokens), \
            "GDN only supports decode-only full CUDAGraph capture."
        dev = m.query_start_loc.device
        num_accepted_tokens = torch.full((m.num_reqs,), m.max_query_len, dtype=torch.int32, device=dev)
        num_drafted_tokens = torch.full((m.num_reqs,), self.num_spec, dtype=torch.int32, device=dev)
        # Fixes query-start loc for spec-sequence-indices.
        m.query_start_loc = torch.arange(0, m.num_actual_tokens + 1, step=m.max_query_len, device=dev,
                                         dtype=torch.int32)
        m.num_computed_tokens_cpu = m.seq_lens.cpu() - torch.full((m.num_reqs,), m.max_query_len, dtype=torch.int32)
        return self.build(0, m, num_accepted_tokens, num_drafted_tokens)


# --- vllm/model_executor/layers/fla/ops/fused_recurrent.py ----------------------------------------------------------

def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, inplace_final_state=True,
                                     cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None):
    """IS_VARLEN, IS_CONTINUOUS_BATCHING, IS_SPEC_DECODING, INPLACE_FINAL_STATE, USE_QK_L2NORM_IN_KERNEL; all
    sequences ``i_n`` at once. ``q``/``k``/``g``/``beta``: [tokens, ...]; a sequence of length 0 (a padded one,
    ``cu_seqlens`` repeating its last offset) loads and stores nothing."""
    assert inplace_final_state
    num_tokens, n_seqs, t_max = q.shape[0], cu_seqlens.shape[0] - 1, ssm_state_indices.shape[1]
    dev = q.device
    bos = cu_seqlens[:-1].to(torch.int64)
    seq_len = cu_seqlens[1:].to(torch.int64) - bos                                   # [N]
    rows = torch.arange(n_seqs, device=dev)
    state_idx = ssm_state_indices[rows, (num_accepted_tokens.to(torch.int64) - 1).clamp(min=0)].to(torch.int64)
    live = (seq_len > 0) & (state_idx >= 0)
    b_h = initial_state[state_idx.clamp(min=0)] * live[:, None, None]                # [N, K, V]
    o = torch.zeros(num_tokens, V, device=dev)
    for i_t in range(t_max):
        tok_live = live & (i_t < seq_len)
        pos = (bos + i_t).clamp(max=num_tokens - 1)
        b_q = F.normalize(q[pos], dim=-1) * scale
        b_k = F.normalize(k[pos], dim=-1)
        b_h = b_h * torch.exp(g[pos])[:, None, None]
        b_v = (v[pos] - (b_h * b_k[:, :, None]).sum(1)) * beta[pos][:, None]
        b_h = torch.where(tok_live[:, None, None], b_h + b_k[:, :, None] * b_v[:, None, :], b_h)
        b_o = (b_h * b_q[:, :, None]).sum(1)
        o.index_put_((pos,), b_o * tok_live[:, None], accumulate=True)
        # keep the states for multi-query tokens
        final_state_idx = ssm_state_indices[:, i_t].to(torch.int64)
        store = tok_live & (final_state_idx >= 0)
        slot = torch.where(store, final_state_idx, 0)
        initial_state[slot] = torch.where(store[:, None, None], b_h, initial_state[slot])
    return o, initial_state


# --- vllm/model_executor/models/qwen3_next.py -----------------------------------------------------------------------

class Qwen3NextGatedDeltaNet:
    def __init__(self, gen, device):
        self.w_q = randn(HIDDEN, K, gen=gen, device=device, scale=0.6)
        self.w_k = randn(HIDDEN, K, gen=gen, device=device, scale=0.6)
        self.w_v = randn(HIDDEN, V, gen=gen, device=device, scale=0.6)
        self.w_a = randn(HIDDEN, 1, gen=gen, device=device, scale=0.6)
        self.w_b = randn(HIDDEN, 1, gen=gen, device=device, scale=0.6)
        self.w_o = randn(V, HIDDEN, gen=gen, device=device, scale=0.6)

    def forward(self, h, ssm_state, attn_metadata: GDNAttentionMetadata):
        # pure spec-decode step: mixed_qkv_spec = mixed_qkv (no non-spec tokens)
        g = F.logsigmoid(h @ self.w_a).squeeze(-1)
        beta = torch.sigmoid(h @ self.w_b).squeeze(-1)
        o, _ = fused_recurrent_gated_delta_rule(
            h @ self.w_q, h @ self.w_k, h @ self.w_v, g, beta, K ** -0.5, initial_state=ssm_state,
            inplace_final_state=True, cu_seqlens=attn_metadata.spec_query_start_loc,
            ssm_state_indices=attn_metadata.spec_state_indices_tensor,
            num_accepted_tokens=attn_metadata.num_accepted_tokens)
        return h + o @ self.w_o


class Qwen3NextForCausalLM:
    def __init__(self, device):
        gen = generator(24667)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.linear_attn = Qwen3NextGatedDeltaNet(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, input_ids, ssm_state, attn_metadata):
        h = self.embed_tokens[input_ids]                                    # [num_input_tokens, HIDDEN]
        return self.linear_attn.forward(h, ssm_state, attn_metadata) @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py -----------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, model, device, variant, enforce_eager):
        self.model, self.device = model, device
        self.vllm_config = VllmConfig(full_decode_graphs=not enforce_eager)
        self.compilation_config = self.vllm_config.compilation_config
        self.cudagraph_batch_sizes = sorted(self.compilation_config.cudagraph_capture_sizes)
        self.uniform_decode_query_len = NUM_SPEC + 1
        # the GDN layer's recurrent state pool (MambaSpec ssm state): [num_blocks, K, V]
        self.ssm_state = torch.zeros(NUM_BLOCKS, K, V, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, **i32)
        self.block_table = torch.zeros(MAX_NUM_SEQS, NUM_SPEC + 1, **i32)
        self.num_accepted_tokens = torch.ones(MAX_NUM_SEQS, **i32)
        self.builder = GDNAttentionMetadataBuilder(self.vllm_config, device, variant)
        self.graphs = {}
        if self.compilation_config.has_full_cudagraphs():
            self.capture_model()

    def _forward(self, attn_metadata, num_input_tokens):
        return self.model.forward(self.input_ids[:num_input_tokens], self.ssm_state, attn_metadata)

    def _common_metadata(self, num_reqs, num_tokens, num_computed_cpu):
        return CommonAttentionMetadata(self.query_start_loc[:num_reqs + 1], self.seq_lens[:num_reqs], num_computed_cpu,
                                       num_reqs, num_tokens, self.uniform_decode_query_len,
                                       self.block_table[:num_reqs])

    def _dummy_run(self, num_tokens):
        """A uniform-decode dummy batch of ``num_tokens`` tokens on the null block; returns its FULL metadata."""
        num_reqs = num_tokens // self.uniform_decode_query_len
        self.block_table[:num_reqs].zero_()
        self.seq_lens[:num_reqs].fill_(self.uniform_decode_query_len)
        m = self._common_metadata(num_reqs, num_tokens, None)
        return self.builder.build_for_cudagraph_capture(m)

    def capture_model(self):
        # FULL decode graphs: capture sizes between uniform_decode_query_len and max_num_seqs * query len
        max_num_tokens = MAX_NUM_SEQS * self.uniform_decode_query_len
        sizes = [x for x in self.cudagraph_batch_sizes if self.uniform_decode_query_len <= x <= max_num_tokens]
        b = self.builder
        for num_tokens in reversed(sizes):
            meta = self._dummy_run(num_tokens)
            self.graphs[num_tokens] = capture(
                lambda n=num_tokens, meta=meta: self._forward(meta, n), device=self.device,
                name=f"FULL uniform decode {num_tokens}", owner="GPUModelRunner (FULL_DECODE_ONLY)",
                static={"input_ids": self.input_ids, "spec_state_indices_tensor": b.spec_state_indices_tensor,
                        "spec_query_start_loc": b.spec_query_start_loc, "num_accepted_tokens": b.num_accepted_tokens},
                state={"ssm_state": self.ssm_state})
        self.ssm_state[0].zero_()                             # the null block: dummy-run writes discarded

    def _preprocess(self, num_scheduled_tokens):
        if self.compilation_config.has_full_cudagraphs() and num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]:
            # Use CUDA graphs. Add padding to the batch size.
            return self.vllm_config.pad_for_cudagraph(num_scheduled_tokens)
        return num_scheduled_tokens                           # eager mode

    def execute_model(self, scheduled):
        """``scheduled``: per request, (its blocks, tokens already computed, its NUM_SPEC + 1 new tokens (the
        sampled one and the draft), tokens accepted last step)."""
        n = len(scheduled)
        tokens = [t for _, _, toks, _ in scheduled for t in toks]
        num_tokens = len(tokens)
        dev = self.device
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens).to(dev))
        qsl = [0]
        for _, _, toks, _ in scheduled:
            qsl.append(qsl[-1] + len(toks))
        self.query_start_loc[:n + 1].copy_(torch.tensor(qsl, dtype=torch.int32).to(dev))
        computed = torch.tensor([c for _, c, _, _ in scheduled], dtype=torch.int32)
        self.seq_lens[:n].copy_((computed + NUM_SPEC + 1).to(dev))
        self.block_table[:n].copy_(torch.tensor([blk for blk, _, _, _ in scheduled], dtype=torch.int32).to(dev))
        self.num_accepted_tokens[:n].copy_(torch.tensor([a for _, _, _, a in scheduled], dtype=torch.int32).to(dev))
        num_draft_tokens = torch.full((n,), NUM_SPEC, dtype=torch.int32, device=dev)

        num_input_tokens = self._preprocess(num_tokens)
        m = self._common_metadata(n, num_tokens, computed)
        attn_metadata = self.builder.build(0, m, self.num_accepted_tokens[:n], num_draft_tokens)

        # dispatch: a uniform spec-decode batch whose padded size has a FULL graph replays it
        if num_input_tokens in self.graphs:
            g, out = self.graphs[num_input_tokens]
            logits = replay(g, out, real=num_tokens, size=num_input_tokens, padded={"input_ids": self.input_ids})
        else:
            logits = self._forward(attn_metadata, num_input_tokens)
        return logits[:num_tokens].clone()

    def add_request(self, blocks, state):
        self.ssm_state[blocks[0]] = state                    # the request's recurrent state after its prefill


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextForCausalLM(device)
    gen = generator(24660)
    names = "ABCDE"
    blocks = {r: [1 + 2 * i, 2 + 2 * i] for i, r in enumerate(names)}
    states = {r: randn(K, V, gen=gen, device=device, scale=0.5) for r in names}
    # steps of pure spec decode: 2 requests (4 tokens, graph 4), 3 (6 tokens, padded to graph 8), 5 (10 tokens:
    # more than the largest capture size, 8), then 3 again
    schedule = [["A", "B"], ["A", "B", "C"], ["A", "B", "C", "D", "E"], ["A", "C", "E"]]
    steps, computed, seen = [], {r: 5 for r in names}, set()
    for reqs in schedule:
        step = []
        for r in reqs:
            toks = torch.randint(0, VOCAB, (NUM_SPEC + 1,), generator=gen).tolist()
            acc = 1 if r not in seen else int(torch.randint(1, NUM_SPEC + 2, (1,), generator=gen))
            step.append((blocks[r], computed[r], toks, acc))
            computed[r] += NUM_SPEC + 1
            seen.add(r)
        steps.append(step)

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(model, device, variant, enforce_eager)
        for r in names:
            runner.add_request(blocks[r], states[r])
        outs = [runner.execute_model(step) for step in steps]
        return outs + [runner.ssm_state[1:].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
