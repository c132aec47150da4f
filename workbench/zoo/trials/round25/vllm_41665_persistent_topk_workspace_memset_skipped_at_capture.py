"""The persistent top-k's workspace clear is gated on the capture-time ``max_seq_len``: graphs never reset it.

Upstream: https://github.com/vllm-project/vllm/pull/41665 ("[Bugfix] Fix condition to clear persistent topk so
that it can be captured regardless"), a follow-up to https://github.com/vllm-project/vllm/pull/41444 ("[Bugfix]
Fix persistent_topk inter-CTA init race on RadixRowState"); the PR links issue #41483 (DeepSeek-V4-Pro + MTP).
Symptom: DeepSeek-V4 sparse-attention decode under CUDA graphs (FULL_DECODE_ONLY, max_model_len < 32K): the
diff's comment calls it a correctness bug once replayed rows take the radix path, "leaving the workspace state to
accumulate across replays", found while debugging hangs in the decode paths; the fix was validated with gsm8k on
DSv4-Pro DEP4 + MTP2 (vLLM main, May 2026). Eager steps with long rows clear the state themselves.
Mechanism: ``persistent_topk`` (csrc/topk.cu) launches one fixed, CUDA-graph-safe grid; each row picks its path
on the device from its ``seq_len``: short rows run a single-CTA select, rows longer than ``RADIX_THRESHOLD`` run
the cooperative radix select, whose CTAs red-add their partial histograms into the row group's
``RadixRowState`` (``histogram``, ``arrival_counter``) in ``topk_workspace`` and pick the threshold bin from the
sum. #41444 moved the zeroing of that state out of the kernel into a host-side ``cudaMemsetAsync`` issued
``if (needs_cooperative)``, with ``needs_cooperative = max_seq_len > RADIX_THRESHOLD`` computed from the host
``max_seq_len`` argument. Under capture ``max_seq_len`` is the dummy batch's (short), so the memset is never
recorded: every replay adds its histograms on top of what earlier replays left, and once a replayed row takes
the radix path the threshold comes from the accumulated counts. An eager step with long rows evaluates
``needs_cooperative`` itself and clears the state first.
Doctor: host-work-frozen, at ``persistent_topk`` (the host ``needs_cooperative`` check that decides whether the
workspace clear is enqueued ran once, at capture).
Fix (upstream): issue the ``cudaMemsetAsync`` of the ``RadixRowState`` bytes unconditionally, so the capture
records it as its own node before the kernel and every replay starts from a cleared workspace.
Read: the PR description and its review thread (the diff's comment: "The previous host-side guard ``if
(needs_cooperative)`` was evaluated at capture time ... the memset would NOT be captured, leaving the workspace
state to accumulate across replays"), and #41444's description of ``RadixRowState``. The radix select is
modelled with one 8-bin pass and two CTAs per row; the sparse-indexer layer around it is reduced to one
query/key projection and one sparse attention.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/41665"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "persistent_topk"
SYMPTOM = "sparse-indexer top-k from workspace state accumulated across decode-graph replays (rows > RADIX_THRESHOLD)"

VOCAB, DIM, MAX_REQS, MAX_LEN = 16, 4, 2, 16
INDEX_TOPK = 4
RADIX_THRESHOLD = 8          # rows longer than this take the cooperative radix path
RADIX = 8                    # bins of the (single, modelled) radix pass
CTAS_PER_GROUP = 2           # CTAs cooperating on one row
SIZE = MAX_REQS              # the FULL_DECODE_ONLY graph: one decode token per request


class Model:
    def __init__(self, device):
        gen = generator(41665)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.col = torch.arange(MAX_LEN, device=device)
        self.bins = torch.arange(RADIX, device=device)
        self.rows = torch.arange(MAX_REQS, device=device)


def persistent_topk_kernel(model, logits, seq_lens, topk_indices, workspace, k):
    """One grid for every row; the path is chosen per row on the device. ``workspace[g]`` is row group
    ``g``'s ``RadixRowState``: ``histogram`` (columns ``:RADIX``) and ``arrival_counter`` (last column)."""
    rows = logits.shape[0]
    valid = model.col[None, :] < seq_lens[:, None]
    radix_row = seq_lens > RADIX_THRESHOLD
    bins = (torch.sigmoid(logits) * RADIX).long().clamp(0, RADIX - 1)
    counted = (bins[..., None] == model.bins) & (valid & radix_row[:, None])[..., None]
    chunk = MAX_LEN // CTAS_PER_GROUP
    for cta in range(CTAS_PER_GROUP):            # each CTA red-adds its partial histogram, then arrives
        workspace[:rows, :RADIX] += counted[:, cta * chunk:(cta + 1) * chunk].sum(1)
        workspace[:rows, RADIX] += radix_row.long()
    hist = workspace[:rows, :RADIX]
    suffix = hist.flip(-1).cumsum(-1).flip(-1)          # elements in bins >= b
    thr = ((suffix >= k).long() * model.bins).amax(-1)  # the threshold bin
    above = suffix.gather(1, (thr + 1).clamp(max=RADIX - 1)[:, None]).squeeze(1)
    count_gt = torch.where(thr < RADIX - 1, above, torch.zeros_like(above))
    take_eq = valid & (bins == thr[:, None])
    take_eq &= take_eq.long().cumsum(-1) <= (k - count_gt)[:, None]
    radix_sel = (valid & (bins > thr[:, None])) | take_eq
    # medium / decode path: a single CTA selects the exact top-k
    rank = logits.masked_fill(~valid, float("-inf")).argsort(-1, descending=True).argsort(-1)
    exact_sel = valid & (rank < k)
    sel = torch.where(radix_row[:, None], radix_sel, exact_sel)
    order = ((~sel).long() * MAX_LEN + model.col).argsort(-1)[:, :k]
    topk_indices[:rows] = torch.where(sel.gather(1, order), order, torch.full_like(order, -1))


