"""The MTP draft's one-token steps replay the graph captured for its (num_spec + 1)-token step.

Upstream: https://github.com/InternLM/lmdeploy/pull/4661 ("[Fix]: Revert the reuse of cudagraph buffer
for mtp", commit 6aecb970d), reverting what #4611 ("Support dp for qwen35 mtp", "decrease captured
draft cudagraphs") changed in the CUDA graph runner.
Symptom: Qwen3.5 MTP speculative decoding with the PyTorch engine and CUDA graphs (lmdeploy main, June
2026): the draft model's one-token steps compute wrong hidden states, hence wrong draft tokens; eager mode
is right. The PR says nothing beyond its title; the program models the consequence of its diff.
Mechanism: #4611 keyed the draft's graphs on ``(batch, is_decoding, microbatch, target_hidden_size)``
instead of the query length and sized every draft graph for ``num_spec + 1`` tokens a sequence, so for
qwen3_5_mtp (equal target and draft hidden sizes) the verify-width draft step and the one-token loop
steps share one graph. FA3 attention decides ``max_q_seqlen = tokens // batch`` in Python, which at
capture is the padded buffer's width, so the graph always takes the speculative path
(``query.unflatten(0, (-1, num_spec + 1))``): on a one-token step, sequence ``j``'s token is attended as
query row ``j % (num_spec + 1)`` of sequence ``j // (num_spec + 1)``, where an eager step takes the
standard single-token path.
Doctor: warmup-divergence, at ``_forward_decoding`` (the speculative-or-standard branch that the
capture decided from the padded width, and that an eager one-token step decides otherwise).
Fix (upstream): put the query length back into the graph key (``query_len = input_ids.size(1) //
batch_size``), pass it to the runner as ``decode_query_len``, and size a one-token graph with
``max_tokens = batch_size``, so each query length gets a graph captured with its own layout.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4661"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_forward_decoding"
SYMPTOM = "one-token draft steps reuse the (num_spec + 1)-token graph: wrong draft hidden states"
VOCAB, DIM, MAX_LEN, SLOTS = 16, 4, 16, 3      # cache slot 0: reserved for padding requests
NUM_SPEC = 2                                   # num_spec_tokens: the first draft step has 3 tokens a sequence
CAPTURE_BATCH_SIZES = (1, 2)
PROMPTS = ((4, 1), (6, 2))                     # (prefilled length, cache slot) of sequences A and B


class AttnMetadata:
    """``TritonAttentionMetadata``, the fields a decoding step reads."""

    def __init__(self, block_offsets, q_start_loc, q_seqlens, kv_seqlens, cu_seqlens_q):
        self.is_decoding = True
        self.block_offsets = block_offsets
        self.q_start_loc = q_start_loc
        self.q_seqlens = q_seqlens
        self.kv_seqlens = kv_seqlens
        self.cu_seqlens_q = cu_seqlens_q


def _token_seq_pos(num_rows, attn_metadata):
    """Sequence and position of each query row of a varlen batch (rows past the last sequence: -1)."""
    t = torch.arange(num_rows, device=attn_metadata.q_seqlens.device)
    batch = attn_metadata.q_seqlens.size(0)
    seq = torch.searchsorted(attn_metadata.cu_seqlens_q[1:], t, right=True)
    valid = seq < batch
    seq = seq.clamp(max=batch - 1)
    pos = attn_metadata.kv_seqlens[seq] - attn_metadata.q_seqlens[seq] + (t - attn_metadata.q_start_loc[seq])
    return seq, pos, valid


class FA3Impl:
    """``lmdeploy/pytorch/backends/cuda/attention/fa3.py``: decoding with one block per sequence."""

    def _get_max_q_seqlen(self, query, attn_metadata):
        max_q_seqlen = query.size(0)
        if attn_metadata.is_decoding:
            batch_size = attn_metadata.q_seqlens.size(0)
            max_q_seqlen = max_q_seqlen // batch_size
        return max_q_seqlen

    def _fill_kv_cache_impl(self, key, value, k_cache, v_cache, attn_metadata):
        seq, pos, valid = _token_seq_pos(key.size(0), attn_metadata)
        slot = torch.where(valid, attn_metadata.block_offsets[seq, 0], 0)     # no sequence: reserved block 0
        pos = torch.where(valid, pos, 0)
        k_cache[slot, pos] = key
        v_cache[slot, pos] = value

    def _decoding_speculative(self, query, k_cache, v_cache, attn_metadata, max_q_seqlen):
        """Multi-token queries: ``flash_attn_with_kvcache`` on ``query.unflatten(0, (-1, max_q_seqlen))``."""
        q = query.unflatten(0, (-1, max_q_seqlen))                              # [batch, q_len, dim]
        slots = attn_metadata.block_offsets[:, 0]
        keys, values = k_cache[slots], v_cache[slots]                           # [batch, MAX_LEN, dim]
        q_pos = attn_metadata.kv_seqlens[:, None] - max_q_seqlen + torch.arange(max_q_seqlen, device=q.device)
        scores = torch.einsum("bqd,bkd->bqk", q, keys) / DIM ** 0.5
        k_pos = torch.arange(MAX_LEN, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[:, :, None], float("-inf"))
        return torch.einsum("bqk,bkd->bqd", torch.softmax(scores, -1), values).flatten(0, 1)

    def _decoding_standard(self, query, k_cache, v_cache, attn_metadata, max_q_seqlen):
        """Single-token queries: paged attention, one query row per sequence (``cu_seqlens_q``)."""
        seq, pos, valid = _token_seq_pos(query.size(0), attn_metadata)
        slots = torch.where(valid, attn_metadata.block_offsets[seq, 0], 0)
        keys, values = k_cache[slots], v_cache[slots]                           # [rows, MAX_LEN, dim]
        scores = torch.einsum("td,tkd->tk", query, keys) / DIM ** 0.5
        k_pos = torch.arange(MAX_LEN, device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > pos[:, None], float("-inf"))
        return torch.einsum("tk,tkd->td", torch.softmax(scores, -1), values)

    def _forward_decoding(self, query, k_cache, v_cache, attn_metadata, max_q_seqlen):
        if max_q_seqlen > 1:
            return self._decoding_speculative(query, k_cache, v_cache, attn_metadata, max_q_seqlen)
        return self._decoding_standard(query, k_cache, v_cache, attn_metadata, max_q_seqlen)

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata):
        max_q_seqlen = self._get_max_q_seqlen(query, attn_metadata)
        self._fill_kv_cache_impl(key, value, k_cache, v_cache, attn_metadata)
        return self._forward_decoding(query, k_cache, v_cache, attn_metadata, max_q_seqlen)


class Qwen3_5MTPModel:
    """The MTP draft layer: token embedding + the target's hidden state, one attention block."""

    def __init__(self, device):
        gen = generator(4661)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.fc = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.attn = FA3Impl()

    def kv(self, input_ids, position_ids, target_hidden_states):
        h = self.embed[input_ids] + self.pos_embed[position_ids] + target_hidden_states @ self.fc
        return h, h @ self.wk, h @ self.wv

    def forward(self, input_ids, position_ids, target_hidden_states, attn_metadata, k_cache, v_cache):
        h, k, v = self.kv(input_ids, position_ids, target_hidden_states)
        o = self.attn.forward(h @ self.wq, k, v, k_cache, v_cache, attn_metadata)
        return h + o @ self.wo


