"""A one-token prompt tail padded to K+1 for the uniform-decode FULL graph: Mamba persists the state after the placeholders.

Upstream: https://github.com/vllm-project/vllm/pull/55178 ("[Bugfix] Preserve Mamba state for padded prompt
tails"); the padding comes from https://github.com/vllm-project/vllm/pull/45237 ("[Core] Avoid mixed batch on
spec-dec D-node via padding").
Symptom: hybrid Mamba models (Nemotron-H class) with MTP K > 0 in prefill/decode-disaggregated serving answer
with corrupted text: 7 of 8 responses corrupted in the reporter's bounded reproduction, SWE accuracy lost with
MTP5 (vLLM main, September 2026); without the padding (or without spec decode) outputs are correct.
Mechanism: a request arriving at the decode node via the KV connector has its recurrent state up to prompt
token N-1 and one real prompt token left. While other requests run speculative decode (K drafts, query length
K+1), the scheduler pads that one-token tail with K placeholder drafts so every row has query length K+1 and
the step replays the uniform-decode FULL CUDA graph. The runner reports the row as a prompt row
(``num_decode_draft_tokens_cpu == -1``), so the Mamba metadata builder puts it on the prefill path, which
persists only the state after the *last* query position: ``h(N + K placeholders)`` lands in the request's
state block instead of ``h(N)``. The scheduler drops the placeholders from its accounting, but the recurrent
state cannot be rolled back: the next step starts from a state that saw K padding tokens.
Doctor: stale-padding, at ``build`` (the metadata builder routes the padded tail row to the prefill state path,
so the real request's persisted state depends on the padded positions).
Fix (upstream): the builder is handed ``num_decode_draft_tokens_cpu`` that counts the padded prompt tail as a
speculative row with (rejected) placeholder drafts; the spec-decode path checkpoints the state after every
query position and the next step resumes from ``num_accepted_tokens - 1``, i.e. from ``h(N)``.
"""
from __future__ import annotations

import torch

from workbench.engine import GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/55178"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "build"
SYMPTOM = "corrupted continuations: the recurrent state resumed after a prompt tail padded with K placeholder drafts"

VOCAB, DIM = 10, 4
NUM_SPEC = 2                                  # speculative_config.num_speculative_tokens (K)
QUERY_LEN = NUM_SPEC + 1                      # uniform_decode_query_len
MAX_NUM_REQS = 2
CUDAGRAPH_CAPTURE_SIZES = [QUERY_LEN, 2 * QUERY_LEN]       # tokens; divisible by K+1
NUM_BLOCKS = MAX_NUM_REQS * QUERY_LEN
PAD_BLOCK = NUM_BLOCKS                        # scratch state row: writes that are not persisted land here
PLACEHOLDER = 0                               # input id of a padded (-1) draft position
DECAY = 0.6

# Request A decodes speculatively; request B arrives from the prefill node with its state after prompt token
# N-1 and one prompt token left. Per step: the row tokens (real ones first) and how many rows' tokens are
# real, then how many positions the rejection sampler accepts.
A, B = 0, 1
STEPS = [
    {A: ([4, 7, 2], 3, 2), B: ([5], 1, 1)},   # B: the padded prompt tail, placeholders are never accepted
    {A: ([9, 1, 3], 3, 1), B: ([6, 8, 2], 3, 2)},
    {A: ([3, 3, 5], 3, 3), B: ([1, 7, 4], 3, 1)},
]


class Model:
    def __init__(self, device):
        gen = generator(55178)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_out = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


def selective_state_update(ssm_state, x, state_read_idx, state_write_idx):
    """The mixer's recurrence for ``[rows, T]`` tokens: start from ``ssm_state[state_read_idx]``, after
    position t store the state in ``ssm_state[state_write_idx[:, t]]`` (PAD_BLOCK: not persisted)."""
    h = ssm_state[state_read_idx]
    ys = []
    for t in range(x.shape[1]):
        h = DECAY * h + x[:, t]
        ssm_state[state_write_idx[:, t]] = h
        ys.append(h)
    return torch.stack(ys, 1)


def mamba_forward(model, ssm_state, input_ids, state_read_idx, state_write_idx):
    """One step of the (single-layer) hybrid model: the FULL graph's work."""
    return selective_state_update(ssm_state, model.emb[input_ids], state_read_idx, state_write_idx) @ model.w_out


