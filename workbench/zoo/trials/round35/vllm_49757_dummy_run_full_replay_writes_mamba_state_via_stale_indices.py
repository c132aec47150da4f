"""A DP dummy step replays the FULL graph with the previous batch's Mamba state indices and overwrites live states.

Upstream: https://github.com/vllm-project/vllm/pull/49757 ("[BugFix] Stop dummy runs from writing mamba state
through stale block-table rows"), Model Runner V2.
Symptom: hybrid Mamba models under data parallelism with FULL CUDA graphs silently corrupted outputs: a rank
with no requests runs dummy steps, and the live requests of that rank produced wrong tokens afterwards;
eager (and PIECEWISE) dummy steps were harmless (vLLM, July 2026).
Mechanism: a dummy step (``execute_model(dummy_run=True)``, the idle DP rank keeping collectives in step)
dispatches to the FULL decode graph of its padded size. In eager or PIECEWISE mode a dummy step skips the
attention/Mamba layers (no metadata), but the FULL graph always runs the captured Mamba decode kernel, which
updates ``ssm_state`` in place at the slots named by the builder's persistent ``state_indices_tensor``. The
dummy step built its metadata through the normal path: ``Mamba2AttentionMetadataBuilder.build`` only
restages the persistent buffer when the batch has decodes (``num_decodes > 0``), so the buffer keeps the
state indices of the previous real batch. The replayed ``selective_state_update`` then folds the dummy
tokens into the recurrent states of those live requests; their next real step reads corrupted states.
Doctor: stale-padding, at ``selective_state_update`` (the in-place state update through the dummy step's
padded rows, whose state indices are the previous batch's).
Fix (upstream): ``execute_model`` builds the attention metadata with
``for_capture=dummy_run and batch_desc.cg_mode == CUDAGraphMode.FULL``: a FULL dummy replay restages the
capture-time buffers from the zeroed dummy block tables (state index 0, the reserved null slot) instead of
retaining the previous real batch's indices.
Read: the merged diff hunk in ``vllm/v1/worker/gpu/model_runner.py`` with its comment ("FULL replay reads
capture-time metadata buffers. Re-stage them from the zeroed dummy block tables instead of retaining state
indices from the previous real batch.") and the review thread; the builder's ``num_decodes > 0`` guard is
modelled on the Mamba builders' FULL-cudagraph branch, not read in this PR's diff.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/49757"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "selective_state_update"
SYMPTOM = "an idle DP rank's dummy FULL replay overwrites live Mamba states: wrong tokens afterwards"

VOCAB, DIM = 12, 4
SIZE = MAX_NUM_REQS = 4          # the one FULL decode graph: 4 requests, one token each
NUM_STATE_SLOTS = 8              # slot 0 is the null slot the dummy block tables point to
NULL_BLOCK, PAD_SLOT_ID = 0, -1


class Model:
    def __init__(self, device):
        gen = generator(49757)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.c_proj = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.decay = (torch.rand(DIM, generator=gen) * 0.5 + 0.4).to(device)


def selective_state_update(model, ssm_state, u, state_batch_indices):
    """Mamba decode step, in place: ``state = decay * state + u`` at each row's state slot; rows whose
    index is ``PAD_SLOT_ID`` are skipped. Returns ``C @ state`` per row."""
    valid = (state_batch_indices != PAD_SLOT_ID)[:, None]
    slots = state_batch_indices.clamp(min=0)
    old = ssm_state[slots]
    new = model.decay * old + u
    ssm_state[slots] = torch.where(valid, new, old)
    return torch.where(valid, new @ model.c_proj, torch.zeros_like(new))


def mamba_mixer2(model, input_ids, ssm_state, state_indices):
    u = model.emb[input_ids] @ model.w_in
    return selective_state_update(model, ssm_state, u, state_indices)


class Mamba2AttentionMetadataBuilder:
    """Keeps the persistent ``state_indices_tensor`` a FULL graph reads."""

    def __init__(self, device):
        self.state_indices_tensor = torch.full((MAX_NUM_REQS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.decode_cudagraph_max_bs = MAX_NUM_REQS

    def build(self, block_table_tensor, num_decodes, num_padded):
        if 0 < num_decodes <= self.decode_cudagraph_max_bs:
            self.state_indices_tensor[:num_decodes].copy_(block_table_tensor[:num_decodes, 0])
            self.state_indices_tensor[num_decodes:num_padded].fill_(PAD_SLOT_ID)
        return self.state_indices_tensor[:num_padded]

    def build_for_cudagraph_capture(self, dummy_block_table, num_padded):
        """Capture-time metadata: every dummy request decodes, on the zeroed dummy block table."""
        return self.build(dummy_block_table, num_padded, num_padded)


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.ssm_state = randn(NUM_STATE_SLOTS, DIM, gen=generator(4975), device=device, scale=0.5)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.input_block_tables = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.long, device=device)
        self.dummy_block_tables = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.long, device=device)
        self.builder = Mamba2AttentionMetadataBuilder(device)
        if graphed:
            state_indices = self.builder.build_for_cudagraph_capture(self.dummy_block_tables, SIZE)
            self.graph, self.out = capture(
                lambda: mamba_mixer2(model, self.input_ids[:SIZE], self.ssm_state, state_indices),
                device=device, owner="GPUModelRunner (FULL decode graph)",
                static={"input_ids": self.input_ids, "state_indices_tensor": self.builder.state_indices_tensor},
                state={"ssm_state": self.ssm_state})

    def execute_model(self, reqs, dummy_run=False):
        """``reqs``: (token id, state slot) per decoding request; a dummy run has none."""
        n = len(reqs)
        if n:
            t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
            self.input_ids[:n].copy_(t([tok for tok, _ in reqs]))
            self.input_block_tables[:n, 0].copy_(t([slot for _, slot in reqs]))
        else:
            self.input_ids[:SIZE].fill_(0)                       # the dummy batch's tokens
        if not self.graphed:
            if dummy_run:
                return None                                      # eager dummy step: attention/Mamba skipped
            md = self.builder.build(self.input_block_tables, n, n)
            return mamba_mixer2(self.model, self.input_ids[:n], self.ssm_state, md).clone()
        for_capture = dummy_run and self.variant == "fix"        # ... and batch_desc.cg_mode == FULL
        if for_capture:
            self.builder.build_for_cudagraph_capture(self.dummy_block_tables, SIZE)
        else:
            self.builder.build(self.input_block_tables, n, SIZE)
        padded = {}
        if dummy_run and not for_capture:
            padded["state_indices_tensor"] = self.builder.state_indices_tensor   # left as the last batch set it
        out = replay(self.graph, self.out, real=n, size=SIZE, padded=padded)
        return None if dummy_run else out[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = []
        batch = lambda toks: [(tok, slot) for tok, slot in zip(toks, (1, 2, 3, 4))]  # noqa: E731
        outs.append(runner.execute_model(batch([3, 5, 7, 9])))
        outs.append(runner.execute_model(batch([4, 6, 8, 10])))
        # The rank's requests wait (e.g. on a KV transfer) while the other DP ranks step: dummy steps.
        runner.execute_model([], dummy_run=True)
        runner.execute_model([], dummy_run=True)
        outs.append(runner.execute_model(batch([1, 2, 11, 0])))
        outs.append(runner.execute_model(batch([5, 3, 2, 7])))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