class CUDASingleGraphRunner:
    """One captured graph and its padded input buffers (``CudaGraphMixin`` buffers)."""

    def __init__(self, model, kv_cache, max_batches, max_tokens, decode_query_len, device, gen):
        self.model, self.kv_cache, self.device, self.gen = model, kv_cache, device, gen
        # decode_query_len sizes FA3's scheduler metadata upstream (not modelled here)
        self.max_batches, self.max_tokens, self.decode_query_len = max_batches, max_tokens, decode_query_len
        self.graph = self.output_buffers = None

    def make_buffers_cudagraph(self):
        b, t = self.max_batches, self.max_tokens
        buf = {"input_ids": torch.zeros(t, dtype=torch.long, device=self.device),
               "position_ids": torch.zeros(t, dtype=torch.long, device=self.device),
               "target_hidden_states": torch.zeros(t, DIM, device=self.device),
               "block_offsets": torch.zeros(b, 1, dtype=torch.long, device=self.device),
               "qkv_lens": torch.zeros(3, b, dtype=torch.long, device=self.device),
               "cu_seqlens_q": torch.zeros(b + 1, dtype=torch.long, device=self.device)}
        self.input_buffers = buf
        self.attn_metadata = AttnMetadata(buf["block_offsets"], buf["qkv_lens"][0], buf["qkv_lens"][1],
                                          buf["qkv_lens"][2], buf["cu_seqlens_q"])

    def fill_buffers_cudagraph(self, input_ids, position_ids, target_hidden_states, attn_metadata):
        buf = self.input_buffers
        num_tokens, batch_size = input_ids.size(0), attn_metadata.q_seqlens.size(0)
        buf["input_ids"].random_(0, VOCAB, generator=self.gen)              # random pad ids (#3530)
        buf["input_ids"][:num_tokens] = input_ids
        buf["position_ids"][:num_tokens] = position_ids
        buf["target_hidden_states"][:num_tokens] = target_hidden_states
        buf["block_offsets"].zero_()                                          # 0 is reserved for padding requests
        buf["block_offsets"][:batch_size] = attn_metadata.block_offsets
        buf["qkv_lens"].zero_()
        buf["qkv_lens"][1:].fill_(self.max_tokens // self.max_batches)        # padding kv == padding q
        buf["qkv_lens"][:, :batch_size] = torch.stack((attn_metadata.q_start_loc, attn_metadata.q_seqlens,
                                                       attn_metadata.kv_seqlens))
        buf["cu_seqlens_q"][1:] = buf["qkv_lens"][1].cumsum(0)

    def _forward(self):
        buf = self.input_buffers
        return self.model.forward(buf["input_ids"], buf["position_ids"], buf["target_hidden_states"],
                                  self.attn_metadata, *self.kv_cache)

    def capture(self, **kwargs):
        self.make_buffers_cudagraph()
        self.fill_buffers_cudagraph(**kwargs)
        self.graph, self.output_buffers = capture(
            self._forward, device=self.device, warmups=1, name=f"draft bs {self.max_batches} x {self.max_tokens}",
            static=self.input_buffers, state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]},
            owner="CUDAGraphRunner (draft)")

    def forward(self, **kwargs):
        self.fill_buffers_cudagraph(**kwargs)
        num_tokens = kwargs["input_ids"].size(0)
        out = replay(self.graph, self.output_buffers, real=num_tokens, size=self.max_tokens,
                     padded={"position_ids": self.input_buffers["position_ids"],
                             "target_hidden_states": self.input_buffers["target_hidden_states"]})
        return out[:num_tokens].clone()                                      # get_outputs_cudagraph


