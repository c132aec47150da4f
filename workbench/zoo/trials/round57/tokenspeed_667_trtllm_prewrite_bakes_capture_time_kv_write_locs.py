"""The trtllm KV prewrite, captured into the prefill graph, keeps writing K/V to the capture forward's write locs.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/667 ("fix(prefill-graph): illegal memory access on the flat
KV-cache path", squash d47253c4; branch commit 121c0ffa "fix(prefill-graph): trtllm extend prewrite bakes stale KV
write locs"), July 2026.
Symptom: gpt-oss with the trtllm backend, flat per-group KV cache and the (default-on) prefill CUDA graph: "every
replay rewrites capture-time locations (the dummy page on the flat path, a stale input-buffer tail on radix) --
silent KV corruption, no crash"; prefill outputs and later decodes drift from eager.
Mechanism: ``TRTLLMMHAAttnBackend.support_kv_cache_prewrite()`` always returned True, so ``GptOssAttention.
forward_prepare`` takes the fused RoPE + KV-write branch, whose write locations come from
``attn_backend.select_out_cache_loc`` -> ``_prewrite_metadata(EXTEND).out_cache_locs[group_id]``: a tensor that
``init_forward_metadata`` builds afresh for each forward (``_compute_flat_extend_out_cache_locs``). That branch is
in the graphed segment, so ``PrefillGraph._capture_bucket`` records the KV store with the dummy capture batch's locs
(all on the null page 0, from ``_dummy_flat_tables``). It hands ``(q, None, None)`` on, so the eager attention break
(run live at replay, with this step's metadata) gets ``save_kv_cache=False`` and stores nothing. On every replay the
graph writes the step's K/V to page 0 again, while the break reads K/V from the step's real pages: they hold zeros
(or an earlier request's K/V). Eager forwards resolve the prewrite locs from the live metadata and are correct.
(Upstream the capture-time locs tensor is released when the next forward's metadata replaces it; the caching
allocator leaves its bytes, the dummy-page locations, in place, which is what the commit reports. Here
``PrefillGraph`` keeps the capture metadata, so the replays read those same values.)
Doctor: warmup-divergence, at ``support_kv_cache_prewrite`` (the capture took the prewrite branch and froze the
capture forward's write-location tensor into the graph; an eager step resolves this step's locations).
Fix (upstream): ``support_kv_cache_prewrite`` returns False while ``is_breakable_capture_active()``, so the captured
segment hands k/v to the eager break, which writes KV from per-step metadata; ``_save_kv_and_prepare_q`` trims the
bucket-padded k/v to the write-loc count (q keeps the bucket shape). (The padded-k/v-vs-real-locs half of the same PR
on the mha backend is round26's ``tokenspeed_667_prefill_graph_padded_kv_vs_real_flat_write_locs``.)
"""
from __future__ import annotations

import bisect
import contextlib
import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/667"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "support_kv_cache_prewrite"
SYMPTOM = "every prefill-graph replay writes K/V to the capture batch's dummy-page locations; attention reads empty KV"

HIDDEN, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 4, 4, 2, 16
CAPTURE_BUCKETS = [4, 8]
GROUP_ID = "full_attention"
_breakable_capture_depth = 0


def is_breakable_capture_active():
    return _breakable_capture_depth > 0


@contextlib.contextmanager
def breakable_capture():
    global _breakable_capture_depth
    _breakable_capture_depth += 1
    try:
        yield
    finally:
        _breakable_capture_depth -= 1


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM, device=device)
        self.v_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM, device=device)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[loc] = cache_k
        self.v_buffer[loc] = cache_v


class TRTLLMMHAMetadata:
    def __init__(self, seq_lens, out_cache_locs):
        self.seq_lens, self.out_cache_locs = seq_lens, out_cache_locs


