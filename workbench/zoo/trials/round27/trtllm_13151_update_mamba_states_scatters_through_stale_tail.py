"""Under MTP + CUDA-graph padding, ``update_mamba_states`` scatters padded rows through the manager's stale ``state_indices`` tail.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13151 ("[None][fix] Fix Mamba cache correctness under MTP +
CUDA-graph padding").
Symptom: hybrid Mamba models (Nemotron-H style) with MTP speculative decoding and CUDA-graph padding lost accuracy:
requests parked outside the current batch (overlap scheduler) came back with corrupted SSM state.
Mechanism: the mixer reads and updates the SSM state through ``mamba_metadata.state_indices`` (under MTP), which the
padded batch fills per step: real requests' slots, then the CUDA-graph sentinel's slot for padding rows.
``MambaCacheManager.update_mamba_states`` (the scatter of the step's new states back into ``ssm_states``) instead read
``self._impl.state_indices``, the manager's own buffer, of which ``_prepare_mamba_cache_blocks`` writes only
``[:len(state_indices)]`` -- the real requests. When a batch of 3 replays the size-4 graph, row 3 of that buffer still
holds the slot of a request from an earlier, larger batch that is now parked; the captured scatter writes the padding
row's state into that live slot. When the parked request resumes, it decodes from a corrupted state.
Doctor: stale-padding, at ``update_mamba_states`` (the cache scatter goes through padded rows of
``state_indices`` that the step left as an earlier step wrote them).
Fix (upstream): ``update_mamba_states`` scatters into the caller-supplied ``state_indices``
(``mamba_metadata.state_indices`` under MTP), whose padded rows hold the sentinel's permanent slot; the PR also
reserves that permanent slot and extra slots for MTP dummies (not modelled).
(Only the PR description was available; the diff was not read. MTP drafting is reduced to one token per request per
step, the SSM to a diagonal recurrence; one CUDA graph of size 4; the bs-3 step runs the padded graph while eager
runs it at its real size.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13151"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "update_mamba_states"
SYMPTOM = "a parked request resumes from an SSM state overwritten by a CUDA-graph padding row"

VOCAB, DIM, MAX_BATCH_SIZE, GRAPH_BS = 16, 4, 4, 4
SENTINEL_SLOT = MAX_BATCH_SIZE            # the CUDA-graph dummy request's permanent slot
NUM_SLOTS = MAX_BATCH_SIZE + 1


class MambaCacheManager:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.ssm_states = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.state_indices = torch.zeros(MAX_BATCH_SIZE, dtype=torch.int32, device=device)
        self.mamba_cache_index = {}

    def slot(self, request_id):
        return self.mamba_cache_index.setdefault(request_id, len(self.mamba_cache_index))

    def _prepare_mamba_cache_blocks(self, request_ids):
        state_indices = [self.slot(r) for r in request_ids]
        self.state_indices[:len(state_indices)] = torch.as_tensor(state_indices, dtype=torch.int32).to(self.device)

    def update_mamba_states(self, new_states, state_indices):
        n = new_states.shape[0]
        idx = (self.state_indices if self.variant == "bug" else state_indices)[:n].long()
        self.ssm_states[idx] = new_states


class MambaMetadata:
    def __init__(self, device):
        self.state_indices = torch.full((MAX_BATCH_SIZE,), SENTINEL_SLOT, dtype=torch.int32, device=device)

    def prepare(self, slots, padded_bs):
        n = len(slots)
        self.state_indices[:n] = torch.as_tensor(slots, dtype=torch.int32).to(self.state_indices.device)
        self.state_indices[n:padded_bs] = SENTINEL_SLOT         # CUDA-graph padding: the dummy's slot


class NemotronHModel:
    def __init__(self, device):
        gen = generator(13151)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.decay = torch.sigmoid(randn(DIM, gen=gen, device=device))
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, mamba_metadata, cache, n):
        idx = mamba_metadata.state_indices[:n].long()
        x = self.embed[input_ids[:n]]
        new_states = cache.ssm_states[idx] * self.decay + torch.tanh(x @ self.w_in)   # mixer (reads metadata)
        cache.update_mamba_states(new_states, mamba_metadata.state_indices)
        return (new_states + x) @ self.lm_head


class PyTorchModelEngine:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.cache = MambaCacheManager(device, variant)
        self.mamba_metadata = MambaMetadata(device)
        self.input_ids = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: model.forward(self.input_ids, self.mamba_metadata, self.cache, GRAPH_BS),
                device=device, owner="CUDAGraphRunner (decode bs 4)",
                static={"input_ids": self.input_ids, "mamba_metadata.state_indices": self.mamba_metadata.state_indices,
                        "MambaCacheManager.state_indices": self.cache.state_indices},
                state={"ssm_states": self.cache.ssm_states})
            self.cache.ssm_states.zero_()                       # warmup / capture dummies leave no state

    def forward(self, batch):
        """``batch``: (request id, token id) for each scheduled generation request."""
        n = len(batch)
        ids = [r for r, _ in batch]
        self.cache._prepare_mamba_cache_blocks(ids)
        padded_bs = GRAPH_BS if self.graphed else n
        self.mamba_metadata.prepare([self.cache.slot(r) for r in ids], padded_bs)
        self.input_ids[:n].copy_(torch.tensor([t for _, t in batch]).to(self.device))
        self.input_ids[n:padded_bs].zero_()
        if not self.graphed:
            return self.model.forward(self.input_ids, self.mamba_metadata, self.cache, n).clone()
        padded = {"MambaCacheManager.state_indices": self.cache.state_indices} if self.variant == "bug" else None
        return replay(self.graph, self.out, real=n, size=GRAPH_BS, padded=padded)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = NemotronHModel(device)
    steps = [
        [(0, 3), (1, 5), (2, 7), (3, 9)],       # requests 0..3 decode
        [(0, 11), (1, 12), (2, 13)],            # request 3 parked (overlap scheduler): 3 padded to 4
        [(0, 2), (1, 4), (2, 6)],
        [(0, 8), (1, 10), (2, 14), (3, 15)],    # request 3 resumes
    ]

    def serve(graphed):
        engine = PyTorchModelEngine(model, device, variant, graphed)
        return [engine.forward(batch) for batch in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
