"""A padded prefill-graph replay stores bucket-row k/v through flat KV write locs that cover only the real tokens.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/667 ("fix(prefill-graph): illegal memory access on the flat
KV-cache path"), July 2026.
Symptom: with the (default-on) prefill CUDA graph and the flat per-group KV cache (reproduced on gpt-oss), the first
prefill whose token count is below its capture bucket dies with an illegal memory access in the KV store kernel;
exact-bucket prefills and eager prefills are fine. (The PR has no description; this follows the docstring of its
new ``test_flat_prefill_graph.py``: "IAE on the first padded replay -- reproduced on gpt-oss + flat + default
prefill graph".)
Mechanism: ``PrefillGraph`` replays a prefill padded to the smallest captured bucket: ``_input_embeds_buf`` (and the
positions) are zeroed past ``num_tokens``, the captured segments compute q/k/v for all ``bucket`` rows, and the
attention runs as an eager break of the breakable graph under ``_padded_to(ctx, bucket)``, where "attention metadata
stays at the real count". ``MHAAttnBackend.forward_extend`` replaces the caller's ``out_cache_loc`` with the flat
per-group write locs of its metadata (``_select_out_cache_loc`` -> ``metadata.out_cache_locs[group_id]``), built for
the real tokens only, and ``_save_kv_cache`` hands those ``num_tokens`` locs together with the ``bucket``-row k/v to
``token_to_kv_pool.set_kv_buffer``: the store walks k's rows and reads write locations past the end of the loc array.
Doctor: padded-shape-mismatch, at ``_save_kv_cache`` (the KV write combines k/v sized for the padded bucket with write
locs sized for the real tokens).
Fix (upstream): ``FlatCacheGroupsMixin._trim_kv_to_locs`` slices k/v down to the write-loc count before the store, in
``MHAAttnBackend._save_kv_cache`` and trtllm's ``_save_kv_and_prepare_q`` (trimming rather than padding the locs with
the null page keeps page 0 all zero); the PR also gives the capture all-zero dummy flat tables and turns trtllm's
extend prewrite off during a breakable capture, which this program does not model.
(Read: the PR diff and its ``test_flat_prefill_graph.py``, and the pre-fix ``prefill_graph.py``, ``mha.py`` and
``flat_groups.py``. One attention layer of one flat group; the breakable capture is written as its two captured
segments around the eager break. The CUDA store kernel walks past the locs unchecked; torch's indexed store here
refuses the mismatched shapes up front.)
"""
from __future__ import annotations

import bisect
import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/667"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_save_kv_cache"
SYMPTOM = "a padded prefill-graph replay writes bucket-row k/v through real-token flat write locs (illegal access)"

HIDDEN, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 4, 4, 2, 16
CAPTURE_BUCKETS = [4, 8]
GROUP_ID = "full_attention"


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM, device=device)
        self.v_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM, device=device)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        """The KV store: row i of k/v goes to slot ``loc[i]``."""
        self.k_buffer[loc] = cache_k
        self.v_buffer[loc] = cache_v


class ForwardExtendMetadata:
    def __init__(self, seq_lens, page_tables, out_cache_locs):
        self.seq_lens, self.page_tables, self.out_cache_locs = seq_lens, page_tables, out_cache_locs


class MHAAttnBackend:
    """The flat-cache-groups MHA backend (one request per prefill, no prefix)."""

    def __init__(self, variant):
        self.variant = variant
        self.forward_extend_metadata = None

    def init_forward_metadata(self, num_tokens, pages, device):
        positions = torch.arange(num_tokens)
        page_table = torch.tensor(pages, dtype=torch.long)
        locs = page_table[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        self.forward_extend_metadata = ForwardExtendMetadata(
            num_tokens, {GROUP_ID: page_table.to(device)}, {GROUP_ID: locs.to(device)})

    @staticmethod
    def _trim_kv_to_locs(out_cache_loc, k, v):
        """Slice a padded KV write down to the write-loc count."""
        n = out_cache_loc.shape[0]
        if k is not None and k.shape[0] > n:
            return k[:n], v[:n]
        return k, v

    def _select_out_cache_loc(self, layer, metadata, out_cache_loc):
        if metadata.out_cache_locs is None:
            return out_cache_loc
        return metadata.out_cache_locs[layer.group_id]

    def _save_kv_cache(self, layer, out_cache_loc, token_to_kv_pool, k, v):
        if k is None:
            return
        if self.variant == "fix":
            k, v = self._trim_kv_to_locs(out_cache_loc, k, v)
        token_to_kv_pool.set_kv_buffer(layer, out_cache_loc, k, v)

    def forward_extend(self, q, k, v, layer, out_cache_loc, token_to_kv_pool):
        metadata = self.forward_extend_metadata
        out_cache_loc = self._select_out_cache_loc(layer, metadata, out_cache_loc)
        return self._forward_prefill(q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata)

    def _forward_prefill(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, metadata):
        self._save_kv_cache(layer, out_cache_loc, token_to_kv_pool, k, v)
        n = metadata.seq_lens                                        # cu_seqlens: the real tokens only
        slots = metadata.out_cache_locs[layer.group_id]
        keys, values = token_to_kv_pool.k_buffer[slots], token_to_kv_pool.v_buffer[slots]
        scores = (q[:n] @ keys.t()) / math.sqrt(HEAD_DIM)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, -1) @ values


