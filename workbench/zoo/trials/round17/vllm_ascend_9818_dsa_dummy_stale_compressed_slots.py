"""An idle DP dummy batch replays the DSA decode graph with the last real request's compressed slot mapping.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/9818 ("[BugFix] Fix DSA compressed idle dummy graph
OOB", issue #9816).
Symptom: DeepSeek-V4-Flash (w8a8, MTP) with DP=8, EP, async scheduling and ACLGraph ``FULL_DECODE_ONLY``: a
request returns 200, then the idle ``execute_dummy_batch()`` replays the graph dummy path and the NPU fails
with 507011 / MTE out-of-range (vllm-ascend on vLLM v0.20.2, June 2026).
Mechanism: DSA's compressed KV cache group gets its slot mapping and block table from ``_prepare_inputs``
(``num_scheduled_tokens_compressed_list``). Dummy and graph-capture runs do not go through
``_prepare_inputs``, so ``_build_attention_metadata`` sees no compressed metadata and, for
``use_compress``, fell through to the generic branch, which only pads the tail:
``slot_mapping[num_tokens:num_tokens_padded].fill_(-1)`` and ``blk_table_tensor[num_reqs:num_reqs_padded]``.
Rows ``[0:num_tokens)`` of the persistent compressed slot mapping and block table keep the values of the
previous real request, and the captured DSA compressor scatters the dummy's compressed KV at those
``[block, offset]`` indices. Upstream the stale indices ran out of range; here they land in the finished
request's last compressed block, which prefix caching hands to the next request with the same prompt.
(Eager dummy runs build no attention metadata and write nothing; one compressed entry per decoded token.)
Doctor: stale-input, at ``_build_attention_metadata`` (the dummy step reads slot-mapping and block-table
entries it did not write, left by the previous real request).
Fix (upstream): for ``use_compress`` dummy/graph-capture runs, clear the whole used range,
``slot_mapping[:num_tokens_padded].fill_(0)`` and ``blk_table_tensor[:num_reqs_padded].fill_(0)``, so the
dummy's writes go to the null block.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/9818"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_build_attention_metadata"
SYMPTOM = "the idle dummy replay scatters into the last request's compressed KV block (out of range upstream)"
VOCAB, DIM, BLOCK, NUM_BLOCKS, MAX_REQS, MAX_BLOCKS, SIZE = 10, 4, 2, 6, 2, 3, 2
NUM_SLOTS = NUM_BLOCKS * BLOCK          # flat compressed cache; one extra row absorbs PAD_SLOT_ID (-1)
NULL_BLOCK = 0


class Model:
    def __init__(self, device):
        gen = generator(9818)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_compress = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_o = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)


def dsa_decode(model, compressed_kv, input_ids, slot_mapping, block_table, seq_lens):
    """Compressor scatter at ``slot_mapping`` (PAD_SLOT_ID rows land in the scratch row), then sparse
    attention of each row over its compressed entries through ``block_table``."""
    x = model.embed[input_ids]
    compressed_kv[slot_mapping] = torch.tanh(x @ model.w_compress)
    pos = torch.arange(MAX_BLOCKS * BLOCK, device=x.device)
    slots = block_table[:, pos // BLOCK] * BLOCK + pos % BLOCK                  # [rows, positions]
    k = compressed_kv[slots]
    s = ((k * (x @ model.w_q)[:, None, :]).sum(-1)).masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
    out = (torch.softmax(s, -1)[..., None] * k).sum(1)
    return torch.nan_to_num(out) @ model.w_o


class NPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.use_compress = True
        self.compressed_kv = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        # the compressed group's persistent BlockTable buffers (block_table.slot_mapping.gpu, get_device_tensor())
        self.slot_mapping = torch.full((SIZE,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(SIZE, dtype=torch.long, device=device)
        if graphed:
            self.graph = capture(lambda: dsa_decode(model, self.compressed_kv, self.input_ids, self.slot_mapping,
                                                    self.block_table[:SIZE], self.seq_lens),
                                 device=device, name="FULL_DECODE_ONLY size 2",
                                 static={"input_ids": self.input_ids, "seq_lens": self.seq_lens,
                                         "slot_mapping": self.slot_mapping, "block_table": self.block_table},
                                 state={"compressed_kv": self.compressed_kv}, owner="NPUModelRunner (ACLGraph)")
            self.compressed_kv.zero_()                      # capture's writes are discarded with the profile run

    def _prepare_inputs(self, rows, tokens, positions):
        """Real steps: the compressed group's slot mapping for the scheduled tokens."""
        slots = [int(self.block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in zip(rows, positions)]
        self.slot_mapping[:len(slots)].copy_(torch.tensor(slots, device=self.device))
        self.input_ids[:len(tokens)].copy_(torch.tensor(tokens, device=self.device))
        self.seq_lens[:len(positions)].copy_(torch.tensor(positions, device=self.device) + 1)
        return [len(slots)]                                  # num_scheduled_tokens_compressed_list

    def _build_attention_metadata(self, num_tokens, num_reqs, num_tokens_padded, num_reqs_padded,
                                  num_scheduled_tokens_compressed_list=None):
        slot_mapping = self.slot_mapping[:num_tokens_padded]
        blk_table_tensor = self.block_table[:num_reqs_padded]
        if self.use_compress and num_scheduled_tokens_compressed_list is not None:
            slot_mapping[sum(num_scheduled_tokens_compressed_list):num_tokens_padded].fill_(-1)
        elif self.use_compress and self.variant == "fix":
            # DSA dummy/graph-capture runs do not go through _prepare_inputs(): clear what they would reuse
            slot_mapping[:num_tokens_padded].fill_(0)
            blk_table_tensor[:num_reqs_padded].fill_(0)
        else:
            slot_mapping[num_tokens:num_tokens_padded].fill_(-1)
            blk_table_tensor[num_reqs:num_reqs_padded].fill_(0)
        return blk_table_tensor, slot_mapping

    def execute_model(self, rows, tokens, positions):
        n = len(rows)
        compressed = self._prepare_inputs(rows, tokens, positions)
        self._build_attention_metadata(n, n, SIZE, SIZE, compressed)
        self.block_table[n:SIZE].fill_(NULL_BLOCK)
        self.seq_lens[n:].zero_()
        if not self.graphed:
            return dsa_decode(self.model, self.compressed_kv, self.input_ids[:n], self.slot_mapping[:n],
                              self.block_table[:n], self.seq_lens[:n]).clone()
        g, out = self.graph
        return replay(g, out, real=n, size=SIZE, padded={})[:n].clone()

    def execute_dummy_batch(self):
        """DP idle rank: ``_dummy_run(1)``; only the FULL graph path builds attention metadata."""
        if not self.graphed:
            return
        self.input_ids.zero_()
        self.seq_lens[:1].fill_(1)
        self.seq_lens[1:].zero_()
        self._build_attention_metadata(1, 1, SIZE, SIZE, None)
        g, out = self.graph
        replay(g, out, real=1, size=SIZE, padded={})


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = NPUModelRunner(model, device, variant, graphed)
        outs = []
        prompt_kv = torch.tanh(model.embed[torch.tensor([3, 5, 7], device=device)] @ model.w_compress)
        # request A (row 0) gets compressed blocks [1, 2]; its prefill wrote compressed positions 0..2
        runner.block_table[0, :2] = torch.tensor([1, 2], device=device)
        runner.compressed_kv[[2, 3, 4]] = prompt_kv
        outs.append(runner.execute_model([0], [8], [3]))     # decode: compressed position 3 -> block 2, offset 1
        # A finishes; blocks 1 and 2 stay cached as its prefix. Other DP ranks still run: this rank idles.
        runner.execute_dummy_batch()
        # request B (row 0) shares A's prompt + first token: a prefix-cache hit on blocks [1, 2], new block 3
        runner.block_table[0] = torch.tensor([1, 2, 3], device=device)
        outs.append(runner.execute_model([0], [6], [4]))
        outs.append(runner.execute_model([0], [2], [5]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
