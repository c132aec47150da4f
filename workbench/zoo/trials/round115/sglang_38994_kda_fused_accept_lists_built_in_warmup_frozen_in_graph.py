"""SGLang KDA (Kimi Delta Attention) fused-accept MTP verify under CUDA graphs: the verify state indices and accepted counts are built lazily once per forward and cached on the ``ForwardMetadata``; the graph runner reuses one metadata object across warm-up and capture, so warm-up builds them, capture skips the build, and every replay reads the warm-up's dummy-slot indices.

Upstream: https://github.com/sgl-project/sglang/pull/38994 ("[Fix][KDA] Rebuild accepted-state lists during CUDA graph
capture", sgl-project/sglang, by jhuangsa, opened 2026-09-11; open, not merged when read: no merge commit).
Read: the PR description (Motivation: "The graph runner reuses one ``ForwardMetadata`` object across warmup and
capture. Warmup populates ``fused_accept_state_indices`` and ``fused_accept_num_accepted``. KDA's lazy builder skips
construction during capture because these arrays already exist. Replay consequently keeps using warmup values after
the input slots or accepted counts change"; Modifications: "Clear the two cached references in
``MambaAttnBackendBase.init_forward_metadata_in_graph`` when the accepted-length pool and metadata exist", 11
production lines); the fused-accept path of #33722 as stored: ``build_fused_accept_indices`` (slot-indexed ``[N, T]``
indices ``slot * scratch_steps + step``, ``accept_lens_pool.index_select(0, slots.clamp(min=0))``) and
``FlashInferKDAKernel.target_verify`` in ``layers/attention/linear/kernels/kda_flashinfer.py`` (fused-accept mode seeds
each row from scratch slot ``nat - 1`` and overwrites all T scratch slots in place; negative indices are inactive
padded rows; "Both tensors are built once per forward by the backend (see KDAAttnBackend), so the 20 KDA layers of a
step share one build"), and its test ``test_kda_fused_accept_indices.py`` ("the backend keys 'build once' on these
being None"). The diff hunk itself and ``KDAAttnBackend``'s lazy builder were not in the stored material; they are
modelled from the description.
Symptom: Kimi (KDA) models with MTP and the fused-accept verify path give wrong tokens with CUDA graphs (eager is
right): replays address the states of the slots the warm-up saw, not the batch's requests, with the warm-up's
accepted counts.
Mechanism: ``capture_one_batch_size`` runs ``run_once`` twice eagerly and then once under capture, all on the same
``ForwardBatch`` / ``ForwardMetadata``. ``run_once`` calls ``init_forward_metadata_in_graph`` and the model; the first
KDA layer finds ``fused_accept_state_indices is None`` and builds the two tensors from the static
``mamba_cache_indices`` buffer and ``accept_lens_pool`` (dummy slot 0 at that time) and caches them on the metadata.
Under capture they are already set, so the build (device ops reading the static buffers) is never recorded; replays
read the warm-up tensors: every real row seeds from and writes to the dummy slot's scratch rows.
Doctor: warmup-divergence, at init_forward_metadata_in_graph. Warm-up decided (built and cached) the verify index
tensors that capture then reused instead of recording their construction; eager steps rebuild them every forward.
``init_forward_metadata_in_graph`` is where the fix clears the cached references so capture records the build.
Fix (upstream, proposed): in ``init_forward_metadata_in_graph`` set ``fused_accept_state_indices`` and
``fused_accept_num_accepted`` to None when the accepted-length pool and the metadata exist.
Modelled: ``build_fused_accept_indices`` as read; ``target_verify``'s fused-accept mode as torch ops (seed from
``slot*steps + nat - 1``, T recurrent steps written in place, negative rows inactive); the lazy per-forward build keyed
on None; the runner's static buffers, two warm-ups and capture per batch size, padding with slot -1, eager fallback.
Stand-ins: one KDA-like layer with a diagonal (per-channel) gated delta state of width 4 instead of the matrix state,
no L2 norm, q/k/v/gate from linear maps of a fixed per-token input, float64; the acceptance lengths are fixed in
advance and written to ``accept_lens_pool`` by the host after each verify (the commit step); slot 0 is the dummy slot.
Workload: slots A 1, B 2, C 3, T = 3 (two drafts); capture sizes 2 and 4. Each request's scratch step 0 is seeded at
"extend" with nat 1. Four verify steps: [A, B] (graph 2), [A, B, C] (graph 4, one padded row), [B, C] (graph 2),
[A, C] (graph 2). Bug: max |graph - eager| = 2.37 (every row seeds from and writes slot 0's scratch). Fix: equals eager
(max 0).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/38994"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_forward_metadata_in_graph"
SYMPTOM = ("KDA fused-accept MTP verify with CUDA graphs: the verify state indices and accepted counts are built in "
           "warm-up and cached on the reused metadata, so capture skips the build and replays use the dummy slot")

HIDDEN, STATE = 6, 4
NUM_SLOTS = 5                 # slot 0 is the dummy slot
DRAFT_TOKEN_NUM = 3           # T = 1 + num_spec_tokens
SCRATCH_STEPS = 3
CAPTURE_BS = (2, 4)
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/layers/attention/mamba/mamba2_metadata.py ----------------------------------------------------------

@dataclasses.dataclass
class ForwardMetadata:
    query_start_loc: torch.Tensor
    mamba_cache_indices: torch.Tensor
    fused_accept_state_indices: torch.Tensor | None = None
    fused_accept_num_accepted: torch.Tensor | None = None


# --- sglang/srt/layers/attention/linear/kernels/kda_flashinfer.py --------------------------------------------------

def build_fused_accept_indices(*, slots, scratch_steps, draft_token_num, accept_lens_pool):
    step = torch.arange(draft_token_num, device=slots.device, dtype=torch.int32)
    ssm_state_indices = (slots.to(torch.int32)[:, None] * scratch_steps + step[None, :]).contiguous()  # [N, T]
    num_accepted_tokens = accept_lens_pool.index_select(0, slots.clamp(min=0).to(torch.int64))
    return ssm_state_indices, num_accepted_tokens


def recurrent_kda_fused_accept(q, k, v, g, *, state_pool, ssm_state_indices, num_accepted_tokens):
    """Stand-in for flashinfer ``recurrent_kda`` in fused-accept mode: row n seeds from pool index
    ``indices[n, 0] + nat[n] - 1`` and writes its post-token states to ``indices[n, t]``; rows whose
    indices are negative are inactive (padded) and leave the pool as it was."""
    n, t_len = ssm_state_indices.shape
    active = (ssm_state_indices[:, 0] >= 0)[:, None]
    seed = (ssm_state_indices[:, 0] + num_accepted_tokens.to(torch.int32) - 1).clamp(min=0).long()
    s = state_pool.index_select(0, seed)
    outs = []
    for t in range(t_len):
        s = g[:, t] * s + k[:, t] * v[:, t]
        outs.append(s * q[:, t])
        idx = ssm_state_indices[:, t].clamp(min=0).long()
        old = state_pool.index_select(0, idx)
        state_pool.index_copy_(0, idx, torch.where(active, s, old))
    return torch.stack(outs, dim=1).reshape(n * t_len, STATE)


# --- sglang/srt/layers/attention/hybrid_linear_attn_backend.py (reduced) -------------------------------------------

class MambaAttnBackendBase:
    def __init__(self, accept_lens_pool):
        self.accept_lens_pool = accept_lens_pool
        self.forward_metadata: ForwardMetadata | None = None

    def init_forward_metadata_in_graph(self, metadata: ForwardMetadata, bs: int):
        """Device-side part of the metadata, run inside the captured region (and eagerly)."""
        self.forward_metadata = metadata
        step = torch.arange(bs + 1, device=metadata.query_start_loc.device, dtype=torch.int32)
        metadata.query_start_loc.copy_(step * DRAFT_TOKEN_NUM)
        if _variant == "fix" and self.accept_lens_pool is not None and metadata is not None:
            # Capture must record the fused-accept build: drop what warm-up cached on the reused metadata.
            metadata.fused_accept_state_indices = None
            metadata.fused_accept_num_accepted = None


class KDAAttnBackend(MambaAttnBackendBase):
    def _fused_accept_indices(self, scratch_steps):
        """Built once per forward, shared by every KDA layer of the step (keyed on None)."""
        md = self.forward_metadata
        if md.fused_accept_state_indices is None:
            md.fused_accept_state_indices, md.fused_accept_num_accepted = build_fused_accept_indices(
                slots=md.mamba_cache_indices, scratch_steps=scratch_steps, draft_token_num=DRAFT_TOKEN_NUM,
                accept_lens_pool=self.accept_lens_pool)
        return md.fused_accept_state_indices, md.fused_accept_num_accepted

    def forward_target_verify(self, q, k, v, g, intermediate_ssm):
        scratch_steps = intermediate_ssm.shape[1]
        indices, nat = self._fused_accept_indices(scratch_steps)
        bs = indices.shape[0]
        shape = (bs, DRAFT_TOKEN_NUM, STATE)
        pool = intermediate_ssm.view(-1, STATE)
        return recurrent_kda_fused_accept(q.view(shape), k.view(shape), v.view(shape), g.view(shape),
                                          state_pool=pool, ssm_state_indices=indices, num_accepted_tokens=nat)


# --- the model (stand-in: one KDA layer) ---------------------------------------------------------------------------

class KimiDeltaAttention:
    def __init__(self, device):
        gen = generator(38994)
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.5).to(DTYPE)   # noqa: E731
        self.w_q, self.w_k, self.w_v, self.w_g, self.w_o = (r(STATE, HIDDEN), r(STATE, HIDDEN), r(STATE, HIDDEN),
                                                            r(STATE, HIDDEN), r(HIDDEN, STATE))

    def forward(self, hidden, backend: KDAAttnBackend, intermediate_ssm):
        q, k, v = F.linear(hidden, self.w_q), F.linear(hidden, self.w_k), F.linear(hidden, self.w_v)
        g = torch.sigmoid(F.linear(hidden, self.w_g))
        o = backend.forward_target_verify(q, k, v, g, intermediate_ssm)
        return F.linear(o, self.w_o)


# --- sglang/srt/model_executor/cuda_graph_runner.py (reduced) ------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model, backend, intermediate_ssm, accept_lens_pool, device):
        self.model, self.backend, self.intermediate_ssm, self.device = model, backend, intermediate_ssm, device
        max_bs = max(CAPTURE_BS)
        self.hidden_states = torch.zeros(max_bs * DRAFT_TOKEN_NUM, HIDDEN, dtype=DTYPE, device=device)
        self.mamba_cache_indices = torch.zeros(max_bs, dtype=torch.int32, device=device)    # dummy slot 0
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs, self.outputs, self.metadata = {}, {}, {}
        state = {"intermediate_ssm": intermediate_ssm, "accept_lens_pool": accept_lens_pool}
        for bs in CAPTURE_BS:
            self.capture_one_batch_size(bs, state)

    def capture_one_batch_size(self, bs, state):
        n = bs * DRAFT_TOKEN_NUM
        metadata = ForwardMetadata(query_start_loc=self.query_start_loc[:bs + 1],
                                   mamba_cache_indices=self.mamba_cache_indices[:bs])
        self.metadata[bs] = metadata

        def run_once():
            self.backend.init_forward_metadata_in_graph(metadata, bs)
            return self.model.forward(self.hidden_states[:n], self.backend, self.intermediate_ssm)

        static = {"hidden_states": self.hidden_states, "mamba_cache_indices": self.mamba_cache_indices,
                  "query_start_loc": self.query_start_loc}
        # for _ in range(2): run_once()  then  with torch.cuda.graph(graph): run_once()
        g, out = capture(run_once, device=self.device, warmups=2, static=static, state=state,
                         owner="CudaGraphRunner", name=f"kda verify graph bs={bs}")
        self.graphs[bs], self.outputs[bs] = g, out

    def can_run(self, raw_bs):
        return raw_bs <= max(CAPTURE_BS)

    def replay(self, hidden, slots):
        raw_bs = slots.shape[0]
        bs = next(b for b in CAPTURE_BS if b >= raw_bs)
        self.mamba_cache_indices[:bs].fill_(-1)                 # padded rows: inactive slot
        self.mamba_cache_indices[:raw_bs].copy_(slots)
        self.hidden_states[:raw_bs * DRAFT_TOKEN_NUM].copy_(hidden)
        out = replay(self.graphs[bs], self.outputs[bs], real=raw_bs * DRAFT_TOKEN_NUM, size=bs * DRAFT_TOKEN_NUM)
        return out[:raw_bs * DRAFT_TOKEN_NUM]


# --- the serving loop ------------------------------------------------------------------------------------------------

SLOTS = {"A": 1, "B": 2, "C": 3}
STEPS = ((["A", "B"], [2, 1]), (["A", "B", "C"], [3, 1, 2]), (["B", "C"], [2, 3]), (["A", "C"], [1, 2]))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_graph: bool):
        gen = generator(115)
        model = KimiDeltaAttention(device)
        intermediate_ssm = torch.zeros(NUM_SLOTS, SCRATCH_STEPS, STATE, dtype=DTYPE, device=device)
        accept_lens_pool = torch.ones(NUM_SLOTS, dtype=torch.int32, device=device)
        for slot in SLOTS.values():                                  # extend: stage scratch step 0, nat = 1
            intermediate_ssm[slot, 0].copy_(randn(STATE, gen=gen, device=device).to(DTYPE))
        backend = KDAAttnBackend(accept_lens_pool)
        runner = CudaGraphRunner(model, backend, intermediate_ssm, accept_lens_pool, device) if use_graph else None
        outs = []
        for names, accepted in STEPS:
            slots = torch.tensor([SLOTS[r] for r in names], dtype=torch.int32).to(device)
            hidden = randn(len(names) * DRAFT_TOKEN_NUM, HIDDEN, gen=gen, device=device).to(DTYPE)
            if runner is not None and runner.can_run(len(names)):
                out = runner.replay(hidden, slots)
            else:                                                    # eager: fresh metadata every forward
                metadata = ForwardMetadata(
                    query_start_loc=torch.zeros(len(names) + 1, dtype=torch.int32, device=device),
                    mamba_cache_indices=slots.clone())
                backend.init_forward_metadata_in_graph(metadata, len(names))
                out = model.forward(hidden, backend, intermediate_ssm)
            outs.append(out.clone())
            # commit after verify: last round's accept length per mamba slot (host-side, outside the graph)
            accept_lens_pool.index_copy_(0, slots.long(), torch.tensor(accepted, dtype=torch.int32).to(device))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