class AttentionLayer:
    group_id = GROUP_ID

    def __init__(self, device):
        gen = generator(667)
        self.w_qkv = randn(HIDDEN, 3 * HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.w_o = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.7)

    def qkv(self, hidden):
        return (hidden @ self.w_qkv).split(HEAD_DIM, dim=-1)

    def out(self, hidden, attn):
        return hidden + attn @ self.w_o


def _land_in(dst, result):
    """The break's result into the (token-padded) handoff buffer: only its leading rows."""
    dst[:result.shape[0]].copy_(result)


class PrefillGraph:
    def __init__(self, layer, backend, pool, device):
        self.layer, self.backend, self.pool, self.device = layer, backend, pool, device
        max_bucket = CAPTURE_BUCKETS[-1]
        self._input_embeds_buf = torch.zeros(max_bucket, HIDDEN, device=device)
        self._attn_handoff = torch.zeros(max_bucket, HEAD_DIM, device=device)
        self._captures = {bucket: self._capture(bucket) for bucket in CAPTURE_BUCKETS}

    def _capture(self, bucket):
        static = {"_input_embeds_buf": self._input_embeds_buf, "_attn_handoff": self._attn_handoff}
        seg0 = capture(lambda: self.layer.qkv(self._input_embeds_buf[:bucket]), device=self.device,
                       name=f"prefill {bucket} seg 0", owner="PrefillGraph (BreakableCapture)", static=static)
        # the break runs eagerly during the capture, on the dummy batch (null page 0)
        with events.dummy_run():
            self.backend.init_forward_metadata(bucket, [0] * (bucket // PAGE_SIZE), self.device)
            self._attention_break(*seg0[1])
        seg1 = capture(lambda: self.layer.out(self._input_embeds_buf[:bucket], self._attn_handoff[:bucket]),
                       device=self.device, name=f"prefill {bucket} seg 1", owner="PrefillGraph (BreakableCapture)",
                       static=static)
        return seg0, seg1

    def _attention_break(self, q, k, v):
        result = self.backend.forward_extend(q, k, v, self.layer, None, self.pool)
        _land_in(self._attn_handoff, result)

    def replay(self, input_embeds):
        num_tokens = input_embeds.shape[0]
        bucket = CAPTURE_BUCKETS[bisect.bisect_left(CAPTURE_BUCKETS, num_tokens)]
        self._input_embeds_buf[:num_tokens].copy_(input_embeds)
        if num_tokens < bucket:
            self._input_embeds_buf[num_tokens:bucket].zero_()
        (g0, qkv), (g1, out) = self._captures[bucket]

        def eager():                                  # this step's forward on the same static buffers
            hidden = self._input_embeds_buf[:bucket]
            q, k, v = self.layer.qkv(hidden)
            self._attention_break(q, k, v)
            return self.layer.out(hidden, self._attn_handoff[:bucket])

        events.serve(g0, num_tokens, bucket, padded={"_attn_handoff": self._attn_handoff}, outputs=out,
                     pieces=(g0, g1), eager=eager)
        g0.replay()
        self._attention_break(*qkv)                   # live ctx: attention metadata at the real count
        g1.replay()
        hidden_states = out.view_as(out)
        events.handed_out(g1, hidden_states)
        return hidden_states[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    layer = AttentionLayer(device)
    gen = generator(6670)
    prompts = [randn(n, HIDDEN, gen=gen, device=device) for n in (8, 5, 3)]     # exact bucket, then padded

    def serve(graphed: bool):
        pool = MHATokenToKVPool(device)
        backend = MHAAttnBackend(variant)
        graph = PrefillGraph(layer, backend, pool, device) if graphed else None
        outs, next_page = [], 1                         # page 0 is the null page
        for embeds in prompts:
            n = embeds.shape[0]
            pages = list(range(next_page, next_page + math.ceil(n / PAGE_SIZE)))
            next_page += len(pages)
            backend.init_forward_metadata(n, pages, device)
            if graph is not None:
                outs.append(graph.replay(embeds))
            else:
                q, k, v = layer.qkv(embeds)
                outs.append(layer.out(embeds, backend.forward_extend(q, k, v, layer, None, pool)).clone())
        return outs + [pool.k_buffer[PAGE_SIZE:].clone(), pool.v_buffer[PAGE_SIZE:].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
