"""HPU Mamba2 prefill at a padded graph bucket: the padded tokens' ``dt`` is masked before ``dt_bias`` and softplus, so every padded position still decays the request's final SSM state.

Upstream: https://github.com/vllm-project/vllm-gaudi/pull/1009 ("Fix mamba cumsum padded calculations",
vllm-project/vllm-gaudi, commit be87dfb0). Read: the commit message ("applying padding mask for `dt` with biases
applied") and its full diff (``vllm_gaudi/ops/pytorch_implementation.py``: ``new_chunk_cumsum`` gains
``padding_mask`` and multiplies ``dt`` by it after ``dt_bias``/softplus/clamp; ``ops/ssd_combined.py`` threads
``padding_mask`` through ``_mamba_chunk_scan_combined_fwd`` and ``hpu_mamba_chunk_scan_combined_varlen``;
``ops/hpu_mamba_mixer2.py`` passes ``padding_mask=padding_mask_flat``), plus the fixed versions of those three files
(``new_chunk_state``, the prefill branch of ``HPUMambaMixer2`` with ``dt = dt * padding_mask_flat`` before the
scan and ``ssm_state[state_indices_tensor] = varlen_states``). No issue thread or PR discussion was read.
Symptom: Mamba2 / hybrid models (granite-4.0-h style) on Gaudi lose accuracy: a prompt whose length is below the
HPU graph bucket it is padded to leaves a wrongly decayed SSM state, so every later decode token of that request
is off. Running the same prompt without bucket padding is fine.
Mechanism: the HPU runner pads each prefill to a bucketed length (the shapes its HPU graphs are captured for) and
hands the mixer ``padding_mask_flat``. ``HPUMambaMixer2.forward`` zeroes the padded rows of ``hidden_states_B_C``
and ``dt``, then ``hpu_mamba_chunk_scan_combined_varlen`` -> ``_mamba_chunk_scan_combined_fwd`` ->
``new_chunk_cumsum`` adds ``dt_bias`` and applies softplus, so a padded ``dt`` of 0 becomes
``softplus(dt_bias) > 0``. ``dA = dt * A`` of the padded positions enters ``dA_cumsum``; ``new_chunk_state`` and
``new_ssd_state_passing`` carry the request's state through the padded positions with decay ``exp(dA)``, and
``varlen_states[last_chunk_indices]`` (the last chunk of the padded sequence) is written to ``ssm_state``. The real
tokens' outputs are right (the scan is causal); the state every decode step starts from is not.
Doctor: stale-padding, at new_chunk_cumsum. The real request's final state depends on what the graph's padded
rows hold after ``dt_bias``/softplus: the padded positions are not inert and their decay leaks into the real row.
Fix (upstream): ``new_chunk_cumsum(..., padding_mask=...)`` multiplies ``dt`` by the padding mask after bias,
softplus and clamp, so padded positions get ``dt = 0``, ``dA = 0`` and carry the state through unchanged.
Modelled: ``new_chunk_cumsum`` (as upstream, with the fix), ``new_chunk_state`` (as upstream), a loop version of
``new_ssd_state_passing`` and ``new_chunk_scan`` (same math, one group), ``hpu_mamba_chunk_scan_combined_varlen``,
``HPUMambaMixer2`` (in_proj -> x/B/C/dt, masking as upstream, scan, ``ssm_state`` write; decode recurrence) and an
``HPUModelRunner`` that pads prefills to the bucket, captures one prefill graph per bucket and replays it. The
causal conv1d is left out (stand-in: identity); embeddings and projections are random, float64. Sizes: hidden 8,
2 heads x head dim 2, state 3, chunk 4, prefill buckets [8].
Workload: request A (4 prompt tokens) is prefilled in the 8-token bucket (4 padded tokens, one whole padded
chunk); request B (8 tokens) fills the bucket exactly. Each then decodes 3 teacher-forced tokens eagerly from its
``ssm_state`` slot. Eager (no graphs, no bucket padding) prefills A at its own length. With the bug A's state is
decayed by ``exp(4 * A * softplus(dt_bias))`` (0.22 and 0.06 for the two heads) and all of A's decode outputs differ; B matches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-gaudi/pull/1009"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "new_chunk_cumsum"
SYMPTOM = ("Mamba2 prefill padded to an HPU graph bucket: padded positions get dt = softplus(dt_bias) > 0, so the "
           "request's final SSM state is decayed through the padding and every decode token after it is wrong")

VOCAB, HIDDEN = 16, 8
NHEADS, HEADDIM, DSTATE = 2, 2, 3
CHUNK_SIZE = 4
PREFILL_BUCKETS = [8]
NUM_SLOTS = 4

_variant = "bug"


def new_chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                     padding_mask=None):
    """dt: (seqlen, nheads) -> dA_cumsum, dt: (nheads, nchunks, chunk_size). The hazard site."""
    seqlen, nheads = dt.shape
    nchunks = seqlen // chunk_size
    dt_min, dt_max = dt_limit
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.view(1, nheads)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, dt_min, dt_max)
    if _variant == "fix" and padding_mask is not None:     # upstream fix: mask after bias/softplus
        dt = dt * padding_mask.view(seqlen, 1).to(dt.dtype)
    dA = dt * A.view(1, nheads)
    dA = dA.transpose(0, 1).reshape(nheads, nchunks, chunk_size)
    dt = dt.transpose(0, 1).reshape(nheads, nchunks, chunk_size)
    return dA.cumsum(dim=-1), dt


def new_chunk_state(B_expanded, x_chunked, dt_t, dA_cumsum_t):
    """Each chunk's own state contribution, (nchunks, nheads, hdim, dstate)."""
    dA_cs_last = dA_cumsum_t[:, :, -1]
    scale = torch.exp(dA_cs_last.unsqueeze(2) - dA_cumsum_t) * dt_t           # (nchunks, nheads, chunk)
    return torch.einsum("chj,cjhp,cjhn->chpn", scale, x_chunked, B_expanded)