class Mamba2AttentionMetadataBuilder:
    """Which state blocks each row reads and writes (eager, before the step)."""

    def __init__(self, block_table):
        self.block_table = block_table            # [num_reqs, K+1] state blocks per request

    def build(self, rows, query_lens, num_decode_draft_tokens_cpu, num_accepted_tokens):
        read_idx, write_idx = [], []
        for row, q_len, drafts, accepted in zip(rows, query_lens, num_decode_draft_tokens_cpu, num_accepted_tokens):
            blocks = self.block_table[row]
            if drafts >= 0:
                # spec decode: resume from the last accepted position, checkpoint every position
                read_idx.append(blocks[accepted - 1])
                write_idx.append(blocks[:q_len])
            else:
                # prefill: resume from the request's state block, persist only the final position
                read_idx.append(blocks[0])
                write_idx.append([PAD_BLOCK] * (q_len - 1) + [blocks[0]])
        return read_idx, write_idx


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    block_table = [list(range(r * QUERY_LEN, (r + 1) * QUERY_LEN)) for r in range(MAX_NUM_REQS)]

    def initial_state():
        gen = torch.Generator().manual_seed(1)
        ssm_state = torch.zeros(NUM_BLOCKS + 1, DIM)
        ssm_state[block_table[A][0]] = torch.randn(DIM, generator=gen)      # A's state after its last step
        ssm_state[block_table[B][0]] = torch.randn(DIM, generator=gen)      # B's h(N-1) from the P node
        return ssm_state.to(device)

    def serve(graphed: bool):
        ssm_state = initial_state()
        builder = Mamba2AttentionMetadataBuilder(block_table)
        num_accepted = {A: 1, B: 1}
        is_prompt_tail = {A: False, B: True}
        if graphed:
            bufs = {"input_ids": torch.zeros(MAX_NUM_REQS, QUERY_LEN, dtype=torch.long, device=device),
                    "state_read_idx": torch.full((MAX_NUM_REQS,), PAD_BLOCK, dtype=torch.long, device=device),
                    "state_write_idx": torch.full((MAX_NUM_REQS, QUERY_LEN), PAD_BLOCK, dtype=torch.long,
                                                  device=device)}
            events.persistent_state("Mamba state cache", {"ssm_state": ssm_state})
            def step_fn(num_tokens):                  # the uniform-decode step: num_tokens // (K+1) rows
                num_reqs = num_tokens // QUERY_LEN
                return mamba_forward(model, ssm_state, bufs["input_ids"][:num_reqs],
                                     bufs["state_read_idx"][:num_reqs], bufs["state_write_idx"][:num_reqs])

            runner = GraphManager(step_fn, CUDAGRAPH_CAPTURE_SIZES, device=device, num_warmups=1,
                                  static_buffers=bufs, name="GPUModelRunner (uniform-decode FULL graphs)")
            runner.capture()
        outs = []
        for step in STEPS:
            rows = sorted(step)
            if graphed:
                # the D-node scheduler pads every row to K+1 so the batch stays uniform (#45237)
                tokens = [step[r][0] + [PLACEHOLDER] * (QUERY_LEN - len(step[r][0])) for r in rows]
                if variant == "bug":
                    drafts = [-1 if is_prompt_tail[r] else QUERY_LEN - 1 for r in rows]
                else:
                    drafts = [QUERY_LEN - 1 for r in rows]     # placeholder drafts count as (rejected) drafts
                read_idx, write_idx = builder.build(rows, [QUERY_LEN] * len(rows), drafts,
                                                    [num_accepted[r] for r in rows])
                n = len(rows)
                bufs["input_ids"][:n].copy_(torch.tensor(tokens, device=device))
                bufs["state_read_idx"][:n].copy_(torch.tensor(read_idx, device=device))
                bufs["state_write_idx"][:n].copy_(torch.tensor(write_idx, device=device))
                size = runner.dispatch(n * QUERY_LEN)
                logits = runner.replay(size, real=size)
                outs += [logits[i, :step[r][1]].clone() for i, r in enumerate(rows)]
            else:
                # no graphs, no padding: the prompt tail is a one-token prefill
                for r in rows:
                    tokens, q_len, _ = step[r]
                    drafts = [-1] if is_prompt_tail[r] else [q_len - 1]
                    read_idx, write_idx = builder.build([r], [q_len], drafts, [num_accepted[r]])
                    outs.append(mamba_forward(model, ssm_state, torch.tensor([tokens], device=device),
                                              torch.tensor(read_idx, device=device),
                                              torch.tensor(write_idx, device=device))[0])
            for r in rows:
                num_accepted[r] = step[r][2]
                is_prompt_tail[r] = False
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
