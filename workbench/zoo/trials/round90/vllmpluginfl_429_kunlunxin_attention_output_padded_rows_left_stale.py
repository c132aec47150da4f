"""Kunlunxin attention under piecewise CUDA graphs writes only the real rows of the graph-allocated output buffer; the padded rows keep stale values that reach real rows downstream.

Upstream: https://github.com/flagos-ai/vllm-plugin-FL/pull/429 ("[Kunlunxin] Fix inference problem with CUDAGraph
enabled", flagos-ai/vllm-plugin-FL, merged 2026-09-01). Read: the PR description ("Fix uninitialized padding output in
Kunlunxin attention backend. Zero out the padding region of attention output"), the maintainer comment on it, the
description of the earlier, unmerged #368 ("garbled output ... when CUDA Graph is enabled ... caused by uninitialized
values in the padded region of the attention output buffer ... when ``num_actual_tokens`` is smaller than the output
buffer size"), and a stored later version of ``vllm_fl/dispatch/backends/vendor/kunlunxin/impl/attention.py`` whose
``KunlunxinAttentionBackendImpl.forward`` carries the fix and whose ``forward_decode`` / ``context_forward`` write only
``output[:num_decode_tokens]`` and ``output[num_decode_tokens:num_actual_tokens]``. The PR's diff itself was not read.
Symptom: garbled / abnormal output on Kunlunxin hardware with CUDA graphs on; eager (``enforce_eager``) is fine.
Mechanism: with piecewise graphs vLLM's ``Attention.forward`` allocates ``output = torch.empty(...)`` inside the
captured piece before the ``unified_attention_with_output`` split op, so the buffer is the piece graph's static
output at the padded token count; replays run no kernel for ``torch.empty``. The attention op runs eagerly between
the pieces and ``KunlunxinAttentionBackendImpl.forward`` fills only ``[:num_actual_tokens]`` (decode rows via
``decode_paged_attention``, prefill rows via ``prefill_attention``). Rows ``[num_actual_tokens:]`` keep whatever the
graph pool block under the buffer holds: the capture placed ``torch.empty`` in a block an earlier temporary of the
same piece had freed (here the embedding gather), so every replay leaves there that temporary's values for the
padded tokens' stale input ids (uninitialised memory, as far as attention is concerned). The next piece reads the
whole buffer.
Doctor: stale-padding, at forward. Real rows of the next piece's output depend on what the padded rows of the attention
output buffer hold, and ``forward`` is where the fix zeroes them.
Fix (upstream): in ``forward``, ``if attn_metadata.num_actual_tokens < output.shape[0]:
output[num_actual_tokens:].zero_()``.
Modelled: one decoder layer split as vLLM's piecewise backend splits it: ``submod_0`` (embedding, qkv projection and
the ``torch.empty`` attention output) and ``submod_1`` (o_proj, residual, lm head), each captured per size [4, 8];
attention eager between them, with the decode / prefill split and the profiling path for ``attn_metadata is None``
as in the stored file (simplified to one head, a paged KV cache with block 0 reserved). Stand-in: the PR does not say
which op lets padded rows reach real rows; here o_proj is a W8A8 linear with a per-tensor dynamic activation scale
(the scale is the absolute maximum over all rows of its input, padded rows included). Input ids and positions of
padded tokens are left as the previous step left them, as vLLM's persistent buffers do. Sizes: hidden 8, vocab 16
(float64), block size 4.
Workload: step 1 prefills A (5 tokens) and B (3): 8 tokens, the size-8 graphs, no padding. Step 2 decodes A and B:
2 tokens padded to 4 (rows 2-3 of the attention output hold embedding rows, larger than the attention rows, so the
o_proj scale grows and A's and B's logits move by up to 0.065). Step 3 prefills C (3) beside the decodes of A and B:
5 tokens padded to 8. Step 4 decodes A, B and C (3 padded to 4). Eager runs each step at its real token count.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flagos-ai/vllm-plugin-FL/pull/429"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "forward"
SYMPTOM = ("Kunlunxin backend with piecewise CUDA graphs: attention writes only num_actual_tokens rows of the "
           "graph-allocated output buffer; padded rows keep what the graph pool left there and skew the per-tensor "
           "activation scale of o_proj, so real tokens' logits differ from eager (garbled output)")

VOCAB, HIDDEN = 16, 8
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 3
NUM_BLOCKS = 1 + 3 * MAX_BLOCKS_PER_REQ
MAX_NUM_TOKENS = 8
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
PAD_SLOT_ID = -1

_variant = "bug"


class KunlunxinMetadata:
    def __init__(self, num_actual_tokens, num_decode_tokens, num_prefill_tokens, reqs):
        self.num_actual_tokens = num_actual_tokens
        self.num_decode_tokens, self.num_prefill_tokens = num_decode_tokens, num_prefill_tokens
        self.reqs = reqs          # decodes first (reorder_batch), then prefills: (token rows, positions, blocks)


class KunlunxinAttentionBackendImpl:
    def __init__(self, device):
        self.scale = HIDDEN ** -0.5
        self.kv_cache = torch.zeros(2, NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device, dtype=torch.float64)

    def _attend(self, q, keys, vals, causal_from):
        s = (q @ keys.T) * self.scale
        j = torch.arange(keys.shape[0], device=q.device)
        mask = j.unsqueeze(0) <= (causal_from + torch.arange(q.shape[0], device=q.device)).unsqueeze(1)
        s = torch.where(mask, s, torch.full_like(s, -1e9))
        return torch.softmax(s, -1) @ vals

    def forward(self, query, key, value, attn_metadata, output):
        """``output`` is the padded buffer the captured piece allocated (the hazard site)."""
        if (_variant == "fix" and attn_metadata is not None
                and attn_metadata.num_actual_tokens < output.shape[0]):    # upstream fix
            output[attn_metadata.num_actual_tokens:].zero_()
        if attn_metadata is None:     # profiling / capture run: context_forward over the whole (dummy) query
            output.copy_(self._attend(query, key, value, 0))
            return output
        for rows, pos, blocks in attn_metadata.reqs:        # reshape_and_cache for the real tokens
            slots = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.kv_cache[0, slots] = key[rows]
            self.kv_cache[1, slots] = value[rows]
        for rows, pos, blocks in attn_metadata.reqs:        # decode_paged_attention / prefill_attention
            ctx = torch.arange(int(pos[-1]) + 1, device=query.device)
            slots = blocks[ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
            output[rows] = self._attend(query[rows], self.kv_cache[0, slots], self.kv_cache[1, slots], int(pos[0]))
        return output


class Model:
    def __init__(self, device):
        gen = generator(429)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(32, HIDDEN, scale=0.5)
        self.wqkv, self.wo, self.lm_head = r(HIDDEN, 3 * HIDDEN, scale=0.2), r(HIDDEN, HIDDEN), r(HIDDEN, VOCAB, scale=0.8)

    def submod_0(self, input_ids, positions):
        x = self.embed[input_ids] + self.pos_embed[positions]
        q, k, v = (x @ self.wqkv).split(HIDDEN, dim=-1)
        output = torch.empty(x.shape, dtype=x.dtype, device=x.device)   # Attention.forward's output buffer
        return x, q, k, v, output

    def submod_1(self, x, attn_output):
        # o_proj: W8A8 with a per-tensor dynamic activation scale (stand-in, see the docstring)
        scale = attn_output.abs().amax().clamp(min=1e-12) / 127.0
        a_q = torch.round(attn_output / scale).clamp(-127, 127)
        h = x + (a_q @ self.wo) * scale
        return h @ self.lm_head


class GPUModelRunner:
    def __init__(self, device, use_graph):
        self.device, self.use_graph = device, use_graph
        self.model = Model(device)
        self.impl = KunlunxinAttentionBackendImpl(device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.graphs = {}
        if use_graph:
            self.capture_model()

    def capture_model(self):
        for n in CUDAGRAPH_CAPTURE_SIZES:           # PIECEWISE: attn_metadata is None during the dummy run
            ids, pos = self.input_ids[:n], self.positions[:n]
            g0, out0 = capture(lambda ids=ids, pos=pos: self.model.submod_0(ids, pos), device=self.device,
                               name=f"submod_0 [{n}]", owner="PiecewiseBackend",
                               static={"input_ids": self.input_ids, "positions": self.positions})
            x, q, k, v, output = out0
            self.impl.forward(q, k, v, None, output)
            g1, out1 = capture(lambda x=x, output=output: self.model.submod_1(x, output), device=self.device,
                               name=f"submod_1 [{n}]", owner="PiecewiseBackend",
                               static={"hidden_states": x, "attn_output": output})
            self.graphs[n] = (g0, out0, g1, out1)

    def execute_model(self, batch):
        """``batch``: list of (tokens, start position, block row); decodes come first (reorder_batch)."""
        ids, pos, reqs, row = [], [], [], 0
        for toks, start, blocks in batch:
            p = torch.arange(start, start + len(toks), device=self.device)
            reqs.append((torch.arange(row, row + len(toks), device=self.device), p,
                         torch.tensor(blocks, device=self.device)))
            ids += toks
            pos += p.tolist()
            row += len(toks)
        n = row
        num_decode = sum(len(t) for t, _, _ in batch if len(t) == 1)
        meta = KunlunxinMetadata(n, num_decode, n - num_decode, reqs)
        self.input_ids[:n] = torch.tensor(ids, device=self.device)
        self.positions[:n] = torch.tensor(pos, device=self.device)
        if self.use_graph:
            size = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n)
            g0, out0, g1, out1 = self.graphs[size]
            x, q, k, v, output = replay(g0, out0, real=n, size=size,
                                        padded={"input_ids": self.input_ids[:size],
                                                "positions": self.positions[:size]})
            self.impl.forward(q, k, v, meta, output)         # unified_attention_with_output, eager
            logits = replay(g1, out1, real=n, size=size, padded={"attn_output": output})
        else:
            x, q, k, v, output = self.model.submod_0(self.input_ids[:n], self.positions[:n])
            self.impl.forward(q, k, v, meta, output)
            logits = self.model.submod_1(x, output)
        last = torch.stack([rows[-1] for rows, _, _ in reqs])
        return logits[last].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(430)
    prompts = {"A": [3, 7, 1, 9, 4], "B": [12, 5, 2], "C": [8, 6, 11]}
    blocks = {rid: [1 + i * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
              for i, rid in enumerate(prompts)}
    nxt = {rid: torch.randint(0, VOCAB, (3,), generator=gen).tolist() for rid in prompts}
    schedule = [[("A", "p"), ("B", "p")], [("A", "d"), ("B", "d")],
                [("A", "d"), ("B", "d"), ("C", "p")], [("A", "d"), ("B", "d"), ("C", "d")]]

    def serve(use_graph):
        runner = GPUModelRunner(device, use_graph)
        done = {rid: 0 for rid in prompts}
        ndec = {rid: 0 for rid in prompts}
        outs = []
        for step in schedule:
            batch = []
            for rid, kind in step:
                toks = prompts[rid] if kind == "p" else [nxt[rid][ndec[rid]]]
                batch.append((toks, done[rid], blocks[rid]))
            outs.append(runner.execute_model(batch))
            for (rid, kind), (toks, _, _) in zip(step, batch):
                done[rid] += len(toks)
                ndec[rid] += kind == "d"
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
