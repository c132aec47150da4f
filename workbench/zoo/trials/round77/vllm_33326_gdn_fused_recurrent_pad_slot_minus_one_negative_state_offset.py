"""FULL-graph GDN spec decode: padded rows of ``ssm_state_indices`` hold PAD_SLOT_ID (-1), and the fused recurrent kernel addresses recurrent state slot -1.

Upstream: https://github.com/vllm-project/vllm/pull/33326 ("[Bugfix][Kernel] Fix negative memory offset in GDN Triton
kernel", description 2026-01-29, merged), fixing https://github.com/vllm-project/vllm/issues/31186.
Symptom: Qwen3-Next with MTP speculative decoding and CUDA graphs dies with ``cudaErrorIllegalAddress`` once a
decode batch is padded up to a captured size; eager mode runs (vLLM, Jan 2026).
Mechanism: ``GDNAttentionMetadataBuilder.build`` (vllm/v1/attention/backends/gdn_attn.py) copies the live requests'
``block_table[:, :num_spec + 1]`` into its persistent ``spec_state_indices_tensor`` and, for FULL graphs, fills the
padded rows with ``PAD_SLOT_ID = -1`` (``num_accepted_tokens`` of padded rows: 1). The captured GDN layer calls
``fused_recurrent_gated_delta_rule`` (vllm/model_executor/layers/fla/ops/fused_recurrent.py) over every captured row.
``fused_recurrent_gated_delta_rule_fwd_kernel`` loads ``ssm_state_indices[i_n, num_accepted_tokens[i_n] - 1]`` and
forms ``p_h0 = h0 + state_idx * stride_init_state_token`` with no check, then, per token, stores the final state at
``ht + ssm_state_indices[i_n, i_t] * stride_final_state_token``. For a padded row that is slot -1: a negative offset
before the state pool, read and written. The replay faults. Eager steps have no padded rows.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule_fwd_kernel`` (the padded rows of the captured
``spec_state_indices_tensor`` hold the PAD_SLOT_ID sentinel, and whether the whole replayed step survives depends on
what those padded rows hold; the fix changes only this kernel, which now treats the sentinel as "skip this row").
Fix (upstream): the kernel loads ``state_idx`` first and ``return``s when ``state_idx < 0`` (no initial-state load, no
output, no store); the per-token final-state store runs only ``if final_state_idx >= 0``.
Modelled: one GDN layer (q, k, v, gate ``g``, ``beta`` from small projections; H = 1 key head, HV = 2 value heads,
K = V = 4; no conv1d, no output gate/norm), MTP with 1 speculative token (every decode row has 2 tokens, the
accepted count per request comes from the workload), FULL graphs for uniform decode at 2 and 4 requests. The kernel
is launched in its dense layout (``q`` is [rows, T, H, K], no ``cu_seqlens``), so every captured row, padded ones
included, carries the uniform query length, as in the regression test written for #31186
(``test_fused_recurrent_cuda_graph_scenario``). (With ``cu_seqlens`` whose padded entries repeat the last
offset, a padded row has T == 0 and returns before its state load; the model keeps the test's layout.)
The kernel is vectorised over rows and heads and computes the flat state address explicitly
(``state_idx * stride + i_hv*K*V + o_k*V + o_v``). Global memory is bounds-checked as the GPU's MMU does: an address outside the state pool is not read (0) nor written, and it raises the context's sticky
"illegal memory access" flag, which the runner's next host synchronisation (reading the sampled tokens) turns into
``RuntimeError: CUDA error: an illegal memory access was encountered``. So the bug fails the same way on the CPU
and on a GPU, and no negative index wraps around to the last slot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/33326"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule_fwd_kernel"
SYMPTOM = ("Qwen3-Next + MTP under FULL CUDA graphs: a padded decode batch hits cudaErrorIllegalAddress, the GDN "
           "kernel addresses recurrent state slot PAD_SLOT_ID (-1) for the padded rows")

PAD_SLOT_ID = -1
VOCAB, HIDDEN = 16, 8
H, HV, K, V = 1, 2, 4, 4
NUM_SPEC = 1                                   # MTP: one draft token, so each decode row has 2 tokens
T = NUM_SPEC + 1
CAPTURE_SIZES = [2, 4]                          # requests per FULL uniform-decode graph
MAX_NUM_REQS = CAPTURE_SIZES[-1]
NUM_BLOCKS = 1 + MAX_NUM_REQS * T               # block 0: the null block; each request holds NUM_SPEC + 1 blocks


class CudaContext:
    """The device's sticky error state: a faulting kernel sets it, the next host synchronisation raises it."""

    def __init__(self, device):
        self.illegal_address = torch.zeros((), dtype=torch.bool, device=device)

    def synchronize(self):
        if bool(self.illegal_address):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


