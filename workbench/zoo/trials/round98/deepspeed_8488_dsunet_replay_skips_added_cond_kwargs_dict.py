"""DeepSpeed inference's ``DSUNet._graph_replay`` refreshes only the top-level tensor arguments of the captured UNet call: SDXL's ``added_cond_kwargs`` dict (pooled text embeddings, size/crop time ids) is never copied in, so every later image is denoised with the first request's conditioning.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/8488 ("Refresh the whole captured input before a CUDA graph
replay", deepspeedai/DeepSpeed, opened 2026-09-11 by vineethsaivs, open, not merged), stacked on
https://github.com/deepspeedai/DeepSpeed/pull/8408 ("Forward the inputs DSUNet._forward accepts to the UNet", open).
Read: both PR descriptions (#8488: "``_graph_replay`` copies a later call's values into the tensors the CUDA graph
captured, but it only matched ``torch.is_tensor``, so it stopped at the top level ... SDXL is the clearest case ...
``added_cond_kwargs={"text_embeds": ..., "time_ids": ...}`` ... That is a dict, not a tensor, so it was skipped. Every
image after the first was denoised with the first prompt's pooled embeddings and time ids"; the fix adds
``refresh_static_tensors()`` next to ``CUDAGraph``, which walks dicts, lists and tuples, and the replay sites zip over
the captured side); #8408's table (``_forward`` drops ``added_cond_kwargs``/``timestep_cond`` and passes ``return_dict``
positionally into ``class_labels``; fix: pass everything after ``encoder_hidden_states`` by keyword). DeepSpeed master
(snapshot of 2026-08-22): ``deepspeed/model_implementations/diffusers/unet.py`` (``DSUNet``), ``vae.py`` (the same six
replay lines) and ``features/cuda_graph.py`` (``CUDAGraph``). The diff of #8488 itself was not available to me:
``refresh_static_tensors`` below is written from its description.
Symptom: SDXL served with ``deepspeed.init_inference(pipe, enable_cuda_graph=True)``: the first image is right, every
later one is conditioned on the first request's pooled prompt embedding and its original-size/crop/target-size ids;
the images stay plausible and nothing raises.
Mechanism: ``DSUNet.forward`` captures on its first call, keeping that call's own arguments as ``static_inputs`` /
``static_kwargs``; the graph reads the tensors inside them, including the two inside the ``added_cond_kwargs`` dict.
Each later call goes to ``_graph_replay``, which ``copy_``s into the captured argument only where ``torch.is_tensor``
holds for the top-level argument: ``sample``, ``timestep`` and ``encoder_hidden_states`` are refreshed, the dict is
skipped. Within the first request the pipeline passes the same conditioning tensors again, so nothing shows; from the
second request on the replays read the first request's ``text_embeds`` and ``time_ids``.
Doctor: stale-input, at ``_graph_replay``: the replay serves a call whose ``added_cond_kwargs`` tensors differ from the
captured ones, but the step never writes those static inputs, so the graph reads what the first request left there.
Fix (upstream, proposed): ``refresh_static_tensors(self.static_inputs, inputs)`` and
``refresh_static_tensors(self.static_kwargs, kwargs)`` in ``_graph_replay``, recursing into dicts, lists and tuples
(zipping over the captured side).
Modelled: ``CUDAGraph`` and ``DSUNet`` (``forward``, ``_create_cuda_graph`` with its three warmups, ``_graph_replay``,
``_forward`` with #8408 applied, as #8488 assumes) line by line, with the fix under ``_variant == "fix"``; a reduced
diffusers ``StableDiffusionXLPipeline.__call__`` (``_get_add_time_ids``, classifier-free guidance with
``force_zeros_for_empty_prompt`` negatives, ``added_cond_kwargs``, the UNet call with ``return_dict=False``, guidance,
scheduler step) and the UNet's ``addition_embed_type == "text_time"`` path (``add_time_proj`` of the flattened time ids,
concatenated with ``text_embeds``, through ``add_embedding``, added to the timestep embedding). Stand-ins: the two text
encoders are one tiny embedding (hidden states, and a pooled projection), the UNet body is one token-mixing layer with
cross-attention, the scheduler is an eta=0 DDIM, the VAE is left out, float64; the capture's side-stream warmups are
``kit.capture(..., warmups=3)``.
Workload: three SDXL requests to one pipeline, one prompt each (CFG batch of 2), 3 denoising steps, guidance 5.0:
1024x1024, then 832x1216, then 1024x1024 with another prompt; outputs: the final latents of each. Eager runs the same
pipeline with ``enable_cuda_graph=False``. The bug serves request 1 exactly and requests 2 and 3 with request 1's
``text_embeds``/``time_ids`` (max error 6.52; request 1 itself is exact); the fix equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/8488"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_graph_replay"
SYMPTOM = ("SDXL with DeepSpeed inference CUDA graphs: DSUNet's replay refreshes only top-level tensor arguments, so "
           "added_cond_kwargs (pooled text embeds, time ids) keeps the first request's values for every later image")

VOCAB, SEQ, TXT, POOLED = 16, 3, 8, 8
LAT_C, LAT_HW, UNET_H, TIME_ID_DIM = 4, 4, 16, 4
STEPS, GUIDANCE = 3, 5.0
DTYPE = torch.float64

_variant = "bug"


# --- deepspeed/model_implementations/features/cuda_graph.py -----------------------------------------------------------

class CUDAGraph:

    def __init__(self, enable_cuda_graph=False):
        super().__init__()
        self.enable_cuda_graph = enable_cuda_graph


def refresh_static_tensors(static, new):
    """Copy ``new`` into the captured ``static`` structure: tensors, and tensors inside dicts, lists and tuples
    (walked over the captured side)."""
    if torch.is_tensor(static):
        static.copy_(new)
    elif isinstance(static, dict):
        for key, value in static.items():
            refresh_static_tensors(value, new[key])
    elif isinstance(static, (list, tuple)):
        for value, new_value in zip(static, new):
            refresh_static_tensors(value, new_value)


def _named_tensors(prefix, obj):
    """The tensors a captured argument structure holds, by name (what the wrapper keeps as its static inputs)."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    named = {}
    for key, value in items:
        named.update(_named_tensors(f"{prefix}[{key}]", value))
    return named


