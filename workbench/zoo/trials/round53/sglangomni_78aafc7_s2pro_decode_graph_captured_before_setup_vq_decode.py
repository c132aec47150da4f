"""S2-Pro decode graph is captured before ``setup_vq_decode()``: replays never run the codebook loop.

Upstream: https://github.com/sgl-project/sglang-omni/commit/78aafc7ddda0819e238eff681d6a5156d49c35ec ("setup_vq_decode
before CUDA graph capture"), a direct commit on main (no PR, no issue).
Symptom: with CUDA graphs on, every graphed decode step of Fish-Audio S2-Pro hands the scheduler the codes that are
already in ``_output_codes`` (zeros at first) instead of this step's semantic token and codebook tokens; eager decode
(``--disable-cuda-graph``) is right. The commit says only that the graph must include ``_decode_codebooks``.
Mechanism: ``S2ProSGLangTextModel.__init__`` sets ``self._vq_ready = False``; ``forward()`` tests that Python bool
twice: on decode it adds the previous step's VQ codebook embeddings (read from the persistent ``_vq_codes[:bs]`` /
``_vq_mask[:bs]``) to ``hidden_states``, and after the logits it calls ``_decode_codebooks(logits, hidden_states)``,
which does the semantic-bias argmax and the fast codebook loop (``reset_caches``, ``project_in``,
``forward_kvcached`` per codebook) and writes ``_output_codes[:bs]`` / ``_output_semantic_ids[:bs]``, which the
``S2ProSGLangModelRunner`` reads after the forward (``_build_outputs``, ``output_ids``). In
``create_s2pro_sglang_engine`` the ``ModelWorker`` is built first, and its ModelRunner warms up and captures the
decode graphs inside ``__init__`` while ``_vq_ready`` is still False; only afterwards does the factory call
``text_model.setup_vq_decode(...)``, which allocates the buffers and sets ``_vq_ready = True``. The capture ran the
Python branches once, with the flag False, so the graph holds only embed -> layers -> norm -> lm_head: replays
neither inject the VQ embeddings nor write ``_output_codes``, while an eager decode step now takes both branches.
Doctor: warmup-divergence, at create_s2pro_sglang_engine (capture decided the ``_vq_ready`` branches before the
factory's lazy setup ran; eager decode steps now take them, replays never do).
Fix (upstream): ``factory.py`` saves ``want_cuda_graph = not server_args.disable_cuda_graph``, sets
``server_args.disable_cuda_graph = True`` while building ``ModelWorker`` (no capture in ``__init__``), restores it,
and after ``setup_vq_decode(...)`` calls ``model_worker.model_runner.init_device_graphs()`` ("Now capture CUDA graphs
with _decode_codebooks in the graph").
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang-omni/commit/78aafc7ddda0819e238eff681d6a5156d49c35ec"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "create_s2pro_sglang_engine"
SYMPTOM = "graphed S2-Pro decode steps return zero/stale audio codes: the captured graph lacks _decode_codebooks"

VOCAB, HIDDEN, FAST_DIM = 16, 8, 8
NUM_CODEBOOKS, CODEBOOK_SIZE = 3, 6
SEMANTIC_BEGIN_ID, SEMANTIC_END_ID, IM_END_ID = 8, 13, 14     # CODEBOOK_SIZE semantic tokens, then <|im_end|>
MAX_BS, STEPS, MAX_POS = 2, 5, 16


class ServerArgs:
    def __init__(self, disable_cuda_graph=False):
        self.disable_cuda_graph = disable_cuda_graph
        self.max_running_requests = MAX_BS


class AudioDecoder:
    """The fast head: codebook embeddings for VQ injection, and a tiny kv-cached codebook decoder."""

    def __init__(self, device):
        gen = generator(7801)
        self.codebook_embeddings = randn(NUM_CODEBOOKS * CODEBOOK_SIZE, HIDDEN, gen=gen, device=device)
        self.codebook_offsets = torch.arange(NUM_CODEBOOKS, device=device) * CODEBOOK_SIZE
        self.w_project_in = randn(HIDDEN, FAST_DIM, gen=gen, device=device, scale=0.5)
        self.embeddings_w = randn(CODEBOOK_SIZE, FAST_DIM, gen=gen, device=device)
        self.w_heads = randn(NUM_CODEBOOKS, FAST_DIM, CODEBOOK_SIZE, gen=gen, device=device)
        self.kv_cache = None

    def setup_caches(self, max_batch_size):
        self.kv_cache = torch.zeros(max_batch_size, 1, FAST_DIM, device=self.codebook_offsets.device)

    def reset_caches(self):
        self.kv_cache.zero_()

    def project_in(self, hidden_states):
        return hidden_states @ self.w_project_in

    def embeddings(self, ids):
        return self.embeddings_w[ids]

    def forward_kvcached(self, x, codebook_idx):
        bs = x.shape[0]
        cache = self.kv_cache[:bs]
        cache.mul_(0.5).add_(x)                                      # the running key/value state
        return torch.tanh(cache) @ self.w_heads[codebook_idx]       # [bs, 1, codebook_size]


class S2ProSGLangTextModel:
    def __init__(self, device):
        gen = generator(7800)
        self._vq_ready = False                                       # set via setup_vq_decode() after model load
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w_layer = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.norm_w = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.rope = randn(MAX_POS, HIDDEN, gen=gen, device=device)    # stands in for RoPE in the layers

    def setup_vq_decode(self, audio_decoder, *, num_codebooks, codebook_size, semantic_begin_id, semantic_end_id,
                        im_end_id, max_batch_size):
        """Attach the audio decoder and allocate the persistent buffers."""
        device = self.embed_tokens.device
        self._audio_decoder = audio_decoder
        self._codebook_size, self._num_codebooks = codebook_size, num_codebooks
        self._semantic_begin_id = semantic_begin_id
        self._vq_codebook_embeddings = audio_decoder.codebook_embeddings
        self._vq_codebook_offsets = audio_decoder.codebook_offsets.to(device)
        self._vq_scale = 1.0 / math.sqrt(num_codebooks + 1)
        self._vq_codes = torch.zeros(max_batch_size, num_codebooks, dtype=torch.long, device=device)
        self._vq_mask = torch.zeros(max_batch_size, dtype=torch.bool, device=device)
        bias = torch.full((VOCAB,), -float("inf"), device=device)
        bias[semantic_begin_id: semantic_end_id + 1] = 0.0
        bias[im_end_id] = 0.0
        self._semantic_bias = bias
        self._output_codes = torch.zeros(max_batch_size, num_codebooks + 1, dtype=torch.long, device=device)
        self._output_semantic_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._vq_ready = True

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens[input_ids]
        if self._vq_ready:                               # decode: VQ combination from the persistent buffers
            bs = hidden_states.shape[0]
            vq_codes, vq_mask = self._vq_codes[:bs], self._vq_mask[:bs]
            offset_parts = vq_codes + self._vq_codebook_offsets[None, :]
            vq_sum = self._vq_codebook_embeddings[offset_parts].sum(dim=1)
            combined = (hidden_states + vq_sum) * self._vq_scale
            hidden_states = torch.where(vq_mask.unsqueeze(-1), combined, hidden_states)
        hidden_states = hidden_states + torch.tanh((hidden_states + self.rope[positions]) @ self.w_layer)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        logits = hidden_states @ self.embed_tokens.t()                                # tied lm_head
        if self._vq_ready:
            self._decode_codebooks(logits, hidden_states)
        return logits, hidden_states

    def _decode_codebooks(self, logits, hidden_states):
        bs = logits.shape[0]
        semantic_token = torch.argmax(logits + self._semantic_bias, dim=-1)
        self._audio_decoder.reset_caches()
        fast_input = self._audio_decoder.project_in(hidden_states).unsqueeze(1)
        self._audio_decoder.forward_kvcached(fast_input, codebook_idx=0)
        sem_id = (semantic_token - self._semantic_begin_id).clamp(min=0, max=self._codebook_size - 1)
        cb_hidden = self._audio_decoder.embeddings(sem_id).unsqueeze(1)
        self._output_codes[:bs, 0] = semantic_token
        self._output_codes[:bs, 1] = sem_id
        for cb_idx in range(1, self._num_codebooks):
            cb_logits = self._audio_decoder.forward_kvcached(cb_hidden, codebook_idx=cb_idx)[:, 0, :self._codebook_size]
            cb_token = torch.argmax(cb_logits, dim=-1)
            cb_hidden = self._audio_decoder.embeddings(cb_token).unsqueeze(1)
            self._output_codes[:bs, cb_idx + 1] = cb_token
        self._output_semantic_ids[:bs] = semantic_token


class ModelRunner:
    """sglang's ModelRunner: captures the decode graph in __init__ unless disable_cuda_graph."""

    def __init__(self, model, server_args, device):
        self.model, self.server_args, self.device = model, server_args, device
        self.graph = None
        if not server_args.disable_cuda_graph:
            self.init_device_graphs()

    def init_device_graphs(self):
        bs = self.server_args.max_running_requests
        self.input_ids = torch.full((bs,), SEMANTIC_BEGIN_ID, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(bs, dtype=torch.long, device=self.device)
        static = {"input_ids": self.input_ids, "positions": self.positions}
        if self.model._vq_ready:
            static.update(_vq_codes=self.model._vq_codes, _vq_mask=self.model._vq_mask)
        self.graph, self.outputs = capture(lambda: self.model.forward(self.input_ids, self.positions), device=self.device,
                                           warmups=2, static=static, owner="CudaGraphRunner (decode)")

    def forward_decode(self, input_ids, positions):
        if self.graph is None:
            return self.model.forward(input_ids, positions)
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        return replay(self.graph, self.outputs)


class ModelWorker:
    def __init__(self, model, server_args, device):
        self.model_runner = ModelRunner(model, server_args, device)


def create_s2pro_sglang_engine(variant, device, server_args):
    text_model, audio_decoder = S2ProSGLangTextModel(device), AudioDecoder(device)
    want_cuda_graph = not server_args.disable_cuda_graph
    if variant == "fix":
        server_args.disable_cuda_graph = True            # defer capture until setup_vq_decode has run
    model_worker = ModelWorker(text_model, server_args, device)
    if variant == "fix":
        server_args.disable_cuda_graph = not want_cuda_graph
    audio_decoder.setup_caches(max_batch_size=server_args.max_running_requests)
    text_model.setup_vq_decode(audio_decoder, num_codebooks=NUM_CODEBOOKS, codebook_size=CODEBOOK_SIZE,
                               semantic_begin_id=SEMANTIC_BEGIN_ID, semantic_end_id=SEMANTIC_END_ID,
                               im_end_id=IM_END_ID, max_batch_size=server_args.max_running_requests)
    if variant == "fix" and want_cuda_graph:             # now capture with _decode_codebooks in the graph
        model_worker.model_runner.init_device_graphs()
    return S2ProSGLangModelRunner(model_worker)


class S2ProSGLangModelRunner:
    def __init__(self, model_worker):
        self.model_worker = model_worker

    def _update_vq_buffers(self, input_ids, last_codebook_values):
        text_model = self.model_worker.model_runner.model
        bs = input_ids.shape[0]
        is_semantic = (input_ids >= SEMANTIC_BEGIN_ID) & (input_ids <= SEMANTIC_END_ID)
        text_model._vq_mask[:bs].copy_(is_semantic)
        for i, values in enumerate(last_codebook_values):
            if values is not None and bool(is_semantic[i]):
                text_model._vq_codes[i].copy_(values)

    def execute_decode(self, input_ids, positions, last_codebook_values):
        self._update_vq_buffers(input_ids, last_codebook_values)
        self.model_worker.model_runner.forward_decode(input_ids, positions)
        text_model = self.model_worker.model_runner.model
        bs = input_ids.shape[0]
        codes = text_model._output_codes[:bs].clone()                  # _build_outputs
        output_ids = text_model._output_semantic_ids[:bs].clone()
        return codes, output_ids


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = create_s2pro_sglang_engine(variant, device, ServerArgs(disable_cuda_graph=not graphed))
        input_ids = torch.tensor([SEMANTIC_BEGIN_ID + 2, SEMANTIC_BEGIN_ID + 4], device=device)
        last = [torch.tensor([2, 1, 5], device=device), torch.tensor([4, 0, 3], device=device)]
        positions, outs = torch.tensor([5, 3], device=device), []
        for _ in range(STEPS):
            codes, output_ids = runner.execute_decode(input_ids, positions, last)
            outs.append(codes.to(torch.float32))
            input_ids, last, positions = output_ids, [codes[i, 1:] for i in range(MAX_BS)], positions + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
