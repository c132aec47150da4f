"""Xlite sizes its decode batch by the graph-padded ``num_decodes``: the padded request reads a stale ``query_start_loc`` entry.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/5711 ("[BugFix] Xlite: Bypass the padding of the graph
mode in non-MTP cases to obtain the correct decode num.", merged January 2026, commit 3ce5a34468).
Symptom: with the Xlite backend in graph mode, ``XModel::PrepareAttn`` received an illegal number of tokens to
infer for a decode request (-540; after the unsigned conversion an overflow) and raised the "decode len too
long" alert. Reported as triggered when, in one step, a decode request finishes and a new prefill request is
added.
Mechanism: in graph mode vllm-ascend pads the request count of a decode batch to the captured size, so the
``AscendMetadata`` that ``AscendAttentionMetadataBuilder.build`` makes carries the padded request count:
``split_decodes_and_prefills`` returns ``num_decodes = num_reqs`` (padded) but ``num_decode_tokens =
num_actual_tokens`` (real), and ``actual_seq_lengths_q = query_start_loc_cpu[1:num_reqs + 1]`` and
``seq_lens = seq_lens_cpu[:num_reqs]`` run over the padded rows too. The runner writes only the real entries of
its persistent ``query_start_loc_cpu`` / ``seq_lens_cpu``; the padded entries keep what an earlier step left
there (the residual state across steps). ``XliteWrapper.__call__`` built the Xlite batch as ``num_prefills +
attn_metadata.num_decodes``, so its ``query_lens`` (differences of ``actual_seq_lengths_q``) include the padded
requests, whose lengths come from those stale entries: after a step where a decode finished and a prefill
joined, the cumulative count of that step's prefill is still in the entry past the real ones, and the padded
request of the next decode step gets a length of several tokens (upstream a negative one), which Xlite rejects.
(The diff of ``xlite.py`` and the builder/``split_decodes_and_prefills`` code at the parent commit were read; that
the runner leaves the padded entries of ``query_start_loc_cpu`` as an earlier step wrote them is taken from the PR
description's "residual state across steps", not from the runner's code.)
Here: step 3 drops request A and adds prefill P (entry 4 of ``query_start_loc_cpu`` becomes 8); step 4 decodes C,
D and P, padded to the size-4 graph, and the padded request's length is ``8 - 3 = 5``.
Doctor: stale-padding, at ``__call__`` (``XliteWrapper.__call__`` builds the Xlite batch over the padded requests,
whose query lengths are read from stale padded entries of ``query_start_loc_cpu``).
Fix (upstream): count the decodes with ``attn_metadata.num_decode_tokens`` (the real decode tokens: one per
decode request without MTP) in the batch size and in ``is_prefills``.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/5711"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "__call__"
SYMPTOM = "Xlite PrepareAttn: 'decode len too long' for the padded request of a graph-mode decode batch"

VOCAB, DIM, MAX_POS = 16, 4, 16
MAX_NUM_REQS = 8
CUDAGRAPH_CAPTURE_SIZES = (4, 8)       # decode graphs: one token per request
DECODE_THRESHOLD = 1
MAX_DECODE_LEN = 1                     # Xlite without MTP: a decode request infers one token


@dataclasses.dataclass
class AscendCommonAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    decode_only: bool


@dataclasses.dataclass
class AscendMetadata:
    num_actual_tokens: int
    num_decode_tokens: int
    num_decodes: int
    num_prefills: int
    seq_lens: torch.Tensor
    actual_seq_lengths_q: list
    decode_only: bool


@dataclasses.dataclass
class ModelAttnMeta:
    lens: list = dataclasses.field(default_factory=list)
    cached_lens: list = dataclasses.field(default_factory=list)
    is_prefills: list = dataclasses.field(default_factory=list)


def split_decodes_and_prefills(common, decode_threshold):
    """vllm_ascend.attention.utils: decodes first, then prefills, told apart by query length."""
    num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
    query_start_loc = common.query_start_loc_cpu
    if common.max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_prefill = query_lens > decode_threshold
    first_prefill = int(is_prefill.int().argmax(dim=-1))
    num_decode_tokens = int(query_start_loc[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


class AscendAttentionMetadataBuilder:
    def build(self, common):
        num_reqs = common.num_reqs
        query_start_loc_cpu = common.query_start_loc_cpu[:num_reqs + 1]
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            dataclasses.replace(common, query_start_loc_cpu=query_start_loc_cpu), DECODE_THRESHOLD)
        return AscendMetadata(num_actual_tokens=common.num_actual_tokens, num_decode_tokens=num_decode_tokens,
                              num_decodes=num_decodes, num_prefills=num_prefills,
                              seq_lens=common.seq_lens_cpu[:num_reqs],
                              actual_seq_lengths_q=query_start_loc_cpu[1:].tolist(),
                              decode_only=common.decode_only)


class Model:
    """The weights both the vLLM model and the Xlite model run (one token at a time: rows are independent)."""

    def __init__(self, device):
        gen = generator(5711)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)


def decode_kernel(model, input_ids, positions):
    return torch.tanh((model.emb[input_ids] + model.pos[positions]) @ model.w)


class XModel:
    """The Xlite model: ``PrepareAttn`` checks the batch on the host, then the kernels run; in graph mode they
    are a graph captured for each decode size, replayed on the runner's input buffers."""

    def __init__(self, model, runner, device, graph_mode):
        self.model, self.runner = model, runner
        self.graphs = {}
        if graph_mode:
            for size in CUDAGRAPH_CAPTURE_SIZES:
                ids, pos = runner.input_ids[:size], runner.positions[:size]
                self.graphs[size] = capture(lambda ids=ids, pos=pos: decode_kernel(model, ids, pos), device=device,
                                            owner=f"Xlite decode graph (size {size})",
                                            static={"input_ids": runner.input_ids, "positions": runner.positions})

    def PrepareAttn(self, meta):  # noqa: N802 - the Xlite name
        for n, (length, is_prefill) in enumerate(zip(meta.lens, meta.is_prefills)):
            if not is_prefill and not 0 < length <= MAX_DECODE_LEN:
                raise RuntimeError(f"XModel::PrepareAttn: decode len too long (request {n}: "
                                   f"{length % (1 << 32)} tokens)")

    def forward(self, input_ids, positions, meta, h):
        self.PrepareAttn(meta)
        size = input_ids.shape[0]
        if size in self.graphs and size != h.shape[0]:
            g, out = self.graphs[size]
            padded = {"input_ids": self.runner.input_ids, "positions": self.runner.positions}
            h.copy_(replay(g, out, real=h.shape[0], size=size, padded=padded)[:h.shape[0]])
        elif size in self.graphs:
            g, out = self.graphs[size]
            h.copy_(replay(g, out))
        else:
            h.copy_(decode_kernel(self.model, input_ids[:h.shape[0]], positions[:h.shape[0]]))


