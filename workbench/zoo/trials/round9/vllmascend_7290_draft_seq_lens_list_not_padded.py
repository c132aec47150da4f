"""FULL_DECODE_ONLY drafter graph: ``actual_seq_lengths_q`` gains the pad request, ``seq_lens_list`` does not.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7290 ("[main][bugfix] Fixed the problem that eagle3
will crash in FULL_DECODE_ONLY").
Symptom: EAGLE3 speculative decoding with ``cudagraph_mode=FULL_DECODE_ONLY`` on Ascend crashes the engine with a
fused-infer-attention (FIA) kernel exception as soon as a decode batch has to be padded up to a capture size;
eager drafting, and batches that hit a capture size exactly, run (vllm-ascend main, March 2026).
Mechanism: in FULL_DECODE_ONLY mode the drafter's ``num_tokens`` is padded to a ``cudagraph_capture_sizes`` entry,
and the padding tokens are given to one extra pad request: with ``num_reqs = 3``, two tokens a request and
capture size 8, ``actual_seq_lengths_q`` becomes ``[2, 4, 6, 8]``. Before each replay the graph's FIA task is
re-parameterised on the host with ``actual_seq_lengths`` (query, padded: ``num_reqs + 1`` entries) and
``actual_seq_lengths_kv`` (``seq_lens_list``, still one entry per real request: ``num_reqs``). The attention
kernel requires one KV length per query sequence, so the padded-size query lengths meet real-size KV lengths
and the kernel raises. Eager drafting never adds the pad request, so both lists have ``num_reqs`` entries.
Doctor: padded-shape-mismatch, at ``update_attn_params`` (it combines the graph-padded ``actual_seq_lengths_q``
with the unpadded ``seq_lens_list``).
Fix (upstream): pad the drafter's ``seq_lens_list`` with zero-length entries up to
``len(actual_seq_lengths_q)`` before the graph's attention parameters are updated (the fix also repairs the
stale last entry of the target's list). The exact lines of the upstream diff are modelled, not copied.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7290"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "update_attn_params"
SYMPTOM = "engine crash (FIA kernel exception) when an EAGLE3 draft batch is padded to a capture size"
DIM, MAX_NUM_REQS, MAX_MODEL_LEN, NUM_SPEC = 4, 4, 8, 1
DECODE_THRESHOLD = 1 + NUM_SPEC                   # query tokens per request in a uniform decode batch
CAPTURE_SIZE = MAX_NUM_REQS * DECODE_THRESHOLD    # cudagraph_capture_sizes: [8]
NULL_ROW = 0                                      # KV row of the pad request


def npu_fused_infer_attention_score(query, key_cache, token_rows, token_kv_lens):
    """FIA in TND layout over per-request KV rows: token t attends to the first ``token_kv_lens[t]`` KV
    positions of row ``token_rows[t]`` (a zero length gives a zero output)."""
    keys = key_cache[token_rows]                                      # [tokens, max_model_len, dim]
    scores = torch.einsum("td,tsd->ts", query, keys) / math.sqrt(query.shape[-1])
    valid = torch.arange(MAX_MODEL_LEN, device=query.device)[None, :] < token_kv_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("ts,tsd->td", probs, keys)


class GraphParams:
    """The captured FIA task's parameters: what ``graph_task_update`` rewrites before each replay."""

    def __init__(self, device):
        self.token_rows = torch.zeros(CAPTURE_SIZE, dtype=torch.long, device=device)
        self.token_kv_lens = torch.zeros(CAPTURE_SIZE, dtype=torch.long, device=device)


def update_attn_params(graph_params, attn_metadata, variant: str):
    """Host side of ``update_full_graph_params`` for the draft model: re-issue the FIA task with this step's
    ``actual_seq_lengths`` (query, cumulative) and ``actual_seq_lengths_kv`` (``seq_lens_list``)."""
    actual_seq_lengths = attn_metadata["actual_seq_lengths_q"]
    seq_lens_list = attn_metadata["seq_lens_list"]
    block_rows = attn_metadata["block_rows"]
    if variant == "fix":
        seq_lens_list = seq_lens_list + [0] * (len(actual_seq_lengths) - len(seq_lens_list))
    q_lens = torch.diff(torch.tensor([0] + actual_seq_lengths))
    # The kernel takes one KV length per query sequence (TND): per token, its sequence's KV length.
    token_kv_lens = torch.repeat_interleave(torch.tensor(seq_lens_list), q_lens)
    token_rows = torch.repeat_interleave(torch.tensor(block_rows), q_lens)
    graph_params.token_kv_lens.copy_(token_kv_lens)
    graph_params.token_rows.copy_(token_rows)


