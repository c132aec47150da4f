"""Graphed decode checkpoints each tracked Mamba state into the slot named in the buffer's tail.

Upstream: https://github.com/sgl-project/sglang/pull/32555 ("[Nemotron] Fix decode track-save reading
the stale tail of the CUDA-graph track buffer").
Symptom: a Mamba2 hybrid model (NemotronH) with the ``extra_buffer`` mamba radix cache and decode CUDA
graphs: a request whose prefix hits a decode-seeded mamba checkpoint gets corrupted logits (KL ~1.55
against a cold prefill; ~0.002 with ``--disable-cuda-graph``), silently (sglang main, July 2026).
Mechanism: ``MambaAttnBackendBase._replay_metadata`` refreshes its static ``(max_bs,)`` track-destination
buffer from the runner's slot, of which only rows ``[:raw_bs]`` hold this batch's destinations, and hands
the whole buffer to ``ForwardMetadata``. ``Mamba2AttnBackend.forward`` pairs it with the batch's rows from
its end (``[-num_decodes:]``), so every graph smaller than ``max_bs`` captured a track-save that reads the
buffer's tail: zeros, or the destinations an earlier, larger batch left there. Each tracked row
checkpoints its state into that stale slot, clobbering another request's checkpoint, while its own
checkpoint slot is never written, so a later prefix hit restores the wrong state.
Doctor: stale-input, at ``track_mamba_states_if_needed`` (the track-save reading the destinations that
this step did not write).
Fix (upstream): ``_replay_metadata`` hands out the batch-length view ``mamba_track_indices_buf[:bs]``,
honouring the ``ForwardMetadata`` contract (length == batch), so row ``i`` keeps its own destination.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/32555"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "track_mamba_states_if_needed"
SYMPTOM = "a prefix hit on a decode-seeded mamba checkpoint restores another request's (or no) state"
DIM, MAX_BS, CAPTURE_BS, SLOTS = 4, 4, (2, 4), 11
# mamba slots: 0 dummy (capture), 1-4 working slots of requests A-D, 5-8 their track (checkpoint)
# slots, 9-10 working slots of E and F, which arrive later with prefixes cached from A and C.
REQ_TO_MAMBA = [0, 1, 2, 3, 4, 9, 10]          # req_pool_index -> mamba slot (req 0: the dummy)


class ForwardMetadata:
    def __init__(self, mamba_cache_indices, mamba_track_indices, num_decodes):
        self.mamba_cache_indices = mamba_cache_indices
        self.mamba_track_indices = mamba_track_indices
        self.num_decodes = num_decodes


class ForwardBatch:
    def __init__(self, batch_size, hidden, req_pool_indices, mamba_track_mask, mamba_track_indices):
        self.batch_size = batch_size
        self.hidden = hidden
        self.req_pool_indices = req_pool_indices
        self.mamba_track_mask = mamba_track_mask
        self.mamba_track_indices = mamba_track_indices


class MambaPool:
    def __init__(self, device):
        self.ssm = torch.zeros(SLOTS, DIM, device=device)
        self.req_index_to_mamba_index = torch.tensor(REQ_TO_MAMBA, device=device)

    def copy_from(self, src, dst):                  # radix-cache COW: a prefix hit restores a checkpoint
        self.ssm[dst] = self.ssm[src]


def track_mamba_states_if_needed(ssm, cache_indices, track_mask, track_indices, bs):
    """``ssm[track_indices[i]] = ssm[cache_indices[i]]`` for the rows ``track_mask`` selects (the
    Triton kernel masks rows; untracked rows here copy their slot onto itself)."""
    dst = torch.where(track_mask[:bs], track_indices[:bs], cache_indices[:bs])
    ssm.index_copy_(0, dst, ssm.index_select(0, cache_indices[:bs]))


class Mamba2AttnBackend:
    def __init__(self, pool: MambaPool, variant: str, device):
        self.pool, self.variant, self.device = pool, variant, device
        self.forward_metadata: ForwardMetadata | None = None

    # ---- eager
    def init_forward_metadata(self, fb: ForwardBatch):
        idx = self.pool.req_index_to_mamba_index[fb.req_pool_indices]
        self.forward_metadata = ForwardMetadata(idx, fb.mamba_track_indices, fb.batch_size)

    # ---- cuda graph
    def init_cuda_graph_state(self, max_bs: int):
        # Single (max_bs,) track-destination buffer mirroring the runner's slot; refreshed in place.
        self.mamba_track_indices_buf = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.state_indices_list = [torch.full((i + 1,), -1, dtype=torch.int64, device=self.device)
                                   for i in range(max_bs)]

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False):
        self.forward_metadata = self._replay_metadata(fb.batch_size, fb.req_pool_indices,
                                                      mamba_track_indices=fb.mamba_track_indices)

    def _replay_metadata(self, bs, req_pool_indices, mamba_track_indices=None):
        mamba_indices = self.pool.req_index_to_mamba_index[req_pool_indices]
        self.state_indices_list[bs - 1][: len(mamba_indices)].copy_(mamba_indices)
        track_buf = None
        if mamba_track_indices is not None:
            track_buf = self.mamba_track_indices_buf
            track_buf[: len(mamba_track_indices)].copy_(mamba_track_indices)   # the fb hands the full slot
            if self.variant == "fix":
                track_buf = track_buf[:bs]                                     # length == batch
        return ForwardMetadata(self.state_indices_list[bs - 1], track_buf, bs)

    def forward(self, fb: ForwardBatch, layer):
        """Mamba2 mixer decode on every row, then the radix-cache track-save of the tracked rows."""
        md = self.forward_metadata
        ssm = self.pool.ssm
        h = ssm.index_select(0, md.mamba_cache_indices) * layer.decay + fb.hidden @ layer.w_in
        ssm.index_copy_(0, md.mamba_cache_indices, h)
        out = torch.tanh(h @ layer.w_out)
        num_decodes = md.num_decodes
        track_mamba_states_if_needed(ssm, md.mamba_cache_indices[-num_decodes:],
                                     fb.mamba_track_mask[-num_decodes:],
                                     md.mamba_track_indices[-num_decodes:], num_decodes)
        return out


class Layer:
    def __init__(self, device):
        gen = generator(32555)
        self.decay = torch.linspace(0.5, 0.9, DIM).to(device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.6)


def schedule(device):
    """Per decode step: (req_pool_indices, track mask, track destinations, COW before the step).
    Step 1: A-D (bs 4); C and D reach a track boundary and checkpoint into 7 and 8. Step 2: A and B
    (graph of 2); A checkpoints into 5. Then E hits A's cached prefix (slot 5), F hits C's (slot 7),
    and step 3 decodes E and F."""
    gen = generator(1)
    steps = [([1, 2, 3, 4], [0, 0, 1, 1], [5, 6, 7, 8], []),
             ([1, 2], [1, 0], [5, 6], []),
             ([5, 6], [0, 0], [0, 0], [(5, 9), (7, 10)])]
    return [(torch.tensor(r, device=device), torch.tensor(m, dtype=torch.bool, device=device),
             torch.tensor(t, device=device), cow, randn(len(r), DIM, gen=gen, device=device))
            for r, m, t, cow in steps]


def prefill(pool, device):
    gen = generator(7)
    pool.ssm[1:5] = randn(4, DIM, gen=gen, device=device)      # A-D after their prefills


def run(variant: str, device: str = "cpu"):
    layer = Layer(device)
    steps = schedule(device)

    def eager():
        pool = MambaPool(device)
        prefill(pool, device)
        backend = Mamba2AttnBackend(pool, variant, device)
        outs = []
        for reqs, mask, track, cow, hidden in steps:
            for src, dst in cow:
                pool.copy_from(src, dst)
            fb = ForwardBatch(len(reqs), hidden, reqs, mask, track)
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(fb, layer))
        return outs

    def served():
        pool = MambaPool(device)
        prefill(pool, device)
        backend = Mamba2AttnBackend(pool, variant, device)
        backend.init_cuda_graph_state(MAX_BS)
        # DecodeInputBuffers: the runner's static (max_bs,) slots
        bufs = {"hidden": torch.zeros(MAX_BS, DIM, device=device),
                "req_pool_indices": torch.zeros(MAX_BS, dtype=torch.int64, device=device),
                "mamba_track_mask": torch.zeros(MAX_BS, dtype=torch.bool, device=device),
                "mamba_track_indices": torch.zeros(MAX_BS, dtype=torch.int64, device=device)}

        def fb_view(bs):
            # the track-destination slot is handed over un-sliced, as the runner's fb view does
            return ForwardBatch(bs, bufs["hidden"][:bs], bufs["req_pool_indices"][:bs],
                                bufs["mamba_track_mask"][:bs], bufs["mamba_track_indices"])

        captured_for = {"bs": None}

        def forward(bs):
            if captured_for["bs"] != bs:
                # capture_one_batch_size: out-of-graph metadata init, once, before the warmups
                backend.init_forward_metadata_out_graph(fb_view(bs), in_capture=True)
                captured_for["bs"] = bs
            return backend.forward(fb_view(bs), layer)

        events.persistent_state("MambaPool", {"ssm": pool.ssm})
        events.static_buffers("Mamba2AttnBackend", {"mamba_track_indices_buf": backend.mamba_track_indices_buf,
                                                    **{f"state_indices_bs{bs}": backend.state_indices_list[bs - 1]
                                                       for bs in CAPTURE_BS}})
        manager = GraphManager(forward, CAPTURE_BS, device=device, mode=CUDAGraphMode.FULL, num_warmups=2,
                               static_buffers=bufs, name="CudaGraphRunner")
        manager.capture()
        outs = []
        for reqs, mask, track, cow, hidden in steps:
            for src, dst in cow:
                pool.copy_from(src, dst)
            n = len(reqs)
            bs = manager.dispatch(n)
            bufs["hidden"][:n].copy_(hidden)                       # replay_prepare: rows [:raw_bs]
            bufs["req_pool_indices"][:n].copy_(reqs)
            bufs["mamba_track_mask"][:n].copy_(mask)
            bufs["mamba_track_indices"][:n].copy_(track)
            backend.init_forward_metadata_out_graph(fb_view(bs))
            captured_for["bs"] = bs
            outs.append(manager.replay(bs, n).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