# --- deepspeed/model_implementations/diffusers/unet.py ----------------------------------------------------------------

class DSUNet(CUDAGraph):

    def __init__(self, unet, enable_cuda_graph=True):
        super().__init__(enable_cuda_graph=enable_cuda_graph)
        self.unet = unet
        # SD pipeline accesses this attribute
        self.in_channels = unet.in_channels
        self.device = self.unet.device
        self.dtype = self.unet.dtype
        self.config = self.unet.config
        self.fwd_count = 0
        self.cuda_graph_created = False

    def _graph_replay(self, *inputs, **kwargs):
        if _variant == "fix":
            refresh_static_tensors(self.static_inputs, inputs)
            refresh_static_tensors(self.static_kwargs, kwargs)
        else:
            for i in range(len(inputs)):
                if torch.is_tensor(inputs[i]):
                    self.static_inputs[i].copy_(inputs[i])
            for k in kwargs:
                if torch.is_tensor(kwargs[k]):
                    self.static_kwargs[k].copy_(kwargs[k])
        return replay(self._cuda_graphs, self.static_output)          # get_accelerator().replay_graph(...)

    def forward(self, *inputs, **kwargs):
        if self.enable_cuda_graph:
            if self.cuda_graph_created:
                outputs = self._graph_replay(*inputs, **kwargs)
            else:
                self._create_cuda_graph(*inputs, **kwargs)
                outputs = self._graph_replay(*inputs, **kwargs)
            return outputs
        else:
            return self._forward(*inputs, **kwargs)

    __call__ = forward

    def _create_cuda_graph(self, *inputs, **kwargs):
        # warmup to create the workspace and cublas handle (three side-stream calls), then
        # create cuda_graph and assign static_inputs and static_outputs
        self.static_inputs = inputs
        self.static_kwargs = kwargs
        static = {**_named_tensors("static_inputs", self.static_inputs),
                  **_named_tensors("static_kwargs", self.static_kwargs)}
        self._cuda_graphs, self.static_output = capture(
            lambda: self._forward(*self.static_inputs, **self.static_kwargs), device=self.device, warmups=3,
            name="DSUNet", owner="DSUNet", static=static)
        self.cuda_graph_created = True

    def _forward(self, sample, timestamp, encoder_hidden_states, return_dict=True, cross_attention_kwargs=None,
                 timestep_cond=None, added_cond_kwargs=None):
        # (#8408: everything after encoder_hidden_states by keyword)
        return self.unet(sample, timestamp, encoder_hidden_states, cross_attention_kwargs=cross_attention_kwargs,
                         timestep_cond=timestep_cond, added_cond_kwargs=added_cond_kwargs, return_dict=return_dict)