# --- vllm/model_executor/layers/fla/ops/fused_recurrent.py ----------------------------------------------------------

def _global_load(base, addr, ctx):
    """``tl.load`` from global memory ``base`` (flat) at ``addr``: an address outside the allocation faults."""
    legal = (addr >= 0) & (addr < base.numel())
    ctx.illegal_address |= (~legal).any()
    return torch.where(legal, base[addr.clamp(0, base.numel() - 1)], torch.zeros((), device=base.device))


def _global_store(base, addr, value, mask, ctx):
    """``tl.store`` of ``value`` at ``addr`` where ``mask``; an address outside the allocation faults."""
    legal = (addr >= 0) & (addr < base.numel())
    ctx.illegal_address |= (mask & ~legal).any()
    write = mask & legal
    a = addr.clamp(0, base.numel() - 1)
    base[a.reshape(-1)] = torch.where(write, value, base[a]).reshape(-1)


def fused_recurrent_gated_delta_rule_fwd_kernel(q, k, v, g, beta, o, h0, ht, ssm_state_indices, num_accepted_tokens,
                                                scale, stride_init_state_token, stride_final_state_token, variant,
                                                ctx):
    """All programs ``(i_n, i_hv)`` at once; IS_CONTINUOUS_BATCHING, IS_SPEC_DECODING, INPLACE_FINAL_STATE,
    USE_QK_L2NORM_IN_KERNEL. ``h0``/``ht``: the flat state pool; the state of a slot is [HV, K, V]."""
    n_rows, t_len = q.shape[0], q.shape[1]
    dev = q.device
    i_hv = torch.arange(HV, device=dev)
    i_h = i_hv // (HV // H)
    o_k = torch.arange(K, device=dev)
    o_v = torch.arange(V, device=dev)
    inner = (i_hv[:, None, None] * K * V + o_k[None, :, None] * V + o_v[None, None, :])[None]   # [1, HV, K, V]
    rows = torch.arange(n_rows, device=dev)

    i_t0 = num_accepted_tokens.to(torch.int64) - 1
    state_idx = ssm_state_indices[rows, i_t0].to(torch.int64)                                  # [N]
    if variant == "fix":
        # Skip if state index is invalid (PAD_SLOT_ID = -1): the program returns before any load or store
        live = state_idx >= 0
    else:
        live = torch.ones_like(state_idx, dtype=torch.bool)
    p_h0 = state_idx[:, None, None, None] * stride_init_state_token + inner
    b_h = torch.where(live[:, None, None, None], _global_load(h0, torch.where(live[:, None, None, None], p_h0, 0), ctx),
                      torch.zeros((), device=dev))
    for i_t in range(t_len):
        b_q = q[:, i_t, i_h]                                                                    # [N, HV, K]
        b_k = k[:, i_t, i_h]
        b_v = v[:, i_t]                                                                          # [N, HV, V]
        b_q = b_q / torch.sqrt((b_q * b_q).sum(-1, keepdim=True) + 1e-6)
        b_k = b_k / torch.sqrt((b_k * b_k).sum(-1, keepdim=True) + 1e-6)
        b_q = b_q * scale
        b_h = b_h * torch.exp(g[:, i_t])[:, :, None, None]
        b_v = b_v - (b_h * b_k[..., None]).sum(-2)
        b_v = b_v * beta[:, i_t][..., None]
        b_h = b_h + b_k[..., None] * b_v[..., None, :]
        b_o = (b_h * b_q[..., None]).sum(-2)
        o[:, i_t] = torch.where(live[:, None, None], b_o, o[:, i_t])
        # keep the states for multi-query tokens
        final_state_idx = ssm_state_indices[:, i_t].to(torch.int64)
        if variant == "fix":
            store = live & (final_state_idx >= 0)          # only store if the state index is valid (not PAD_SLOT_ID)
        else:
            store = live
        p_ht = final_state_idx[:, None, None, None] * stride_final_state_token + inner
        _global_store(ht, p_ht, b_h, store[:, None, None, None].expand_as(b_h), ctx)


def fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state,
                                         ssm_state_indices, num_accepted_tokens, variant, ctx):
    assert inplace_final_state
    o = q.new_zeros(q.shape[0], q.shape[1], HV, V)
    final_state = initial_state
    fused_recurrent_gated_delta_rule_fwd_kernel(
        q, k, v, g, beta, o, initial_state.view(-1), final_state.view(-1), ssm_state_indices, num_accepted_tokens,
        scale, initial_state.stride(0), final_state.stride(0), variant, ctx)
    return o, final_state


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, inplace_final_state=True,
                                     ssm_state_indices=None, num_accepted_tokens=None, *, variant, ctx):
    return fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state,
                                                ssm_state_indices, num_accepted_tokens, variant, ctx)


# --- vllm/v1/attention/backends/gdn_attn.py -------------------------------------------------------------------------

class GDNAttentionMetadata:
    def __init__(self, num_spec_decodes, spec_state_indices_tensor, num_accepted_tokens):
        self.num_spec_decodes = num_spec_decodes
        self.spec_state_indices_tensor = spec_state_indices_tensor
        self.num_accepted_tokens = num_accepted_tokens


class GDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.use_full_cuda_graph = use_full_cuda_graph
        self.spec_state_indices_tensor = torch.zeros(MAX_NUM_REQS, NUM_SPEC + 1, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=device)

    def build(self, block_table_tensor, num_accepted_tokens, num_spec_decodes, batch_size):
        """``batch_size``: the rows the (padded) step runs; ``num_spec_decodes``: the live requests among them."""
        spec_state_indices_tensor = block_table_tensor[:num_spec_decodes, :NUM_SPEC + 1]
        if self.use_full_cuda_graph:
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor, non_blocking=True)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)
            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens, non_blocking=True)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)
        return GDNAttentionMetadata(num_spec_decodes, spec_state_indices_tensor, num_accepted_tokens)


# --- vllm/model_executor/models/qwen3_next.py -----------------------------------------------------------------------

class Qwen3NextGatedDeltaNet:
    def __init__(self, gen, device, variant):
        self.variant = variant
        self.w_q = randn(HIDDEN, H * K, gen=gen, device=device, scale=0.6)
        self.w_k = randn(HIDDEN, H * K, gen=gen, device=device, scale=0.6)
        self.w_v = randn(HIDDEN, HV * V, gen=gen, device=device, scale=0.6)
        self.w_a = randn(HIDDEN, HV, gen=gen, device=device, scale=0.6)
        self.w_b = randn(HIDDEN, HV, gen=gen, device=device, scale=0.6)
        self.w_o = randn(HV * V, HIDDEN, gen=gen, device=device, scale=0.6)

    def forward(self, h, ssm_state, attn_metadata: GDNAttentionMetadata, ctx):
        b = h.shape[0]
        q = (h @ self.w_q).view(b, T, H, K)
        k = (h @ self.w_k).view(b, T, H, K)
        v = (h @ self.w_v).view(b, T, HV, V)
        g = F.logsigmoid(h @ self.w_a)
        beta = torch.sigmoid(h @ self.w_b)
        o, _ = fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, K ** -0.5, initial_state=ssm_state, inplace_final_state=True,
            ssm_state_indices=attn_metadata.spec_state_indices_tensor,
            num_accepted_tokens=attn_metadata.num_accepted_tokens, variant=self.variant, ctx=ctx)
        return h + o.reshape(b, T, HV * V) @ self.w_o


