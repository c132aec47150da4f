"""Pi0.5 RTX ``set_language_embeds()`` replaces the prompt-embeds buffer on a same-length prompt change; the recorded graph keeps copying from the freed old one.

Upstream: https://github.com/flashrt-project/FlashRT/commit/3a34a52a721c76ee39d59d64c0bdfefabac7e6e6 ("fix(pi05):
support state prompts without repeated graph rebuilds", flashrt-project/FlashRT, pushed to main 2026-05-28; no PR).
Symptom: after the first calibration (graph recorded), ``set_prompt()`` with a new instruction of the same token length
("pick up the red block" -> "pick up the blue block") has no effect on the actions: every replay still conditions on
the old prompt's embeddings, or on whatever a later allocation put in their freed block. No error is raised. Without
the graph (``run_pipeline`` eagerly) the new prompt is used. Pi0.5 state-in-prompt (the discretised state changes the
prompt text every step, its length often not) is what made this common and motivated the commit.
Mechanism: ``Pi05Pipeline.run_pipeline()`` (flash_rt/models/pi05/pipeline_rtx.py) starts with
``_copy_lang_embeds_to_encoder_x()``: ``cudaMemcpyAsync(encoder_x + vs_enc*ENC_D*2, self._lang_embeds_buf.ptr, nbytes,
D2D)``, re-seeding the prompt slot of the encoder residual stream that the encoder layers overwrite in place.
``record_infer_graph()`` captures ``run_pipeline``, so the graph's memcpy node holds the capture-time
``_lang_embeds_buf`` address. ``Pi05TorchFrontendRtx.set_prompt()`` (frontends/torch/pi05_rtx.py) rebuilds the
pipeline only when ``prompt_len != current_prompt_len``; for a same-length prompt it keeps the pipeline and its
recorded graph (``calibrate()`` is not run again) and calls ``pipeline.set_language_embeds(embeds_np)``. Before the
fix that did ``self._lang_embeds_buf = CudaBuffer.from_numpy(arr)``: a new device buffer, and the old one, losing
its last reference, is freed (``CudaBuffer.__del__`` -> ``cudaFree``). The setter's own eager copy puts the new
embeds into ``encoder_x``, but every later ``forward()`` replays the graph, whose first node overwrites that slot
from the freed address. Eager ``run_pipeline`` resolves ``self._lang_embeds_buf`` at call time and is correct.
Doctor: dangling-reference, at set_language_embeds (it rebinds ``_lang_embeds_buf`` to a new buffer and drops the
last reference to the one the recorded graph's prompt copy reads, so every replay after a same-length prompt change
reads memory whose owner released it).
Fix (upstream): when a ``_lang_embeds_buf`` of the same ``nbytes`` exists, ``self._lang_embeds_buf.upload(arr)``
writes the new embeds into it in place (the baked source pointer stays valid); only a size change allocates, and a
size change goes through a pipeline rebuild and a new capture anyway. (The same hunk is in pipeline_rtx_fp16/
_batched/_cfg; the commit's per-prompt-length pipeline cache and state-prompt formatting are features, not modelled.)
Modelled: a tiny Pi0.5: one camera view of 4 patches, a 1-layer "SigLIP", a 2-layer bidirectional "Gemma" encoder
over [vision tokens | prompt tokens] that leaves its last layer's K/V for the decoder, and a 1-layer action expert
doing ``num_steps`` flow steps on ``diffusion_noise`` in place (action_out pre-scaled by -1/num_steps, as upstream).
Single precision instead of BF16/FP8, no calibration/autotune, no decoder-only graph (``cache_frames`` = 1), no RL
mode. ``CudaBuffer`` wraps a torch tensor (its ``__del__``/``cudaFree`` is the tensor's release); the tokenizer is a
word table ([BOS] + words + "\\n", as the SentencePiece fallback). Released blocks are handed to the next allocation
of their size (``reuse_freed_blocks`` on the CPU; the caching allocator on CUDA). The first same-length change is
wrong on both backends however the block is reused: the new buffer is allocated, and the new prompt embedded,
while the captured buffer is still alive, so the new embeds never land in it before the next replay reads it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/flashrt-project/FlashRT/commit/3a34a52a721c76ee39d59d64c0bdfefabac7e6e6"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "set_language_embeds"
SYMPTOM = ("after a same-length set_prompt the recorded Pi0.5 graph copies the prompt embeds from the freed old "
           "_lang_embeds_buf: the new instruction is ignored")

NUM_VIEWS, VIS_SEQ_PER_VIEW, PATCH_DIM = 1, 4, 12     # upstream 256 patches of 14x14x3 per view
VIS_D, ENC_D, DEC_D = 8, 16, 8                        # upstream 1152, 2048, 1024
ENC_L, DEC_L = 2, 1                                   # upstream 18, 18
CHUNK_SIZE, ACTION_DIM, LIBERO_ACTION_DIM = 5, 3, 2   # upstream 10, 32, 7
NUM_STEPS = 3                                         # upstream 10
MAX_PROMPT_LEN_DEFAULT = 48
EPS = 1e-6

_DEVICE = "cpu"        # the device CudaBuffer allocates on (flash_rt.core.cuda_buffer's _cudart)

# --- tokenizer (the SentencePiece fallback: [BOS] + Encode(prompt) + [108 "\n"]) --------------------------------------
_WORDS = ["<pad>", "<bos>", "\n", "pick", "up", "the", "red", "blue", "green", "block", "cup", "put", "away", "bowl"]
VOCAB = len(_WORDS)


def _tokenize(prompt_text: str) -> list[int]:
    return [_WORDS.index("<bos>")] + [_WORDS.index(w) for w in prompt_text.split()] + [_WORDS.index("\n")]


# --- flash_rt/core/cuda_buffer.py -------------------------------------------------------------------------------------

class CudaBuffer:
    """GPU buffer (device memory). Dropping the last reference releases it (upstream ``__del__`` -> ``cudaFree``)."""

    def __init__(self, nbytes: int):
        self.t = torch.empty(nbytes // 4, dtype=torch.float32, device=_DEVICE)     # cudaMalloc
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> "CudaBuffer":
        """Create device buffer, upload via H2D."""
        arr = np.ascontiguousarray(arr)
        buf = cls(arr.nbytes)
        buf.t.copy_(torch.from_numpy(arr).reshape(-1))
        return buf

    @classmethod
    def device_zeros(cls, count: int) -> "CudaBuffer":
        buf = cls(count * 4)
        buf.t.zero_()
        return buf

    def upload(self, arr: np.ndarray):
        """Upload numpy -> buffer (in place)."""
        assert arr.nbytes <= self._nbytes
        arr = np.ascontiguousarray(arr)
        self.t[:arr.size].copy_(torch.from_numpy(arr).reshape(-1))


# --- flash_rt/models/pi05/pipeline_rtx.py -----------------------------------------------------------------------------

def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class Pi05Pipeline:
    def __init__(self, weights, *, num_views: int, max_prompt_len: int, chunk_size: int, num_steps: int,
                 variant: str):
        self.weights = weights
        self.num_views, self.max_prompt_len = num_views, max_prompt_len
        self.chunk_size, self.num_steps = chunk_size, num_steps
        self.variant = variant                          # (which FlashRT: before/after 3a34a52a)
        self.vision_seq = self.num_views * VIS_SEQ_PER_VIEW
        self.vision_seq_enc = self.vision_seq           # vision_pool_factor 1
        self.encoder_seq_len = self.vision_seq_enc + self.max_prompt_len
        self.bufs = self._allocate_buffers()
        self._graph = None                              # CUDA graph state (set by record_infer_graph)

    def _allocate_buffers(self) -> dict:
        vs, es, ds = self.vision_seq, self.encoder_seq_len, self.chunk_size
        return {
            "observation_images_normalized": CudaBuffer.device_zeros(vs * PATCH_DIM),
            "vision_x": CudaBuffer.device_zeros(vs * VIS_D),
            "encoder_x": CudaBuffer.device_zeros(es * ENC_D),
            "enc_k": CudaBuffer.device_zeros(es * DEC_D),        # attn backend's encoder K/V (last layer)
            "enc_v": CudaBuffer.device_zeros(es * DEC_D),
            "decoder_x": CudaBuffer.device_zeros(ds * DEC_D),
            "decoder_action_buf": CudaBuffer.device_zeros(ds * ACTION_DIM),
            "diffusion_noise": CudaBuffer.device_zeros(ds * ACTION_DIM),
        }

    def _buf(self, name, *shape):
        return self.bufs[name].t.view(*shape)

    def vision_encoder(self) -> None:
        W, vs = self.weights, self.vision_seq
        x = self._buf("vision_x", vs, VIS_D)
        torch.matmul(self._buf("observation_images_normalized", vs, PATCH_DIM), W["vision_patch_embedding_w"], out=x)
        x.add_(W["vision_position_embedding"])
        x.add_(F.gelu(_rms(x) @ W["vision_ffn_up_w"]) @ W["vision_ffn_down_w"])

    def transformer_encoder(self) -> None:
        """The language embeds have already been copied into encoder_x[vs_enc:vs_enc+prompt_len]."""
        W, vs, es = self.weights, self.vision_seq_enc, self.encoder_seq_len
        x = self._buf("encoder_x", es, ENC_D)
        torch.matmul(self._buf("vision_x", vs, VIS_D), W["encoder_multi_modal_projector_w"], out=x[:vs])
        x[:vs].add_(W["encoder_multi_modal_projector_b"])
        for i in range(ENC_L):                          # residual stream overwritten in place
            h = _rms(x)
            q, k, v = h @ W[f"encoder_attn_q_w_{i}"], h @ W[f"encoder_attn_k_w_{i}"], h @ W[f"encoder_attn_v_w_{i}"]
            if i == ENC_L - 1:                          # the prefix K/V the decoder attends to
                self._buf("enc_k", es, DEC_D).copy_(k)
                self._buf("enc_v", es, DEC_D).copy_(v)
            attn = torch.softmax(q @ k.t() * DEC_D ** -0.5, dim=-1) @ v
            x.add_(attn @ W[f"encoder_attn_o_w_{i}"])
            x.add_(F.gelu(_rms(x) @ W[f"encoder_ffn_up_w_{i}"]) @ W[f"encoder_ffn_down_w_{i}"])

    def transformer_decoder(self) -> None:
        """Run num_steps-step diffusion denoise on bufs['diffusion_noise']."""
        W, es, ds = self.weights, self.encoder_seq_len, self.chunk_size
        noise, dx = self._buf("diffusion_noise", ds, ACTION_DIM), self._buf("decoder_x", ds, DEC_D)
        act = self._buf("decoder_action_buf", ds, ACTION_DIM)
        enc_k, enc_v = self._buf("enc_k", es, DEC_D), self._buf("enc_v", es, DEC_D)
        for step in range(self.num_steps):
            torch.matmul(noise, W["decoder_action_in_proj_w"], out=dx)
            dx.add_(W["decoder_action_in_proj_b"] + W["decoder_time_embeds"][step])
            for i in range(DEC_L):
                h = _rms(dx)
                q, k, v = h @ W[f"decoder_attn_q_w_{i}"], h @ W[f"decoder_attn_k_w_{i}"], h @ W[f"decoder_attn_v_w_{i}"]
                keys, values = torch.cat([enc_k, k]), torch.cat([enc_v, v])
                dx.add_(torch.softmax(q @ keys.t() * DEC_D ** -0.5, dim=-1) @ values @ W[f"decoder_attn_o_w_{i}"])
                dx.add_(F.gelu(_rms(dx) @ W[f"decoder_ffn_up_w_{i}"]) @ W[f"decoder_ffn_down_w_{i}"])
            torch.matmul(_rms(dx), W["decoder_action_out_proj_w"], out=act)
            act.add_(W["decoder_action_out_proj_b"])
            noise.add_(act)                             # weights pre-scaled by -1/num_steps by frontend

    def run_pipeline(self) -> None:
        """Run vision -> encoder -> decoder end-to-end (re-copying the stored language embeddings first)."""
        self._copy_lang_embeds_to_encoder_x()
        self.vision_encoder()
        self.transformer_encoder()
        self.transformer_decoder()

    def record_infer_graph(self, device: str) -> None:
        """Capture the full pipeline as a CUDA Graph (3 warmups on the capture stream, then capture)."""
        self._graph, _ = capture(
            self.run_pipeline, device=device, warmups=3, name="Pi05Pipeline infer", owner="Pi05Pipeline",
            static={"observation_images_normalized": self.bufs["observation_images_normalized"].t,
                    "diffusion_noise": self.bufs["diffusion_noise"].t},
            on_freed="reuse")

    @property
    def input_images_buf(self) -> CudaBuffer:
        return self.bufs["observation_images_normalized"]

    @property
    def input_noise_buf(self) -> CudaBuffer:
        return self.bufs["diffusion_noise"]

    def set_language_embeds(self, lang_embeds_np) -> None:
        """Store language embeddings for this prompt (re-copied into encoder_x at every forward)."""
        prompt_len = lang_embeds_np.shape[0]
        assert prompt_len <= self.max_prompt_len
        assert lang_embeds_np.shape[1] == ENC_D
        # Store a persistent device copy of the (prompt_len, ENC_D) embeds.
        arr = np.ascontiguousarray(lang_embeds_np)
        if self.variant == "bug":
            self._lang_embeds_buf = CudaBuffer.from_numpy(arr)
        else:
            # CUDA Graph capture bakes the source pointer used by
            # _copy_lang_embeds_to_encoder_x(), so same-shape prompt updates must
            # upload into the existing buffer instead of replacing it.
            if (hasattr(self, "_lang_embeds_buf")
                    and self._lang_embeds_buf.nbytes == arr.nbytes):
                self._lang_embeds_buf.upload(arr)
            else:
                self._lang_embeds_buf = CudaBuffer.from_numpy(arr)
        self._current_prompt_len = prompt_len
        # Initial copy into encoder_x (so the FIRST calibration pass sees the correct lang embeds).
        self._copy_lang_embeds_to_encoder_x()

    def _copy_lang_embeds_to_encoder_x(self) -> None:
        """D2D copy stored lang embeds into encoder_x[vs:vs+prompt_len]."""
        if not hasattr(self, "_lang_embeds_buf"):
            return
        start = self.vision_seq_enc * ENC_D             # language embeds follow pooled vision tokens
        n = self._lang_embeds_buf.nbytes // 4
        self.bufs["encoder_x"].t[start:start + n].copy_(self._lang_embeds_buf.t[:n])

    def forward(self) -> torch.Tensor:
        """Replay the captured graph (or fall back to run_pipeline); diffusion_noise then holds the actions."""
        if self._graph is not None:
            return replay(self._graph, self._buf("diffusion_noise", self.chunk_size, ACTION_DIM))
        self.run_pipeline()
        return self._buf("diffusion_noise", self.chunk_size, ACTION_DIM)


# --- flash_rt/frontends/torch/pi05_rtx.py -----------------------------------------------------------------------------

def _embed_prompt(prompt_text: str, embedding_weight: torch.Tensor, max_len: int = 48):
    """Tokenise + embed via the PaliGemma embedding table (on the device)."""
    tokens = _tokenize(prompt_text)[:max_len]
    token_ids = torch.tensor(tokens, dtype=torch.long, device=embedding_weight.device)
    prompt_len = len(token_ids)
    embeds = F.embedding(token_ids, embedding_weight)
    embeds = embeds * float(embeds.shape[-1] ** 0.5)
    return embeds, prompt_len


def make_checkpoint(device: str) -> dict:
    gen = generator(3434)

    def w(*shape, scale=None):
        s = shape[0] ** -0.5 if scale is None else scale
        return (torch.randn(*shape, generator=gen) * s).to(device)

    W = {"embedding_weight": w(VOCAB, ENC_D, scale=0.3),
         "vision_patch_embedding_w": w(PATCH_DIM, VIS_D), "vision_position_embedding": w(VIS_SEQ_PER_VIEW, VIS_D, scale=0.1),
         "vision_ffn_up_w": w(VIS_D, 2 * VIS_D), "vision_ffn_down_w": w(2 * VIS_D, VIS_D),
         "encoder_multi_modal_projector_w": w(VIS_D, ENC_D), "encoder_multi_modal_projector_b": w(ENC_D, scale=0.1),
         "decoder_action_in_proj_w": w(ACTION_DIM, DEC_D), "decoder_action_in_proj_b": w(DEC_D, scale=0.1),
         "decoder_time_embeds": w(NUM_STEPS, DEC_D, scale=0.5),
         # frontend pre-scales action_out by -1/num_steps
         "decoder_action_out_proj_w": w(DEC_D, ACTION_DIM) * (-1.0 / NUM_STEPS),
         "decoder_action_out_proj_b": w(ACTION_DIM, scale=0.1) * (-1.0 / NUM_STEPS)}
    for i in range(ENC_L):
        W |= {f"encoder_attn_q_w_{i}": w(ENC_D, DEC_D), f"encoder_attn_k_w_{i}": w(ENC_D, DEC_D),
              f"encoder_attn_v_w_{i}": w(ENC_D, DEC_D), f"encoder_attn_o_w_{i}": w(DEC_D, ENC_D),
              f"encoder_ffn_up_w_{i}": w(ENC_D, 2 * ENC_D), f"encoder_ffn_down_w_{i}": w(2 * ENC_D, ENC_D)}
    for i in range(DEC_L):
        W |= {f"decoder_attn_q_w_{i}": w(DEC_D, DEC_D), f"decoder_attn_k_w_{i}": w(DEC_D, DEC_D),
              f"decoder_attn_v_w_{i}": w(DEC_D, DEC_D), f"decoder_attn_o_w_{i}": w(DEC_D, DEC_D),
              f"decoder_ffn_up_w_{i}": w(DEC_D, 2 * DEC_D), f"decoder_ffn_down_w_{i}": w(2 * DEC_D, DEC_D)}
    return W


class Pi05TorchFrontendRtx:
    def __init__(self, device: str, variant: str, use_cuda_graph: bool = True):
        self.device, self.variant, self.use_cuda_graph = device, variant, use_cuda_graph
        self.ckpt = make_checkpoint(device)
        self.embedding_weight = self.ckpt["embedding_weight"]
        self.num_views, self.chunk_size, self._num_steps = NUM_VIEWS, CHUNK_SIZE, NUM_STEPS
        self.calibrated = self.graph_recorded = False
        self.current_prompt_len = 0
        self.pipeline: Pi05Pipeline | None = None
        self._noise_gen = generator(5005)               # (upstream: self._noise_buf.normal_())
        self._noise_buf = torch.zeros(CHUNK_SIZE, ACTION_DIM, device=device)
        self._noise_out = torch.zeros(CHUNK_SIZE, ACTION_DIM, device=device)
        self._img_buf = torch.zeros(NUM_VIEWS * VIS_SEQ_PER_VIEW, PATCH_DIM, device=device)
        self.norm_stats = {"mean": torch.linspace(-0.2, 0.2, ACTION_DIM), "std": torch.linspace(0.5, 1.5, ACTION_DIM)}

    def set_prompt(self, prompt_text: str) -> None:
        """Tokenise prompt + (re)build the pipeline for the exact prompt length."""
        embeds, prompt_len = _embed_prompt(prompt_text, self.embedding_weight, max_len=MAX_PROMPT_LEN_DEFAULT)
        if self.pipeline is None or prompt_len != self.current_prompt_len:
            # Rebuild the pipeline with the exact prompt length to avoid wasted compute on padding tokens.
            self.current_prompt_len = prompt_len
            self.graph_recorded = False
            self.calibrated = False
            self.pipeline = Pi05Pipeline(self.ckpt, num_views=self.num_views, max_prompt_len=prompt_len,
                                         chunk_size=self.chunk_size, num_steps=self._num_steps, variant=self.variant)
        # Upload language embeds into pipeline's encoder_x slot
        embeds_np = embeds.contiguous().cpu().numpy()
        self.pipeline.set_language_embeds(embeds_np)
        self._frame_count = 0

    def _fill_img_buf(self, observation: dict) -> None:
        self._img_buf.copy_(observation["image"])

    @staticmethod
    def _copy_tensor_to_pipeline_buf_stream(t: torch.Tensor, buf: CudaBuffer) -> None:
        buf.t.copy_(t.reshape(-1))

    def calibrate(self, observation: dict) -> None:
        """Single-frame calibration pass, then graph capture."""
        if self.calibrated:
            return                                      # "calibrate() called a second time; returning"
        self._fill_img_buf(observation)
        self._copy_tensor_to_pipeline_buf_stream(self._img_buf, self.pipeline.input_images_buf)
        self._copy_tensor_to_pipeline_buf_stream(self._noise_buf, self.pipeline.input_noise_buf)
        self.pipeline.run_pipeline()
        if self.use_cuda_graph:
            self.pipeline.record_infer_graph(self.device)
            self.graph_recorded = True
        self.calibrated = True

    def infer(self, observation: dict) -> dict:
        self._frame_count += 1
        self._noise_buf.copy_(torch.randn(CHUNK_SIZE, ACTION_DIM, generator=self._noise_gen))
        self._copy_tensor_to_pipeline_buf_stream(self._noise_buf, self.pipeline.input_noise_buf)
        self._fill_img_buf(observation)
        self._copy_tensor_to_pipeline_buf_stream(self._img_buf, self.pipeline.input_images_buf)
        out = self.pipeline.forward()
        self._noise_out.copy_(out)                      # D2D download -> staging tensor
        raw_actions = self._noise_out.float().cpu()
        unnorm = raw_actions * self.norm_stats["std"] + self.norm_stats["mean"]
        return {"actions": unnorm[:, :LIBERO_ACTION_DIM]}


def run(variant: str, device: str = "cpu"):
    global _DEVICE
    _DEVICE = device
    gen = generator(3434_52)
    observations = [{"image": torch.randn(NUM_VIEWS * VIS_SEQ_PER_VIEW, PATCH_DIM, generator=gen).to(device)}
                    for _ in range(8)]
    # the robot's instructions over an episode: all of one token length (7), so no pipeline rebuild
    schedule = [("pick up the red block", 3), ("pick up the blue block", 3), ("put the green cup away", 2)]

    def serve(use_cuda_graph: bool):
        frontend = Pi05TorchFrontendRtx(device, variant, use_cuda_graph=use_cuda_graph)
        outs, frames = [], iter(observations)
        for prompt, n in schedule:
            frontend.set_prompt(prompt)
            for _ in range(n):
                obs = next(frames)
                frontend.calibrate(obs)                 # first call only: calibration + graph capture
                outs.append(frontend.infer(obs)["actions"].clone())
        return outs

    def served():
        with reuse_freed_blocks():       # a released block goes to the next allocation of its size
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
