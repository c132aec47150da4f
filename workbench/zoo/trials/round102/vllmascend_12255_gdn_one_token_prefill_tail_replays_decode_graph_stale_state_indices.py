"""vllm-ascend GDN: a prompt's final one-token chunk is shape-dispatched to the FULL decode graph, but the GDN metadata builder calls it a prefill and skips refreshing the graph's state-index buffer, so the graph updates the previous decode step's slots.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/12255 ("[v0.23.0][BugFix][GDN] Restore stateful one-token
decode selection", vllm-project/vllm-ascend, branch releases/v0.23.0, merged as commit cd9a500dd of 2026-07-21). Read:
the commit message (the PR description: Problem, Solution, Verification) and its whole diff
(``vllm_ascend/ops/gdn_attn_builder.py``: new ``_treat_single_token_prefills_with_state_as_decodes``, new
``_fold_spec_sized_prefill_chunks_into_spec``, and ``build`` now starting with ``m =
_treat_single_token_prefills_with_state_as_decodes(common_attn_metadata)``); the pre-fix ``gdn_attn_builder.py`` at
cd9a500dd^ (``AscendGDNAttentionMetadataBuilder.build``: the non-spec branch calls ``split_decodes_and_prefills(m,
decode_threshold=1, treat_short_extends_as_decodes=False)`` and copies into the persistent
``self.non_spec_state_indices_tensor`` / ``self.non_spec_query_start_loc`` only under ``use_full_cuda_graph and
num_prefills == 0 and num_spec_decodes == 0``); the description of #14089 (the port to v0.26: "treats a one-token
prefill as decode only when ``query_len == 1``, ``seq_len > 1``, the row is classified as prefill").
Symptom: Qwen3.5/3.6 (GDN hybrid) under FULL_DECODE_ONLY graphs: a request whose final prompt chunk is exactly one token
(PD recompute, chunked prefill) answers garbage from its first decoded token; sporadic GPQA swings (34/50 vs 45/50 on
identical code). Eager is correct. No error.
Mechanism: graph dispatch is shape-only: a step of one token per request is a uniform decode and replays the decode
graph. Since #11735 the captured GDN decode kernels read the builder's persistent ``non_spec_state_indices_tensor`` /
``non_spec_query_start_loc``, which ``build`` refreshes only for pure-decode batches. The final one-token chunk still
has ``is_prefilling`` set, so ``split_decodes_and_prefills`` (short extends not treated as decodes) counts it as a
prefill, ``num_prefills == 1`` and the refresh is skipped: the replay reads the indices of the last pure-decode step,
where that request's row holds the null block. Its recurrent state is never advanced over the last prompt token and its
first logits lack the layer's output. An eager step runs the prefill path on the fresh metadata.
Doctor: stale-input, at build (the step did not write the graph's state-index and query-start buffers: ``build`` skipped
their refresh, so the real rows read what the previous decode step left there).
Fix (upstream): ``build`` first applies ``_treat_single_token_prefills_with_state_as_decodes``: a row with
``is_prefilling``, query length 1 and ``seq_len > 1`` is a decode (one recurrence step from its cached state), so the
batch is pure decode and the persistent buffers are refreshed. (The spec-path fold, ``num_spec + 1``-token chunks, is
not modelled: no MTP here.)
Modelled: ``CommonAttentionMetadata`` (the fields used), ``split_decodes_and_prefills`` (upstream logic),
``_treat_single_token_prefills_with_state_as_decodes`` (as upstream), ``AscendGDNAttentionMetadataBuilder.build``
(non-spec branch: persistent buffers, refresh condition, ``NULL_BLOCK_ID`` fill, ``batch_size = num_actual_tokens``),
``GDNAttentionMetadata`` (subset), the forward context, a runner with a shape-only ``_is_uniform_decode`` dispatch and
FULL_DECODE_ONLY graphs for 1, 2 and 4 requests (mixed steps run eagerly). Stand-ins: the model (embedding, one gated
delta rule layer without the causal conv, LM head; float64), ``fused_recurrent_gated_delta_rule`` (rows with a zero
query length or the null block are skipped, as vLLM's FLA kernels skip ``NULL_BLOCK_ID``), the prefill kernel (the same
recurrence token by token, so a one-token prefill from cached state equals a decode step exactly), slot allocation (slot
0 is the null block).
Workload: requests B (3-token prompt), C (2), A (4, chunked 3 + 1). Step 1 prefills B and C (eager); step 2 decodes B, C
(graph of 2: persistent indices [1, 2, 0, 0]); step 3 decodes B, C and prefills A's first 3 tokens (eager); step 4
decodes B, C with A's last prompt token (3 x 1 token: graph of 4); steps 5-6 decode all three (graph of 4). Bug: at step
4 the replay reads [1, 2, 0, 0], so A's row is skipped (no GDN output for it) and A's slot misses its last prompt token:
A's logits differ at steps 4, 5 and 6 by 0.87, 0.36 and 0.32 (max |graph - eager| = 0.869), B and C match to 2e-15. Fix:
equals eager (max 1.8e-15, float64 summation order).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/12255"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "build"
SYMPTOM = ("GDN models under FULL_DECODE_ONLY graphs: a prompt whose final chunk is one token is shape-dispatched to "
           "the decode graph, the builder skips the persistent state-index refresh, the request's state is never "
           "advanced over its prompt: garbage from the first decoded token, no error")

HIDDEN, VOCAB = 8, 16
H = HV = 2                      # key/value heads of the gated delta rule
K = V = 4                       # head dims
MAX_NUM_REQS = 4
MAX_NUM_TOKENS = 16
NUM_SLOTS = MAX_NUM_REQS + 1    # slot 0: NULL_BLOCK_ID
NULL_BLOCK_ID = 0
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/attention/backends/utils.py (reduced) ------------------------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    is_prefilling: torch.Tensor | None = None

    def compute_num_computed_tokens(self):
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    def replace(self, **kwargs):
        return dataclasses.replace(self, **kwargs)


def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1, treat_short_extends_as_decodes=True):
    m = common_attn_metadata
    num_reqs, num_tokens = m.num_reqs, m.num_actual_tokens
    is_prefilling = m.is_prefilling
    if m.max_query_len <= decode_threshold and (
            treat_short_extends_as_decodes or is_prefilling is None or not bool(is_prefilling.any())):
        return num_reqs, 0, num_tokens, 0
    query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
    is_prefill = query_lens > decode_threshold
    if not treat_short_extends_as_decodes and is_prefilling is not None:
        is_prefill = is_prefill | is_prefilling
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax(dim=-1))
    num_decode_tokens = int(m.query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


# --- vllm/forward_context.py (reduced) --------------------------------------------------------------------------------

_forward_context = None


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _forward_context
    prev, _forward_context = _forward_context, attn_metadata
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context():
    return _forward_context


# --- vllm_ascend/ops/gdn_attn_builder.py ------------------------------------------------------------------------------

def _treat_single_token_prefills_with_state_as_decodes(common_attn_metadata):
    """A final one-token prompt chunk replays the same update graph as a decode; once the request has recurrent
    state, both must construct identical GDN metadata. First-token prefills stay on the prefill path."""
    is_prefilling = common_attn_metadata.is_prefilling
    seq_lens_cpu = common_attn_metadata.seq_lens_cpu_upper_bound
    if is_prefilling is None or seq_lens_cpu is None:
        return common_attn_metadata
    query_lens_cpu = torch.diff(common_attn_metadata.query_start_loc_cpu)
    prefill_to_decode = is_prefilling & (query_lens_cpu == 1) & (seq_lens_cpu > 1)
    if not torch.any(prefill_to_decode).item():
        return common_attn_metadata
    is_prefilling = is_prefilling.clone()
    is_prefilling[prefill_to_decode] = False
    return common_attn_metadata.replace(is_prefilling=is_prefilling)


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None
    non_spec_query_start_loc: torch.Tensor
    non_spec_query_start_loc_cpu: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor


class AscendGDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = max(CUDAGRAPH_CAPTURE_SIZES)
        self.non_spec_state_indices_tensor = torch.full((self.decode_cudagraph_max_bs,), NULL_BLOCK_ID,
                                                        dtype=torch.int32, device=device)
        self.non_spec_query_start_loc = torch.zeros(self.decode_cudagraph_max_bs + 1, dtype=torch.int32, device=device)

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        if _variant == "bug":
            m = common_attn_metadata
        else:
            m = _treat_single_token_prefills_with_state_as_decodes(common_attn_metadata)

        query_start_loc, query_start_loc_cpu = m.query_start_loc, m.query_start_loc_cpu
        context_lens_tensor = m.compute_num_computed_tokens()
        block_table_tensor = m.block_table_tensor           # mamba_get_block_table_tensor: one state block per request

        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            m, decode_threshold=1, treat_short_extends_as_decodes=False)
        non_spec_state_indices_tensor = block_table_tensor[:, 0]
        non_spec_query_start_loc = query_start_loc
        has_initial_state = context_lens_tensor > 0 if num_prefills > 0 else None

        batch_size = m.num_actual_tokens
        if self.use_full_cuda_graph and num_prefills == 0 and num_decodes <= self.decode_cudagraph_max_bs:
            self.non_spec_state_indices_tensor[batch_size:].fill_(NULL_BLOCK_ID)
            self.non_spec_state_indices_tensor[:num_decodes].copy_(non_spec_state_indices_tensor, non_blocking=True)
            non_spec_state_indices_tensor = self.non_spec_state_indices_tensor[:batch_size]
            non_spec_state_indices_tensor[num_decodes:].fill_(NULL_BLOCK_ID)

            self.non_spec_query_start_loc[:num_decodes + 1].copy_(non_spec_query_start_loc, non_blocking=True)
            non_spec_num_query_tokens = non_spec_query_start_loc[-1]
            non_spec_query_start_loc = self.non_spec_query_start_loc[:batch_size + 1]
            non_spec_query_start_loc[num_decodes + 1:].fill_(non_spec_num_query_tokens)

        return GDNAttentionMetadata(
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_actual_tokens=m.num_actual_tokens,
            has_initial_state=has_initial_state, non_spec_query_start_loc=non_spec_query_start_loc,
            non_spec_query_start_loc_cpu=query_start_loc_cpu,
            non_spec_state_indices_tensor=non_spec_state_indices_tensor)


# --- the gated delta rule kernels (stand-ins) -------------------------------------------------------------------------

def _recurrent_step(h, q, k, v, g, beta):
    """One token of the gated delta rule for a batch of rows: h [B, HV, V, K]."""
    h = h * torch.exp(g)[..., None, None]
    v_new = (v - (h * k.unsqueeze(2)).sum(-1)) * beta.unsqueeze(-1)
    h = h + v_new.unsqueeze(-1) * k.unsqueeze(2)
    return h, (h * q.unsqueeze(2)).sum(-1) * K ** -0.5


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, ssm_state, ssm_state_indices):
    """Decode: one token per row at ``cu_seqlens[i]``; rows of zero length or the null block are skipped."""
    n = ssm_state_indices.shape[0]
    tok = cu_seqlens[:n].long()
    idx = ssm_state_indices.long()
    active = ((cu_seqlens[1:n + 1] - cu_seqlens[:n]) > 0) & (idx != NULL_BLOCK_ID)
    h0 = ssm_state[idx]
    h, o = _recurrent_step(h0, q[tok], k[tok], v[tok], g[tok], beta[tok])
    ssm_state[idx] = torch.where(active[:, None, None, None], h, h0)
    out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
    return out.index_add(0, tok, torch.where(active[:, None, None], o, torch.zeros_like(o)))


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_cpu, ssm_state, state_indices, has_initial_state):
    """Prefill: token by token per request, from the cached state if it has one."""
    out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
    for r in range(state_indices.shape[0]):
        s, e = int(cu_seqlens_cpu[r]), int(cu_seqlens_cpu[r + 1])
        slot = state_indices[r:r + 1].long()
        h = ssm_state[slot] if bool(has_initial_state[r]) else torch.zeros_like(ssm_state[slot])
        for t in range(s, e):
            h, o = _recurrent_step(h, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            out[t] = o[0]
        ssm_state[slot] = h
    return out


# --- the model (stand-in: Qwen3-Next-like, one GDN layer) ------------------------------------------------------------

class GatedDeltaNet:
    def __init__(self, gen, device, ssm_state):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.wq, self.wk, self.wv = r(HIDDEN, H * K), r(HIDDEN, H * K), r(HIDDEN, HV * V)
        self.wa, self.wb, self.wo = r(HIDDEN, HV), r(HIDDEN, HV), r(HV * V, HIDDEN)
        self.A_log, self.dt_bias = r(HV, scale=0.3), r(HV, scale=0.3)
        self.ssm_state = ssm_state

    def _forward_core(self, q, k, v, g, beta, attn_metadata):
        md = attn_metadata
        out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
        if md.num_prefills > 0:
            nd = md.num_decodes
            out = out + chunk_gated_delta_rule(
                q, k, v, g, beta, md.non_spec_query_start_loc_cpu[nd:], self.ssm_state,
                md.non_spec_state_indices_tensor[nd:], md.has_initial_state[nd:])
        if md.num_decodes > 0:
            indices = md.non_spec_state_indices_tensor
            if md.num_prefills > 0:
                indices = indices[:md.num_decodes]
            out = out + fused_recurrent_gated_delta_rule(q, k, v, g, beta, md.non_spec_query_start_loc,
                                                         self.ssm_state, indices)
        return out

    def forward(self, x):
        T = x.shape[0]
        q = torch.nn.functional.normalize((x @ self.wq).view(T, H, K), dim=-1)
        k = torch.nn.functional.normalize((x @ self.wk).view(T, H, K), dim=-1)
        v = (x @ self.wv).view(T, HV, V)
        g = -torch.exp(self.A_log) * torch.nn.functional.softplus(x @ self.wa + self.dt_bias)
        beta = torch.sigmoid(x @ self.wb)
        o = self._forward_core(q, k, v, g, beta, get_forward_context())
        return x + o.reshape(T, HV * V) @ self.wo


class Qwen3NextForCausalLM:
    def __init__(self, device, ssm_state):
        gen = generator(12255)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.linear_attn = GatedDeltaNet(gen, device, ssm_state)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).to(DTYPE)

    def forward(self, input_ids):
        return self.linear_attn.forward(self.embed_tokens[input_ids]) @ self.lm_head


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ------------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.ssm_state = torch.zeros(NUM_SLOTS, HV, V, K, dtype=DTYPE, device=device)
        self.model = Qwen3NextForCausalLM(device, self.ssm_state)
        self.builder = AscendGDNAttentionMetadataBuilder(device, use_full_cuda_graph=use_cuda_graph)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int32, device=device)
        self.requests, self.free_slots, self.graphs = {}, list(range(NUM_SLOTS - 1, 0, -1)), {}
        if use_cuda_graph:
            self.capture_model()

    def _common_metadata(self, query_lens, seq_lens, is_prefilling, num_reqs):
        qsl_cpu = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(self.device), query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu_upper_bound=seq_lens_cpu, num_reqs=num_reqs,
            num_actual_tokens=int(qsl_cpu[-1]), max_query_len=max(query_lens),
            block_table_tensor=self.block_table[:num_reqs], is_prefilling=torch.tensor(is_prefilling))

    def capture_model(self):
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.block_table[:bs].fill_(NULL_BLOCK_ID)                      # dummy requests own no state
            m = self._common_metadata([1] * bs, [1] * bs, [False] * bs, bs)
            attn_metadata = self.builder.build(0, m)
            with set_forward_context(attn_metadata):
                self.graphs[bs] = capture(
                    lambda bs=bs: self.model.forward(self.input_ids[:bs]), device=self.device,
                    name=f"FULL_DECODE_ONLY [{bs}]", owner="NPUModelRunner",
                    static={"input_ids": self.input_ids,
                            "non_spec_state_indices_tensor": self.builder.non_spec_state_indices_tensor,
                            "non_spec_query_start_loc": self.builder.non_spec_query_start_loc},
                    state={"ssm_state": self.ssm_state})

    def add_request(self, req_id, prompt):
        self.requests[req_id] = {"prompt": prompt, "num_computed": 0, "slot": self.free_slots.pop(), "last": None}

    @staticmethod
    def _is_uniform_decode(max_num_scheduled_tokens, num_reqs, num_tokens, uniform_decode_query_len=1):
        return (max_num_scheduled_tokens == uniform_decode_query_len
                and num_tokens == max_num_scheduled_tokens * num_reqs)

    def execute_model(self, scheduled):
        """``scheduled``: [(request id, tokens this step)], decodes first. Returns each row's last-token logits."""
        tokens, query_lens, seq_lens, is_prefilling = [], [], [], []
        for row, (req_id, n) in enumerate(scheduled):
            req = self.requests[req_id]
            c, prompt = req["num_computed"], req["prompt"]
            tokens += prompt[c:c + n] if c < len(prompt) else [req["last"]]
            query_lens.append(n)
            seq_lens.append(c + n)
            is_prefilling.append(c < len(prompt))
            self.block_table[row, 0] = req["slot"]
        num_reqs, num_tokens = len(scheduled), len(tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens, dtype=torch.int64))
        m = self._common_metadata(query_lens, seq_lens, is_prefilling, num_reqs)
        attn_metadata = self.builder.build(0, m)

        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs), None)
        with set_forward_context(attn_metadata):
            if self.graphs and size is not None and self._is_uniform_decode(max(query_lens), num_reqs, num_tokens):
                g, out = self.graphs[size]
                logits = replay(g, out, real=num_reqs, size=size, padded={"input_ids": self.input_ids})[:num_reqs]
            else:
                logits = self.model.forward(self.input_ids[:num_tokens])[m.query_start_loc_cpu[1:].long() - 1]
        logits = logits.clone()
        for row, (req_id, n) in enumerate(scheduled):
            req = self.requests[req_id]
            req["num_computed"] += n
            if req["num_computed"] >= len(req["prompt"]):
                req["last"] = int(logits[row].argmax())
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"B": [5, 9, 2], "C": [7, 1], "A": [4, 12, 6, 3]}
    steps = [[("B", 3), ("C", 2)],                      # prefills: eager
             [("B", 1), ("C", 1)],                      # pure decode: graph of 2
             [("B", 1), ("C", 1), ("A", 3)],            # mixed (A's first chunk): eager
             [("B", 1), ("C", 1), ("A", 1)],            # A's last prompt token: shape says decode, graph of 4
             [("B", 1), ("C", 1), ("A", 1)],
             [("B", 1), ("C", 1), ("A", 1)]]

    def serve(use_cuda_graph):
        runner = NPUModelRunner(device, use_cuda_graph)
        for req_id in "BCA":
            runner.add_request(req_id, prompts[req_id])
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