# --- diffusers (reduced) ----------------------------------------------------------------------------------------------

def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half_dim, dtype=DTYPE, device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = timesteps[:, None].to(DTYPE) * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return emb


@dataclasses.dataclass
class UNet2DConditionOutput:
    sample: torch.Tensor


class UNet2DConditionModel:
    in_channels = LAT_C

    def __init__(self, device, gen):
        self.device, self.dtype = device, DTYPE
        self.config = {"in_channels": LAT_C, "addition_embed_type": "text_time",
                       "addition_time_embed_dim": TIME_ID_DIM}
        r = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.time_embedding = r(UNET_H, UNET_H, scale=0.3)
        self.add_embedding = r(POOLED + 6 * TIME_ID_DIM, UNET_H, scale=0.3)
        self.w_in, self.w_q = r(LAT_C, UNET_H, scale=0.5), r(UNET_H, UNET_H, scale=0.4)
        self.w_k, self.w_v = r(TXT, UNET_H, scale=0.4), r(TXT, UNET_H, scale=0.4)
        self.w_out = r(UNET_H, LAT_C, scale=0.1)

    def add_time_proj(self, time_ids):
        return get_timestep_embedding(time_ids, self.config["addition_time_embed_dim"])

    def __call__(self, sample, timestep, encoder_hidden_states, class_labels=None, timestep_cond=None,
                 attention_mask=None, cross_attention_kwargs=None, added_cond_kwargs=None, return_dict=True):
        b, c, h, w = sample.shape
        t_emb = get_timestep_embedding(timestep.reshape(1).expand(b), UNET_H)
        emb = torch.tanh(t_emb @ self.time_embedding)
        aug_emb = None
        if self.config["addition_embed_type"] == "text_time":
            text_embeds = added_cond_kwargs.get("text_embeds")
            time_ids = added_cond_kwargs.get("time_ids")
            time_embeds = self.add_time_proj(time_ids.flatten())
            time_embeds = time_embeds.reshape((text_embeds.shape[0], -1))
            add_embeds = torch.concat([text_embeds, time_embeds], dim=-1)
            aug_emb = torch.tanh(add_embeds @ self.add_embedding)
        emb = emb + aug_emb if aug_emb is not None else emb
        x = sample.permute(0, 2, 3, 1).reshape(b, h * w, c)
        hidden = torch.tanh(x @ self.w_in + emb[:, None, :])
        q, k, v = hidden @ self.w_q, encoder_hidden_states @ self.w_k, encoder_hidden_states @ self.w_v
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(UNET_H), dim=-1)        # cross-attention
        out = ((hidden + attn @ v) @ self.w_out).reshape(b, h, w, c).permute(0, 3, 1, 2)
        if not return_dict:
            return (out,)
        return UNet2DConditionOutput(sample=out)