class Qwen3NextForCausalLM:
    def __init__(self, device, variant):
        gen = generator(33326)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.linear_attn = Qwen3NextGatedDeltaNet(gen, device, variant)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, input_ids, ssm_state, attn_metadata, ctx):
        h = self.embed_tokens[input_ids]                                    # [rows, T, HIDDEN]
        h = self.linear_attn.forward(h, ssm_state, attn_metadata, ctx)
        return h @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py -----------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, model, device, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.ctx = CudaContext(device)
        # the GDN layer's recurrent state pool (MambaSpec ssm state): [num_blocks, HV, K, V]
        self.ssm_state = torch.zeros(NUM_BLOCKS, HV, K, V, device=device)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(MAX_NUM_REQS, T, **long)
        self.block_table = torch.zeros(MAX_NUM_REQS, NUM_SPEC + 1, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.builder = GDNAttentionMetadataBuilder(device, use_full_cuda_graph=graphed)
        self.graphs = {}
        if graphed:
            self.capture_model()

    def _forward_step(self, attn_metadata, num_rows):
        return self.model.forward(self.input_ids[:num_rows], self.ssm_state, attn_metadata, self.ctx)

    def capture_model(self):
        for size in reversed(CAPTURE_SIZES):
            # _dummy_run: `size` dummy uniform-decode requests on the null block, all of them live (no padded rows)
            self.block_table[:size].zero_()
            self.num_accepted_tokens[:size].fill_(1)
            meta = self.builder.build(self.block_table, self.num_accepted_tokens[:size], size, size)
            self.graphs[size] = capture(
                lambda size=size, meta=meta: self._forward_step(meta, size), device=self.device,
                name=f"FULL uniform decode {size}", owner="GPUModelRunner (FULL graphs)",
                static={"input_ids": self.input_ids,
                        "spec_state_indices_tensor": self.builder.spec_state_indices_tensor,
                        "num_accepted_tokens": self.builder.num_accepted_tokens},
                state={"ssm_state": self.ssm_state})
        self.ssm_state[0].zero_()                             # the null block: dummy-run writes discarded

    def execute_model(self, scheduled):
        """``scheduled``: per request, (its NUM_SPEC + 1 block ids, its T input tokens, tokens accepted last step)."""
        n = len(scheduled)
        t = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt).to(self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([toks for _, toks, _ in scheduled]))
        self.block_table[:n].copy_(t([blocks for blocks, _, _ in scheduled], torch.int32))
        self.num_accepted_tokens[:n].copy_(t([acc for _, _, acc in scheduled], torch.int32))
        num_reqs_padded = next(s for s in CAPTURE_SIZES if s >= n) if self.graphed else n
        meta = self.builder.build(self.block_table, self.num_accepted_tokens[:n], n, num_reqs_padded)
        if not self.graphed:
            logits = self._forward_step(meta, n)
        else:
            g, out = self.graphs[num_reqs_padded]
            logits = replay(g, out, real=n, size=num_reqs_padded, padded={"input_ids": self.input_ids})
        logits = logits[:n].clone()
        # _bookkeeping_sync: the sampled (target) tokens go to the host; a faulted replay surfaces here
        self.ctx.synchronize()
        logits.argmax(-1).tolist()
        return logits

    def add_request(self, blocks):
        self.ssm_state[torch.tensor(blocks, device=self.device)] = 0.0    # a fresh request: zero recurrent state


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextForCausalLM(device, variant)
    gen = generator(3132)
    blocks = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8]}

    def toks():
        return torch.randint(0, VOCAB, (T,), generator=gen).tolist()

    def acc():
        return int(torch.randint(1, T + 1, (1,), generator=gen))

    schedule = [["A", "B"], ["A", "B", "C"], ["A", "B", "C", "D"], ["A", "C", "D"], ["A"]]
    steps, first = [], set()
    for names in schedule:
        step = []
        for r in names:
            step.append((blocks[r], toks(), 1 if r not in first else acc()))
            first.add(r)
        steps.append(step)
    new_at = [["A", "B"], ["C"], ["D"], [], []]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, graphed)
        outs = []
        for new, step in zip(new_at, steps):
            for r in new:
                runner.add_request(blocks[r])
            outs.append(runner.execute_model(step))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
