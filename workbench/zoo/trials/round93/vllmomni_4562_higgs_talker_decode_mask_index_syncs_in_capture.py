"""Higgs-Audio-v3 talker: the audio-feedback step filters decode rows by boolean-mask indexing inside graph capture.

Upstream: https://github.com/vllm-project/vllm-omni/issues/4562 ("[Bug]: [HiggsAudioV3] Talker crashes CUDA graph
capture (low_latency profile) due to boolean-mask indexing", vllm-project/vllm-omni, opened 2026-06-19, closed).
Read: the issue (traceback ``forward`` -> ``_apply_audio_feedback`` -> ``_decode_request_token_positions``; the quoted
lines ``decode_mask = (spans == 1) & (starts >= 0) & (starts < int(num_tokens))`` / ``return req_rows[decode_mask],
starts[decode_mask]``), the proposed fix PR https://github.com/vllm-project/vllm-omni/pull/4563 (closed unmerged: an
early return in ``_decode_request_token_positions`` keyed on ``_use_external_decode_cudagraph``; the review rejected it
because eager prefill/mixed steps also call it), and two stored versions of
``vllm_omni/model_executor/models/higgs_audio_v3/higgs_audio_v3_talker.py``: one with the issue's code (``__init__``,
``update_decode_step_metadata``, ``forward``, ``_set_last_step_query_start_loc``, ``_apply_audio_feedback``,
``_is_single_token_decode_step``, ``_step_request_count``, ``_decode_request_token_positions``), and a later one where
``_apply_audio_feedback`` first asks ``_is_single_token_decode_step`` and, for a dense single-token decode step, builds
``req_rows = token_positions = torch.arange(num_tokens)`` without calling ``_decode_request_token_positions``; only a
step with multi-token rows still takes the masked path. That later code is taken as the fix; the PR that closed the
issue was not identified. The runner side (persistent buffers, FULL_DECODE_ONLY capture sizes, padding) is a stand-in.
Symptom: Higgs-Audio-v3 TTS with the Stage-0 CUDA-graph profile (``enforce_eager: false``, ``cudagraph_mode:
FULL_DECODE_ONLY``) dies at startup while capturing the decode graphs: ``torch.AcceleratorError: CUDA error: operation
not permitted when stream is capturing``. The eager profile serves fine.
Mechanism: with external decode CUDA graphs the talker's ``forward`` always runs ``_apply_audio_feedback`` (it replaces
the ``<|audio|>`` continuation embedding with the fused multi-codebook embedding of the previous step's codes, read from
the pre-allocated ``_decode_last_codes`` / ``_decode_has_codes`` buffers). To find the decode rows it calls
``_decode_request_token_positions``, which derives spans from the runner-supplied ``query_start_loc`` on the device and
returns ``req_rows[decode_mask]``: a boolean-mask read whose output length depends on the mask, so the host must wait
for the device. Eagerly that is only a stall; inside ``torch.cuda.graph`` the stream refuses it, and the first decode
graph capture aborts. Under FULL_DECODE_ONLY every captured step is a uniform single-token decode, so the mask is
all-true and the filtered result equals the unfiltered one.
Doctor: sync-in-capture, at _decode_request_token_positions. The boolean-mask read ``req_rows[decode_mask]`` is a host
synchronisation attempted during capture; the fix keeps the captured dense-decode step off that function.
Fix (upstream): in ``_apply_audio_feedback``, a dense single-token decode step (``query_start_loc`` has one entry per
row plus one) uses ``torch.arange(num_tokens)`` for both the request rows and token positions and indexes the decode
state buffers by slicing; ``_decode_request_token_positions`` is only called for steps with multi-token rows.
Modelled: ``HiggsAudioV3TalkerForConditionalGeneration`` with ``HiggsFusedMultiTextEmbedding`` /
``HiggsFusedMultiTextHead`` (fused ``[N*V, D]`` weight, offset lookup, tied head), ``update_decode_step_metadata``,
``_set_last_step_query_start_loc`` (persistent ``_last_step_query_start_loc_buffer``), ``forward``
(``torch.where`` masking of negative ids, audio feedback, backbone), ``_apply_audio_feedback``,
``_is_single_token_decode_step``, ``_step_request_count``, ``_decode_request_token_positions``,
``_ensure_decode_state_capacity`` (pre-allocated, never grows here). Stand-ins: the Qwen3 backbone is a position
embedding plus two residual MLP blocks and a norm (tokens independent, no attention); ``sample`` is greedy (text argmax,
per-codebook argmax of the modality head) with no delay pattern: every row switches to audio after its first decode
step; the runner (``TalkerDecodeGraphRunner``) keeps persistent ``input_ids`` / ``positions`` buffers, pads a decode
batch to the captured sizes [1, 2, 4] (padding rows: token 0, one token each in ``query_start_loc``) and captures one
FULL graph per size at startup (warm-up, then capture), as vLLM's ``CUDAGraphWrapper`` does for FULL_DECODE_ONLY.
Hidden 8, text vocab 16, 2 codebooks of 6 codes, float64.
Workload: the decode graphs are captured at startup; then three requests decode 4 steps together (3 rows padded to the
size-4 graph); logits of every real row are compared with the same requests served without graphs (the eager profile,
``_use_external_decode_cudagraph`` off). The bug raises at the capture of the size-1 graph (the emulator's
CaptureError for the masked read; on CUDA, the stream-capture error the issue reports). The fix equals eager (0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/issues/4562"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_decode_request_token_positions"
SYMPTOM = ("Higgs-Audio-v3 talker with FULL_DECODE_ONLY CUDA graphs fails at startup: the audio-feedback step filters "
           "decode rows with boolean-mask indexing, a host synchronisation the graph capture refuses ('operation not "
           "permitted when stream is capturing')")

HIDDEN = 8
TEXT_VOCAB = 16
AUDIO_ID = TEXT_VOCAB - 1            # the <|audio|> continuation token
NUM_CODEBOOKS, CODEBOOK_SIZE = 2, 6
MAX_POS = 32
MAX_NUM_SEQS = 4
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]

_variant = "bug"


class HiggsFusedMultiTextEmbedding(torch.nn.Module):
    """Fused multi-codebook embedding: [N*V, D] weight + offset lookup, summed over codebooks."""

    def __init__(self, weight, offsets):
        super().__init__()
        self.weight = weight
        self._offsets = offsets

    def forward(self, codes):
        fused_ids = codes + self._offsets
        return F.embedding(fused_ids, self.weight).sum(dim=-2)


class HiggsFusedMultiTextHead(torch.nn.Module):
    """Fused multi-codebook head: [L, D] -> [L, N, V] via one linear (weight tied to the embedding)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def generate(self, hidden):
        return F.linear(hidden, self.weight).reshape(hidden.shape[0], NUM_CODEBOOKS, CODEBOOK_SIZE)