class TextEncoders:
    """Both SDXL text encoders in one: penultimate hidden states and the pooled projection."""

    def __init__(self, device, gen):
        self.embed = randn(VOCAB, TXT, gen=gen, device=device).to(DTYPE)
        self.w = randn(TXT, TXT, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.text_projection = randn(TXT, POOLED, gen=gen, device=device, scale=0.5).to(DTYPE)

    def __call__(self, input_ids):
        hidden = torch.tanh(self.embed[input_ids] @ self.w)                           # [B, SEQ, TXT]
        return hidden, hidden[:, -1] @ self.text_projection                           # pooled: last token


class DDIMScheduler:
    """eta=0 DDIM stepping by timestep value (the alphas are host floats)."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).tolist()
        self.num_train_timesteps, self.init_noise_sigma = num_train_timesteps, 1.0

    def set_timesteps(self, num_inference_steps, device):
        self.ratio = self.num_train_timesteps // num_inference_steps
        self._ts = [(num_inference_steps - 1 - i) * self.ratio + 1 for i in range(num_inference_steps)]
        self.timesteps = torch.tensor(self._ts, dtype=torch.long).to(device)

    def scale_model_input(self, sample, timestep):
        return sample

    def step(self, model_output, step_index, sample, return_dict=False):
        t = self._ts[step_index]
        a_t = self.alphas_cumprod[t]
        a_prev = self.alphas_cumprod[t - self.ratio] if t - self.ratio >= 0 else 1.0
        pred_x0 = (sample - math.sqrt(1 - a_t) * model_output) / math.sqrt(a_t)
        return (math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev) * model_output,)


class StableDiffusionXLPipeline:
    def __init__(self, device, enable_cuda_graph):
        gen = generator(8488)
        self.device = device
        self.text_encoder = TextEncoders(device, gen)
        # deepspeed.init_inference(pipe, enable_cuda_graph=...): generic_injection wraps the UNet in DSUNet
        self.unet = DSUNet(UNet2DConditionModel(device, gen), enable_cuda_graph=enable_cuda_graph)
        self.scheduler = DDIMScheduler()
        self.force_zeros_for_empty_prompt = True

    def encode_prompt(self, prompt_ids):
        text_input_ids = torch.tensor(prompt_ids, dtype=torch.long).to(self.device)   # tokenizer output
        prompt_embeds, pooled_prompt_embeds = self.text_encoder(text_input_ids)
        # negative_prompt is None and force_zeros_for_empty_prompt: zero negatives
        return (prompt_embeds, torch.zeros_like(prompt_embeds), pooled_prompt_embeds,
                torch.zeros_like(pooled_prompt_embeds))

    def _get_add_time_ids(self, original_size, crops_coords_top_left, target_size, dtype):
        add_time_ids = list(original_size + crops_coords_top_left + target_size)
        return torch.tensor([add_time_ids], dtype=dtype)

    def __call__(self, prompt_ids, latents, height, width, num_inference_steps=STEPS, guidance_scale=GUIDANCE):
        original_size = target_size = (height, width)
        crops_coords_top_left = (0, 0)
        batch_size = len(prompt_ids)
        prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds = \
            self.encode_prompt(prompt_ids)
        self.scheduler.set_timesteps(num_inference_steps, self.device)
        timesteps = self.scheduler.timesteps
        latents = latents * self.scheduler.init_noise_sigma

        add_text_embeds = pooled_prompt_embeds
        add_time_ids = self._get_add_time_ids(original_size, crops_coords_top_left, target_size, DTYPE)
        negative_add_time_ids = add_time_ids
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
        add_text_embeds = torch.cat([negative_pooled_prompt_embeds, add_text_embeds], dim=0)
        add_time_ids = torch.cat([negative_add_time_ids, add_time_ids], dim=0)
        add_time_ids = add_time_ids.to(self.device).repeat(batch_size, 1)

        for i, t in enumerate(timesteps):
            latent_model_input = torch.cat([latents] * 2)                           # classifier-free guidance
            latent_model_input = self.scheduler.scale_model_input(latent_model_input, t)
            added_cond_kwargs = {"text_embeds": add_text_embeds, "time_ids": add_time_ids}
            noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds, timestep_cond=None,
                                   cross_attention_kwargs=None, added_cond_kwargs=added_cond_kwargs,
                                   return_dict=False)[0]
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            latents = self.scheduler.step(noise_pred, i, latents, return_dict=False)[0]
        return latents                                                              # (output_type="latent")


# --- the workload -----------------------------------------------------------------------------------------------------

REQUESTS = [([[3, 7, 1]], 1024, 1024), ([[5, 2, 14]], 832, 1216), ([[9, 4, 11]], 1024, 1024)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(84880)
    latents = [randn(len(p), LAT_C, LAT_HW, LAT_HW, gen=gen, device=device).to(DTYPE) for p, _, _ in REQUESTS]

    def serve(enable_cuda_graph):
        pipe = StableDiffusionXLPipeline(device, enable_cuda_graph)
        return [pipe(prompts, lat, height, width).clone() for (prompts, height, width), lat in zip(REQUESTS, latents)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