class XliteWrapper:
    def __init__(self, runnable, xlite_model, device, variant, full_mode=False):
        self.runnable, self.xlite_model, self.variant, self.full_mode = runnable, xlite_model, variant, full_mode
        self.hidden_states = torch.zeros(MAX_NUM_REQS * 8, DIM, device=device)

    def __call__(self, input_ids, positions, attn_metadata):
        with_prefill = not attn_metadata.decode_only
        if not with_prefill or self.full_mode:
            if self.variant == "fix":
                # attn_metadata.num_decodes is padded in graph mode: count the real decode tokens
                num_decodes = attn_metadata.num_decode_tokens
            else:
                num_decodes = attn_metadata.num_decodes
            num_prefills = attn_metadata.num_prefills
            batch = num_prefills + num_decodes
            seq_lens = attn_metadata.seq_lens[:batch]
            seq_tensor = torch.cat([torch.tensor([0]), torch.tensor(attn_metadata.actual_seq_lengths_q)], dim=0)
            query_lens = (seq_tensor[1:] - seq_tensor[:-1])[:batch]
            cached_lens = seq_lens - query_lens
            meta = ModelAttnMeta(lens=query_lens.tolist(), cached_lens=cached_lens.tolist(),
                                 is_prefills=[False] * num_decodes + [True] * num_prefills)
            h = self.hidden_states[:attn_metadata.num_actual_tokens]
            self.xlite_model.forward(input_ids, positions, meta, h)
            return h
        return self.runnable(input_ids, positions)


