"""GLM-OCR's MTP draft layer zeroes position-0 embeddings by boolean-mask assignment: a host sync inside the capture.

Upstream: https://github.com/vllm-project/vllm/pull/56447 ("[Bugfix] Fix GLM-OCR MTP position masking
during CUDA graph capture"), for the crash reported in https://github.com/vllm-project/vllm/issues/48749
("[MRV2] MTP speculative decoding crashes with cudaErrorStreamCaptureUnsupported during CUDA graph
capture"); the same statement in the GLM4-MoE-Lite MTP layer is the subject of the (open) follow-up
https://github.com/vllm-project/vllm/pull/51966, whose description names the pattern.
Symptom: serving with ``speculative_config={"method": "mtp", ...}`` and CUDA graphs on (Model Runner V2),
engine start-up dies while the speculator's graphs are captured (``CudaGraphManager.capture`` ->
``EagleSpeculator._prefill`` -> ``_run_model``) with ``CUDA error: operation not permitted when stream
is capturing`` / ``cudaErrorStreamCaptureUnsupported``; ``--enforce-eager`` works (vLLM 0.2x, 2026).
Mechanism: ``GlmOcrMultiTokenPredictorLayer.forward`` drops the embedding of every token at position 0
(nothing precedes it for the MTP head to predict from) with ``inputs_embeds[positions == 0] = 0``. A
boolean-mask ``index_put_`` has to know how many rows are selected, so it runs ``nonzero`` and copies
the count to the host: eagerly a harmless sync, inside ``torch.cuda.graph`` an illegal one, so the draft
model's FULL graph can never be captured.
Doctor: sync-in-capture, at ``forward`` (``GlmOcrMultiTokenPredictorLayer.forward``: the boolean-mask
assignment that reads the mask's count on the host during capture).
Fix (upstream): build the mask from the positions (the text row of MRoPE ``[3, T]`` positions, or the
runner's 1-D positions) and zero the rows with a broadcast ``masked_fill``, an elementwise kernel with a
static shape that a graph can record. Only the PR description was read (the diff was not available);
the pre-fix statement is the one #51966 quotes for the sibling GLM MTP layer, and the draft decoder
block is reduced here to a per-token MLP.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/56447"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = "MTP draft-graph capture aborts: inputs_embeds[positions == 0] = 0 syncs with the host"

VOCAB, HIDDEN = 16, 4
CAPTURE_SIZES = [4, 8]                 # the speculator's FULL graph sizes (tokens)
MAX_NUM_TOKENS = CAPTURE_SIZES[-1]
EPS = 1e-6


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


class GlmOcrMultiTokenPredictorLayer:
    """``enorm`` / ``hnorm`` / ``eh_proj`` / ``mtp_block`` / ``shared_head`` of the MTP layer."""

    def __init__(self, variant: str, device):
        gen = generator(56447)
        self.variant = variant
        self.enorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.hnorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.eh_proj = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.head_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7)

    def forward(self, positions, previous_hidden_states, inputs_embeds):
        if self.variant == "bug":
            # masking inputs at position 0, as not needed by MTP
            inputs_embeds[positions == 0] = 0
        else:
            mask = positions == 0
            if mask.dim() == 2:                  # MRoPE positions [3, T]: the text row decides
                mask = mask[0]
            inputs_embeds = inputs_embeds.masked_fill(mask.unsqueeze(-1), 0)
        inputs_embeds = rms_norm(inputs_embeds, self.enorm)
        previous_hidden_states = rms_norm(previous_hidden_states, self.hnorm)
        hidden_states = torch.cat([inputs_embeds, previous_hidden_states], dim=-1) @ self.eh_proj
        residual = hidden_states
        hidden_states = torch.relu(hidden_states @ self.w_up) @ self.w_down      # mtp_block (reduced)
        return residual + hidden_states


class GlmOcrMultiTokenPredictor:
    def __init__(self, variant: str, device):
        gen = generator(48749)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layer = GlmOcrMultiTokenPredictorLayer(variant, device)

    def embed_input_ids(self, input_ids):
        return self.embed_tokens[input_ids]

    def __call__(self, input_ids, positions, previous_hidden_states):
        inputs_embeds = self.embed_input_ids(input_ids)
        return self.layer.forward(positions, previous_hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states):
        return rms_norm(hidden_states, self.layer.head_norm) @ self.layer.lm_head


class EagleSpeculator:
    """MRV2's speculator: persistent input buffers, and FULL graphs of ``_run_model`` per token count."""

    def __init__(self, variant: str, device, graphed: bool):
        self.device = device
        self.model = GlmOcrMultiTokenPredictor(variant, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.cudagraph_manager = None
        if graphed:
            self.cudagraph_manager = GraphManager(
                self._run_model, CAPTURE_SIZES, device=device, mode=CUDAGraphMode.FULL,
                name="EagleCudaGraphManager (MTP draft)",
                static_buffers={"input_ids": self.input_ids, "positions": self.positions,
                                "hidden_states": self.hidden_states})

    def _run_model(self, num_tokens: int):
        hidden_states = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                   self.hidden_states[:num_tokens])
        return self.model.compute_logits(hidden_states)

    def capture(self):
        self.cudagraph_manager.capture()

    def propose(self, input_ids, positions, target_hidden_states):
        n = len(input_ids)
        self.input_ids[:n].copy_(torch.tensor(input_ids, device=self.device))
        self.positions[:n].copy_(torch.tensor(positions, device=self.device))
        self.hidden_states[:n].copy_(target_hidden_states)
        if self.cudagraph_manager is None:
            return self._run_model(n).clone()
        size = self.cudagraph_manager.dispatch(n)
        return self.cudagraph_manager.replay(size, n, padded={"input_ids": self.input_ids,
                                                              "positions": self.positions,
                                                              "hidden_states": self.hidden_states}).clone()


# draft steps: (token ids, positions); a new request's prompt starts at position 0
STEPS = [([3, 9, 4], [0, 1, 2]),
         ([5, 11, 2, 7, 1], [3, 0, 1, 2, 3]),
         ([8, 6], [4, 4]),
         ([12, 0, 14, 3, 10, 5, 9], [0, 1, 2, 5, 5, 0, 1])]


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    target_hidden = [randn(len(ids), HIDDEN, gen=gen, device=device) for ids, _ in STEPS]

    def serve(graphed: bool):
        speculator = EagleSpeculator(variant, device, graphed)
        if graphed:
            speculator.capture()                 # capture_model at start-up
        return [speculator.propose(ids, pos, h) for (ids, pos), h in zip(STEPS, target_hidden)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