class CUDAGraphRunner:
    """``lmdeploy/pytorch/backends/cuda/graph_runner.py``: one graph per key, captured on first use."""

    def __init__(self, model, kv_cache, variant, device):
        self.model, self.kv_cache, self.variant, self.device = model, kv_cache, variant, device
        self._runner_map = {}
        self.gen = generator(3530)

    def _get_capture_tokens(self, batch_size):
        return next(s for s in CAPTURE_BATCH_SIZES if s >= batch_size)

    def get_graph_key(self, input_ids, attn_metadata, target_hidden_states):
        batch_size = attn_metadata.q_seqlens.size(0)
        capture_bs = self._get_capture_tokens(batch_size)
        if self.variant == "bug":
            # for draft model to distinguish inputs from target model and itself (#4611)
            return (capture_bs, True, False, target_hidden_states.size(-1))
        query_len = input_ids.size(0) // batch_size
        return (capture_bs, True, False, query_len)

    def _get_max_tokens(self, graph_key, input_ids, q_seqlens):
        """``ARSpecCudagraphStrategy.get_max_tokens`` (method ``qwen3_5_mtp``)."""
        batch_size, origin_batch_size, num_tokens = graph_key[0], q_seqlens.size(0), input_ids.size(0)
        if self.variant == "fix" and num_tokens == origin_batch_size:
            return batch_size
        return batch_size * (NUM_SPEC + 1)

    def __call__(self, input_ids, position_ids, target_hidden_states, attn_metadata):
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, target_hidden_states=target_hidden_states,
                      attn_metadata=attn_metadata)
        graph_key = self.get_graph_key(input_ids, attn_metadata, target_hidden_states)
        if graph_key not in self._runner_map:
            max_tokens = self._get_max_tokens(graph_key, input_ids, attn_metadata.q_seqlens)
            decode_query_len = graph_key[3] if self.variant == "fix" else max_tokens // graph_key[0]
            runner = CUDASingleGraphRunner(self.model, self.kv_cache, graph_key[0], max_tokens, decode_query_len,
                                           self.device, self.gen)
            runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
            return None                                                      # a warmup batch: nothing to hand out
        return self._runner_map[graph_key].forward(**kwargs)