def new_ssd_state_passing(states, dA_cumsum, initial_states=None):
    """States at the end of every chunk, carried across chunks with each chunk's total decay."""
    h = torch.zeros_like(states[0]) if initial_states is None else initial_states
    ends = []
    for c in range(states.shape[0]):
        h = torch.exp(dA_cumsum[:, c, -1]).view(-1, 1, 1) * h + states[c]
        ends.append(h)
    return torch.stack(ends)


def new_chunk_scan(C, B, x_chunked, dt_t, dA_cumsum_t, chunk_states, out, D):
    """Outputs of every position: intra-chunk (causal) plus the state entering the chunk."""
    nchunks, chunk = x_chunked.shape[:2]
    Cc, Bc = C.view(nchunks, chunk, -1), B.view(nchunks, chunk, -1)
    prev = torch.cat([torch.zeros_like(chunk_states[:1]), chunk_states[:-1]])
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=x_chunked.device))
    diff = dA_cumsum_t.unsqueeze(-1) - dA_cumsum_t.unsqueeze(-2)                # (c, h, i, j)
    L = torch.where(causal, torch.exp(torch.where(causal, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    CB = torch.einsum("cin,cjn->cij", Cc, Bc)
    y = torch.einsum("cij,chij,chj,cjhp->cihp", CB, L, dt_t, x_chunked)
    y = y + torch.einsum("chi,cin,chpn->cihp", torch.exp(dA_cumsum_t), Cc, prev)
    y = y + D.view(1, 1, -1, 1) * x_chunked
    out.copy_(y.reshape(out.shape))


def hpu_mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, last_chunk_indices, out, D=None, dt_bias=None,
                                         dt_softplus=False, padding_mask=None):
    seqlen, nheads, headdim = x.shape
    dA_cumsum, dt = new_chunk_cumsum(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                     padding_mask=padding_mask)
    nchunks = seqlen // chunk_size
    dt_t, dA_cumsum_t = dt.transpose(0, 1), dA_cumsum.transpose(0, 1)          # (nchunks, nheads, chunk)
    x_chunked = x.view(nchunks, chunk_size, nheads, headdim)
    B_expanded = B.view(nchunks, chunk_size, 1, -1).expand(-1, -1, nheads, -1)
    states = new_chunk_state(B_expanded, x_chunked, dt_t, dA_cumsum_t)
    states = new_ssd_state_passing(states, dA_cumsum)
    new_chunk_scan(C, B, x_chunked, dt_t, dA_cumsum_t, states, out, D)
    return states[last_chunk_indices]


class HPUMambaMixer2:
    def __init__(self, device):
        gen = generator(1009)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.in_proj = r(HIDDEN, NHEADS * HEADDIM + 2 * DSTATE + NHEADS)
        self.out_proj = r(NHEADS * HEADDIM, HIDDEN)
        self.A = -torch.tensor([0.45, 0.7], device=device, dtype=torch.float64)
        self.dt_bias = torch.tensor([0.3, 0.6], device=device, dtype=torch.float64)
        self.D = torch.tensor([0.5, -0.25], device=device, dtype=torch.float64)
        self.ssm_state = torch.zeros(NUM_SLOTS, NHEADS, HEADDIM, DSTATE, device=device, dtype=torch.float64)

    def _project(self, input_ids):
        zxbcdt = self.embed[input_ids] @ self.in_proj
        hidden_states_B_C, dt = zxbcdt.split([NHEADS * HEADDIM + 2 * DSTATE, NHEADS], dim=-1)
        return hidden_states_B_C, dt

    def forward_prefill(self, input_ids, padding_mask_flat, state_indices_tensor, last_chunk_indices_p):
        hidden_states_B_C, dt = self._project(input_ids)
        mask = padding_mask_flat.to(torch.float64).view(-1, 1)
        hidden_states_B_C = hidden_states_B_C * mask          # as upstream: padded rows zeroed
        dt = dt * mask                                        # ... before dt_bias is added in the scan
        x, B, C = hidden_states_B_C.split([NHEADS * HEADDIM, DSTATE, DSTATE], dim=-1)
        out = torch.empty(x.shape[0], NHEADS, HEADDIM, device=x.device, dtype=x.dtype)
        varlen_states = hpu_mamba_chunk_scan_combined_varlen(
            x.view(-1, NHEADS, HEADDIM), dt, self.A, B, C, CHUNK_SIZE, last_chunk_indices_p, out, D=self.D,
            dt_bias=self.dt_bias, dt_softplus=True, padding_mask=padding_mask_flat)
        self.ssm_state[state_indices_tensor] = varlen_states
        return (out.view(x.shape[0], -1) * mask) @ self.out_proj

    def forward_decode(self, input_ids, state_indices_tensor):
        hidden_states_B_C, dt = self._project(input_ids)
        x, B, C = hidden_states_B_C.split([NHEADS * HEADDIM, DSTATE, DSTATE], dim=-1)
        x = x.view(-1, NHEADS, HEADDIM)
        dt = F.softplus(dt + self.dt_bias)                                         # (n, nheads)
        h = self.ssm_state[state_indices_tensor]
        h = torch.exp(dt * self.A).view(-1, NHEADS, 1, 1) * h + torch.einsum("bh,bhp,bn->bhpn", dt, x, B)
        self.ssm_state[state_indices_tensor] = h
        y = torch.einsum("bn,bhpn->bhp", C, h) + self.D.view(1, -1, 1) * x
        return y.reshape(x.shape[0], -1) @ self.out_proj


class HPUModelRunner:
    def __init__(self, device, use_hpu_graphs):
        self.device = device
        self.mixer = HPUMambaMixer2(device)
        self.graphs = {}
        if use_hpu_graphs:
            self.input_ids = torch.zeros(max(PREFILL_BUCKETS), dtype=torch.int64, device=device)
            self.padding_mask_flat = torch.zeros(max(PREFILL_BUCKETS), dtype=torch.bool, device=device)
            self.state_indices = torch.zeros(1, dtype=torch.int64, device=device)
            self.last_chunk_indices = torch.zeros(1, dtype=torch.int64, device=device)
            self.warmup_model()

    def _prefill_step(self, n):
        return self.mixer.forward_prefill(self.input_ids[:n], self.padding_mask_flat[:n], self.state_indices,
                                          self.last_chunk_indices)

    def warmup_model(self):
        for n in PREFILL_BUCKETS:
            self.input_ids[:n].zero_()
            self.padding_mask_flat[:n].fill_(True)
            self.last_chunk_indices.fill_(n // CHUNK_SIZE - 1)
            self.state_indices.fill_(NUM_SLOTS - 1)           # scratch slot for the dummy prompt
            self.graphs[n] = capture(lambda n=n: self._prefill_step(n), device=self.device,
                                     name=f"mamba prefill [{n}]", owner="HPUModelRunner (HPU graph)",
                                     static={"input_ids": self.input_ids, "padding_mask_flat": self.padding_mask_flat,
                                             "state_indices": self.state_indices,
                                             "last_chunk_indices": self.last_chunk_indices},
                                     state={"ssm_state": self.mixer.ssm_state})
        self.mixer.ssm_state.zero_()

    def execute_prefill(self, prompt, slot):
        n = len(prompt)
        if not self.graphs:                                    # eager: the prompt at its own length
            ids = torch.tensor(prompt, device=self.device)
            mask = torch.ones(n, dtype=torch.bool, device=self.device)
            idx = torch.tensor([slot], device=self.device)
            last = torch.tensor([n // CHUNK_SIZE - 1], device=self.device)
            return self.mixer.forward_prefill(ids, mask, idx, last).clone()
        bucket = next(b for b in PREFILL_BUCKETS if b >= n)
        self.input_ids[:bucket].zero_()                        # pad tokens (id 0) past the prompt
        self.input_ids[:n] = torch.tensor(prompt, device=self.device)
        self.padding_mask_flat[:bucket] = torch.arange(bucket, device=self.device) < n
        self.state_indices.fill_(slot)
        self.last_chunk_indices.fill_(bucket // CHUNK_SIZE - 1)   # last chunk of the padded sequence
        g, out = self.graphs[bucket]
        return replay(g, out, real=n, size=bucket)[:n].clone()

    def execute_decode(self, token, slot):
        ids = torch.tensor([token], device=self.device)
        return self.mixer.forward_decode(ids, torch.tensor([slot], device=self.device)).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    requests = {"A": ([3, 7, 1, 12], [5, 9, 2]), "B": ([4, 4, 11, 6, 0, 13, 8, 2], [1, 14, 6])}

    def serve(use_hpu_graphs: bool):
        runner = HPUModelRunner(device, use_hpu_graphs)
        outs = []
        for slot, (prompt, _) in enumerate(requests.values()):
            outs.append(runner.execute_prefill(prompt, slot))
        for step in range(3):
            for slot, (_, decode_tokens) in enumerate(requests.values()):
                outs.append(runner.execute_decode(decode_tokens[step], slot))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
