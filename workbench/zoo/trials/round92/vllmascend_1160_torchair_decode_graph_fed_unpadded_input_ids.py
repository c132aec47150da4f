"""vllm-ascend torchair graph mode: the decode graph compiled for the padded batch size is called with input_ids / positions sliced back to the real token count, while its attention metadata is padded to the graph size.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/1160 ("fix torchair execute issue on padding data, and mtp
padding logic", vllm-project/vllm-ascend, merged 2025-06-10, commit 291c216). Read: the PR description ("The former PR
#736 select the valid token inside the ``input_ids`` and ``position_ids`` breaks the necessary padding required by
torchair. In this PR, we pending the pad logic after the multimodal part"), its full diff (``NPUModelRunner.
_process_reqs``: the block ``if (VLLM_ENABLE_MC2 or self.torchair_graph_enabled) and not with_prefill: input_ids =
self.input_ids[:padded_batch_size]; positions = self.positions[:padded_batch_size]`` moved from before the multimodal /
MRoPE section, which re-slices both to ``num_input_tokens = total_num_scheduled_tokens``, to after it;
``AscendMLAMetadataBuilder.build`` pads the decode metadata for ``SpecDecoding`` as well as ``DecodeOnly``), and the
pre-fix ``model_runner_v1.py`` (``select_torchair_padded_batch_size``, ``graph_pad_size``,
``_get_torchair_lazy_compiled_model(padded_batch_size)`` called with ``input_ids`` / ``positions`` / ``attn_metadata``)
and ``mla_v1.py`` (``build``: with ``graph_pad_size`` the decode ``seq_lens`` are padded with 1, ``slot_mapping`` with
``PAD_SLOT_ID``, ``block_table`` with zero rows, ``input_positions`` with 0). Reconstructed: what the torchair graph
does with the mismatched inputs (a graph compiled per padded batch size with static shapes; a call whose inputs have
other shapes is traced again, and the model then combines real-size token tensors with padded metadata; here the
KV-cache write of the real-size keys through the padded ``slot_mapping`` raises); the model itself (stand-in).
Symptom: DeepSeek-style MLA models served with torchair graph mode fail in decode steps whose batch is padded to a
torchair graph batch size ("torchair execute issue on padding data"); eager mode and prefill are fine.
Mechanism: in torchair decode the runner pads the attention metadata to ``padded_batch_size`` (``graph_pad_size`` extra
rows) and calls the model compiled for that size. The padded slices of ``input_ids`` / ``positions`` were taken before
the multimodal section, which unconditionally re-slices them to the real token count, so the graph for the padded size
receives real-size token inputs next to padded metadata. Eagerly nothing is padded and the shapes agree.
Doctor: padded-shape-mismatch, at _process_reqs. The step run at the graph's padded size combines metadata sized for the
padded rows with token inputs sized for the real rows.
Fix (upstream): take the ``[:padded_batch_size]`` slices of ``input_ids`` and ``positions`` after the multimodal section
(and pad the decode metadata for ``SpecDecoding`` too).
Modelled: ``NPUModelRunner`` with ``_process_reqs`` (the slice ordering, switched by the variant), ``_dummy_run``,
``capture_model``, ``select_torchair_padded_batch_size``, ``_get_torchair_lazy_compiled_model``;
``AscendMLAMetadataBuilder.build`` with its ``graph_pad_size`` padding (the ``SpecDecoding`` half is switched too but
not exercised: the workload decodes without speculation); ``AscendAttentionState``; ``PAD_SLOT_ID``. Stand-ins: the
torchair-compiled model (one graph per input-shape signature, captured with the engine API on first use, replayed with
the inputs copied into its graph inputs), a one-layer attention decoder (hidden 8, paged KV cache, learned positions,
float64) for DeepSeek's MLA, the scheduler. Torchair graph batch sizes [2, 4], captured at start-up by dummy runs.
Workload: requests A, B, C (prompts of 3, 5, 2 tokens) prefill eagerly (torchair is used for decode only), then 4 greedy
decode steps of 3 requests, each padded to the size-4 graph (one padded row: stale ``input_ids`` / ``positions``, padded
metadata). The bug raises RuntimeError in the first decode step (the size-4 graph is traced again with 3-row token
inputs: "The size of tensor a (4) must match the size of tensor b (3)", on CPU and CUDA); the fix replays the size-4
graph and equals eager (max error 0 over the prefill and 4 decode steps).
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/1160"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_process_reqs"
SYMPTOM = ("torchair graph mode: decode steps padded to a graph batch size call the padded-size graph with input_ids "
           "and positions sliced back to the real token count while the attention metadata is padded, and execution "
           "fails")

HIDDEN, VOCAB, MAX_POS = 8, 16, 24
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 12, 3     # block 0: null block
MAX_NUM_REQS = 4
TORCHAIR_GRAPH_BATCH_SIZES = [2, 4]
PAD_SLOT_ID = -1

_variant = "bug"


class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    DecodeOnly = 1
    SpecDecoding = 2


@dataclasses.dataclass
class AscendMLADecodeMetadata:
    input_positions: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclasses.dataclass
class AscendMLAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    attn_state: AscendAttentionState
    decode: AscendMLADecodeMetadata | None
    query_start_loc: torch.Tensor | None = None


class DeepseekStandIn:
    """Embedding + learned positions, one attention layer over a paged KV cache, lm head."""

    def __init__(self, device):
        gen = generator(1160)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POS, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.kv_cache = torch.zeros(2, NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device, dtype=torch.float64)

    def forward(self, input_ids, positions, attn_metadata):
        x = self.embed[input_ids] + self.pos_embed[positions]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        md = attn_metadata
        keep = (md.slot_mapping >= 0).unsqueeze(-1)
        slots = md.slot_mapping.clamp(min=0)            # PAD_SLOT_ID rows write the null block back unchanged
        self.kv_cache[0, slots] = torch.where(keep, k, self.kv_cache[0, slots])
        self.kv_cache[1, slots] = torch.where(keep, v, self.kv_cache[1, slots])
        if md.decode is not None:                       # one query token per request
            dec = md.decode
            ctx = torch.arange(MAX_BLOCKS_PER_REQ * BLOCK_SIZE, device=x.device)
            kv_slots = dec.block_table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
            visible = ctx.unsqueeze(0) < dec.seq_lens.unsqueeze(1)
        else:                                           # prefill: causal over the request's own tokens
            kv_slots = md.slot_mapping.clamp(min=0).unsqueeze(0).expand(x.shape[0], -1)
            req = torch.searchsorted(md.query_start_loc[1:], torch.arange(x.shape[0], device=x.device), right=True)
            visible = (req.unsqueeze(1) == req.unsqueeze(0)) & \
                      (torch.arange(x.shape[0], device=x.device).unsqueeze(0) <= torch.arange(
                          x.shape[0], device=x.device).unsqueeze(1))
        keys, vals = self.kv_cache[0, kv_slots], self.kv_cache[1, kv_slots]
        scores = ((keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5).masked_fill(~visible, -1e9)
        return x + (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1) @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class TorchairCompiledModel:
    """Stand-in for the model compiled by torchair for one graph batch size: one graph per input-shape signature,
    compiled (captured) on first use; later calls copy their inputs into that graph's inputs and replay it."""

    def __init__(self, model, batch_size, device):
        self.model, self.batch_size, self.device = model, batch_size, device
        self.graphs = {}

    def __call__(self, input_ids, positions, attn_metadata):
        dec = attn_metadata.decode
        args = {"input_ids": input_ids, "positions": positions, "slot_mapping": attn_metadata.slot_mapping,
                "input_positions": dec.input_positions, "block_table": dec.block_table, "seq_lens": dec.seq_lens}
        key = tuple(tuple(t.shape) for t in args.values())
        if key not in self.graphs:
            inputs = {name: t.clone() for name, t in args.items()}

            def forward(i=inputs):
                md = AscendMLAMetadata(i["slot_mapping"].shape[0], i["slot_mapping"], attn_metadata.attn_state,
                                       AscendMLADecodeMetadata(i["input_positions"], i["block_table"], i["seq_lens"]))
                return self.model.forward(i["input_ids"], i["positions"], md)

            g, out = capture(forward, device=self.device, warmups=1, name=f"torchair decode [{self.batch_size}]",
                             owner="NPUModelRunner", static=inputs, state={"kv_cache": self.model.kv_cache})
            self.graphs[key] = (g, out, inputs)
        g, out, inputs = self.graphs[key]
        for name, t in args.items():
            inputs[name].copy_(t)
        n = attn_metadata.num_actual_tokens
        return replay(g, out, real=n, size=self.batch_size,
                      padded={"input_ids": inputs["input_ids"], "positions": inputs["positions"]})