class HiggsAudioV3TalkerForConditionalGeneration(torch.nn.Module):
    def __init__(self, device, use_external_decode_cudagraph):
        super().__init__()
        gen = generator(4562)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self._use_external_decode_cudagraph = use_external_decode_cudagraph
        self.num_codebooks, self.codebook_size = NUM_CODEBOOKS, CODEBOOK_SIZE
        fused = r(NUM_CODEBOOKS * CODEBOOK_SIZE, HIDDEN, scale=0.8)
        offsets = torch.arange(NUM_CODEBOOKS, dtype=torch.long, device=device) * CODEBOOK_SIZE
        self.multimodal_embedding = HiggsFusedMultiTextEmbedding(fused, offsets)
        self.modality_head = HiggsFusedMultiTextHead(fused)        # tie_modality_embeddings
        self.embed_tokens = r(TEXT_VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POS, HIDDEN, scale=0.3)
        self.w1, self.w2 = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, TEXT_VOCAB, scale=0.8)

        self._last_step_input_ids = None
        self._last_step_query_start_loc = None
        self._last_step_query_start_loc_buffer = None
        self._decode_step_metadata_from_runner = False
        # Pre-allocated decode-step audio feedback buffers (CUDA-graph safe): populated by sample(), read by forward().
        max_bs = max(8, MAX_NUM_SEQS)
        self._decode_last_codes = torch.zeros(max_bs, NUM_CODEBOOKS, dtype=torch.long, device=device)
        self._decode_has_codes = torch.zeros(max_bs, dtype=torch.bool, device=device)
        self._decode_active_audio_count = 0

    # ---------------------------------------------------------------- metadata the runner sets before forward
    def update_decode_step_metadata(self, *, input_ids=None, omni_query_start_loc=None):
        if input_ids is not None:
            self._last_step_input_ids = input_ids
            if self._use_external_decode_cudagraph and input_ids.ndim >= 1:
                self._ensure_decode_state_capacity(int(input_ids.shape[0]), input_ids.device)
        self._set_last_step_query_start_loc(omni_query_start_loc)
        self._decode_step_metadata_from_runner = True

    def _set_last_step_query_start_loc(self, query_start_loc):
        if not isinstance(query_start_loc, torch.Tensor):
            self._last_step_query_start_loc = None
            return
        source = query_start_loc.detach()
        numel = int(source.numel())
        buf = self._last_step_query_start_loc_buffer
        if buf is None or buf.device != source.device or buf.dtype != source.dtype or int(buf.numel()) < numel:
            buf = torch.empty(max(numel, 17), dtype=source.dtype, device=source.device)
            self._last_step_query_start_loc_buffer = buf
        buf[:numel].copy_(source.reshape(-1))
        self._last_step_query_start_loc = buf[:numel]

    def _ensure_decode_state_capacity(self, num_rows, device=None):
        if num_rows <= int(self._decode_last_codes.shape[0]):
            return
        raise AssertionError("decode state buffers are pre-allocated for max_num_seqs rows")

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, positions):
        self._decode_step_metadata_from_runner = False
        safe_ids = torch.where(input_ids < 0, torch.zeros_like(input_ids), input_ids)
        hidden_states = self.embed_tokens[safe_ids]
        hidden_states = self._apply_audio_feedback(hidden_states, input_ids)
        return self._run_qwen3_layers_eager(positions, hidden_states)

    def _run_qwen3_layers_eager(self, positions, hidden_states):
        hidden_states = hidden_states + self.pos_embed[positions]
        hidden_states = hidden_states + torch.tanh(hidden_states @ self.w1)
        hidden_states = hidden_states + torch.tanh(hidden_states @ self.w2)
        return hidden_states / hidden_states.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    # ---------------------------------------------------------------- audio feedback
    def _apply_audio_feedback(self, hidden_states, input_ids):
        """Replace decode-step embeddings with audio feedback from the pre-allocated buffers (torch.where, no dict)."""
        num_tokens = int(hidden_states.shape[0])
        external_decode_graph = bool(getattr(self, "_use_external_decode_cudagraph", False))
        if self._decode_active_audio_count == 0 and not external_decode_graph:
            return hidden_states

        if _variant == "fix":
            dense_decode = self._is_single_token_decode_step(num_tokens)
            if dense_decode:
                req_rows = torch.arange(num_tokens, dtype=torch.long, device=hidden_states.device)
                token_positions = req_rows
            else:
                req_rows, token_positions = self._decode_request_token_positions(num_tokens, hidden_states.device)
                if int(req_rows.numel()) == 0:
                    return hidden_states
        else:
            req_rows, token_positions = self._decode_request_token_positions(num_tokens, hidden_states.device)
            if int(req_rows.numel()) == 0:
                return hidden_states
            dense_decode = self._is_single_token_decode_step(num_tokens)

        num_reqs = self._step_request_count(num_tokens)
        self._ensure_decode_state_capacity(num_reqs, hidden_states.device)
        if dense_decode:
            codes_slice = self._decode_last_codes[:num_tokens]
            has_codes = self._decode_has_codes[:num_tokens].unsqueeze(-1)
            current_hidden = hidden_states
        else:
            codes_slice = self._decode_last_codes.index_select(0, req_rows)
            has_codes = self._decode_has_codes.index_select(0, req_rows).unsqueeze(-1)
            current_hidden = hidden_states.index_select(0, token_positions)
        audio_embeds = self.multimodal_embedding(codes_slice).to(dtype=hidden_states.dtype)
        replaced = torch.where(has_codes, audio_embeds, current_hidden)
        if dense_decode:
            return replaced
        new_hidden = hidden_states.clone()
        new_hidden.index_copy_(0, token_positions, replaced)
        return new_hidden

    def _is_single_token_decode_step(self, num_rows):
        q_start = self._last_step_query_start_loc
        if isinstance(q_start, torch.Tensor):
            return int(q_start.numel()) == int(num_rows) + 1
        ids = self._last_step_input_ids
        if not isinstance(ids, torch.Tensor) or int(ids.numel()) != int(num_rows):
            return False
        if self._use_external_decode_cudagraph:
            return True
        return int(num_rows) == 1

    def _step_request_count(self, num_tokens):
        q_start = self._last_step_query_start_loc
        if isinstance(q_start, torch.Tensor) and int(q_start.numel()) >= 2:
            return int(q_start.numel()) - 1
        return int(num_tokens)

    def _decode_request_token_positions(self, num_tokens, device):
        q_start = self._last_step_query_start_loc
        if isinstance(q_start, torch.Tensor) and int(q_start.numel()) >= 2:
            q = q_start.to(device=device, dtype=torch.long)
            starts = q[:-1]
            spans = q[1:] - q[:-1]
            req_rows = torch.arange(int(q.numel()) - 1, dtype=torch.long, device=device)
            decode_mask = (spans == 1) & (starts >= 0) & (starts < int(num_tokens))
            return req_rows[decode_mask], starts[decode_mask]
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty

    # ---------------------------------------------------------------- sampling (stand-in, eager, after forward)
    def sample(self, hidden_states, num_reqs):
        """Greedy text token; per-codebook greedy audio codes written into the decode-state buffers."""
        codes = self.modality_head.generate(hidden_states[:num_reqs]).argmax(-1)
        self._decode_last_codes[:num_reqs] = codes
        self._decode_has_codes[:num_reqs] = True
        self._decode_active_audio_count = num_reqs
        return torch.full((num_reqs,), AUDIO_ID, dtype=torch.long, device=hidden_states.device)


