"""DeepSpeed inference's ``DSUNet`` captures one CUDA graph, with the batch of its first call, and replays it for every later call: a Stable Diffusion request with more images than the first one cannot be copied into the captured inputs.
Upstream: https://github.com/deepspeedai/DeepSpeed-MII/issues/132 ("MII Text to Image Task Issue",
deepspeedai/DeepSpeed-MII, opened 2023-01-04, confirmed by maintainer mrwyattii on 2023-01-17: "stable diffusion uses
cuda graphs in the MII deployment ... DeepSpeed-inference captures the graph only once for a model, using the initially
provided batch size. As a result, changing the batch size will give the error you are seeing. We are working on a
solution that allows capturing multiple graph[s]"). Read: the issue (the reporter's errors "output with shape [1, 77]
doesn't match the broadcast shape [4, 77]" through MII, and "The size of tensor a (4) must match the size of tensor b
(2) at non-singleton dimension 0" with DeepSpeed directly); ``DSUNet``
(``deepspeed/model_implementations/diffusers/unet.py``) and ``DSClipEncoder`` at the DeepSpeed commit of that time
(35eabb0a, Jan 2023: ``forward``, ``_create_cuda_graph`` with three side-stream warmups and ``self.static_inputs =
inputs``, ``_graph_replay`` copying every tensor argument into the captured one, ``_forward``); the same pattern in
``InferenceEngine`` (``deepspeed/inference/engine.py`` at e4b3b610); and the two DeepSpeed PRs that proposed the fix,
neither merged: #2458 by maintainer cmikeh2 ("Collect unique CUDA graphs for Unique Input Signatures ... Enables serving
different batch sizes with CUDA Graph enabled (would previously crash)") and #2896 (same title; its review threads show
``self._cuda_graphs[shape_signature].replay()`` and per-signature
``static_inputs``/``static_kwargs``/``static_output``). The fix below is reconstructed from those excerpts; the helper
that computes the signature is not shown there, its name and body here are mine.
Symptom: after a first request with one prompt, a request with two prompts (or more images per prompt) fails with a
RuntimeError from the copy into the captured inputs (upstream: "output with shape [1, 77] doesn't match the broadcast
shape [4, 77]" on the CLIP encoder's token ids, "The size of tensor a (4) must match the size of tensor b (2)" on a
latent); only a restart with the new batch size works.
Mechanism: ``DSUNet.forward`` captures on its first call and, once ``cuda_graph_created`` is set, sends every later call
to ``_graph_replay``, which ``copy_``s each tensor argument into the argument of the first call (``static_inputs``). The
classifier-free-guidance batch of the first request (2 latents) sized every static buffer; a request of 2 prompts gives
4 latents, which do not fit the captured [2, ...] buffer, and torch refuses the copy. The graph itself would also only
ever compute 2 rows.
Doctor: undersized-buffer, at forward. A replay is asked to serve a batch of 4 where the graph and its static inputs
were captured for 2: ``forward`` never compares the call's shapes with the captured ones.
Fix (upstream, proposed in #2458/#2896, reconstructed): key the graphs by the input shape signature. ``forward``
computes the signature of the call and captures a new graph (with its own static inputs and output) for a signature it
has not seen; ``_graph_replay`` copies into and replays the graph of that signature.
Modelled: ``DSUNet`` (``forward``, ``_create_cuda_graph``, ``_graph_replay``, ``_forward``) as upstream wrote it, with
the fix's lines under ``variant == "fix"``; a reduced diffusers ``StableDiffusionPipeline.__call__`` (prompt embeds for
``batch_size * num_images_per_prompt`` with the unconditional half, ``torch.cat([latents] * 2)``, ``.sample``, guidance,
scheduler step) and a DDIM (eta=0) scheduler stepping by index. Stand-ins: the text encoder is a tiny embedding + linear
run eagerly (``DSClipEncoder``, which fails the same way on the token ids, is left out, as is the VAE); the UNet is one
token-mixing layer with a timestep embedding and cross-attention to the text embeddings; the three side-stream warmups
are ``kit.capture(..., warmups=3)``; latents are drawn by the caller; float64.
Workload: three requests to one pipeline: 1 prompt, then 2 prompts, then 1 prompt again; 3 denoising steps each,
guidance 7.5. Eager runs the same pipeline with ``enable_cuda_graph=False``. The bug serves request 1 and raises at the
first UNet call of request 2 (RuntimeError "The size of tensor a (2) must match the size of tensor b (4) at
non-singleton dimension 0": the [2, 4, 4, 4] static latents cannot take the [4, 4, 4, 4] CFG batch); the fix captures a
second graph for the batch of 4, replays the first graph again for request 3, and its final latents equal eager (max
error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed-MII/issues/132"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "forward"
SYMPTOM = ("DeepSpeed inference with enable_cuda_graph: DSUNet captures one graph with the first request's batch and "
           "replays it for every call, so a later Stable Diffusion request with more images fails to copy its larger "
           "latents into the captured static inputs")

VOCAB, SEQ, TXT = 16, 3, 8
LAT_C, LAT_HW, UNET_H = 4, 4, 8
STEPS, GUIDANCE = 3, 7.5
DTYPE = torch.float64

_variant = "bug"


# --- the reduced diffusers models -----------------------------------------------------------------------------------

@dataclasses.dataclass
class UNet2DConditionOutput:
    sample: torch.Tensor


class CLIPTextModel:
    def __init__(self, device, gen):
        self.embed = randn(VOCAB, TXT, gen=gen, device=device).to(DTYPE)
        self.w = randn(TXT, TXT, gen=gen, device=device, scale=0.4).to(DTYPE)

    def __call__(self, input_ids):
        return torch.tanh(self.embed[input_ids] @ self.w)                # [B, SEQ, TXT]


class UNet2DConditionModel:
    in_channels = LAT_C

    def __init__(self, device, gen):
        self.device, self.dtype = device, DTYPE
        self.config = {"in_channels": LAT_C}
        r = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.w_in, self.w_q = r(LAT_C, UNET_H, scale=0.5), r(UNET_H, UNET_H, scale=0.4)
        self.w_k, self.w_v = r(TXT, UNET_H, scale=0.4), r(TXT, UNET_H, scale=0.4)
        self.w_out = r(UNET_H, LAT_C, scale=0.3)
        self.freqs = (torch.arange(1, UNET_H + 1, dtype=DTYPE) / 700.0).to(device)

    def __call__(self, sample, timestep, encoder_hidden_states, return_dict=True):
        b, c, h, w = sample.shape
        x = sample.permute(0, 2, 3, 1).reshape(b, h * w, c)
        hidden = torch.tanh(x @ self.w_in + torch.sin(timestep.to(DTYPE) * self.freqs))     # [b, hw, UNET_H]
        q, k, v = hidden @ self.w_q, encoder_hidden_states @ self.w_k, encoder_hidden_states @ self.w_v
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(UNET_H), dim=-1)            # cross-attention
        out = ((hidden + attn @ v) @ self.w_out).reshape(b, h, w, c).permute(0, 3, 1, 2)
        return UNet2DConditionOutput(sample=out)


class DDIMScheduler:
    """eta=0 DDIM; ``step`` takes the step index (the alphas are host floats)."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).tolist()
        self.num_train_timesteps, self.init_noise_sigma = num_train_timesteps, 1.0

    def set_timesteps(self, num_inference_steps, device):
        ratio = self.num_train_timesteps // num_inference_steps
        self._ts = [(num_inference_steps - 1 - i) * ratio + 1 for i in range(num_inference_steps)]
        self.timesteps = torch.tensor(self._ts, dtype=DTYPE).to(device)

    def step(self, model_output, step_index, sample):
        a_t = self.alphas_cumprod[self._ts[step_index]]
        a_prev = self.alphas_cumprod[self._ts[step_index + 1]] if step_index + 1 < len(self._ts) else 1.0
        pred_x0 = (sample - math.sqrt(1 - a_t) * model_output) / math.sqrt(a_t)
        return math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev) * model_output


