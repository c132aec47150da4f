"""The SSM metadata prep trusts stale host shadows of ``seq_len`` while the graph runner's capture dummies live on the device.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/14640 ("[https://nvbugs/6221483][fix] Revert auto_deploy
_mamba_ssm_prepare_metadata to pre-#13566 state").
Symptom: AutoDeploy SuperV3 (Nemotron-H, hybrid Mamba) with MTP and CUDA graphs crashes while the CUDA graphs
are being captured, with ``Indexing.cu:1515 indexSelectSmallIndex: srcIndex < srcSelectDimSize`` (a device-side
assert / illegal index); without CUDA graphs the same model serves.
Mechanism: #13566 changed ``auto_deploy::mamba_ssm_prepare_metadata`` to take the prefill token count from the host
(``batch_info_host.get_num_tokens()``, ``seq_len_host``) and to build ``seq_idx_prefill`` with the
``torch.repeat_interleave(arange(num_prefill), seq_len, output_size=num_prefill_tokens)`` shortcut (no device sync).
Regular steps write the device ``seq_len``/``cu_seqlen`` and their host shadows together (``nest_sequences``), but
the capture warmup's dummy batch is emitted on the device only, so during capture the host shadows still hold what
the previous (startup) batch left. With ``output_size`` larger than the device total, the tail of ``seq_idx`` names
a sequence past ``num_prefill``, and the per-token index_select of the state slots reads out of range.
(Description and the PR's summary of its diff were read; the revert's exact lines were not.) Here the shortcut is
written as the boundary search it performs; the CPU reports the out-of-range index as an ``IndexError``.
Doctor: stale-input, at ``_mamba_ssm_prepare_metadata`` (reads host shadows the capture step did not write).
Fix (upstream): revert to the pre-#13566 function: derive ``seq_idx_prefill`` from the device ``seq_len`` with a
plain ``repeat_interleave`` (no host ``output_size``), so the capture dummies and real steps agree.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/14640"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_mamba_ssm_prepare_metadata"
SYMPTOM = "CUDA graph capture with MTP crashes in indexSelectSmallIndex (srcIndex < srcSelectDimSize)"

DIM, MAX_BATCH, MAX_TOKENS, NUM_SLOTS = 4, 2, 8, 4
DRAFT_LEN = 2
TOKENS_PER_SEQ = 1 + DRAFT_LEN          # an MTP verify step: the golden token plus the drafts
GRAPH_BS = 2
GRAPH_TOKENS = GRAPH_BS * TOKENS_PER_SEQ


class SequenceInfo:
    """Device metadata buffers and their host shadows (AutoDeploy's ``SequenceInfo``)."""

    def __init__(self, device):
        self.device = device
        self.input = torch.zeros(MAX_TOKENS, DIM, device=device)
        self.seq_len = torch.zeros(MAX_BATCH, dtype=torch.long, device=device)
        self.cu_seqlen = torch.zeros(MAX_BATCH + 1, dtype=torch.long, device=device)
        self.slot_idx = torch.zeros(MAX_BATCH, dtype=torch.long, device=device)   # mamba state slot per sequence
        self.seq_len_host = torch.zeros(MAX_BATCH, dtype=torch.long)              # host shadows
        self.batch_info_host = torch.zeros(3, dtype=torch.long)   # num_prefill, num_prefill_tokens, num_decode

    def nest_sequences(self, seqs, slots):
        """A regular step: device buffers and host shadows are written together."""
        lens = [s.shape[0] for s in seqs]
        n = sum(lens)
        self.input[:n].copy_(torch.cat(seqs).to(self.device))
        self.seq_len[:len(lens)].copy_(torch.tensor(lens, device=self.device))
        self.cu_seqlen[1:len(lens) + 1].copy_(torch.tensor(lens, device=self.device).cumsum(0))
        self.slot_idx[:len(slots)].copy_(torch.tensor(slots, device=self.device))
        self.seq_len_host[:len(lens)] = torch.tensor(lens)
        self.batch_info_host.copy_(torch.tensor([len(lens), n, 0]))

    def set_capture_dummies(self, bs, tokens_per_seq):
        """The graph runner's warmup batch for MTP capture: emitted on the device only."""
        self.input[:bs * tokens_per_seq].zero_()
        self.seq_len[:bs].fill_(tokens_per_seq)
        self.cu_seqlen[1:bs + 1].copy_(self.seq_len[:bs].cumsum(0))
        self.slot_idx[:bs].copy_(torch.arange(bs, device=self.device))


def _mamba_ssm_prepare_metadata(info: SequenceInfo, variant: str):
    """Per-token sequence index and state slot of the prefill (extend) tokens."""
    device = info.device
    num_prefill, num_prefill_tokens, _ = info.batch_info_host.tolist()
    if variant == "bug":
        # #13566: repeat_interleave(arange(num_prefill), seq_len, output_size=num_prefill_tokens) with the
        # host count; each output position takes the sequence whose cu_seqlen boundary it has not passed.
        pos = torch.arange(num_prefill_tokens, device=device)
        seq_idx_prefill = torch.searchsorted(info.cu_seqlen[1:num_prefill + 1], pos, right=True)
    else:
        seq_idx_prefill = torch.repeat_interleave(
            torch.arange(num_prefill, device=device), info.seq_len[:num_prefill])
    slot_per_token = info.slot_idx[:num_prefill].index_select(0, seq_idx_prefill)   # indexSelectSmallIndex
    return seq_idx_prefill, slot_per_token


class MambaPiece:
    """The captured SSM piece: each token mixes its input with its sequence's cached state."""

    def __init__(self, device):
        gen = generator(14640)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.ssm_state = randn(NUM_SLOTS, DIM, gen=gen, device=device)
        self.slot_per_token = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)   # static metadata

    def __call__(self, info: SequenceInfo, n: int):
        x = info.input[:n]
        return torch.tanh(x @ self.w) + self.ssm_state[self.slot_per_token[:n]]


