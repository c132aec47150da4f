"""vllm-ascend MLA under piecewise ACL graphs: ``AscendMLAImpl.forward`` allocates its ``o_proj_input`` with the
graph-padded token count but writes only the real rows, so the padded rows hold whatever the allocator's block held
(NaN or an earlier step's rows), and the o_proj's dynamic activation quantization lets them reach the real rows.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/9687 ("[BugFix][MLA][Ascend950] Zero-init o_proj_input
padding to prevent NaN propagation in quantization", vllm-project/vllm-ascend, by gaozihao-shy, merged 2026-05-30 as
commit edd724d4da495604fb78d3e652c0811d65cded9a, parent d3e1c3346511318b258db61d0ff5d50848017314).
Read: the commit message and its one-line diff of ``vllm_ascend/attention/mla_v1.py`` (``torch.empty`` ->
``torch.zeros`` for ``o_proj_input``); at the parent commit, ``AscendMLAImpl.forward`` (``num_actual_tokens`` from
the metadata, ``o_proj_input_shape = (_EXTRA_CTX.num_tokens, num_heads * v_head_dim)``, the decode path writing
``o_proj_input[:num_decode_tokens] = output_decode``, the prefill path ``[num_decode_tokens:num_actual_tokens]``,
``output[...] = self.o_proj(o_proj_input, ...)[0]``, ``del o_proj_input``, ``return output_padded``),
``get_num_actual_tokens``, and ``set_ascend_forward_context`` in ``vllm_ascend/ascend_forward_context.py``
(``forward_context.num_tokens = num_tokens``: the runner's padded input token count).
Symptom: Kimi models (w8a8_mxfp8 on Ascend 950) in graph mode show precision degradation: spurious bursts of '!'
tokens; eager mode is fine.
Mechanism: with graph padding, ``_EXTRA_CTX.num_tokens`` is the captured size while the attention metadata counts
the real tokens. The MLA op (a splitting op, run eagerly between the captured pieces) allocates ``o_proj_input`` at
the padded size with ``torch.empty`` and fills only ``[:num_actual_tokens]``; rows ``[num_actual_tokens:num_tokens]``
keep the allocator block's old bytes (NaN in fresh memory, or rows a larger batch left there). The quantized o_proj
computes its activation scale over the whole padded input, so NaN (or a stale row larger than the real ones) changes
the scale, and with it every real row's output.
Doctor: stale-padding, at forward. The real rows' attention output depends on what the padded rows of
``o_proj_input`` hold, which ``AscendMLAImpl.forward`` leaves unwritten.
Fix (upstream): allocate ``o_proj_input`` with ``torch.zeros``, so padded rows are inert for quantization.
Modelled: ``AscendMLAImpl.forward`` as read (decode path only: ``_mla_preprocess``, ``_forward_decode``, the
``o_proj_input`` allocation and row writes, ``del``, ``output_padded``), ``_EXTRA_CTX.num_tokens`` as set by the
forward context, a piecewise runner (captured piece before and after the attention op at capture sizes 1, 2, 4,
the op eager in between, as vLLM's splitting ops run; eager reference without padding). Stand-ins: a one-layer
MLA decoder (absorbed latent attention over a paged latent cache, per-row block tables and sequence lengths), the
o_proj's quantization is a w8a8 *per-tensor dynamic* activation scale (the one place rows meet, standing in for
the mxfp8 quantization through which upstream saw the NaN spread; vLLM's own report of this mechanism,
vllm-project/vllm#37442, names per-tensor FP8 quantization's amax over the batch), and ``npu_empty`` stands in for torch_npu's
caching allocator (a freed block is handed to the next allocation of its size with its bytes; fresh memory holds
NaN); greedy sampling; float64.
Workload: four requests decode from empty contexts, batches [A B C] (padded to 4), [A B C D], [A B C], [A],
[A B] (capture sizes 4, 2, 1, captured largest first). Bug: the first step's o_proj_input block is the one the
capture's dummy run of size 4 freed, whose rows were computed from the piece's not-yet-computed output (NaN here),
so its padded row is NaN and every logit of the step is NaN; the wrong tokens then change every later step
(max |graph - eager| = inf, 3.8 to 6.0 on the later steps). Fix: all five steps equal eager (max error 1.7e-15).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/9687"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "forward"
SYMPTOM = ("MLA in graph mode leaves the padded rows of o_proj_input uninitialized; NaN or stale rows there reach "
           "the real tokens through the o_proj's dynamic quantization scale (spurious '!' bursts)")

VOCAB, HIDDEN, NUM_HEADS, KV_LORA_RANK, V_HEAD_DIM, INTER = 32, 16, 2, 8, 4, 24
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 17, 4
CUDAGRAPH_CAPTURE_SIZES = (1, 2, 4)
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


# --- torch_npu's caching allocator (stand-in) -------------------------------------------------------------------------

class NPUCachingAllocator:
    """A freed block goes to the next allocation of its size, bytes as they were; fresh memory holds NaN."""

    def __init__(self):
        self.free_blocks: dict = {}

    def empty(self, shape, dtype, device):
        key = (tuple(shape), dtype, str(device))
        block = self.free_blocks.pop(key, None)
        return block if block is not None else torch.full(shape, float("nan"), dtype=dtype, device=device)

    def free(self, t):
        self.free_blocks[(tuple(t.shape), t.dtype, str(t.device))] = t


_npu_allocator = NPUCachingAllocator()


def npu_empty(shape, dtype, device):
    return _npu_allocator.empty(shape, dtype, device)


def npu_zeros(shape, dtype, device):
    return _npu_allocator.empty(shape, dtype, device).zero_()


# --- vllm_ascend/ascend_forward_context.py ----------------------------------------------------------------------------

@dataclasses.dataclass
class _ExtraForwardContext:
    num_tokens: int = 0          # the runner's (padded) input token count
    attn_metadata: object = None


_EXTRA_CTX = _ExtraForwardContext()


# --- vllm_ascend/attention/mla_v1.py ------------------------------------------------------------------------------------

@dataclasses.dataclass
class AscendMLAMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


class AscendW8A8DynamicRowLinear:
    """o_proj with int8 per-channel weights and a dynamic activation scale (per tensor: the stand-in)."""

    def __init__(self, weight):
        self.w_scale = weight.abs().amax(dim=1, keepdim=True) / 127.0
        self.weight_q = torch.round(weight / self.w_scale)

    def __call__(self, x, is_prefill=False):
        x_scale = x.abs().amax() / 127.0                  # npu_dynamic_quant over the (padded) input
        x_q = torch.round(x / x_scale).clamp(-127, 127)
        return (F.linear(x_q, self.weight_q) * self.w_scale.T * x_scale,)


class AscendMLAImpl:
    def __init__(self, gen, device, kv_cache):
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.num_heads, self.v_head_dim, self.kv_lora_rank = NUM_HEADS, V_HEAD_DIM, KV_LORA_RANK
        self.q_proj = r(NUM_HEADS * KV_LORA_RANK, HIDDEN)          # W_q absorbed with W_uk
        self.kv_a_proj = r(KV_LORA_RANK, HIDDEN)
        self.W_UV = r(NUM_HEADS, KV_LORA_RANK, V_HEAD_DIM)
        self.o_proj = AscendW8A8DynamicRowLinear(r(HIDDEN, NUM_HEADS * V_HEAD_DIM))
        self.kv_cache = kv_cache                                    # [NUM_BLOCKS * BLOCK_SIZE, KV_LORA_RANK]

    def get_num_actual_tokens(self, attn_metadata):
        return attn_metadata.num_actual_tokens

    def _mla_preprocess(self, hidden_states, attn_metadata):
        n = attn_metadata.num_actual_tokens
        h = hidden_states[:n]
        q = F.linear(h, self.q_proj).view(n, NUM_HEADS, KV_LORA_RANK)
        latent = F.linear(h, self.kv_a_proj)
        slots = attn_metadata.slot_mapping[:n].long()
        valid = slots >= 0                                          # PAD_SLOT_ID: no cache write
        self.kv_cache.index_copy_(0, slots[valid], latent[valid])
        return q

    def _forward_decode(self, q, attn_metadata):
        ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=q.device)
        tables = attn_metadata.block_tables[: q.shape[0]].long()
        slots = tables[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
        c = self.kv_cache[slots]                                    # [T, ctx, R]
        scores = torch.einsum("thr,tcr->thc", q, c) / KV_LORA_RANK ** 0.5
        masked = ctx[None, :] >= attn_metadata.seq_lens[: q.shape[0], None]
        p = scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1)
        o_latent = torch.einsum("thc,tcr->thr", p, c)
        return torch.einsum("thr,hrv->thv", o_latent, self.W_UV).reshape(q.shape[0], -1)

    def forward(self, layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv=False, output=None):
        assert output is not None, "Output tensor must be provided."
        num_actual_tokens = self.get_num_actual_tokens(attn_metadata)
        num_decode_tokens = attn_metadata.num_decode_tokens
        # Inputs and outputs may be padded for CUDA graphs
        output_padded = output
        o_proj_input_shape = (_EXTRA_CTX.num_tokens, self.num_heads * self.v_head_dim)
        if _variant == "bug":
            o_proj_input = npu_empty(o_proj_input_shape, dtype=hidden_states.dtype, device=hidden_states.device)
        else:
            o_proj_input = npu_zeros(o_proj_input_shape, dtype=hidden_states.dtype, device=hidden_states.device)
        q = self._mla_preprocess(hidden_states, attn_metadata)
        output_decode = self._forward_decode(q[:num_decode_tokens], attn_metadata)
        o_proj_input[:num_decode_tokens] = output_decode
        assert num_decode_tokens == num_actual_tokens            # decode-only workload: no prefill rows
        output[...] = self.o_proj(o_proj_input, is_prefill=False)[0]
        _npu_allocator.free(o_proj_input)                         # del o_proj_input
        del o_proj_input
        return output_padded


# --- the model (one DeepSeek/Kimi-style MLA layer) ----------------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(9687)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.input_layernorm, self.post_attention_layernorm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.gate_up_proj, self.down_proj = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.norm, self.lm_head = 1.0 + r(HIDDEN, scale=0.1), r(VOCAB, HIDDEN)
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, KV_LORA_RANK, dtype=DTYPE, device=device)
        self.self_attn = AscendMLAImpl(gen, device, self.kv_cache)

    def piece_before_attention(self, input_ids):
        residual = self.embed_tokens[input_ids]
        hidden_states = rms_norm(residual, self.input_layernorm)
        output = torch.empty_like(residual)                       # unified attention's output buffer
        return hidden_states, residual, output

    def attention(self, hidden_states, output):                   # the splitting op: eager under piecewise graphs
        return self.self_attn.forward("model.layers.0.self_attn.attn", hidden_states, self.kv_cache,
                                      _EXTRA_CTX.attn_metadata, output=output)

    def piece_after_attention(self, attn_output, residual):
        h = residual + attn_output
        gate, up = F.linear(rms_norm(h, self.post_attention_layernorm), self.gate_up_proj).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.down_proj)
        return F.linear(rms_norm(h, self.norm), self.lm_head)

    def forward(self, input_ids):
        hidden_states, residual, output = self.piece_before_attention(input_ids)
        return self.piece_after_attention(self.attention(hidden_states, output), residual)


# --- the runner (vLLM piecewise graphs, NPUModelRunner's padding) ----------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, use_graph):
        self.device = device
        self.model = DeepseekV2ForCausalLM(device)
        self.input_ids = torch.zeros(max(CUDAGRAPH_CAPTURE_SIZES), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max(CUDAGRAPH_CAPTURE_SIZES),), PAD_SLOT_ID, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max(CUDAGRAPH_CAPTURE_SIZES), MAX_BLOCKS, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max(CUDAGRAPH_CAPTURE_SIZES), dtype=torch.int32, device=device)
        self.requests, self.graphs = {}, {}
        if use_graph:
            self.capture_model()

    def _metadata(self, num_reqs):
        return AscendMLAMetadata(num_actual_tokens=num_reqs, num_decodes=num_reqs, num_decode_tokens=num_reqs,
                                 num_prefills=0, slot_mapping=self.slot_mapping[:num_reqs],
                                 block_tables=self.block_tables[:num_reqs], seq_lens=self.seq_lens[:num_reqs])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        m = self.model
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            # _dummy_run: null block, no cache writes
            self.slot_mapping[:n].fill_(PAD_SLOT_ID)
            self.block_tables[:n].fill_(0)
            self.seq_lens[:n].fill_(1)
            _EXTRA_CTX.num_tokens, _EXTRA_CTX.attn_metadata = n, self._metadata(n)
            g0, out0 = capture(lambda n=n: m.piece_before_attention(self.input_ids[:n]), device=self.device,
                               pool=pool, name=f"piecewise [{n}] piece 0", owner="NPUModelRunner",
                               static={"input_ids": self.input_ids})
            m.attention(out0[0], out0[2])
            g1, out1 = capture(lambda o=out0: m.piece_after_attention(o[2], o[1]), device=self.device, pool=pool,
                               name=f"piecewise [{n}] piece 1", owner="NPUModelRunner",
                               static={"attn_output": out0[2]})
            self.graphs[n] = (g0, out0, g1, out1)

    def add_request(self, req_id, token, blocks):
        self.requests[req_id] = {"last": token, "len": 0, "blocks": blocks}

    def _prepare_inputs(self, req_ids):
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            pos = req["len"]
            self.input_ids[row] = req["last"]
            self.slot_mapping[row] = req["blocks"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.block_tables[row] = torch.tensor(req["blocks"], dtype=torch.int32)
            self.seq_lens[row] = pos + 1
        return self._metadata(len(req_ids))

    def execute_model(self, req_ids):
        n = len(req_ids)
        attn_metadata = self._prepare_inputs(req_ids)
        num_input_tokens = next((s for s in sorted(self.graphs) if s >= n), n)
        _EXTRA_CTX.num_tokens, _EXTRA_CTX.attn_metadata = num_input_tokens, attn_metadata
        if num_input_tokens in self.graphs:
            g0, out0, g1, out1 = self.graphs[num_input_tokens]
            hidden_states, residual, output = replay(g0, out0, real=n, size=num_input_tokens,
                                                     padded={"input_ids": self.input_ids})
            self.model.attention(hidden_states, output)
            logits = replay(g1, out1, real=n, size=num_input_tokens)[:n].clone()
        else:
            logits = self.model.forward(self.input_ids[:n])[:n].clone()
        for row, req_id in enumerate(req_ids):                     # greedy sampling
            req = self.requests[req_id]
            req["len"] += 1
            req["last"] = int(logits[row].nan_to_num(nan=0.0).argmax())
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [list("ABC"), list("ABCD"), list("ABC"), ["A"], list("AB")]

    def serve(use_graph):
        _npu_allocator.free_blocks.clear()
        runner = NPUModelRunner(device, use_graph)
        for i, (req_id, token) in enumerate(zip("ABCD", (3, 7, 11, 19))):
            runner.add_request(req_id, token, [1 + i * MAX_BLOCKS + j for j in range(MAX_BLOCKS)][:MAX_BLOCKS])
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