def persistent_topk(model, logits, seq_lens, topk_indices, workspace, k, max_seq_len: int, variant):
    """The host wrapper: ``max_seq_len`` is a host int from the attention metadata."""
    needs_cooperative = max_seq_len > RADIX_THRESHOLD
    if variant == "fix" or needs_cooperative:
        workspace.zero_()                        # cudaMemsetAsync(workspace, 0, state_bytes, stream)
    persistent_topk_kernel(model, logits, seq_lens, topk_indices, workspace, k)


def sparse_attn_indexer_decode(model, input_ids, positions, seq_lens, k_cache, v_cache, topk_indices, workspace,
                               max_seq_len, variant):
    """One decode token per request (row r = request r): cache its K/V, score the context, select the
    top-k positions, attend over them."""
    rows = input_ids.shape[0]
    h = model.emb[input_ids]
    q, k, v = h @ model.wq, h @ model.wk, h @ model.wv
    req = model.rows[:rows]
    k_cache[req, positions] = k
    v_cache[req, positions] = v
    logits = torch.einsum("rd,rld->rl", q, k_cache[:rows])
    persistent_topk(model, logits, seq_lens, topk_indices, workspace, INDEX_TOPK, max_seq_len, variant)
    idx = topk_indices[:rows]
    ok = idx >= 0
    sel = idx.clamp(min=0)
    ks = k_cache[req[:, None], sel]
    vs = v_cache[req[:, None], sel]
    scores = (ks @ q[:, :, None]).squeeze(-1).masked_fill(~ok, float("-inf"))
    return h + (torch.softmax(scores, -1)[:, :, None] * vs).sum(1)


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant = model, device, variant
        self.k_cache = torch.zeros(MAX_REQS, MAX_LEN, DIM, device=device)
        self.v_cache = torch.zeros(MAX_REQS, MAX_LEN, DIM, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.positions = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.topk_indices_buffer = torch.full((SIZE, INDEX_TOPK), -1, dtype=torch.long, device=device)
        self.topk_workspace = torch.zeros(MAX_REQS, RADIX + 1, dtype=torch.long, device=device)
        self.graph = None
        if graphed:
            self.seq_lens.fill_(1)                 # the dummy decode batch of the capture
            self.graph, self.out = capture(
                lambda: sparse_attn_indexer_decode(model, self.input_ids, self.positions, self.seq_lens,
                                                   self.k_cache, self.v_cache, self.topk_indices_buffer,
                                                   self.topk_workspace, 1, variant),
                device=device, name=f"FULL_DECODE_ONLY size {SIZE}", owner="GPUModelRunner (decode graph)",
                static={"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens},
                state={"k_cache": self.k_cache, "v_cache": self.v_cache})

    def prefill(self, r, prompt):
        """Eager prefill: the prompt's K/V land in the cache."""
        ids = torch.tensor(prompt, dtype=torch.long).to(self.device)
        h = self.model.emb[ids]
        self.k_cache[r, :len(prompt)] = h @ self.model.wk
        self.v_cache[r, :len(prompt)] = h @ self.model.wv

    def decode(self, tokens, positions):
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids.copy_(t(tokens))
        self.positions.copy_(t(positions))
        self.seq_lens.copy_(t([p + 1 for p in positions]))
        max_seq_len = max(positions) + 1           # attn_metadata.max_seq_len (host)
        if self.graph is not None:
            return replay(self.graph, self.out).clone()
        return sparse_attn_indexer_decode(self.model, self.input_ids, self.positions, self.seq_lens, self.k_cache,
                                          self.v_cache, self.topk_indices_buffer, self.topk_workspace,
                                          max_seq_len, self.variant).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(4166)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 11)]
    steps = [torch.randint(0, VOCAB, (MAX_REQS,), generator=gen).tolist() for _ in range(4)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        for r, prompt in enumerate(prompts):
            runner.prefill(r, prompt)
        lens = [len(p) for p in prompts]
        outs = []
        for tokens in steps:                       # decode: both rows are past RADIX_THRESHOLD
            outs.append(runner.decode(tokens, list(lens)))
            lens = [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
