"""The XQA decode op re-allocates its sequence-length buffer before every replay: the graph reads the freed one.

Upstream: https://github.com/alibaba/rtp-llm/pull/1078 ("feat: fix XQA CUDA graph support and enable
adaptive multi-block decode"; item 1 of #1077: "Fix XQA decode CUDA graph replay: update sequence_lengths
in-place and split prepare into make_params + prepare_for_cuda_graph_replay").
Symptom: XQA decode under CUDA graphs replays with the key lengths of a buffer that no longer exists
(wrong attention spans or illegal memory access), rtp-llm, June 2026.
Mechanism: ``XQAWrapper.prepare`` allocates the kernel's ``_seq_lens_4d`` (key lengths, ``seq_lens +
q_len``) and its output buffer, then fills them. The decode op's ``prepare_cuda_graph``, run before every
replay, called that same ``prepare``: each replay step bound a fresh ``_seq_lens_4d`` and dropped the one
whose address the graph captured. The replay's XQA kernel reads the released buffer, not this step's lengths.
Doctor: dangling-reference, at ``forward`` (the XQA kernel reading ``_seq_lens_4d``).
Fix (upstream): split ``prepare`` into ``make_params`` and ``prepare_for_cuda_graph_replay``, which only
rewrites the buffers allocated at capture in place (``_update_seq_lens_4d``: ``copy_``).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/pull/1078"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "replay reads the released key-length buffer of the capture step (IMA / wrong spans upstream)"
DIM, PAGE, PAGES_PER_SEQ, BS, Q_LEN = 4, 2, 3, 2, 1
MAX_KV = PAGE * PAGES_PER_SEQ


class XQAWrapper:
    """The XQA decode kernel's Python wrapper: it owns the buffers the kernel reads and writes."""

    def __init__(self, device):
        self.device = device
        self._batch_size = 0
        self._q_len_per_req = 0
        self._output_buffer = None
        self._seq_lens_4d = None

    def _alloc_buffers(self):
        self._output_buffer = torch.zeros(self._batch_size, DIM, device=self.device)
        self._seq_lens_4d = torch.zeros(self._batch_size, 1, dtype=torch.int32, device=self.device)

    def _update_seq_lens_4d(self, seq_lens):
        """From the host's sequence lengths (outside capture)."""
        bs = self._batch_size
        new_seq_lens = (seq_lens[:bs] + self._q_len_per_req).to(torch.int32)
        self._seq_lens_4d[:bs].copy_(new_seq_lens.unsqueeze(1))

    def make_params(self, attn_inputs):
        return {"page_table": attn_inputs["kv_cache_block_id_device"]}

    def prepare(self, attn_inputs):
        self._batch_size = attn_inputs["sequence_lengths"].shape[0]
        self._q_len_per_req = Q_LEN
        self._alloc_buffers()
        self._update_seq_lens_4d(attn_inputs["sequence_lengths"])
        return self.make_params(attn_inputs)

    def prepare_for_cuda_graph_replay(self, attn_inputs):
        self._update_seq_lens_4d(attn_inputs["sequence_lengths"])

    def forward(self, q, k_cache, v_cache, fmha_params):
        page_table = fmha_params["page_table"]
        seq_lens_4d = self._seq_lens_4d[:self._batch_size]
        pos = torch.arange(MAX_KV, device=q.device)
        slots = page_table[:, pos // PAGE] * PAGE + pos % PAGE
        scores = (q[:, None, :] * k_cache[slots]).sum(-1) / DIM ** 0.5
        scores = scores.masked_fill(pos[None, :] >= seq_lens_4d, float("-inf"))
        self._output_buffer.zero_()
        self._output_buffer += (torch.softmax(scores, -1)[..., None] * v_cache[slots]).sum(1)
        return self._output_buffer


class XQADecodeOp:
    """The decode attention op: writes this step's key/value, then runs XQA."""

    def __init__(self, model, device, fixed: bool):
        self.model, self.fixed = model, fixed
        self.fmha_impl = XQAWrapper(device)
        self.fmha_params = None

    def prepare(self, attn_inputs):
        self.fmha_params = self.fmha_impl.prepare(attn_inputs)

    def prepare_cuda_graph(self, attn_inputs):
        if self.fixed:
            self.fmha_impl.prepare_for_cuda_graph_replay(attn_inputs)
            self.fmha_params = self.fmha_impl.make_params(attn_inputs)
        else:
            self.fmha_params = self.fmha_impl.prepare(attn_inputs)

    def forward(self, input_ids, k_cache, v_cache, slot_mapping):
        h = self.model["emb"][input_ids]
        k_cache[slot_mapping] = h @ self.model["wk"]
        v_cache[slot_mapping] = h @ self.model["wv"]
        out = self.fmha_impl.forward(h @ self.model["wq"], k_cache, v_cache, self.fmha_params)
        return out @ self.model["lm_head"]


def steps(device):
    """Two sequences on pages [0, 1, 2] and [3, 4, 5], prompts of 2 and 1 tokens, 3 decode steps."""
    out = []
    for s in range(3):
        lengths = [2 + s, 1 + s]                         # tokens already in the cache
        slots = [0 * PAGE * PAGES_PER_SEQ + lengths[0], 3 * PAGE + lengths[1]]
        out.append((torch.tensor([(4 + s) % 9, (7 + 2 * s) % 9], device=device), torch.tensor(slots, device=device),
                    torch.tensor(lengths, dtype=torch.int32)))
    return out


def run(variant: str, device: str = "cpu"):
    gen = generator(1078)
    model = {"emb": randn(9, DIM, gen=gen, device=device),
             "wq": randn(DIM, DIM, gen=gen, device=device, scale=0.5),
             "wk": randn(DIM, DIM, gen=gen, device=device, scale=0.5),
             "wv": randn(DIM, DIM, gen=gen, device=device, scale=0.5),
             "lm_head": randn(DIM, 9, gen=gen, device=device, scale=0.5)}
    page_table = torch.tensor([[0, 1, 2], [3, 4, 5]], device=device)

    def new_cache():
        k = torch.zeros((2 * PAGES_PER_SEQ + 1) * PAGE, DIM, device=device)
        v = torch.zeros_like(k)
        for slot, tok in ((0, 1), (1, 2), (6, 3)):          # the prompts' keys and values (prefill)
            k[slot] = model["emb"][tok] @ model["wk"]
            v[slot] = model["emb"][tok] @ model["wv"]
        return k, v

    def eager():
        k_cache, v_cache = new_cache()
        op, outs = XQADecodeOp(model, device, fixed=True), []
        for ids, slots, lengths in steps(device):
            op.prepare({"sequence_lengths": host(lengths, device), "kv_cache_block_id_device": page_table})
            outs.append(op.forward(ids, k_cache, v_cache, slots))
        return outs

    def served():
        k_cache, v_cache = new_cache()
        op = XQADecodeOp(model, device, fixed=variant == "fix")
        # the C++ CudaGraphRunner's capture inputs: fixed addresses, refreshed in place every step
        inputs = {"input_ids": torch.zeros(BS, dtype=torch.long, device=device),
                  "slot_mapping": torch.full((BS,), 2 * PAGES_PER_SEQ * PAGE, dtype=torch.long, device=device),
                  "kv_cache_block_id_device": torch.full((BS, PAGES_PER_SEQ), 2 * PAGES_PER_SEQ, device=device)}
        sequence_lengths = host(torch.zeros(BS, dtype=torch.int32), device)
        attn_inputs = {"sequence_lengths": sequence_lengths,
                       "kv_cache_block_id_device": inputs["kv_cache_block_id_device"]}
        op.prepare(attn_inputs)                               # before capture
        g, out = capture(lambda: op.forward(inputs["input_ids"], k_cache, v_cache, inputs["slot_mapping"]),
                         device=device, static=inputs, state={"k_cache": k_cache, "v_cache": v_cache},
                         owner="CudaGraphRunner", name="decode bs 2")
        outs = []
        for ids, slots, lengths in steps(device):
            inputs["input_ids"].copy_(ids)
            inputs["slot_mapping"].copy_(slots)
            inputs["kv_cache_block_id_device"].copy_(page_table)
            sequence_lengths.copy_(lengths)
            op.prepare_cuda_graph(attn_inputs)                # before each replay
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