class NPUModelRunner:
    def __init__(self, model, device, variant, graph_mode):
        self.model, self.device, self.graph_mode = model, device, graph_mode
        self.input_ids = torch.zeros(MAX_NUM_REQS * 8, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_REQS * 8, dtype=torch.long, device=device)
        # persistent host buffers: each step writes the entries of its real requests only
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_REQS, dtype=torch.int32)
        self.builder = AscendAttentionMetadataBuilder()
        xlite_model = XModel(model, self, device, graph_mode)
        self.model_fn = XliteWrapper(lambda ids, pos: decode_kernel(model, ids, pos), xlite_model, device, variant)

    def _prepare_inputs(self, reqs):
        """``reqs``: (new token ids, tokens already computed), decodes first."""
        num_reqs = len(reqs)
        query_lens = [len(toks) for toks, _ in reqs]
        num_tokens = sum(query_lens)
        cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        self.query_start_loc_cpu[:num_reqs + 1] = cu
        self.seq_lens_cpu[:num_reqs] = torch.tensor([done + len(toks) for toks, done in reqs], dtype=torch.int32)
        ids = [t for toks, _ in reqs for t in toks]
        pos = [done + i for toks, done in reqs for i in range(len(toks))]
        self.input_ids[:num_tokens].copy_(torch.tensor(ids).to(self.device))
        self.positions[:num_tokens].copy_(torch.tensor(pos).to(self.device))
        decode_only = max(query_lens) <= DECODE_THRESHOLD
        num_input_tokens, num_reqs_padded = num_tokens, num_reqs
        if self.graph_mode and decode_only:
            # graph mode: pad the decode batch (requests and tokens) to a captured size
            num_input_tokens = num_reqs_padded = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs)
        common = AscendCommonAttentionMetadata(num_reqs=num_reqs_padded, num_actual_tokens=num_tokens,
                                               max_query_len=max(query_lens),
                                               query_start_loc_cpu=self.query_start_loc_cpu,
                                               seq_lens_cpu=self.seq_lens_cpu, decode_only=decode_only)
        return self.builder.build(common), num_input_tokens

    def execute_model(self, reqs):
        attn_metadata, num_input_tokens = self._prepare_inputs(reqs)
        h = self.model_fn(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens], attn_metadata)
        return h[:attn_metadata.num_actual_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graph_mode: bool):
        runner = NPUModelRunner(model, device, variant, graph_mode)
        outs = []
        # 1: prefill A, B, C, D
        outs.append(runner.execute_model([([1, 2, 3], 0), ([4, 5], 0), ([6, 7], 0), ([8, 9], 0)]))
        # 2: decode A, B, C, D (the size-4 graph, no padding)
        outs.append(runner.execute_model([([10], 3), ([11], 2), ([12], 2), ([13], 2)]))
        # 3: A finished and prefill P joins (decodes first): query_start_loc_cpu[4] = 8
        outs.append(runner.execute_model([([14], 3), ([15], 3), ([0], 3), ([2, 4, 6, 8, 3], 0)]))
        # 4: B finished: C, D, P decode, padded to the size-4 graph
        outs.append(runner.execute_model([([5], 4), ([7], 4), ([9], 5)]))
        outs.append(runner.execute_model([([1], 5), ([3], 5), ([11], 6)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