class AscendMLAMetadataBuilder:
    def __init__(self, runner):
        self.runner = runner

    def build(self, num_reqs, num_actual_tokens, query_start_loc, graph_pad_size=-1):
        r = self.runner
        dev = r.device
        block_table = r.block_table[:num_reqs]
        slot_mapping = r.slot_mapping_cpu[:num_actual_tokens].to(dev)
        input_positions = r.positions_cpu[:num_actual_tokens].to(dev)
        seq_lens = r.seq_lens_cpu[:num_reqs]
        decode = None
        use_torchair_graph = graph_pad_size != -1
        if r.attn_state != AscendAttentionState.PrefillNoCache:
            padded_states = ([AscendAttentionState.DecodeOnly, AscendAttentionState.SpecDecoding]
                             if _variant == "fix" else [AscendAttentionState.DecodeOnly])
            if use_torchair_graph and r.attn_state in padded_states:
                seq_lens = torch.cat([seq_lens, torch.ones(graph_pad_size, dtype=seq_lens.dtype)])
                slot_mapping = torch.cat([slot_mapping, torch.full((graph_pad_size,), PAD_SLOT_ID,
                                                                   dtype=slot_mapping.dtype, device=dev)])
                block_table = torch.cat([block_table, torch.zeros((graph_pad_size,) + block_table.shape[1:],
                                                                  dtype=block_table.dtype, device=dev)])
                input_positions = torch.cat([input_positions, torch.zeros(graph_pad_size,
                                                                          dtype=input_positions.dtype, device=dev)])
            decode = AscendMLADecodeMetadata(input_positions, block_table, seq_lens.to(dev))
        return AscendMLAMetadata(num_actual_tokens, slot_mapping, r.attn_state, decode, query_start_loc)


