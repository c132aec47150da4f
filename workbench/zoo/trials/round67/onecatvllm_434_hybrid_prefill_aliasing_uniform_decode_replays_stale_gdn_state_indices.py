"""A hybrid (K+1)-token prefill replays the spec-decode FULL graph with stale GDN state indices.

Upstream: https://github.com/1CatAI/1Cat-vLLM/pull/434 ("[Bugfix][V1] Reject hybrid prefills from uniform
decode", merged into the fork); the same upstream vLLM bug is https://github.com/vllm-project/vllm/issues/53051
("Prefill misdispatched into spec-decode FULL cudagraph when prompt length == 1 + num_speculative_tokens ->
silent GDN state loss, garbage output") and https://github.com/vllm-project/vllm/issues/49918; the upstream
fixes (vllm #53059, #47123, #39945) are still open.
Symptom: on GDN hybrids (Qwen3-Next / Qwen3.5 / Qwen3.6) with MTP and FULL_AND_PIECEWISE, a request whose
prompt step schedules exactly 1 + num_speculative_tokens tokens produces deterministic garbage (``!!!!!``
walls). Its recurrent state is never written, so every later step starts from a zero state. Other
requests in the same batch are corrupted too.
Mechanism: ``GPUModelRunner._is_uniform_decode`` (vllm/v1/worker/gpu_model_runner.py) checks shape only:
``max_num_scheduled_tokens == uniform_decode_query_len and num_tokens == max_num_scheduled_tokens * num_reqs``.
A prefill of K+1 tokens, alone or beside spec decodes, passes. ``_determine_batch_execution_and_padding``
then makes ``CudagraphDispatcher`` pick the FULL uniform-decode graph. The builder still sees the real
batch: ``GDNAttentionMetadataBuilder.build`` (vllm/v1/attention/backends/gdn_attn.py) classifies the
request as a prefill (``num_decode_draft_tokens == -1``) and builds fresh prefill metadata. It copies into
the persistent FULL-graph buffers (``spec_state_indices_tensor``, ``num_accepted_tokens``, ...) only under
``use_full_cuda_graph and num_prefills == 0 and num_decodes == 0``, so this step skips the copy. The
replay then runs the captured spec-verify kernel (``fused_recurrent_gated_delta_rule`` with
``ssm_state_indices``/``num_accepted_tokens``) on whatever those buffers still hold. The prefill's row
still holds PAD_SLOT_ID, left by the capture or by the last decode's padding. The kernel's
``state_idx < 0`` guard therefore skips both its state read and its state write. The decode row next to
it keeps the previous step's indices and accepted count, so it starts from the wrong state slot. Eager
runs the prefill kernel on fresh metadata and writes the state.
Doctor: stale-input, at ``_is_uniform_decode``. Its shape-only classification sends a prefill step to the
FULL graph, whose real rows read ``spec_state_indices_tensor``/``num_accepted_tokens`` elements this step
never wrote.
Fix (upstream): PR #434 adds ``_compute_force_uniform_decode(scheduler_output)`` in gpu_model_runner.py
(and at the PP+SP caller in gpu_worker.py). For hybrid models it returns ``False`` when the current
``SchedulerOutput`` still has prefill work (new requests, or cached ones in their context phase).
``execute_model`` passes that as ``force_uniform_decode``, so ``_is_uniform_decode`` answers False and the
batch runs as mixed (PIECEWISE: GDN eager). For non-hybrid models and decode-only batches it returns
``None``, which keeps the shape check.
Modelled: one GDN layer with a vector state per slot (decay + tanh update), no conv state and no
full-attention layers. Each request owns K+1 state slots (``block_table[:, :K+1]``), and slot 0 is the null
block. The spec-verify kernel reads slot ``num_accepted - 1`` and writes slot t after token t. The
prefill kernel writes slot 0. Persistent views are sliced by request count (not by token count). Draft
acceptance is a fixed schedule. Capture sizes are 3 and 6 (K = 2).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/1CatAI/1Cat-vLLM/pull/434"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_is_uniform_decode"
SYMPTOM = "a (K+1)-token prefill replays the spec-decode FULL graph: GDN state never written, garbage output"

VOCAB, D, K, DECAY = 16, 4, 2, 0.9
Q = K + 1                                    # uniform_decode_query_len
MAX_BS, NUM_SLOTS, PAD_SLOT_ID = 2, 7, -1    # slot 0: the null block
CAPTURE_SIZES = (3, 6)
BLOCKS = {"A": [1, 2, 3], "B": [4, 5, 6]}
PROMPTS = {"A": 5, "B": Q}                   # B's prompt is exactly 1 + num_speculative_tokens
# per step: (request, is new, scheduled tokens, draft tokens (-1: prefill), accepted after the step)
STEPS = ((("A", True, 5, -1, 1),),
         (("A", False, Q, K, 2),),
         (("A", False, Q, K, 3), ("B", True, Q, -1, 1)),
         (("A", False, Q, K, 1), ("B", False, Q, K, 2)),
         (("B", False, Q, K, 3),))


class Weights:
    def __init__(self, device):
        gen = generator(434)
        self.emb = randn(VOCAB, D, gen=gen, device=device)
        self.wk, self.wq, self.wo = (randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(3))


def fused_recurrent_gated_delta_rule(x, w, ssm_state, ssm_state_indices, num_accepted_tokens):
    """Spec verify: initial state at slot ``num_accepted - 1``; the state after token t goes to slot t.
    A negative index (PAD_SLOT_ID) reads a zero state and writes nothing."""
    n, t_len = ssm_state_indices.shape
    xs = x.view(n, t_len, D)
    init = ssm_state_indices.gather(1, (num_accepted_tokens.long() - 1)[:, None]).squeeze(1).long()
    h = torch.where((init >= 0)[:, None], ssm_state[init.clamp(min=0)], torch.zeros_like(xs[:, 0]))
    outs = []
    for t in range(t_len):
        h = DECAY * h + torch.tanh(xs[:, t] @ w.wk)
        outs.append(h * (xs[:, t] @ w.wq))
        idx = ssm_state_indices[:, t].long()
        safe = idx.clamp(min=0)
        ssm_state[safe] = torch.where((idx >= 0)[:, None], h, ssm_state[safe])
    return torch.stack(outs, 1).reshape(n * t_len, D)


def chunk_gated_delta_rule(x, w, ssm_state, state_indices_cpu, has_initial_state, query_start_loc_cpu):
    """Prefill (eager only): zero initial state unless the request has context; final state to its slot."""
    outs = []
    for i, idx in enumerate(state_indices_cpu):
        h = ssm_state[idx] if has_initial_state[i] else torch.zeros_like(ssm_state[idx])
        for t in range(query_start_loc_cpu[i], query_start_loc_cpu[i + 1]):
            h = DECAY * h + torch.tanh(x[t] @ w.wk)
            outs.append(h * (x[t] @ w.wq))
        ssm_state[idx] = h
    return torch.stack(outs)


class GDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.device, self.use_full_cuda_graph = device, use_full_cuda_graph
        self.spec_state_indices_tensor = torch.full((MAX_BS, Q), PAD_SLOT_ID, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.ones(MAX_BS, dtype=torch.int32, device=device)

    def build(self, m, num_accepted_tokens, num_decode_draft_tokens_cpu, for_cudagraph_capture=False):
        spec = [d >= 0 for d in num_decode_draft_tokens_cpu]
        num_spec_decodes = sum(spec)
        qsl = m["query_start_loc_cpu"]
        tok = lambda r: list(range(qsl[r], qsl[r + 1]))  # noqa: E731
        meta = {"num_spec_decodes": num_spec_decodes, "num_prefills": len(spec) - num_spec_decodes,
                "spec_token_indx": [t for r in range(len(spec)) if spec[r] for t in tok(r)],
                "non_spec_token_indx": [t for r in range(len(spec)) if not spec[r] for t in tok(r)]}
        rows = [r for r in range(len(spec)) if spec[r]]
        spec_idx = torch.tensor([m["block_table"][r][:Q] for r in rows] or [[0] * Q], dtype=torch.int32)[:len(rows)]
        if for_cudagraph_capture:
            spec_idx = torch.full_like(spec_idx, PAD_SLOT_ID)
        spec_idx = spec_idx.to(self.device)
        accepted = torch.tensor([num_accepted_tokens[r] for r in rows], dtype=torch.int32).to(self.device)
        others = [r for r in range(len(spec)) if not spec[r]]
        meta["non_spec_state_indices_cpu"] = [m["block_table"][r][0] for r in others]
        meta["has_initial_state"] = [m["num_computed_tokens_cpu"][r] > 0 for r in others]
        meta["non_spec_query_start_loc_cpu"] = [0]
        for r in others:
            meta["non_spec_query_start_loc_cpu"].append(meta["non_spec_query_start_loc_cpu"][-1] + qsl[r + 1] - qsl[r])
        if self.use_full_cuda_graph and meta["num_prefills"] == 0 and num_spec_decodes <= MAX_BS:
            # Prepare tensors for cudagraph: only the all-spec-decode batch refreshes the persistent buffers
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_idx)
            self.spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)
            self.num_accepted_tokens[:num_spec_decodes].copy_(accepted)
            self.num_accepted_tokens[num_spec_decodes:].fill_(1)
            spec_idx = self.spec_state_indices_tensor[:num_spec_decodes]
            accepted = self.num_accepted_tokens[:num_spec_decodes]
        meta["spec_state_indices_tensor"], meta["num_accepted_tokens"] = spec_idx, accepted
        return meta


class Qwen3NextGatedDeltaNet:
    def __init__(self, w, ssm_state):
        self.w, self.ssm_state = w, ssm_state

    def forward(self, input_ids, meta):
        x = self.w.emb[input_ids]
        if meta["num_prefills"] == 0:            # pure spec decode: the whole batch is the spec batch
            core = fused_recurrent_gated_delta_rule(x, self.w, self.ssm_state, meta["spec_state_indices_tensor"],
                                                    meta["num_accepted_tokens"])
        else:
            core = torch.zeros_like(x)
            if meta["num_spec_decodes"] > 0:
                si = torch.tensor(meta["spec_token_indx"]).to(x.device)
                core[si] = fused_recurrent_gated_delta_rule(
                    x[si], self.w, self.ssm_state, meta["spec_state_indices_tensor"], meta["num_accepted_tokens"])
            ni = torch.tensor(meta["non_spec_token_indx"]).to(x.device)
            core[ni] = chunk_gated_delta_rule(x[ni], self.w, self.ssm_state, meta["non_spec_state_indices_cpu"],
                                              meta["has_initial_state"], meta["non_spec_query_start_loc_cpu"])
        return x + core @ self.w.wo


class GPUModelRunner:
    def __init__(self, w, ssm_state, device, variant, use_cuda_graph):
        self.device, self.variant, self.is_hybrid = device, variant, True
        self.uniform_decode_query_len = Q
        self.model = Qwen3NextGatedDeltaNet(w, ssm_state)
        self.builder = GDNAttentionMetadataBuilder(device, use_full_cuda_graph=use_cuda_graph)
        self.input_ids = torch.zeros(max(CAPTURE_SIZES), dtype=torch.long, device=device)
        self.graphs = {}
        self.num_computed, self.num_accepted = {}, {}
        if use_cuda_graph:
            for n in CAPTURE_SIZES:
                self._dummy_run(n)

    def _dummy_run(self, num_tokens):
        """Capture the FULL uniform-decode graph: num_tokens // Q spec decodes with PAD state indices."""
        nr = num_tokens // Q
        m = {"query_start_loc_cpu": [r * Q for r in range(nr + 1)], "block_table": [[0] * Q] * nr,
             "num_computed_tokens_cpu": [1] * nr}
        meta = self.builder.build(m, [1] * nr, [K] * nr, for_cudagraph_capture=True)
        self.graphs[num_tokens] = capture(
            lambda: self.model.forward(self.input_ids[:num_tokens], meta), device=self.device,
            name=f"FULL uniform decode {num_tokens}", owner="GPUModelRunner",
            static={"input_ids": self.input_ids, "spec_state_indices_tensor": self.builder.spec_state_indices_tensor,
                    "num_accepted_tokens": self.builder.num_accepted_tokens},
            state={"ssm_state": self.model.ssm_state})

    @staticmethod
    def _is_uniform_decode(max_num_scheduled_tokens, uniform_decode_query_len, num_tokens, num_reqs,
                           force_uniform_decode=None):
        return (((max_num_scheduled_tokens == uniform_decode_query_len)
                 and (num_tokens == max_num_scheduled_tokens * num_reqs))
                if force_uniform_decode is None else force_uniform_decode)

    def _compute_force_uniform_decode(self, scheduler_output):
        """The fix: a hybrid batch with unfinished prefill work is never uniform decode."""
        if not self.is_hybrid:
            return None
        if any(new or self.num_computed.get(r, 0) < PROMPTS[r] for r, new, *_ in scheduler_output):
            return False
        return None

    def execute_model(self, scheduler_output, tokens):
        num_sched = [n for _, _, n, _, _ in scheduler_output]
        num_tokens, num_reqs = sum(num_sched), len(scheduler_output)
        force = self._compute_force_uniform_decode(scheduler_output) if self.variant == "fix" else None
        uniform = self._is_uniform_decode(max(num_sched), self.uniform_decode_query_len, num_tokens, num_reqs,
                                          force_uniform_decode=force)
        qsl = [0]
        for n in num_sched:
            qsl.append(qsl[-1] + n)
        m = {"query_start_loc_cpu": qsl, "block_table": [BLOCKS[r] for r, *_ in scheduler_output],
             "num_computed_tokens_cpu": [self.num_computed.get(r, 0) for r, *_ in scheduler_output]}
        meta = self.builder.build(m, [self.num_accepted.get(r, 1) for r, *_ in scheduler_output],
                                  [d for _, _, _, d, _ in scheduler_output])
        ids = tokens.to(self.device)
        if uniform and num_tokens in self.graphs:          # CudagraphDispatcher.dispatch -> FULL
            g, out = self.graphs[num_tokens]
            self.input_ids[:num_tokens].copy_(ids)
            hidden = replay(g, out).clone()
        else:                                              # mixed batch: PIECEWISE, GDN runs eagerly
            hidden = self.model.forward(ids, meta)
        for r, _, n, _, acc in scheduler_output:
            self.num_computed[r] = self.num_computed.get(r, 0) + n
            self.num_accepted[r] = acc
        return hidden


def run(variant: str, device: str = "cpu"):
    w = Weights(device)
    gen = generator(4340)
    tokens = [torch.randint(0, VOCAB, (sum(s[2] for s in step),), generator=gen) for step in STEPS]

    def serve(graphed: bool):
        ssm_state = torch.zeros(NUM_SLOTS, D, device=device)
        runner = GPUModelRunner(w, ssm_state, device, variant, use_cuda_graph=graphed)
        return [runner.execute_model(step, ids) for step, ids in zip(STEPS, tokens)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