def make_step(device, lengths, q_len, tokens, hidden, slots):
    """A decoding step of the draft model: ``q_len`` tokens a sequence after ``lengths`` cached ones."""
    batch = len(lengths)
    q_seqlens = torch.full((batch,), q_len, dtype=torch.long, device=device)
    meta = AttnMetadata(torch.tensor(slots, device=device)[:, None],
                        torch.arange(batch, device=device) * q_len, q_seqlens,
                        torch.tensor(lengths, device=device) + q_len,
                        torch.cat([q_seqlens.new_zeros(1), q_seqlens.cumsum(0)]))
    positions = torch.cat([torch.arange(n, n + q_len, device=device) for n in lengths])
    return dict(input_ids=torch.tensor(tokens, device=device), position_ids=positions,
                target_hidden_states=hidden, attn_metadata=meta)


def schedule(device):
    """Two decode rounds for A and B: the draft step over num_spec + 1 tokens, then the one-token
    loop steps (``loop_count = num_spec - 1``)."""
    gen = generator(1)
    steps, lengths = [], [n for n, _ in PROMPTS]
    slots = [s for _, s in PROMPTS]
    for r in range(2):
        q = NUM_SPEC + 1
        steps.append(make_step(device, lengths, q, [(3 * r + 5 * i + j) % VOCAB for i in range(2) for j in range(q)],
                               randn(2 * q, DIM, gen=gen, device=device), slots))
        lengths = [n + q for n in lengths]
        for _ in range(NUM_SPEC - 1):
            steps.append(make_step(device, lengths, 1, [(7 * r + 2 * i + 1) % VOCAB for i in range(2)],
                                   randn(2, DIM, gen=gen, device=device), slots))
            lengths = [n + 1 for n in lengths]
    return steps


def prefill(model, kv_cache, device):
    gen = generator(2)
    for length, slot in PROMPTS:
        ids = torch.randint(0, VOCAB, (length,), generator=gen).to(device)
        _, k, v = model.kv(ids, torch.arange(length, device=device), randn(length, DIM, gen=gen, device=device))
        kv_cache[0][slot, :length] = k
        kv_cache[1][slot, :length] = v


def dummy_step(device, batch_size, q_len):
    """``make_dummy`` for warmup: every sequence in the reserved block 0."""
    return make_step(device, [0] * batch_size, q_len, [0] * (batch_size * q_len),
                     torch.zeros(batch_size * q_len, DIM, device=device), [0] * batch_size)


def run(variant: str, device: str = "cpu"):
    model = Qwen3_5MTPModel(device)
    steps = schedule(device)

    def new_cache():
        return (torch.zeros(SLOTS, MAX_LEN, DIM, device=device), torch.zeros(SLOTS, MAX_LEN, DIM, device=device))

    def eager():
        kv_cache = new_cache()
        prefill(model, kv_cache, device)
        return [model.forward(s["input_ids"], s["position_ids"], s["target_hidden_states"], s["attn_metadata"],
                              *kv_cache) for s in steps]

    def served():
        kv_cache = new_cache()
        runner = CUDAGraphRunner(model, kv_cache, variant, device)
        # SpecModelAgent.warmup: for each capture size, a (num_spec + 1)-token decode, then a one-token one
        for batch_size in sorted(CAPTURE_BATCH_SIZES, reverse=True):
            runner(**dummy_step(device, batch_size, NUM_SPEC + 1))
            runner(**dummy_step(device, batch_size, 1))
        prefill(model, kv_cache, device)
        return [runner(**s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
