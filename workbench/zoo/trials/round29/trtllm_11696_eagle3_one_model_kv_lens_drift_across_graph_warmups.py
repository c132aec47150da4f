"""The captured Eagle3 one-model draft loop moves ``kv_lens_cuda`` in place; warmups on one input drift it off the KV cache.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/11696 ("[https://nvbugs/5821053][fix] Preventing drift
accumulation on kv_lens_cuda").
Symptom: with Eagle3 one-model speculative decoding and CUDA graphs (PyTorch backend), the CUDA graph warmup of
the generation graphs fails with an out-of-bounds KV cache access (illegal memory access) before serving starts.
Mechanism: ``CUDAGraphRunner.capture`` runs ``forward_fn`` ``WARMUP_STEPS`` (2) times and then once more under
capture, all on the same ``capture_inputs``: ``PyTorchModelEngine._prepare_inputs`` sets the attention metadata's
``kv_lens_cuda`` only once, before the warmups. Inside ``forward_fn``, ``Eagle3OneModelWorker.forward`` modifies
``attn_metadata.kv_lens_cuda`` in place for its draft loop: it rewinds each generation request to its accepted
length (``+= num_accepted_tokens - (max_draft_len + 1)``) and adds 1 per draft step, a net ``+accepted - 1`` that
it never undoes (``_prepare_attn_metadata_for_spec_dec`` saves and restores ``_seq_lens`` / ``_seq_lens_cuda`` only;
the capture-only ``postprocess_fn`` of #7373 reverses just the ``_preprocess_inputs`` offset). So the captured
function writes a static buffer it does not own, and every warmup starts from where the previous one left it: the
dummy requests' KV lengths grow by ``max_draft_len`` per run until the draft tokens' KV positions index past the
requests' blocks (an IMA on the GPU, an ``IndexError`` in the block-table lookup here).
Doctor: persistent-mutation, at ``forward`` (``Eagle3OneModelWorker.forward``: its in-place ``kv_lens_cuda`` updates
write the engine's attention-metadata buffer, and the next warmup reads the drifted lengths).
Fix (upstream): ``Eagle3OneModelWorker`` overrides ``_prepare_attn_metadata_for_spec_dec`` so that
``attn_metadata.prepare_for_spec_dec`` also saves ``kv_lens_cuda``; ``_restore_attn_metadata_from_spec_dec`` copies it
back after the draft loop, so ``forward`` leaves ``kv_lens_cuda`` as it found it.
(Read: the #11696 description only, not its diff; the save/restore is modelled after ``prepare_for_spec_dec`` /
``restore_from_spec_dec`` of ``AttentionMetadata`` as the description names them. Tiny model: the target model is one
attention layer over a paged KV cache, the Eagle3 draft a single-layer loop with its own KV cache; no overlap
scheduler, so ``_preprocess_inputs`` adds no offset and the ``postprocess_fn`` is left out.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/11696"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "forward"
SYMPTOM = "CUDA graph warmups drift kv_lens_cuda by max_draft_len per run until draft KV writes go out of bounds (IMA)"

VOCAB, DIM = 16, 4
MAX_DRAFT_LEN = 2
TOKENS_PER_GEN = MAX_DRAFT_LEN + 1         # the verified token plus the draft tokens of the last step
TOKENS_PER_BLOCK, MAX_BLOCKS_PER_SEQ, NUM_BLOCKS = 3, 2, 9
BATCH_SIZE = 2                             # the one generation graph (batch size 2, draft_len 2)
WARMUP_STEPS = 2                           # CUDAGraphRunner.WARMUP_STEPS


class AttentionMetadata:
    """The engine's persistent metadata buffers the captured graph reads."""

    def __init__(self, device):
        self.kv_lens_cuda = torch.zeros(BATCH_SIZE, dtype=torch.long, device=device)
        self.block_table = torch.zeros(BATCH_SIZE, MAX_BLOCKS_PER_SEQ, dtype=torch.long, device=device)
        self._saved = None

    def prepare_for_spec_dec(self, *fields):
        self._saved = {f: getattr(self, f).clone() for f in fields}

    def restore_from_spec_dec(self):
        for f, t in self._saved.items():
            getattr(self, f).copy_(t)
        self._saved = None


class Model:
    def __init__(self, device):
        gen = generator(11696)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.fc = randn(DIM, DIM, gen=gen, device=device, scale=0.7)        # Eagle3 draft layer
        self.d_wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.ctx_pos = torch.arange(MAX_BLOCKS_PER_SEQ * TOKENS_PER_BLOCK, device=device)


