"""vllm-ascend GDN: an idle data-parallel rank's one-token dummy batch replays the FULL decode graph with GDN metadata built from a block-table row a finished request left behind, advancing that request's cached recurrent state.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/15510 ("[BugFix][GDN] Skip recurrent state updates for idle
DP dummy runs", vllm-project/vllm-ascend, opened 2026-09-01, merged; a rebased resubmission of #15253). Read: the
#15510 description (idle DP ranks "still execute a one-token dummy batch to participate in graph replay and
collectives", which "can advance causal-conv and KDA recurrent state through block-table entries left by an earlier
request"; the fix "builds zero-length GDN metadata for idle DP dummies"; validated with prefix cache and
FULL_DECODE_ONLY); the diff of the #15253 branch commit 3cd7136 (``_dummy_run`` gains ``skip_gdn_state_update`` and
then zero-fills ``gdn_query_start_loc``; ``_build_attention_metadata`` gives the GDN builder ``num_actual_tokens=0``,
``max_query_len=0``, cleared ``is_prefilling``; both idle paths pass the flag; the builder test
``test_full_graph_idle_dummy_uses_zero_length_recurrent_metadata``); the pre-fix ``_dummy_run`` (metadata only for a
FULL runtime mode, ``commit_block_table(num_reqs_padded)`` before the GDN metadata reads the rows) and
``AscendGDNAttentionMetadataBuilder.build``. The merged #15510 diff itself was not available.
Symptom: multi-node GDN/Mamba serving with DP and FULL_DECODE_ONLY graphs: results depend on whether a DP rank was idle
between requests (a follow-up request reusing a cached prefix resumes from a corrupted recurrent state). Eager mode is
unaffected. No error.
Mechanism: an idle rank runs ``_dummy_run`` with one token. Under a FULL runtime mode it builds attention metadata so
the decode graph can replay: the dummy's query start locations say one token, and the GDN builder takes the state
slot from ``block_table[0]``, the row of the request that last ran there, and copies it into the graph's persistent
index buffer. The replayed recurrent kernel advances that slot with the dummy token. With prefix caching the slot is
a cached block: the next request with that prefix starts from the corrupted state. An eager dummy builds no metadata
and the GDN layer does nothing.
Doctor: stale-padding, at _dummy_run (the dummy row serves no request; its GDN metadata is built from what the
block-table row and the token buffer still hold from an earlier request, and real rows of a later step depend on what
it wrote).
Fix (upstream): for idle DP dummies ``_dummy_run`` zeroes ``gdn_query_start_loc`` and ``_build_attention_metadata``
gives the GDN builder zero tokens: every GDN row has query length 0 and the captured kernels skip it.
Modelled: ``_dummy_run`` (the FULL-mode metadata branch, ``gdn_query_start_loc``, ``commit_block_table``),
``_build_attention_metadata`` (the GDN no-op replacement, as in the diff), ``NPUWorker.execute_dummy_batch``,
``CommonAttentionMetadata`` / ``split_decodes_and_prefills`` / ``AscendGDNAttentionMetadataBuilder.build`` (non-spec
branch, persistent buffers, as upstream), a CpuGpuBuffer-like block table left as the finished request wrote it.
Stand-ins: the model (embedding, one gated delta rule layer without causal conv and with slowly decaying heads, LM
head; float64), the recurrent kernel (rows of zero query length or the null block are skipped; ``None`` metadata, the
eager dummy, skips the layer), the prefix cache (a finished request's state slot is kept under its computed tokens; a
request whose prompt starts with them copies that state into its own slot: mamba "align" mode reduced to one block),
the DP peer (not modelled: the idle steps call ``execute_dummy_batch``; no collectives).
Workload: the rank serves A (4-token prompt: eager prefill at step 1, then 3 decode steps on the graph of 1); A
finishes and its state (7 computed tokens) stays cached in slot 1. Steps 5-7: the rank is idle and runs the dummy
batch. Step 8: B (A's 7 tokens + A's last token + 2 new ones) hits the cache, copies slot 1 and prefills 3 tokens
(eager); steps 9-10 decode B. Bug: the three dummies advance slot 1 with the token A's last step left in
``input_ids``, so B's logits differ at steps 8, 9 and 10 by 0.069, 0.064 and 0.060 (max |graph - eager| = 0.0694);
A's are exact. Fix: the dummies' GDN rows have query length 0 and leave slot 1 alone; equals eager (0).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/15510"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_dummy_run"
SYMPTOM = ("GDN models with DP and FULL_DECODE_ONLY graphs: an idle rank's dummy batch replays the decode graph on a "
           "finished request's block-table row and advances its cached recurrent state; a later request reusing that "
           "prefix decodes from corrupted state, no error")

HIDDEN, VOCAB = 8, 16
H = HV = 2
K = V = 4
MAX_NUM_REQS = 2
MAX_NUM_TOKENS = 16
NUM_SLOTS = 4                   # slot 0: NULL_BLOCK_ID
NULL_BLOCK_ID = 0
CUDAGRAPH_CAPTURE_SIZES = [1, 2]
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/attention/backends/utils.py, vllm/forward_context.py (reduced) ------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
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
    num_reqs, num_tokens, is_prefilling = m.num_reqs, m.num_actual_tokens, m.is_prefilling
    if m.max_query_len <= decode_threshold and (
            treat_short_extends_as_decodes or is_prefilling is None or not bool(is_prefilling.any())):
        return num_reqs, 0, num_tokens, 0
    is_prefill = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]) > decode_threshold
    if not treat_short_extends_as_decodes and is_prefilling is not None:
        is_prefill = is_prefill | is_prefilling
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax(dim=-1))
    num_decode_tokens = int(m.query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


_forward_context = None


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _forward_context
    prev, _forward_context = _forward_context, attn_metadata
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm_ascend/ops/gdn_attn_builder.py (non-spec branch) ------------------------------------------------------------

@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None
    non_spec_query_start_loc: torch.Tensor
    non_spec_query_start_loc_cpu: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor


class GDNAttentionMetadataBuilder:
    pass


class AscendGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    def __init__(self, device, use_full_cuda_graph):
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = max(CUDAGRAPH_CAPTURE_SIZES)
        self.non_spec_state_indices_tensor = torch.full((self.decode_cudagraph_max_bs,), NULL_BLOCK_ID,
                                                        dtype=torch.int32, device=device)
        self.non_spec_query_start_loc = torch.zeros(self.decode_cudagraph_max_bs + 1, dtype=torch.int32, device=device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        m = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            m, decode_threshold=1, treat_short_extends_as_decodes=False)
        non_spec_state_indices_tensor = m.block_table_tensor[:, 0]
        non_spec_query_start_loc = m.query_start_loc
        has_initial_state = m.compute_num_computed_tokens() > 0 if num_prefills > 0 else None

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
            num_prefills=num_prefills, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            num_actual_tokens=m.num_actual_tokens, has_initial_state=has_initial_state,
            non_spec_query_start_loc=non_spec_query_start_loc, non_spec_query_start_loc_cpu=m.query_start_loc_cpu,
            non_spec_state_indices_tensor=non_spec_state_indices_tensor)


# --- the gated delta rule (stand-ins) ---------------------------------------------------------------------------------

def _recurrent_step(h, q, k, v, g, beta):
    h = h * torch.exp(g)[..., None, None]
    v_new = (v - (h * k.unsqueeze(2)).sum(-1)) * beta.unsqueeze(-1)
    h = h + v_new.unsqueeze(-1) * k.unsqueeze(2)
    return h, (h * q.unsqueeze(2)).sum(-1) * K ** -0.5


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, ssm_state, ssm_state_indices):
    """Decode: one token per row at ``cu_seqlens[i]``; rows of zero length or the null block are skipped."""
    n = ssm_state_indices.shape[0]
    tok = cu_seqlens[:n].long().clamp(max=q.shape[0] - 1)
    idx = ssm_state_indices.long()
    active = ((cu_seqlens[1:n + 1] - cu_seqlens[:n]) > 0) & (idx != NULL_BLOCK_ID)
    h0 = ssm_state[idx]
    h, o = _recurrent_step(h0, q[tok], k[tok], v[tok], g[tok], beta[tok])
    ssm_state[idx] = torch.where(active[:, None, None, None], h, h0)
    out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
    return out.index_add(0, tok, torch.where(active[:, None, None], o, torch.zeros_like(o)))


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_cpu, ssm_state, state_indices, has_initial_state):
    out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
    for r in range(state_indices.shape[0]):
        slot = state_indices[r:r + 1].long()
        h = ssm_state[slot] if bool(has_initial_state[r]) else torch.zeros_like(ssm_state[slot])
        for t in range(int(cu_seqlens_cpu[r]), int(cu_seqlens_cpu[r + 1])):
            h, o = _recurrent_step(h, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            out[t] = o[0]
        ssm_state[slot] = h
    return out


class GatedDeltaNet:
    def __init__(self, gen, device, ssm_state):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.wq, self.wk, self.wv = r(HIDDEN, H * K), r(HIDDEN, H * K), r(HIDDEN, HV * V)
        self.wa, self.wb, self.wo = r(HIDDEN, HV), r(HIDDEN, HV), r(HV * V, HIDDEN)
        self.A_log, self.dt_bias = r(HV, scale=0.3) - 2.0, r(HV, scale=0.3)   # slowly decaying heads
        self.ssm_state = ssm_state

    def forward(self, x):
        md = _forward_context
        if md is None:                          # dummy / profile run without metadata: the layer does nothing
            return x
        T = x.shape[0]
        q = torch.nn.functional.normalize((x @ self.wq).view(T, H, K), dim=-1)
        k = torch.nn.functional.normalize((x @ self.wk).view(T, H, K), dim=-1)
        v = (x @ self.wv).view(T, HV, V)
        g = -torch.exp(self.A_log) * torch.nn.functional.softplus(x @ self.wa + self.dt_bias)
        beta = torch.sigmoid(x @ self.wb)
        o = torch.zeros(T, HV, V, dtype=x.dtype, device=x.device)
        if md.num_prefills > 0:
            nd = md.num_decodes
            o = o + chunk_gated_delta_rule(q, k, v, g, beta, md.non_spec_query_start_loc_cpu[nd:], self.ssm_state,
                                           md.non_spec_state_indices_tensor[nd:], md.has_initial_state[nd:])
        if md.num_decodes > 0:
            indices = md.non_spec_state_indices_tensor
            if md.num_prefills > 0:
                indices = indices[:md.num_decodes]
            o = o + fused_recurrent_gated_delta_rule(q, k, v, g, beta, md.non_spec_query_start_loc,
                                                     self.ssm_state, indices)
        return x + o.reshape(T, HV * V) @ self.wo


class KimiLinearForCausalLM:
    def __init__(self, device, ssm_state):
        gen = generator(15510)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.linear_attn = GatedDeltaNet(gen, device, ssm_state)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).to(DTYPE)

    def forward(self, input_ids):
        return self.linear_attn.forward(self.embed_tokens[input_ids]) @ self.lm_head


# --- vllm_ascend/worker/model_runner_v1.py, worker.py (reduced) ------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *shape, dtype, device):
        self.cpu = torch.zeros(*shape, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n=None):
        self.gpu[:n].copy_(self.cpu[:n])


class BlockTable(CpuGpuBuffer):
    """The input batch's mamba block table: one state block per row; a removed request's row is not cleared."""

    def commit_block_table(self, num_reqs):
        self.copy_to_gpu(num_reqs)


class NPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.ssm_state = torch.zeros(NUM_SLOTS, HV, V, K, dtype=DTYPE, device=device)
        self.model = KimiLinearForCausalLM(device, self.ssm_state)
        self.builder = AscendGDNAttentionMetadataBuilder(device, use_full_cuda_graph=use_cuda_graph)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.block_table = BlockTable(MAX_NUM_REQS, 1, dtype=torch.int32, device=device)
        self.gdn_query_start_loc = CpuGpuBuffer(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self._has_gdn, self.graphs = True, {}
        self.requests, self.free_slots, self.prefix_cache = {}, list(range(NUM_SLOTS - 1, 0, -1)), {}
        if use_cuda_graph:
            for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
                self._dummy_run(bs, uniform_decode=True, is_graph_capturing=True)

    def _common(self, qsl_cpu, seq_lens, is_prefilling, num_reqs):
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(self.device), query_start_loc_cpu=qsl_cpu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device), num_reqs=num_reqs,
            num_actual_tokens=int(qsl_cpu[num_reqs]), max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()),
            block_table_tensor=self.block_table.gpu[:num_reqs], is_prefilling=torch.tensor(is_prefilling))

    def _build_attention_metadata(self, common_attn_metadata, num_reqs_padded, skip_gdn_state_update=False):
        builder = self.builder
        is_gdn_noop = _variant == "fix" and skip_gdn_state_update and isinstance(builder, GDNAttentionMetadataBuilder)
        if is_gdn_noop:
            # An idle DP dummy has a real tensor shape for model and collective execution, but no GDN tokens.
            common_attn_metadata = common_attn_metadata.replace(
                query_start_loc=self.gdn_query_start_loc.gpu[:num_reqs_padded + 1],
                query_start_loc_cpu=self.gdn_query_start_loc.cpu[:num_reqs_padded + 1],
                num_actual_tokens=0, max_query_len=0,
                is_prefilling=torch.zeros_like(common_attn_metadata.is_prefilling))
        return builder.build(0, common_attn_metadata)

    def _dummy_run(self, num_tokens, uniform_decode=False, is_graph_capturing=False, skip_gdn_state_update=False):
        num_reqs = num_tokens if uniform_decode else 1
        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs), None)
        full = self.builder.use_full_cuda_graph and size is not None        # _determine_batch_execution_and_padding
        num_reqs_padded = size if full else num_reqs
        attn_metadata = None
        if full:                                                            # _should_build_dummy_attn_metadata
            cum_num_tokens = torch.arange(1, num_reqs_padded + 1, dtype=torch.int32)
            if self._has_gdn:
                if _variant == "fix" and skip_gdn_state_update:
                    self.gdn_query_start_loc.np.fill(0)
                else:
                    self.gdn_query_start_loc.np[1:num_reqs_padded + 1] = cum_num_tokens.numpy()
                self.gdn_query_start_loc.copy_to_gpu()
            if is_graph_capturing:
                self.block_table.cpu[:num_reqs_padded].fill_(NULL_BLOCK_ID)  # capture: dummy requests own no state
            # Dummy graph runs do not go through _prepare_inputs(); sync the rows the GDN metadata reads.
            self.block_table.commit_block_table(num_reqs_padded)
            qsl_cpu = torch.cat([torch.zeros(1, dtype=torch.int32), cum_num_tokens])     # query_start_loc
            m = self._common(qsl_cpu, [1] * num_reqs_padded, [False] * num_reqs_padded, num_reqs_padded)
            m = m.replace(query_start_loc=self.gdn_query_start_loc.gpu[:num_reqs_padded + 1],     # the GDN groups
                          query_start_loc_cpu=self.gdn_query_start_loc.cpu[:num_reqs_padded + 1])
            attn_metadata = self._build_attention_metadata(m, num_reqs_padded, skip_gdn_state_update)
        with set_forward_context(attn_metadata):
            if is_graph_capturing:
                self.graphs[size] = capture(
                    lambda bs=size: self.model.forward(self.input_ids[:bs]), device=self.device,
                    name=f"FULL_DECODE_ONLY [{size}]", owner="NPUModelRunner",
                    static={"input_ids": self.input_ids,
                            "non_spec_state_indices_tensor": self.builder.non_spec_state_indices_tensor,
                            "non_spec_query_start_loc": self.builder.non_spec_query_start_loc},
                    state={"ssm_state": self.ssm_state})
            elif full:
                g, out = self.graphs[size]
                replay(g, out, real=0, size=size, padded={"input_ids": self.input_ids})
            else:
                self.model.forward(self.input_ids[:num_tokens])

    def add_request(self, req_id, prompt, max_tokens):
        req = {"prompt": prompt, "num_computed": 0, "slot": self.free_slots.pop(), "out": [], "max": max_tokens}
        hit = max((key for key in self.prefix_cache if tuple(prompt[:len(key)]) == key), key=len, default=None)
        if hit is not None:                          # prefix cache hit: resume from the cached state block
            self.ssm_state[req["slot"]] = self.ssm_state[self.prefix_cache[hit]]
            req["num_computed"] = len(hit)
        self.requests[req_id] = req

    def execute_model(self, req_ids):
        """Each request: its remaining prompt, or its last sampled token. Returns last-token logits per request."""
        tokens, qsl, seq_lens, is_prefilling = [], [0], [], []
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            c, prompt = req["num_computed"], req["prompt"]
            step = prompt[c:] if c < len(prompt) else req["out"][-1:]
            tokens += step
            qsl.append(qsl[-1] + len(step))
            seq_lens.append(c + len(step))
            is_prefilling.append(c < len(prompt))
            self.block_table.cpu[row, 0] = req["slot"]
        num_reqs, num_tokens = len(req_ids), len(tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens, dtype=torch.int64))
        self.block_table.commit_block_table(num_reqs)
        m = self._common(torch.tensor(qsl, dtype=torch.int32), seq_lens, is_prefilling, num_reqs)
        attn_metadata = self._build_attention_metadata(m, num_reqs)
        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs), None)
        with set_forward_context(attn_metadata):
            if self.graphs and size is not None and num_tokens == num_reqs:          # uniform decode: FULL
                g, out = self.graphs[size]
                logits = replay(g, out, real=num_reqs, size=size, padded={"input_ids": self.input_ids})[:num_reqs]
            else:
                logits = self.model.forward(self.input_ids[:num_tokens])[torch.tensor(qsl[1:]) - 1]
        logits = logits.clone()
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            req["num_computed"] += qsl[row + 1] - qsl[row]
            req["out"].append(int(logits[row].argmax()))
            if len(req["out"]) == req["max"]:         # finished: its state block stays in the prefix cache
                computed = (req["prompt"] + req["out"])[:req["num_computed"]]
                self.prefix_cache[tuple(computed)] = req["slot"]
                del self.requests[req_id]              # the input batch row keeps its block ids
        return logits


class NPUWorker:
    def __init__(self, device, use_cuda_graph):
        self.model_runner = NPUModelRunner(device, use_cuda_graph)

    def execute_dummy_batch(self):
        num_tokens = getattr(self.model_runner, "uniform_decode_query_len", 1)
        self.model_runner._dummy_run(num_tokens, uniform_decode=True, skip_gdn_state_update=True)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompt_a = [4, 12, 6, 3]

    def serve(use_cuda_graph):
        worker = NPUWorker(device, use_cuda_graph)
        runner = worker.model_runner
        outs = []
        runner.add_request("A", prompt_a, max_tokens=4)
        for _ in range(4):                             # step 1: prefill (eager); steps 2-4: graph of 1
            outs.append(runner.execute_model(["A"]))
        for _ in range(3):                             # steps 5-7: this DP rank is idle, its peer is not
            worker.execute_dummy_batch()
        a_tokens = prompt_a + outs[0].argmax(-1).tolist() + [int(o.argmax()) for o in outs[1:]]
        runner.add_request("B", a_tokens + [9, 1], max_tokens=3)
        for _ in range(3):                             # step 8: prefill of the new turn; steps 9-10: decode
            outs.append(runner.execute_model(["B"]))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
