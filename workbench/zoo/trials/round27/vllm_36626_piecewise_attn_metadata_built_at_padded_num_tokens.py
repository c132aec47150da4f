"""PIECEWISE CUDA graphs (Model Runner V2) build attention metadata at the graph's padded token count.

Upstream: https://github.com/vllm-project/vllm/pull/36626 ("[Model Runner V2] Use unpadded num_tokens for
PW CUDA graph attn metadata").
Symptom: with PIECEWISE CUDA graphs in Model Runner V2, building attention metadata fails for batches
padded up to a capture size ("PW CUDA Graph fails to build attention metadata because the padded
``num_tokens`` value is used"); eager mode works. Only the PR description was read, not the diff.
Mechanism: in PIECEWISE mode the model pieces are graphs captured at ``num_tokens_after_padding`` while
attention (the splitting op) runs eagerly between them on the real batch. ``ModelState.prepare_attn`` was
handed the padded token count, so the metadata builder combines per-token tensors sliced at the padded
count (``positions[:num_tokens]``, ``slot_mapping[:num_tokens]``) with tensors derived from the real
requests (``query_start_loc`` / the token-to-request map, ``num_scheduled_tokens`` long), which raises.
Doctor: padded-shape-mismatch, at ``build_attn_metadata`` (padded-size slices combined with real-size ones).
Fix (upstream): for PIECEWISE graphs pass the unpadded ``num_tokens`` to attention-metadata preparation
(FULL graphs keep the padded count, since attention is inside the graph there).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/36626"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "build_attn_metadata"
SYMPTOM = "PIECEWISE graph step fails to build attention metadata for a batch padded to a capture size"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 4, 4, 8, 2
CAPTURE_SIZES = (4, 8)
MAX_NUM_TOKENS = max(CAPTURE_SIZES)


class Model:
    """Two compiled pieces (``piece_0``: embed + qkv, ``piece_1``: o_proj) around eager attention."""

    def __init__(self, device):
        gen = generator(36626)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.rope = randn(64, DIM, gen=gen, device=device, scale=0.3)

    def piece_0(self, input_ids, positions):
        h = self.emb[input_ids] + self.rope[positions]
        return torch.cat([h @ self.wq, h @ self.wk], dim=-1)

    def piece_1(self, attn_out):
        return attn_out @ self.wo


def build_attn_metadata(query_start_loc, seq_lens, positions, slot_mapping, block_table, num_tokens):
    """The backend builder: per-token tensors are sliced at ``num_tokens``; the token-to-request map comes
    from the requests' query lengths (their sum is the real token count)."""
    num_reqs = seq_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    token_to_req = torch.repeat_interleave(torch.arange(num_reqs, device=seq_lens.device), query_lens)
    pos = positions[:num_tokens]
    # causal limit of each token within its request's context
    ctx_len = torch.minimum(pos + 1, seq_lens[token_to_req])
    return {"token_to_req": token_to_req, "ctx_len": ctx_len, "slot_mapping": slot_mapping[:num_tokens],
            "block_table": block_table, "num_actual_tokens": num_tokens}


def unified_attention(qk, kv_cache, meta):
    """Eager attention between the pieces (a splitting op): cache the keys, attend over each request's
    context. Only the metadata's tokens are touched."""
    n = meta["num_actual_tokens"]
    q, k = qk[:n, :DIM], qk[:n, DIM:]
    kv_cache[meta["slot_mapping"]] = k
    ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=qk.device)
    bt = meta["block_table"][meta["token_to_req"]]
    slots = bt[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    keys = kv_cache[slots]
    scores = (keys @ q[:, :, None]).squeeze(-1).masked_fill(ctx[None, :] >= meta["ctx_len"][:, None], -1e9)
    out = torch.zeros_like(qk[:, :DIM])
    out[:n] = (torch.softmax(scores, -1)[:, :, None] * keys).sum(1)
    return out


class ModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.long, device=device)
        self.attn_out = torch.zeros(MAX_NUM_TOKENS, DIM, device=device)
        self.graphs = {}
        if graphed:
            for size in CAPTURE_SIZES:
                g0, qk = capture(lambda s=size: model.piece_0(self.input_ids[:s], self.positions[:s]),
                                 device=device, owner=f"piece_0 (PIECEWISE, {size} tokens)",
                                 static={"input_ids": self.input_ids, "positions": self.positions})
                g1, out = capture(lambda s=size: model.piece_1(self.attn_out[:s]), device=device,
                                  owner=f"piece_1 (PIECEWISE, {size} tokens)", static={"attn_out": self.attn_out})
                self.graphs[size] = (g0, qk, g1, out)

    def prepare_attn(self, reqs, num_tokens):
        """``ModelState.prepare_attn``: the per-step attention metadata for ``num_tokens`` tokens."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        qsl = [0]
        for _, toks, _ in reqs:
            qsl.append(qsl[-1] + len(toks))
        seq_lens = t([start + len(toks) for start, toks, _ in reqs])
        block_table = t([blocks for _, _, blocks in reqs])
        return build_attn_metadata(t(qsl), seq_lens, self.positions, self.slot_mapping, block_table, num_tokens)

    def execute_model(self, reqs):
        """``reqs``: (first position, token ids, block ids) per request."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        ids = [tok for _, toks, _ in reqs for tok in toks]
        pos = [start + i for start, toks, _ in reqs for i in range(len(toks))]
        slots = [b[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for start, toks, b in reqs for p in range(start, start + len(toks))]
        n = len(ids)
        self.input_ids[:n].copy_(t(ids))
        self.positions[:n].copy_(t(pos))
        self.slot_mapping[:n].copy_(t(slots))
        self.slot_mapping[n:].fill_(-1)
        if not self.graphed:
            meta = self.prepare_attn(reqs, n)
            qk = self.model.piece_0(self.input_ids[:n], self.positions[:n])
            return self.model.piece_1(unified_attention(qk, self.kv_cache, meta)).clone()
        size = next(s for s in CAPTURE_SIZES if s >= n)          # num_tokens_after_padding
        # PIECEWISE: attention runs eagerly, so its metadata must describe the real tokens.
        meta = self.prepare_attn(reqs, size if self.variant == "bug" else n)
        g0, qk, g1, out = self.graphs[size]
        qk = replay(g0, qk, real=n, size=size, padded={"input_ids": self.input_ids, "positions": self.positions})
        self.attn_out[:size].copy_(unified_attention(qk, self.kv_cache, meta))
        return replay(g1, out, real=n, size=size)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, graphed)
        outs = [runner.execute_model([(0, [3, 5, 7], [1, 2]), (0, [2, 9], [3, 4])])]      # 5 tokens -> 8
        outs.append(runner.execute_model([(3, [11], [1, 2]), (2, [4], [3, 4])]))          # 2 tokens -> 4
        outs.append(runner.execute_model([(4, [6, 1], [1, 2]), (3, [8], [3, 4]), (0, [1, 2, 3, 4], [5, 6])]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
