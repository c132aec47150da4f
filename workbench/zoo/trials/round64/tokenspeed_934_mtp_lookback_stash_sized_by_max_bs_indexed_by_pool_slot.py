"""MTP lookback stashes pre-allocated for capture with ``max_bs`` rows; the captured decode indexes them by pool slot.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/934 ("fix(cache): complete recipe migration across CI
models", squash commit 24af1646); the mtp.py hunk is commit ec960dea, "fix(spec): size MTP lookback stash by
request pool", with the test ``test_mtp_lookback_stash_uses_request_pool_capacity`` (max_bs=16, pool rows=18).
Symptom: not described upstream (empty PR body; the test pins the capacity). From the code: once a request holds a
request-pool slot >= max_bs, the gather/scatter of the stash in the captured MTP decode round reads and writes past
the buffer (device-side assert / illegal memory access on the GPU; IndexError in this emulation).
Mechanism: ``Mtp.__init__`` (drafter/mtp.py) pre-allocates the cross-round stashes ``_lookback_tokens_buf`` and
``_lookback_hidden_buf`` because "the decode rounds that fill them run inside CUDA graph capture, where allocation
is off-limits". They were sized ``page_table.shape[0]`` rows, but that ``page_table`` is the batch-ordered draft
table (``max_bs`` rows). The stashes are keyed by request-pool index: ``_decode_slices`` takes
``slot = input_buffers.req_pool_indices_buf[:bs].clamp_min(0)``, the captured ``_run_multi_step_lookback`` gathers
``_lookback_tokens_buf[slot]`` and ``hidden_stash[slot]``, and ``_update_lookback_stash_decode`` scatters
``tokens[slot] = _committed_tail_update(...)``. The request pool has ``req_pool_size + 1`` rows (slot 0 reserved
for padding), so slots reach ``max_bs`` and beyond; the capture (dummy slots 0) is fine, a replay whose batch holds
such a slot indexes past the static stash. The reference here is the same decode with stashes the eager code
allocates at first use, outside any capture, with one row per request-pool slot.
Doctor: undersized-buffer, at ``__init__`` (the static stash the graph reads and writes has fewer rows than the
slot indices a replay addresses it with).
Fix (upstream): both stashes get ``runtime_states.valid_cache_lengths.shape[0]`` rows (the request pool), and
``Mtp.__init__`` raises if ``runtime_states`` is None.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/934"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = "MTP lookback decode faults (out-of-bounds stash index) once a request's pool slot is >= max_bs"

VOCAB, HIDDEN = 16, 8
MAX_BS = 4                      # the captured decode size; the batch-ordered draft page table has MAX_BS rows
REQ_POOL_SIZE = 6               # request-pool slots 1..6 (slot 0: the padding slot); runtime states have 7 rows
SPEC_NUM_TOKENS, SPEC_NUM_STEPS = 3, 3
LOOKBACK = SPEC_NUM_STEPS - 1


def _committed_tail_update(stash, fresh, valid, lookback):
    """Roll a committed-tail stash: last ``lookback`` of [stash || fresh[:valid]] (upstream, verbatim in substance)."""
    bs = fresh.shape[0]
    rows = valid.view(bs, 1) - lookback + torch.arange(lookback, dtype=torch.int64, device=fresh.device).view(1, -1)
    idx_shape = (bs, lookback) + (1,) * (fresh.dim() - 2)
    expand = (bs, lookback) + fresh.shape[2:]
    new_rows = fresh.gather(1, rows.clamp_min(0).view(idx_shape).expand(expand))
    old_rows = stash.gather(1, (rows + lookback).clamp(0, lookback - 1).view(idx_shape).expand(expand))
    return torch.where((rows >= 0).view(idx_shape), new_rows, old_rows)


class RuntimeStates:
    def __init__(self, req_pool_size, device):
        self.valid_cache_lengths = torch.zeros(req_pool_size + 1, dtype=torch.int32, device=device)


class InputBuffers:
    def __init__(self, device):
        self.max_bs = MAX_BS
        self.req_pool_indices_buf = torch.zeros(MAX_BS, dtype=torch.int32, device=device)
        self.base_model_output_buf = torch.zeros(MAX_BS, SPEC_NUM_TOKENS, dtype=torch.long, device=device)
        self.accept_lengths_buf = torch.ones(MAX_BS, dtype=torch.int32, device=device)
        self.hidden_states_buf = torch.zeros(MAX_BS * SPEC_NUM_TOKENS, HIDDEN, device=device)


class Mtp:
    def __init__(self, device, variant, page_table, runtime_states, input_buffers, preallocate=True):
        gen = generator(934)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.device, self.runtime_states, self.input_buffers = device, runtime_states, input_buffers
        self.spec_num_tokens, self.draft_lookback = SPEC_NUM_TOKENS, LOOKBACK
        self._lookback_tokens_buf = self._lookback_hidden_buf = None
        if not preallocate:             # outside capture: allocated at first use (see _stash)
            return
        # Cross-round stashes keyed by req_pool_indices (PAD rows clamp to the reserved slot 0). Allocated eagerly:
        # the decode rounds that fill them run inside CUDA graph capture, where allocation is off-limits.
        if variant == "bug":
            rows = page_table.shape[0]
        else:
            if self.runtime_states is None:
                raise RuntimeError("MTP lookback requires request-pool runtime state")
            # page_table is batch-ordered and may have fewer rows than the request-pool indices used to address
            # these persistent stashes.
            rows = self.runtime_states.valid_cache_lengths.shape[0]
        self._lookback_tokens_buf = torch.zeros((rows, LOOKBACK), dtype=torch.int64, device=device)
        self._lookback_hidden_buf = torch.zeros((rows, LOOKBACK, HIDDEN), device=device)

    def _stash(self):
        if self._lookback_tokens_buf is None:
            rows = self.runtime_states.valid_cache_lengths.shape[0]
            self._lookback_tokens_buf = torch.zeros((rows, LOOKBACK), dtype=torch.int64, device=self.device)
            self._lookback_hidden_buf = torch.zeros((rows, LOOKBACK, HIDDEN), device=self.device)
        return self._lookback_tokens_buf, self._lookback_hidden_buf

    def _decode_slices(self, bs):
        k = self.spec_num_tokens
        slot = self.input_buffers.req_pool_indices_buf[:bs].to(torch.int64).clamp_min(0)
        v = self.input_buffers.base_model_output_buf[:bs].view(bs, k).to(torch.int64)
        accept = self.input_buffers.accept_lengths_buf[:bs].to(torch.int64).clamp(1, k).view(bs, 1)
        return slot, v, accept

    def _run_multi_step_lookback(self, bs, h0, slot, v, accept):
        k, lb = self.spec_num_tokens, self.draft_lookback
        total = lb + k
        gather_ids = torch.arange(bs, dtype=torch.int64, device=v.device) * total + (lb - 1) + accept.view(-1)
        tokens_buf, hidden_stash = self._stash()
        stash_tokens = tokens_buf[slot]
        prev_hidden = torch.cat([hidden_stash[slot], h0.view(bs, k, -1)], 1).reshape(bs * total, -1)
        input_ids = torch.cat([stash_tokens, v], 1).reshape(-1)      # the window: committed tail, then this round
        drafts = []
        for _d in range(1, SPEC_NUM_STEPS):
            prev_hidden = torch.tanh(self.embed[input_ids] + prev_hidden @ self.w)
            drafts.append(prev_hidden[gather_ids])
            input_ids = input_ids.view(bs, total).roll(-1, 1).reshape(-1)   # each row's window shifts by one
        return torch.stack(drafts, 1)

    def _update_lookback_stash_decode(self, slot, accept, v, h0):
        lb = self.draft_lookback
        tokens, hidden = self._stash()
        tokens[slot] = _committed_tail_update(tokens[slot], v, accept.view(-1), lb)
        hidden[slot] = _committed_tail_update(hidden[slot], h0, accept.view(-1), lb)

    def draft(self, bs):
        slot, v, accept = self._decode_slices(bs)
        h0 = self.input_buffers.hidden_states_buf[: bs * self.spec_num_tokens]
        out = self._run_multi_step_lookback(bs, h0, slot, v, accept)
        self._update_lookback_stash_decode(slot, accept, v, h0.view(bs, self.spec_num_tokens, -1))
        return out


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(934)
    # Decode rounds: the request-pool slots in the batch. Slots are handed out as requests arrive; once the pool
    # has given out slot 4 (= MAX_BS), that request's stash row lies past a MAX_BS-row buffer.
    schedule = [[1, 2, 3], [1, 2, 3], [1, 3, 4], [3, 4, 5, 6], [4, 6]]
    steps = []
    for slots in schedule:
        n = len(slots)
        steps.append((torch.tensor(slots, dtype=torch.int32),
                      torch.randint(0, VOCAB, (n, SPEC_NUM_TOKENS), generator=gen),
                      torch.randint(1, SPEC_NUM_TOKENS + 1, (n,), generator=gen).to(torch.int32),
                      torch.randn(n * SPEC_NUM_TOKENS, HIDDEN, generator=gen)))

    def serve(graphed: bool):
        bufs = InputBuffers(device)
        draft_page_table = torch.zeros((MAX_BS, 4), dtype=torch.int32, device=device)   # batch-ordered
        mtp = Mtp(device, variant, draft_page_table, RuntimeStates(REQ_POOL_SIZE, device), bufs, preallocate=graphed)
        if graphed:
            g, out = capture(lambda: mtp.draft(MAX_BS), device=device, owner="Mtp (decode graph)",
                             name=f"mtp decode bs={MAX_BS}",
                             static={"req_pool_indices_buf": bufs.req_pool_indices_buf,
                                     "base_model_output_buf": bufs.base_model_output_buf,
                                     "accept_lengths_buf": bufs.accept_lengths_buf,
                                     "hidden_states_buf": bufs.hidden_states_buf},
                             state={"_lookback_tokens_buf": mtp._lookback_tokens_buf,
                                    "_lookback_hidden_buf": mtp._lookback_hidden_buf})
        outs = []
        for slots, v, accept, h0 in steps:
            bs = slots.shape[0]
            bufs.req_pool_indices_buf[:bs].copy_(slots.to(device))
            bufs.base_model_output_buf[:bs].copy_(v.to(device))
            bufs.accept_lengths_buf[:bs].copy_(accept.to(device))
            bufs.hidden_states_buf[: bs * SPEC_NUM_TOKENS].copy_(h0.to(device))
            if not graphed:
                outs.append(mtp.draft(bs))
                continue
            bufs.req_pool_indices_buf[bs:].zero_()           # padding rows: the reserved slot 0
            padded = {"base_model_output_buf": bufs.base_model_output_buf,
                      "accept_lengths_buf": bufs.accept_lengths_buf, "hidden_states_buf": bufs.hidden_states_buf}
            outs.append(replay(g, out, real=bs, size=MAX_BS, padded=padded)[:bs].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