class ADEngine:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.info = SequenceInfo(device)
        self.piece = MambaPiece(device)
        gen = generator(7)
        # Startup: the KV/SSM-cache sizing forward runs a prefill-shaped dummy batch through nest_sequences.
        self.forward([randn(4, DIM, gen=gen, device="cpu"), randn(4, DIM, gen=gen, device="cpu")], [2, 3])
        if graphed:
            self.info.set_capture_dummies(GRAPH_BS, TOKENS_PER_SEQ)
            self._prepare(GRAPH_TOKENS)
            self.graph, self.out = capture(
                lambda: self.piece(self.info, GRAPH_TOKENS), device=device, owner="ADEngine (MTP verify graph)",
                static={"input": self.info.input, "slot_per_token": self.piece.slot_per_token},
                state={"ssm_state": self.piece.ssm_state})

    def _prepare(self, n):
        _, slots = _mamba_ssm_prepare_metadata(self.info, self.variant)
        self.piece.slot_per_token[:n].copy_(slots[:n])

    def forward(self, seqs, slots):
        self.info.nest_sequences(seqs, slots)
        n = sum(s.shape[0] for s in seqs)
        self._prepare(n)
        if self.graphed and n == GRAPH_TOKENS and len(seqs) == GRAPH_BS:
            return replay(self.graph, self.out).clone()
        return self.piece(self.info, n).clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        engine = ADEngine(device, variant, graphed)
        gen = generator(99)
        outs = []
        for slots in ([1, 3], [3, 1], [0, 2]):           # MTP verify steps: 2 sequences x (1 + 2 drafts)
            seqs = [randn(TOKENS_PER_SEQ, DIM, gen=gen, device="cpu") for _ in range(GRAPH_BS)]
            outs.append(engine.forward(seqs, slots))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