class TRTLLMMHAAttnBackend:
    """Flat cache groups: one request per prefill, no prefix, one group."""

    def __init__(self, variant):
        self.variant = variant
        self.forward_prefill_metadata = None

    def support_kv_cache_prewrite(self, forward_mode=None):
        if self.variant == "fix" and is_breakable_capture_active():
            return False        # bake the non-prewrite branch: the eager break writes KV from fresh metadata
        return True

    def init_forward_metadata(self, num_tokens, pages, device):
        """``_compute_flat_extend_out_cache_locs``: a fresh write-loc tensor for each forward."""
        positions = torch.arange(num_tokens)
        table = torch.tensor(pages, dtype=torch.long)
        locs = table[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        self.forward_prefill_metadata = TRTLLMMHAMetadata(num_tokens, {GROUP_ID: locs.to(device)})

    def select_out_cache_loc(self, layer, out_cache_loc, forward_mode=None):
        metadata = self.forward_prefill_metadata          # _prewrite_metadata(EXTEND)
        if metadata is None or metadata.out_cache_locs is None:
            return out_cache_loc
        return metadata.out_cache_locs[layer.group_id]

    def _save_kv_and_prepare_q(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache):
        if self.variant == "fix" and k is not None and k.shape[0] > out_cache_loc.shape[0]:
            k, v = k[:out_cache_loc.shape[0]], v[:out_cache_loc.shape[0]]
        if save_kv_cache:
            token_to_kv_pool.set_kv_buffer(layer, out_cache_loc, k, v)
        return q

    def forward_extend(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache):
        metadata = self.forward_prefill_metadata
        out_cache_loc = self.select_out_cache_loc(layer, out_cache_loc)
        q = self._save_kv_and_prepare_q(q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache)
        n = metadata.seq_lens                              # the kernel reads the real tokens' pages
        keys, values = token_to_kv_pool.k_buffer[out_cache_loc], token_to_kv_pool.v_buffer[out_cache_loc]
        scores = (q[:n] @ keys.t()) / math.sqrt(HEAD_DIM)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ values


def rotary_emb(positions, q, k, inv_freq):
    angle = positions.to(q.dtype)[:, None] * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)

    def rot(x):
        x1, x2 = x[:, :2], x[:, 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rot(q), rot(k)


class GptOssAttention:
    group_id = GROUP_ID

    def __init__(self, device):
        gen = generator(667)
        self.w_qkv = randn(HIDDEN, 3 * HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.w_o = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.7)
        self.inv_freq = torch.tensor([1.0, 0.1]).to(device)

    def forward_prepare(self, positions, hidden_states, attn_backend, token_to_kv_pool, out_cache_loc):
        q, k, v = (hidden_states @ self.w_qkv).split(HEAD_DIM, dim=-1)
        if attn_backend.support_kv_cache_prewrite("extend"):
            loc = attn_backend.select_out_cache_loc(self, out_cache_loc, "extend")   # flat: this group's locs
            q, k = rotary_emb(positions, q, k, self.inv_freq)  # fused RoPE + set_kv_buffer
            token_to_kv_pool.set_kv_buffer(self, loc, k, v)
            return q, None, None
        q, k = rotary_emb(positions, q, k, self.inv_freq)
        return q, k, v

    def forward_core(self, hidden_states, attn_output):
        return hidden_states + attn_output @ self.w_o


class PrefillGraph:
    """A breakable capture per bucket: segment 0, the eager attention break, segment 1."""

    def __init__(self, layer, backend, pool, device):
        self.layer, self.backend, self.pool, self.device = layer, backend, pool, device
        max_bucket = CAPTURE_BUCKETS[-1]
        self._input_embeds_buf = torch.zeros(max_bucket, HIDDEN, device=device)
        self.positions_buf = torch.zeros(max_bucket, dtype=torch.long, device=device)
        self._attn_handoff = torch.zeros(max_bucket, HEAD_DIM, device=device)
        self._capture_metadata = {}
        self._captures = {b: self._capture_bucket(b) for b in sorted(CAPTURE_BUCKETS, reverse=True)}

    def _segment0(self, bucket):
        return self.layer.forward_prepare(self.positions_buf[:bucket], self._input_embeds_buf[:bucket],
                                          self.backend, self.pool, None)

    def _capture_bucket(self, bucket):
        static = {"_input_embeds_buf": self._input_embeds_buf, "positions_buf": self.positions_buf,
                  "_attn_handoff": self._attn_handoff}
        state = {"k_buffer": self.pool.k_buffer, "v_buffer": self.pool.v_buffer}
        owner = "PrefillGraph (BreakableCapture)"
        self.positions_buf[:bucket].copy_(torch.arange(bucket, device=self.device))   # _make_dummy_batch
        self.backend.init_forward_metadata(bucket, [0] * (bucket // PAGE_SIZE), self.device)  # null page 0
        self._capture_metadata[bucket] = self.backend.forward_prefill_metadata
        events.static_buffers(owner, static)
        events.persistent_state(owner, state)
        with events.warmup():                              # _run_inner(bucket) before `with cap:`
            self._attention_break(self._segment0(bucket))
        with breakable_capture():
            seg0 = capture(lambda: self._segment0(bucket), device=self.device, warmups=0,
                           name=f"prefill {bucket} seg 0", owner=owner)
            with events.dummy_run():                       # the break runs eagerly on the dummy batch
                self._attention_break(seg0[1])
            seg1 = capture(lambda: self.layer.forward_core(self._input_embeds_buf[:bucket],
                                                           self._attn_handoff[:bucket]),
                           device=self.device, warmups=0, name=f"prefill {bucket} seg 1", owner=owner)
        return seg0, seg1

    def _attention_break(self, inner_state):
        q, k, v = inner_state
        result = self.backend.forward_extend(q, k, v, self.layer, None, self.pool, save_kv_cache=k is not None)
        self._attn_handoff[:result.shape[0]].copy_(result)

    def replay(self, input_embeds):
        num_tokens = input_embeds.shape[0]
        bucket = CAPTURE_BUCKETS[bisect.bisect_left(CAPTURE_BUCKETS, num_tokens)]
        self._input_embeds_buf[:num_tokens].copy_(input_embeds)
        self._input_embeds_buf[num_tokens:bucket].zero_()
        self.positions_buf[:bucket].copy_(torch.arange(bucket, device=self.device) * (
            torch.arange(bucket, device=self.device) < num_tokens))
        (g0, inner_state), (g1, out) = self._captures[bucket]

        def eager():                                       # this step's forward on the same static buffers
            self._attention_break(self._segment0(bucket))
            return self.layer.forward_core(self._input_embeds_buf[:bucket], self._attn_handoff[:bucket])

        events.serve(g0, num_tokens, bucket, padded={"_attn_handoff": self._attn_handoff}, outputs=out,
                     pieces=(g0, g1), eager=eager)
        g0.replay()
        self._attention_break(inner_state)                 # live: this step's metadata
        g1.replay()
        hidden_states = out.view_as(out)
        events.handed_out(g1, hidden_states)
        return hidden_states[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    layer = GptOssAttention(device)
    gen = generator(6671)
    prompts = [randn(n, HIDDEN, gen=gen, device=device) for n in (8, 5, 4, 3)]

    def serve(graphed: bool):
        pool = MHATokenToKVPool(device)
        backend = TRTLLMMHAAttnBackend(variant)
        graph = PrefillGraph(layer, backend, pool, device) if graphed else None
        outs, next_page = [], 1                            # page 0 is the null page
        for embeds in prompts:
            n = embeds.shape[0]
            pages = list(range(next_page, next_page + math.ceil(n / PAGE_SIZE)))
            next_page += len(pages)
            backend.init_forward_metadata(n, pages, device)
            if graph is not None:
                outs.append(graph.replay(embeds))
            else:
                positions = torch.arange(n, device=device)
                inner = layer.forward_prepare(positions, embeds, backend, pool, None)
                attn = backend.forward_extend(*inner, layer, None, pool, save_kv_cache=inner[1] is not None)
                outs.append(layer.forward_core(embeds, attn).clone())
        return outs + [pool.k_buffer[PAGE_SIZE:].clone(), pool.v_buffer[PAGE_SIZE:].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