class EagleProposer:
    def __init__(self, device):
        gen = generator(7290)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_o = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.hidden_states = torch.zeros(CAPTURE_SIZE, DIM, device=device)   # persistent drafter input

    def forward(self, hidden_states, key_cache, token_rows, token_kv_lens):
        attn = npu_fused_infer_attention_score(hidden_states @ self.w_q, key_cache, token_rows, token_kv_lens)
        return hidden_states + attn @ self.w_o


def build_attn_metadata(reqs, seq_lens, num_tokens_padded=None):
    """The drafter's decode metadata: ``actual_seq_lengths_q`` is padded with one pad request that takes the
    graph's padding tokens (FULL_DECODE_ONLY), and so is the block table (the pad request reads the null
    row); ``seq_lens_list`` is per real request."""
    num_reqs = len(reqs)
    actual_seq_lengths_q = [DECODE_THRESHOLD * (i + 1) for i in range(num_reqs)]
    block_rows = [r + 1 for r in reqs]
    if num_tokens_padded is not None and num_tokens_padded > actual_seq_lengths_q[-1]:
        actual_seq_lengths_q.append(num_tokens_padded)
        block_rows.append(NULL_ROW)
    return {"actual_seq_lengths_q": actual_seq_lengths_q, "seq_lens_list": [seq_lens[r] for r in reqs],
            "block_rows": block_rows}


def run(variant: str, device: str = "cpu"):
    proposer = EagleProposer(device)
    gen = torch.Generator().manual_seed(4)
    key_cache = (torch.randn(MAX_NUM_REQS + 1, MAX_MODEL_LEN, DIM, generator=gen)).to(device)
    key_cache[NULL_ROW].zero_()
    seq_lens = [5, 3, 7, 6]
    steps = [[0, 1, 2, 3], [0, 2, 3]]                 # a full batch, then one that must be padded (3 -> 8 tokens)
    hidden = [torch.randn(DECODE_THRESHOLD * len(reqs), DIM, generator=gen) for reqs in steps]

    def eager():
        outs = []
        for reqs, h in zip(steps, hidden):
            meta = build_attn_metadata(reqs, seq_lens)
            q_lens = torch.diff(torch.tensor([0] + meta["actual_seq_lengths_q"]))
            token_kv_lens = torch.repeat_interleave(torch.tensor(meta["seq_lens_list"]), q_lens).to(device)
            token_rows = torch.repeat_interleave(torch.tensor(meta["block_rows"]), q_lens).to(device)
            outs.append(proposer.forward(h.to(device), key_cache, token_rows, token_kv_lens))
        return outs

    def served():
        params = GraphParams(device)
        update_attn_params(params, build_attn_metadata([0, 1, 2, 3], [1] * MAX_NUM_REQS, CAPTURE_SIZE), variant)
        g, out = capture(lambda: proposer.forward(proposer.hidden_states, key_cache, params.token_rows,
                                                  params.token_kv_lens), device=device,
                         static={"hidden_states": proposer.hidden_states, "token_rows": params.token_rows,
                                 "token_kv_lens": params.token_kv_lens},
                         owner="AscendEagleProposer (FULL_DECODE_ONLY draft graph)")
        outs = []
        for reqs, h in zip(steps, hidden):
            num_tokens = DECODE_THRESHOLD * len(reqs)
            proposer.hidden_states[:num_tokens].copy_(h.to(device))
            proposer.hidden_states[num_tokens:].zero_()
            update_attn_params(params, build_attn_metadata(reqs, seq_lens, CAPTURE_SIZE), variant)
            outs.append(replay(g, out, real=num_tokens, size=CAPTURE_SIZE)[:num_tokens].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