class NPUModelRunner:
    def __init__(self, device, torchair_graph_enabled):
        self.device, self.torchair_graph_enabled = device, torchair_graph_enabled
        self.model = DeepseekStandIn(device)
        self.max_num_reqs = MAX_NUM_REQS
        self.torchair_graph_batch_sizes = TORCHAIR_GRAPH_BATCH_SIZES
        self.torchair_compiled_models = {}
        n_tok = 16
        self.input_ids = torch.zeros(n_tok, dtype=torch.int64, device=device)      # persistent device buffers
        self.positions = torch.zeros(n_tok, dtype=torch.int64, device=device)
        self.positions_cpu = torch.zeros(n_tok, dtype=torch.int64)
        self.slot_mapping_cpu = torch.zeros(n_tok, dtype=torch.int64)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_REQS, dtype=torch.int64)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        self.attn_state = AscendAttentionState.PrefillNoCache
        self.attn_metadata_builder = AscendMLAMetadataBuilder(self)
        self.is_multimodal_model, self.uses_mrope = False, False

    def select_torchair_padded_batch_size(self, batch_size):
        selected_batch_size = self.max_num_reqs
        for padded_batch_size in self.torchair_graph_batch_sizes:
            if batch_size <= padded_batch_size < selected_batch_size:
                selected_batch_size = padded_batch_size
        return selected_batch_size

    def _get_torchair_lazy_compiled_model(self, batch_size):
        if batch_size < 0 or batch_size > self.max_num_reqs:
            raise ValueError(f"Bad graph batch size:{batch_size}! max_num_reqs:{self.max_num_reqs}")
        if batch_size not in self.torchair_compiled_models:
            self.torchair_compiled_models[batch_size] = TorchairCompiledModel(self.model, batch_size, self.device)
        return self.torchair_compiled_models[batch_size]

    def _dummy_run(self, num_tokens):
        """Decode batch of ``num_tokens`` dummy requests on the null block (torchair graph compile)."""
        self.attn_state = AscendAttentionState.DecodeOnly
        self.positions_cpu[:num_tokens] = 0
        self.slot_mapping_cpu[:num_tokens] = PAD_SLOT_ID
        self.seq_lens_cpu[:num_tokens] = 1
        self.block_table[:num_tokens] = 0
        attn_metadata = self.attn_metadata_builder.build(num_tokens, num_tokens, None, graph_pad_size=0)
        compiled_model = self._get_torchair_lazy_compiled_model(num_tokens)
        compiled_model(self.input_ids[:num_tokens], self.positions[:num_tokens], attn_metadata)

    def capture_model(self):
        for bs in reversed(self.torchair_graph_batch_sizes):
            self._dummy_run(bs)

    def _process_reqs(self, token_ids, positions, slot_mapping, seq_lens, block_rows, query_lens):
        num_reqs = len(seq_lens)
        total_num_scheduled_tokens = len(token_ids)
        num_input_tokens = total_num_scheduled_tokens
        self.attn_state = (AscendAttentionState.DecodeOnly if all(q == 1 for q in query_lens)
                           else AscendAttentionState.PrefillNoCache)
        with_prefill = self.attn_state not in [AscendAttentionState.DecodeOnly, AscendAttentionState.SpecDecoding]
        self.positions_cpu[:total_num_scheduled_tokens] = torch.tensor(positions)
        self.slot_mapping_cpu[:total_num_scheduled_tokens] = torch.tensor(slot_mapping)
        self.seq_lens_cpu[:num_reqs] = torch.tensor(seq_lens)
        self.block_table[:num_reqs] = torch.tensor(block_rows, dtype=torch.int64)
        query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), device=self.device)

        extra_builder_kwargs = {}
        if self.torchair_graph_enabled and not with_prefill:          # Add graph_pad_size here
            padded_batch_size = self.select_torchair_padded_batch_size(total_num_scheduled_tokens)
            extra_builder_kwargs["graph_pad_size"] = padded_batch_size - total_num_scheduled_tokens
        attn_metadata = self.attn_metadata_builder.build(num_reqs, total_num_scheduled_tokens, query_start_loc,
                                                         **extra_builder_kwargs)

        self.input_ids[:total_num_scheduled_tokens].copy_(torch.tensor(token_ids))
        self.positions[:total_num_scheduled_tokens].copy_(self.positions_cpu[:total_num_scheduled_tokens])
        input_ids = self.input_ids[:num_input_tokens]

        if _variant == "bug" and self.torchair_graph_enabled and not with_prefill:
            input_ids = self.input_ids[:padded_batch_size]
            positions = self.positions[:padded_batch_size]

        # prepare the MRoPE for mllm if using multimodal
        num_input_tokens = total_num_scheduled_tokens
        # (multimodal encoder / input embeddings: text-only model here)
        input_ids = self.input_ids[:num_input_tokens]
        positions = self.positions[:num_input_tokens]

        if _variant == "fix" and self.torchair_graph_enabled and not with_prefill:
            input_ids = self.input_ids[:padded_batch_size]
            positions = self.positions[:padded_batch_size]

        if self.torchair_graph_enabled and not with_prefill:
            compiled_model = self._get_torchair_lazy_compiled_model(padded_batch_size)
            hidden_states = compiled_model(input_ids, positions, attn_metadata)
        else:
            hidden_states = self.model.forward(input_ids, positions, attn_metadata)
        if with_prefill:
            hidden_states = hidden_states[query_start_loc[1:] - 1]
        return self.model.compute_logits(hidden_states[:num_reqs])


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[3, 7, 1], [2, 9, 4, 4, 11], [5, 6]]
    num_decode_steps = 4

    def serve(torchair_graph_enabled):
        runner = NPUModelRunner(device, torchair_graph_enabled)
        if torchair_graph_enabled:
            runner.capture_model()
        tables = [[1, 2, 0], [3, 4, 5], [6, 7, 0]]
        slot = lambda r, p: tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE  # noqa: E731
        ids = [t for p in prompts for t in p]
        pos = [i for p in prompts for i in range(len(p))]
        slots = [slot(r, i) for r, p in enumerate(prompts) for i in range(len(p))]
        logits = runner._process_reqs(ids, pos, slots, [len(p) for p in prompts], tables, [len(p) for p in prompts])
        outs, lens = [logits.clone()], [len(p) for p in prompts]
        for _ in range(num_decode_steps):
            tokens = logits.argmax(-1).tolist()
            logits = runner._process_reqs(tokens, lens, [slot(r, n) for r, n in enumerate(lens)],
                                          [n + 1 for n in lens], tables, [1] * len(prompts))
            outs.append(logits.clone())
            lens = [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