def _slots(block_table, pos):
    """Paged KV slot of position ``pos`` (any shape, rows first) of each request."""
    rows = torch.arange(block_table.shape[0], device=pos.device).view(-1, *([1] * (pos.dim() - 1)))
    return block_table[rows.expand_as(pos), pos // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + pos % TOKENS_PER_BLOCK


def _attend(model, q, cache, block_table, last_pos):
    """Each query attends over its request's cached keys at positions ``<= last_pos`` (values = keys)."""
    k = cache[_slots(block_table, model.ctx_pos.expand(block_table.shape[0], -1))]       # [bs, ctx, DIM]
    scores = torch.einsum("b...d,bcd->b...c", q, k)
    mask = model.ctx_pos.view(1, *([1] * (q.dim() - 2)), -1) > last_pos.unsqueeze(-1)
    p = torch.softmax(scores.masked_fill(mask, -1e9), -1)
    return torch.einsum("b...c,bcd->b...d", p, k)


def target_forward(model, md, kv_cache, input_ids):
    """The target model on ``TOKENS_PER_GEN`` tokens per request, ending at ``kv_lens_cuda``."""
    h = model.emb[input_ids].view(BATCH_SIZE, TOKENS_PER_GEN, DIM)
    pos = md.kv_lens_cuda[:, None] - TOKENS_PER_GEN + torch.arange(TOKENS_PER_GEN, device=h.device)
    kv_cache[_slots(md.block_table, pos)] = h @ model.wk
    return torch.tanh(_attend(model, h @ model.wq, kv_cache, md.block_table, pos) @ model.wo)


class Eagle3OneModelWorker:
    def __init__(self, variant):
        self.variant = variant

    def _prepare_attn_metadata_for_spec_dec(self, md):
        if self.variant == "fix":
            md.prepare_for_spec_dec("kv_lens_cuda")      # the fix: kv_lens_cuda is saved too
        else:
            md.prepare_for_spec_dec()                    # (_seq_lens, _seq_lens_cuda: not modelled)

    def _restore_attn_metadata_from_spec_dec(self, md):
        md.restore_from_spec_dec()

    def forward(self, model, md, draft_kv_cache, hidden_states, num_accepted_tokens):
        """The draft loop: rewind to the accepted length, then one draft token per step, in place."""
        self._prepare_attn_metadata_for_spec_dec(md)
        md.kv_lens_cuda += num_accepted_tokens - TOKENS_PER_GEN
        rows = torch.arange(BATCH_SIZE, device=hidden_states.device)
        h = hidden_states[rows, num_accepted_tokens - 1]
        drafts = []
        for _ in range(MAX_DRAFT_LEN):
            pos = md.kv_lens_cuda
            draft_kv_cache[_slots(md.block_table, pos)] = h @ model.d_wk
            h = torch.tanh(_attend(model, h, draft_kv_cache, md.block_table, pos) @ model.fc)
            drafts.append(h)
            md.kv_lens_cuda += 1
        self._restore_attn_metadata_from_spec_dec(md)
        return torch.stack(drafts, 1)


class PyTorchModelEngine:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.md = AttentionMetadata(device)
        self.input_ids = torch.zeros(BATCH_SIZE * TOKENS_PER_GEN, dtype=torch.long, device=device)
        self.num_accepted_tokens = torch.ones(BATCH_SIZE, dtype=torch.long, device=device)  # spec metadata
        self.kv_cache = torch.zeros(NUM_BLOCKS * TOKENS_PER_BLOCK, DIM, device=device)
        self.draft_kv_cache = torch.zeros(NUM_BLOCKS * TOKENS_PER_BLOCK, DIM, device=device)
        self.spec_worker = Eagle3OneModelWorker(variant)
        if graphed:
            self.warmup()

    def _forward_step(self):
        hidden = target_forward(self.model, self.md, self.kv_cache, self.input_ids)
        drafts = self.spec_worker.forward(self.model, self.md, self.draft_kv_cache, hidden,
                                          self.num_accepted_tokens)
        return hidden, drafts

    def _prepare_inputs(self, reqs):
        """``reqs``: (token ids, past KV length, accepted tokens of the last step, block ids) per request."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731 - host lists, copied in as one H2D
        self.input_ids.copy_(t([tok for r in reqs for tok in r[0]]).to(self.device))
        self.md.kv_lens_cuda.copy_(t([past + TOKENS_PER_GEN for _, past, _, _ in reqs]).to(self.device))
        self.num_accepted_tokens.copy_(t([acc for _, _, acc, _ in reqs]).to(self.device))
        self.md.block_table.copy_(t([blocks for *_, blocks in reqs]).to(self.device))

    def warmup(self):
        """CUDA graph warmup: dummy generation requests (their own KV blocks), all drafts accepted."""
        dummies = [([0] * TOKENS_PER_GEN, 1, TOKENS_PER_GEN, [5, 6]),
                   ([0] * TOKENS_PER_GEN, 1, TOKENS_PER_GEN, [7, 8])]
        self._prepare_inputs(dummies)                    # once, before all warmups and the capture
        self.graph, self.out = capture(
            self._forward_step, device=self.device, warmups=WARMUP_STEPS, owner="CUDAGraphRunner",
            static={"input_ids": self.input_ids, "kv_lens_cuda": self.md.kv_lens_cuda,
                    "block_table": self.md.block_table, "num_accepted_tokens": self.num_accepted_tokens},
            state={"kv_cache": self.kv_cache, "draft_kv_cache": self.draft_kv_cache})

    def forward(self, reqs):
        self._prepare_inputs(reqs)
        if self.graphed:
            out = replay(self.graph, self.out)
        else:
            out = self._forward_step()
        return [o.clone() for o in out]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    A, B = [1, 2], [3, 4]
    steps = [  # (tokens, past KV length, accepted, blocks) for A and B
        [([3, 5, 7], 0, 1, A), ([2, 4, 6], 0, 3, B)],
        [([9, 1, 2], 1, 2, A), ([8, 3, 3], 3, 1, B)],
        [([4, 4, 1], 2, 2, A), ([5, 6, 7], 1, 3, B)],
    ]

    def serve(graphed: bool):
        engine = PyTorchModelEngine(model, device, variant, graphed)
        outs = []
        for reqs in steps:
            outs += engine.forward(reqs)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
