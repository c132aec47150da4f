"""A one-token prompt tail is built as a Mamba prefill but served by the FULL decode graph: stale state indices.

Upstream: https://github.com/vllm-project/vllm/pull/42430 ("[Bugfix] mamba: run single-token extends as decodes").
Symptom: NIXL prefill/decode disaggregation of a hybrid Mamba model: GSM8K accuracy dropped on the decode
instance with CUDA graphs enabled, and recovered with the fix (vLLM main, May 2026).
Mechanism: the P side computes prompt tokens ``0..N-1`` and ships the Mamba state; the D side computes the last
prompt token ``N`` from it. That row is a one-token step, so a batch of such rows is a *uniform* one-token
batch and the runner dispatches it to the FULL decode graph. The row is still ``is_prefilling``
(``num_computed_tokens < num_prompt_tokens``), and ``split_decodes_and_prefills`` keeps it a prefill for Mamba,
so ``Mamba2AttentionMetadataBuilder.build`` returns prefill metadata (``state_indices_tensor_p``,
``has_initial_states_p``) and does not touch the persistent decode buffer ``state_indices_tensor_d`` that the
graph's ``selective_state_update`` was captured reading (refreshed only on the decode branch of ``build``).
The replay therefore advances the SSM states of the slots an earlier decode step left in that buffer, with this
step's inputs, and returns outputs computed from those requests' states; the new requests' states are never
advanced. Eager execution runs the chunked-scan prefill path for the same rows, which gives the right answer.
Doctor: stale-input, at ``build`` (it leaves ``state_indices_tensor_d``, which the replayed decode graph reads,
as an earlier step wrote it).
Fix (upstream): Mamba classifies one-token prefill rows that already have state (``num_computed_tokens > 0``)
as decodes; first-token prompts remain prefills. The step then takes the decode branch of ``build``, which
copies its state indices into ``state_indices_tensor_d`` before the replay.
Read: the PR description only (the classification change in the Mamba metadata builder); ``build``'s branches and
the persistent ``state_indices_tensor_d`` are reconstructed from the Mamba2 builder of earlier vLLM releases.
The SSM is reduced to a diagonal recurrence without the conv state; the KV-connector load is a direct write of
the P side's final state into the request's slot.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/42430"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "build"
SYMPTOM = "NIXL P/D with a hybrid Mamba model: accuracy drop on the decode instance with CUDA graphs on"

VOCAB, DIM, NUM_SLOTS, MAX_TOKENS = 16, 4, 5, 8
SIZE = 2                      # FULL decode graph: two one-token requests
PAD_SLOT_ID = -1


class Model:
    def __init__(self, device):
        gen = generator(42430)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.decay = torch.linspace(0.3, 0.8, DIM).to(device)


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: np.ndarray
    num_computed_tokens_cpu: np.ndarray
    is_prefilling: np.ndarray            # num_computed_tokens < num_prompt_tokens
    state_slots: torch.Tensor            # block_table_tensor[:, 0]: each request's state slot
    num_reqs: int
    num_actual_tokens: int


@dataclasses.dataclass
class Mamba2AttentionMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    query_start_loc_p: np.ndarray | None = None
    has_initial_states_p: np.ndarray | None = None
    state_indices_tensor_p: torch.Tensor | None = None
    state_indices_tensor_d: torch.Tensor | None = None


def split_decodes_and_prefills(common, variant, decode_threshold=1):
    """Decodes first (the batch is reordered so); returns the number of leading decode requests."""
    query_lens = np.diff(common.query_start_loc_cpu)
    is_prefill = (query_lens > decode_threshold) | common.is_prefilling
    if variant == "fix":
        # a one-token row that already has state (a prompt tail) runs as a decode
        is_prefill &= ~((query_lens == 1) & (common.num_computed_tokens_cpu > 0))
    num_decodes = int(np.argmax(is_prefill)) if is_prefill.any() else common.num_reqs
    return num_decodes, int(query_lens[:num_decodes].sum())


class Mamba2AttentionMetadataBuilder:
    def __init__(self, device, variant, full_cudagraph):
        self.variant, self.full_cudagraph = variant, full_cudagraph
        self.decode_cudagraph_max_bs = SIZE
        self.state_indices_tensor_d = torch.full((SIZE,), PAD_SLOT_ID, dtype=torch.long, device=device)

    def build(self, common):
        num_decodes, num_decode_tokens = split_decodes_and_prefills(common, self.variant)
        meta = Mamba2AttentionMetadata(num_decodes, num_decode_tokens, common.num_reqs - num_decodes)
        if meta.num_prefills > 0:
            qsl = common.query_start_loc_cpu[num_decodes:]
            meta.query_start_loc_p = qsl - qsl[0]
            meta.has_initial_states_p = common.num_computed_tokens_cpu[num_decodes:] > 0
            meta.state_indices_tensor_p = common.state_slots[num_decodes:]
        if num_decodes > 0:
            if self.full_cudagraph and num_decodes <= self.decode_cudagraph_max_bs:
                self.state_indices_tensor_d[:num_decodes].copy_(common.state_slots[:num_decodes])
                self.state_indices_tensor_d[num_decodes:].fill_(PAD_SLOT_ID)
                meta.state_indices_tensor_d = self.state_indices_tensor_d[:SIZE]
            else:
                meta.state_indices_tensor_d = common.state_slots[:num_decodes]
        return meta

    def build_for_cudagraph_capture(self, common):
        meta = Mamba2AttentionMetadata(SIZE, SIZE, 0)
        meta.state_indices_tensor_d = self.state_indices_tensor_d[:SIZE]
        return meta


def selective_state_update(model, ssm_state, u, state_batch_indices):
    valid = (state_batch_indices >= 0)[:, None]
    slots = state_batch_indices.clamp(min=0)
    h = model.decay * ssm_state[slots] + u
    ssm_state[slots] = torch.where(valid, h, ssm_state[slots])
    return h @ model.w_out


def mamba_chunk_scan_combined(model, ssm_state, u, meta):
    """Prefill path (eager only): scan each request from its initial state, write the final state back."""
    outs = []
    for i, slot in enumerate(meta.state_indices_tensor_p):
        h = ssm_state[slot] if meta.has_initial_states_p[i] else torch.zeros_like(ssm_state[slot])
        for t in range(meta.query_start_loc_p[i], meta.query_start_loc_p[i + 1]):
            h = model.decay * h + u[t]
            outs.append(h @ model.w_out)
        ssm_state[slot] = h
    return torch.stack(outs)


def mamba_mixer2(model, input_ids, ssm_state, meta):
    u = torch.tanh(model.emb[input_ids] @ model.w_in)
    outs = []
    if meta.num_decodes > 0:
        outs.append(selective_state_update(model, ssm_state, u[:meta.state_indices_tensor_d.shape[0]],
                                           meta.state_indices_tensor_d)[:meta.num_decode_tokens])
    if meta.num_prefills > 0:
        outs.append(mamba_chunk_scan_combined(model, ssm_state, u[meta.num_decode_tokens:], meta))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.ssm_state = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.builder = Mamba2AttentionMetadataBuilder(device, variant, full_cudagraph=graphed)
        if graphed:
            meta = self.builder.build_for_cudagraph_capture(None)
            self.graph, self.out = capture(
                lambda: mamba_mixer2(model, self.input_ids[:SIZE], self.ssm_state, meta),
                device=device, name=f"FULL decode size {SIZE}", owner="GPUModelRunner (FULL decode graph)",
                static={"input_ids": self.input_ids, "state_indices_tensor_d": self.builder.state_indices_tensor_d},
                state={"ssm_state": self.ssm_state})

    def execute_model(self, reqs):
        """``reqs``: (scheduled token ids, state slot, num_computed_tokens, num_prompt_tokens), decodes first."""
        ids = [t for tokens, _, _, _ in reqs for t in tokens]
        n = len(ids)
        self.input_ids[:n].copy_(torch.tensor(ids, dtype=torch.long).to(self.device))
        query_lens = [len(tokens) for tokens, _, _, _ in reqs]
        common = CommonAttentionMetadata(
            query_start_loc_cpu=np.concatenate([[0], np.cumsum(query_lens)]),
            num_computed_tokens_cpu=np.array([c for _, _, c, _ in reqs]),
            is_prefilling=np.array([c < p for _, _, c, p in reqs]),
            state_slots=torch.tensor([s for _, s, _, _ in reqs], dtype=torch.long).to(self.device),
            num_reqs=len(reqs), num_actual_tokens=n)
        meta = self.builder.build(common)
        uniform_decode = max(query_lens) == 1 and n == SIZE
        if self.graphed and uniform_decode:            # the dispatcher: FULL decode graph
            return replay(self.graph, self.out).clone()
        return mamba_mixer2(self.model, self.input_ids[:n], self.ssm_state, meta).clone()


def p_side_state(model, prompt):
    """What the P side computed for ``prompt`` (and the KV connector ships): the final SSM state."""
    h = torch.zeros(DIM, device=model.emb.device)
    for t in prompt:
        h = model.decay * h + torch.tanh(model.emb[t] @ model.w_in)
    return h


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(4243)
    tok = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    pa, pb, pc, pd = tok(3), tok(2), tok(4), tok(3)
    decodes = [tok(2) for _ in range(4)]
    A, B, C, D = 1, 2, 3, 4                                   # state slots

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = [runner.execute_model([(pa, A, 0, 3), (pb, B, 0, 2)])]              # local prefills
        outs.append(runner.execute_model([([decodes[0][0]], A, 3, 3), ([decodes[0][1]], B, 2, 2)]))
        # C and D arrive from the P side: state of all prompt tokens but the last is loaded into their slots
        runner.ssm_state[C].copy_(p_side_state(model, pc[:-1]))
        runner.ssm_state[D].copy_(p_side_state(model, pd[:-1]))
        outs.append(runner.execute_model([([pc[-1]], C, 3, 4), ([pd[-1]], D, 2, 3)]))  # one-token prompt tails
        outs.append(runner.execute_model([([decodes[1][0]], C, 4, 4), ([decodes[1][1]], D, 3, 3)]))
        outs.append(runner.execute_model([([decodes[2][0]], A, 4, 3), ([decodes[2][1]], B, 3, 2)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
