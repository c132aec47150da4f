"""The EAGLE draft graph advances its static ``positions`` in place; never-reset padded rows run off the RoPE table.

Upstream: https://github.com/sgl-project/sglang/pull/10892 ("Fix CUDA illegal memory access issues in speculative
decoding"), the root-cause fix for the draft-graph crashes reported in #6309, #8296, #8336 and #9888 (after the
padding work-around #9687).
Symptom: EAGLE / EAGLE3 speculative decoding with CUDA graphs crashes during decode with ``CUDA error: an illegal
memory access was encountered`` after serving for a while (#6309, #8296, #8336, #9888), in the EAGLE draft CUDA
graph runners (sglang, 2025).
Mechanism: ``EAGLEWorker.draft_forward`` runs ``speculative_num_steps`` draft steps and before each draft forward
after the first does ``forward_batch.positions.add_(1)``: an in-place write. ``EAGLEDraftCudaGraphRunner`` captures
``draft_forward`` on a ``ForwardBatch`` whose ``positions`` is a view of its static ``self.positions`` buffer, so
every replay adds ``speculative_num_steps - 1`` to every row of that buffer, the padded rows included. ``replay``
copies the real rows' positions in (``self.positions[:raw_num_token].copy_(...)``) and, when ``bs != raw_bs``,
resets ``seq_lens`` and ``out_cache_loc`` of the padded rows, but not ``positions``: those rows keep what the last
replay left and grow by ``num_steps - 1`` per padded replay, without bound. The draft model's rotary embedding
gathers ``cos_sin_cache.index_select(0, positions)`` for every row of the captured batch, so after enough padded
replays a padded row indexes past ``max_position_embeddings`` rows: an out-of-bounds read on the GPU (an IMA), an
``IndexError`` here. (The PR does not name the faulting kernel; the rotary lookup is this program's choice of a
position-indexed read.)
Doctor: persistent-mutation, at ``draft_forward`` (the captured ``positions.add_(1)`` writes the runner's static
``positions`` buffer, and in the padded rows that write is what the next replay reads).
Fix (upstream): in ``replay``'s padding branch (``if bs != raw_bs``) also reset ``self.positions`` (zeroed) in the
EAGLE CUDA graph runners, so every replay starts from positions the step wrote.
(Read: the #10892 description and its diff hunk in ``eagle_draft_cuda_graph_runner.py``'s padding branch, and the
``draft_forward`` / draft runner code of that time. Tiny model: ``topk = 1``, the draft decoder layer is reduced to
its rotary embedding on one projection (attention over the KV cache, which positions do not otherwise reach,
is left out), no KV writes.)
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/10892"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "draft_forward"
SYMPTOM = "padded rows of the draft graph's positions grow every replay until RoPE reads past its table (IMA)"

VOCAB, HIDDEN, ROTARY_DIM = 16, 8, 8
MAX_POSITION_EMBEDDINGS = 16
SPECULATIVE_NUM_STEPS, TOPK = 3, 1
CAPTURE_BS = [2, 4]


class RotaryEmbedding:
    def __init__(self, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM))
        freqs = torch.arange(MAX_POSITION_EMBEDDINGS, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward_native(self, positions, x):
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


@dataclasses.dataclass
class EagleDraftInput:
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    positions: torch.Tensor
    spec_info: EagleDraftInput
    input_ids: torch.Tensor | None = None


class LlamaForCausalLMEagle:
    """The draft model: embed + fc(concat(embed, target hidden)), one rotary-embedded projection, lm_head."""

    def __init__(self, device):
        gen = generator(10892)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.q_proj = randn(HIDDEN, ROTARY_DIM, gen=gen, device=device, scale=0.6)
        self.o_proj = randn(ROTARY_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.rotary_emb = RotaryEmbedding(device)

    def forward(self, input_ids, positions, forward_batch):
        h = torch.cat([self.embed_tokens[input_ids], forward_batch.spec_info.hidden_states], dim=-1) @ self.fc
        q = self.rotary_emb.forward_native(positions, h @ self.q_proj)
        hidden = h + torch.tanh(q) @ self.o_proj
        return LogitsProcessorOutput(hidden @ self.lm_head, hidden)


def select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores):
    """topk == 1: a chain; the tree bookkeeping reduces to the running score and the token."""
    scores = topk_p if i == 0 else scores * topk_p
    return topk_index.flatten(), hidden_states, scores, (scores, topk_index)


class EAGLEWorker:
    def __init__(self, device):
        self.draft_model = LlamaForCausalLMEagle(device)
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS

    def draft_forward(self, forward_batch):
        spec_info = forward_batch.spec_info
        topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states
        score_list, token_list = [], []
        scores = None
        for i in range(self.speculative_num_steps):
            input_ids, hidden_states, scores, tree_info = select_top_k_tokens(
                i, topk_p, topk_index, hidden_states, scores)
            score_list.append(tree_info[0])
            token_list.append(tree_info[1])
            # We don't need to run the last forward.
            if i == self.speculative_num_steps - 1:
                break
            # Set inputs
            forward_batch.input_ids = input_ids
            forward_batch.positions.add_(1)
            spec_info.hidden_states = hidden_states
            logits_output = self.draft_model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
            probs = torch.softmax(logits_output.next_token_logits, dim=-1)
            topk_p, topk_index = probs.topk(TOPK, dim=-1)
            hidden_states = logits_output.hidden_states
        return torch.cat(score_list, dim=1), torch.cat(token_list, dim=1)


class EAGLEDraftCudaGraphRunner:
    def __init__(self, eagle_worker, device, variant):
        self.eagle_worker, self.variant = eagle_worker, variant
        self.capture_bs = CAPTURE_BS
        self.max_bs = max(CAPTURE_BS)
        self.num_tokens_per_bs = TOPK
        self.positions = torch.zeros(self.max_bs * self.num_tokens_per_bs, dtype=torch.long, device=device)
        self.topk_p = torch.zeros(self.max_bs, TOPK, device=device)
        self.topk_index = torch.zeros(self.max_bs, TOPK, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(self.max_bs, HIDDEN, device=device)
        self.graphs, self.output_buffers = {}, {}
        pool = graph_pool_handle(device)
        for bs in reversed(self.capture_bs):               # largest first, to share the pool
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, pool, device)

    def capture_one_batch_size(self, num_seqs, pool, device):
        num_tokens = num_seqs * self.num_tokens_per_bs
        spec_info = EagleDraftInput(self.topk_p[:num_seqs], self.topk_index[:num_seqs],
                                    self.hidden_states[:num_seqs])
        forward_batch = ForwardBatch(batch_size=num_seqs, positions=self.positions[:num_tokens], spec_info=spec_info)

        def run_once():
            # Backup the field draft_forward reassigns (positions is advanced in place, not reassigned).
            hidden_states_backup = forward_batch.spec_info.hidden_states
            ret = self.eagle_worker.draft_forward(forward_batch)
            forward_batch.spec_info.hidden_states = hidden_states_backup
            return ret

        return capture(run_once, device=device, pool=pool, warmups=2, name=f"draft bs={num_seqs}",
                       owner="EAGLEDraftCudaGraphRunner",
                       static={"positions": self.positions, "topk_p": self.topk_p,
                               "topk_index": self.topk_index, "hidden_states": self.hidden_states})

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs and self.variant == "fix":
            self.positions.zero_()
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(forward_batch.spec_info.topk_p)
        self.topk_index[:raw_bs].copy_(forward_batch.spec_info.topk_index)
        self.hidden_states[:raw_bs].copy_(forward_batch.spec_info.hidden_states)
        padded = {"topk_p": self.topk_p, "topk_index": self.topk_index, "hidden_states": self.hidden_states}
        if self.variant == "bug":
            padded["positions"] = self.positions        # its padded rows keep what the last replay left
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=padded)
        return tuple(o[:raw_bs].clone() for o in out)


# Decode steps after a prefill of four requests: the positions of the draft's first token, per request. One
# request finishes after the first step; the remaining three are padded to the captured batch size 4.
STEP_POSITIONS = [[3, 5, 7, 9], [4, 6, 8], [5, 7, 9], [6, 8, 10], [7, 9, 11]]


def draft_inputs(step, positions, device):
    gen = generator(100 + step)
    n = len(positions)
    probs = torch.softmax(torch.randn(n, VOCAB, generator=gen), dim=-1)
    topk_p, topk_index = probs.topk(TOPK, dim=-1)
    hidden = torch.randn(n, HIDDEN, generator=gen)
    return ForwardBatch(batch_size=n, positions=torch.tensor(positions, dtype=torch.long).to(device),
                        spec_info=EagleDraftInput(topk_p.to(device), topk_index.to(device), hidden.to(device)))


def run(variant: str, device: str = "cpu"):
    worker = EAGLEWorker(device)

    def serve(graphed: bool):
        runner = EAGLEDraftCudaGraphRunner(worker, device, variant) if graphed else None
        outs = []
        for step, positions in enumerate(STEP_POSITIONS):
            forward_batch = draft_inputs(step, positions, device)
            if graphed:
                outs.extend(runner.replay(forward_batch))
            else:
                outs.extend(t.clone() for t in worker.draft_forward(forward_batch))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