class TalkerDecodeGraphRunner:
    """FULL_DECODE_ONLY decode graphs per batch size, captured at startup; decode batches padded to a captured size."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        n = max(CUDAGRAPH_CAPTURE_SIZES)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.graphs = {}
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES):
            self.query_start_loc[:bs + 1] = torch.arange(bs + 1, dtype=torch.int32, device=device)
            self.model.update_decode_step_metadata(input_ids=self.input_ids[:bs],
                                                   omni_query_start_loc=self.query_start_loc[:bs + 1])
            g, out = capture(lambda bs=bs: self.model.forward(self.input_ids[:bs], self.positions[:bs]),
                             device=device, name=f"talker decode [{bs}]", owner="TalkerDecodeGraphRunner",
                             static={"input_ids": self.input_ids, "positions": self.positions,
                                     "query_start_loc": self.model._last_step_query_start_loc_buffer},
                             state={"decode_last_codes": self.model._decode_last_codes,
                                    "decode_has_codes": self.model._decode_has_codes})
            self.graphs[bs] = (g, out)

    def execute(self, input_ids, positions):
        num_reqs = int(input_ids.shape[0])
        bs = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= num_reqs)
        self.input_ids[:num_reqs].copy_(input_ids)
        self.input_ids[num_reqs:bs].fill_(0)
        self.positions[:num_reqs].copy_(positions)
        self.positions[num_reqs:bs].fill_(0)
        self.query_start_loc[:bs + 1] = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        self.model.update_decode_step_metadata(input_ids=self.input_ids[:bs],
                                               omni_query_start_loc=self.query_start_loc[:bs + 1])
        g, out = self.graphs[bs]
        hidden = replay(g, out, real=num_reqs, size=bs,
                        padded={"decode_last_codes": self.model._decode_last_codes,
                                "decode_has_codes": self.model._decode_has_codes})
        return hidden[:num_reqs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    num_steps = 4

    def serve(use_cuda_graph):
        model = HiggsAudioV3TalkerForConditionalGeneration(device, use_external_decode_cudagraph=use_cuda_graph)
        runner = TalkerDecodeGraphRunner(model, device) if use_cuda_graph else None    # captured at startup
        tokens = torch.tensor([3, 7, 11], dtype=torch.long, device=device)             # last prompt tokens
        positions = torch.tensor([5, 9, 6], dtype=torch.long, device=device)           # prompts already prefilled
        qsl = torch.arange(4, dtype=torch.int32, device=device)
        outs = []
        for _ in range(num_steps):
            if runner is not None:
                hidden = runner.execute(tokens, positions)
            else:
                model.update_decode_step_metadata(input_ids=tokens, omni_query_start_loc=qsl)
                hidden = model.forward(tokens, positions)
            outs.append(model.compute_logits(hidden).clone())
            tokens = model.sample(hidden, int(tokens.shape[0]))
            positions = positions + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