# --- deepspeed/model_implementations/diffusers/unet.py ----------------------------------------------------------------

class DSUNet:
    def __init__(self, unet, enable_cuda_graph=True):
        self.unet = unet
        # SD pipeline accesses this attribute
        self.in_channels = unet.in_channels
        self.device, self.dtype, self.config = unet.device, unet.dtype, unet.config
        self.cuda_graph_created = False
        self.enable_cuda_graph = enable_cuda_graph
        if _variant == "fix":                                  # one graph (and its static buffers) per signature
            self._cuda_graphs, self.static_inputs, self.static_kwargs, self.static_output = {}, {}, {}, {}

    @staticmethod
    def _shape_signature(*inputs, **kwargs):
        return (tuple(tuple(t.shape) for t in inputs if torch.is_tensor(t)),
                tuple((k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if torch.is_tensor(v)))

    def _graph_replay(self, *inputs, **kwargs):
        if _variant == "fix":
            shape_signature = self._shape_signature(*inputs, **kwargs)
            static_inputs = self.static_inputs[shape_signature]
            static_kwargs = self.static_kwargs[shape_signature]
            graph, static_output = self._cuda_graphs[shape_signature], self.static_output[shape_signature]
        else:
            static_inputs, static_kwargs = self.static_inputs, self.static_kwargs
            graph, static_output = self._cuda_graphs, self.static_output
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                static_inputs[i].copy_(inputs[i])
        for k in kwargs:
            if torch.is_tensor(kwargs[k]):
                static_kwargs[k].copy_(kwargs[k])
        return UNet2DConditionOutput(sample=replay(graph, static_output))

    def forward(self, *inputs, **kwargs):
        if self.enable_cuda_graph:
            if _variant == "fix":
                if self._shape_signature(*inputs, **kwargs) not in self._cuda_graphs:
                    self._create_cuda_graph(*inputs, **kwargs)
                outputs = self._graph_replay(*inputs, **kwargs)
            elif self.cuda_graph_created:
                outputs = self._graph_replay(*inputs, **kwargs)
            else:
                self._create_cuda_graph(*inputs, **kwargs)
                outputs = self._graph_replay(*inputs, **kwargs)
            return outputs
        else:
            return self._forward(*inputs, **kwargs)

    __call__ = forward

    def _create_cuda_graph(self, *inputs, **kwargs):
        # warmup to create the workspace and cublas handle (three side-stream calls), then capture;
        # the static inputs and static output are the first call's own tensors
        static = {f"static_inputs[{i}]": t for i, t in enumerate(inputs) if torch.is_tensor(t)}
        static.update({f"static_kwargs[{k}]": t for k, t in kwargs.items() if torch.is_tensor(t)})
        graph, static_output = capture(lambda: self._forward(*inputs, **kwargs).sample, device=self.device,
                                       warmups=3, name="DSUNet", owner="DSUNet", static=static)
        if _variant == "fix":
            shape_signature = self._shape_signature(*inputs, **kwargs)
            self._cuda_graphs[shape_signature] = graph
            self.static_inputs[shape_signature], self.static_kwargs[shape_signature] = inputs, kwargs
            self.static_output[shape_signature] = static_output
        else:
            self._cuda_graphs = graph
            self.static_inputs, self.static_kwargs = inputs, kwargs
            self.static_output = static_output
        self.cuda_graph_created = True

    def _forward(self, sample, timestamp, encoder_hidden_states, return_dict=True):
        return self.unet(sample, timestamp, encoder_hidden_states, return_dict)


# --- diffusers StableDiffusionPipeline (reduced) ----------------------------------------------------------------------

class StableDiffusionPipeline:
    def __init__(self, device, enable_cuda_graph):
        gen = generator(132)
        self.device = device
        self.text_encoder = CLIPTextModel(device, gen)
        unet = UNet2DConditionModel(device, gen)
        # deepspeed.init_inference(pipe, enable_cuda_graph=...): generic_injection wraps the UNet in DSUNet
        self.unet = DSUNet(unet, enable_cuda_graph=enable_cuda_graph)
        self.scheduler = DDIMScheduler()

    def _encode_prompt(self, prompt_ids, num_images_per_prompt):
        text_input_ids = torch.tensor(prompt_ids, dtype=torch.long).to(self.device)          # tokenizer output
        prompt_embeds = self.text_encoder(text_input_ids).repeat_interleave(num_images_per_prompt, dim=0)
        uncond_embeds = self.text_encoder(torch.zeros_like(text_input_ids)).repeat_interleave(num_images_per_prompt, 0)
        return torch.cat([uncond_embeds, prompt_embeds])

    def __call__(self, prompt_ids, latents, num_images_per_prompt=1, num_inference_steps=STEPS,
                 guidance_scale=GUIDANCE):
        prompt_embeds = self._encode_prompt(prompt_ids, num_images_per_prompt)
        self.scheduler.set_timesteps(num_inference_steps, self.device)
        latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(self.scheduler.timesteps):
            latent_model_input = torch.cat([latents] * 2)                  # classifier-free guidance
            noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds).sample
            noise_uncond, noise_text = noise_pred.chunk(2)
            noise_pred = noise_uncond + guidance_scale * (noise_text - noise_uncond)
            latents = self.scheduler.step(noise_pred, i, latents)
        return latents                                                     # (output_type="latent")


# --- the workload ---------------------------------------------------------------------------------------------------

REQUESTS = [[[3, 7, 1]], [[5, 2, 14], [9, 4, 11]], [[6, 13, 8]]]         # 1 prompt, 2 prompts, 1 prompt


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1320)
    latents = [randn(len(p), LAT_C, LAT_HW, LAT_HW, gen=gen, device=device).to(DTYPE) for p in REQUESTS]

    def serve(enable_cuda_graph):
        pipe = StableDiffusionPipeline(device, enable_cuda_graph)
        return [pipe(prompts, lat).clone() for prompts, lat in zip(REQUESTS, latents)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
