"""A padded decode graph's CUDA-graph padding sentinel gets no recurrent-state slot of its own and evicts a live request's.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/14003 ("[None][fix] Fix CppMambaHybridCacheManager
functional and perf issues"), functional fix 2, commit 992ec1bd08 ("Reserve recurrent-state slots for CUDA
graph padding and draft-len sentinels").
Symptom: hybrid Mamba models served with CUDA graphs and batch padding produced corrupted output under
load (the padding sentinels "evict live recurrent state"); eager runs and unpadded batches were fine.
Mechanism: ``CppMambaHybridCacheManager`` sizes its recurrent-state (SSM) snapshot pool with
``_calculate_max_num_blocks_for_linear_attention`` at exactly ``max_batch_size`` blocks. When
``CUDAGraphRunner._get_padded_batch`` pads a decode batch up to a captured size it adds the padding
sentinel ``CUDA_GRAPH_DUMMY_REQUEST_ID`` through ``add_dummy_requests``, which needs one more recurrent
state block. With ``max_batch_size`` requests resident (some of them parked outside this step's batch,
as a scheduler or the overlap scheduler leaves them), the pool has no free block, so the sentinel's block
is taken from a live request (the least recently scheduled one). The padded row's state index then
points at that request's SSM state, and the captured ``selective_state_update`` advances it with the
padded row's token: when the parked request is scheduled again it continues from a corrupted state.
Eager execution never pads, never adds the sentinel, and never needs the extra block.
Only the PR description (and commit title) was readable, not the diff: the eviction policy of the C++
block pool is modelled as "take the least recently scheduled live request's block".
Doctor: undersized-buffer, at ``add_dummy_requests`` (the padded batch's recurrent states, ``max_batch_size``
live requests plus the sentinel, do not fit the pool sized by ``_calculate_max_num_blocks_for_linear_attention``).
Fix (upstream): size the snapshot pool at ``max_batch_size + 1`` (plus one per draft length for the
speculative-decoding sentinels), so the padding sentinel always has a block of its own.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/14003"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "add_dummy_requests"
SYMPTOM = "a parked request's Mamba state is advanced by the padding row; its later tokens are wrong"

HIDDEN, STATE = 4, 4
MAX_BATCH_SIZE = 4
CUDA_GRAPH_BATCH_SIZE = 4                 # the one captured decode size
CUDA_GRAPH_DUMMY_REQUEST_ID = 2**32 - 1


class MambaMixer:
    def __init__(self, device):
        gen = generator(14003)
        self.w_in = randn(HIDDEN, STATE, gen=gen, device=device, scale=0.6)
        self.w_out = randn(STATE, HIDDEN, gen=gen, device=device, scale=0.6)
        self.decay = (torch.rand(STATE, generator=gen) * 0.5 + 0.4).to(device)


def selective_state_update(mixer, ssm_states, hidden_states, state_indices):
    """One recurrent step per row: read the row's state slot, advance it, write it back."""
    state = ssm_states[state_indices] * mixer.decay + torch.tanh(hidden_states @ mixer.w_in)
    ssm_states[state_indices] = state
    return state @ mixer.w_out


class CppMambaHybridCacheManager:
    def __init__(self, device, variant):
        self.variant = variant
        self.max_snapshots = self._calculate_max_num_blocks_for_linear_attention()
        self.ssm_states = torch.zeros(self.max_snapshots, STATE, device=device)
        self.free_blocks = list(range(self.max_snapshots))
        self.mamba_cache_index: dict[int, int] = {}
        self.last_scheduled: dict[int, int] = {}
        self.step = 0

    def _calculate_max_num_blocks_for_linear_attention(self):
        if self.variant == "fix":
            return MAX_BATCH_SIZE + 1             # + the CUDA graph padding sentinel's block
        return MAX_BATCH_SIZE

    def _allocate_block(self, exclude):
        if self.free_blocks:
            return self.free_blocks.pop(0)
        # Pool exhausted: reclaim the block of the least recently scheduled live request.
        victims = [r for r in self.mamba_cache_index if r not in exclude and r != CUDA_GRAPH_DUMMY_REQUEST_ID]
        victim = min(victims, key=lambda r: self.last_scheduled[r])
        return self.mamba_cache_index[victim]

    def prepare_resources(self, request_ids):
        self.step += 1
        for r in request_ids:
            if r not in self.mamba_cache_index:
                block = self._allocate_block(exclude=request_ids)
                self.mamba_cache_index[r] = block
                self.ssm_states[block].zero_()    # a new request starts from a zero state
            self.last_scheduled[r] = self.step

    def add_dummy_requests(self, request_ids, batch_request_ids):
        for r in request_ids:
            if r not in self.mamba_cache_index:
                self.mamba_cache_index[r] = self._allocate_block(exclude=batch_request_ids)

    def get_state_indices(self, request_ids):
        return [self.mamba_cache_index[r] for r in request_ids]


class PyTorchModelEngine:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.mixer = MambaMixer(device)
        self.kv_cache_manager = CppMambaHybridCacheManager(device, variant)
        self.hidden_states = torch.zeros(CUDA_GRAPH_BATCH_SIZE, HIDDEN, device=device)
        self.state_indices = torch.zeros(CUDA_GRAPH_BATCH_SIZE, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: selective_state_update(self.mixer, self.kv_cache_manager.ssm_states,
                                               self.hidden_states, self.state_indices),
                device=device, owner="CUDAGraphRunner (decode)",
                static={"hidden_states": self.hidden_states, "state_indices": self.state_indices},
                state={"ssm_states": self.kv_cache_manager.ssm_states})

    def _get_padded_batch(self, request_ids):
        """CUDAGraphRunner._get_padded_batch: pad with the sentinel up to the captured size."""
        pad = CUDA_GRAPH_BATCH_SIZE - len(request_ids)
        if pad == 0:
            return list(request_ids)
        self.kv_cache_manager.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID], request_ids)
        return list(request_ids) + [CUDA_GRAPH_DUMMY_REQUEST_ID] * pad

    def forward(self, request_ids, tokens):
        mgr = self.kv_cache_manager
        mgr.prepare_resources(request_ids)
        n = len(request_ids)
        x = tokens.to(self.device)
        if not self.graphed:
            idx = torch.tensor(mgr.get_state_indices(request_ids), dtype=torch.long, device=self.device)
            return selective_state_update(self.mixer, mgr.ssm_states, x, idx).clone()
        batch = self._get_padded_batch(request_ids)
        self.hidden_states[:n].copy_(x)
        self.hidden_states[n:].zero_()
        self.state_indices.copy_(torch.tensor(mgr.get_state_indices(batch), dtype=torch.long, device=self.device))
        return replay(self.graph, self.out, real=n, size=CUDA_GRAPH_BATCH_SIZE)[:n].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(1403)
    steps = [([0, 1, 2, 3], torch.randn(4, HIDDEN, generator=gen)),
             ([0, 1, 2], torch.randn(3, HIDDEN, generator=gen)),       # request 3 parked: padded batch
             ([0, 1, 2, 3], torch.randn(4, HIDDEN, generator=gen)),
             ([0, 1, 2, 3], torch.randn(4, HIDDEN, generator=gen))]

    def serve(graphed: bool):
        engine = PyTorchModelEngine(device, variant, graphed)
        return [engine.forward(ids, tokens) for ids, tokens in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
