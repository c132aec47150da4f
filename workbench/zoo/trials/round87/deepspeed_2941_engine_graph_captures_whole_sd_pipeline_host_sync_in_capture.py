"""DeepSpeed inference with ``enable_cuda_graph=True`` on a Stable Diffusion pipeline: the engine captures the whole pipeline call, whose host work cannot be captured.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/2941 ("Check for local CUDA graphs when enable_cuda_graph=True",
merged as commit 87eaf8f99, 2023-03-06). Read: the full diff of that commit (``deepspeed/inference/engine.py``:
``_module_match``, ``_local_cuda_graph_used`` and the new ``and not self.local_cuda_graph`` gate in
``InferenceEngine.forward``; ``DSUNet``/``DSVAE`` made subclasses of a ``CUDAGraph`` feature class), the pre-fix
``InferenceEngine._create_cuda_graph``/``_graph_replay``/``forward`` and ``DSUNet``/``DSVAE``
(``deepspeed/model_implementations/diffusers/{unet,vae}.py``) at the parent commit, ``generic_injection``
(``module_inject/replace_module.py``) and ``UNetPolicy.match_replaced``. Also read: the description of the user report
https://github.com/deepspeedai/DeepSpeed/issues/2717 ("with ``enable_cuda_graph=True`` [it] breaks as the entire model
can't be traced under a cuda graph ... introducing a global cuda graph and local ones through the policies like DSUnet
... works"); its error log was not read. The diffusers pipeline code was not re-read: the pipeline below is written from
memory of ``StableDiffusionPipeline.__call__`` and reduced.
Symptom: ``deepspeed.init_inference(pipe, enable_cuda_graph=True)`` then ``pipe(prompt)`` fails on the first call: after
three warmup calls the engine captures the whole pipeline call into one CUDA graph, and the first host work in it (the
prompt's token ids copied to the GPU; later ``image.cpu().numpy()``) is refused by the capturing stream.
Mechanism: ``init_inference`` runs ``generic_injection``, which wraps ``pipe.unet`` in ``DSUNet`` and ``pipe.vae`` in
``DSVAE``; these capture their own local graphs (UNet step, VAE decode) on first use. ``InferenceEngine.forward``
ignored that: with ``enable_cuda_graph`` it calls ``_create_cuda_graph``, which warms ``self.module(*inputs)`` up three
times and then runs it inside ``torch.cuda.graph``. ``self.module`` is the pipeline (not an ``nn.Module``): tokenizer
output to device, a Python loop over scheduler steps, local-graph replays, and a device-to-host conversion of the image.
The pageable host-to-device copy of the token ids is a host synchronisation, refused during capture.
Doctor: sync-in-capture, at forward. The engine's ``forward`` sends the pipeline call into ``_create_cuda_graph``'s
capture, where the pipeline's host copies (token ids in, image out) are attempted while the stream is capturing.
Fix (upstream): ``__init__`` sets ``self.local_cuda_graph = self._local_cuda_graph_used(self.module)`` (a non-Module
whose attributes match a replaced policy module with ``enable_cuda_graph``), and ``forward`` uses the engine-level graph
only ``and not self.local_cuda_graph``: the pipeline then runs eagerly and its DSUNet/DSVAE replay their own graphs.
Modelled: ``InferenceEngine`` (``__init__``, ``_module_match``, ``_local_cuda_graph_used``, ``_create_cuda_graph``,
``_graph_replay``, ``forward``), ``generic_injection`` reduced to the two policy wraps, ``UNetPolicy``/``VAEPolicy``
``match_replaced``, ``DSUNet`` and ``DSVAE`` (decoder graph) as upstream wrote them (static inputs are the first call's
own tensors), a reduced ``StableDiffusionPipeline`` (CFG, 4 steps) with a DDIM-style scheduler (host-float alphas,
indexed by step), a tiny text encoder, UNet and VAE decoder. Stand-ins: the accelerator check
(``device_name() == 'cuda'``) is the workbench device; the tokenizer's pageable output moved to the GPU is
``torch.tensor(ids, device=...)``; the three side-stream warmups are ``kit.capture(..., warmups=3)``;
``DSClipEncoder`` (a third local graph) is left out. Latents are given by the caller (deterministic).
Workload: two prompts (5 token ids each), latents [1, 4, 4, 4], 4 denoising steps, guidance 7.5. Eager runs the same
engine with ``enable_cuda_graph=False``. The bug raises at the engine-level capture of the first call (the token ids'
copy to the device); the fix runs both prompts through the local DSUNet/DSVAE graphs and equals eager.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/2941"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = ("init_inference(pipe, enable_cuda_graph=True): the engine captures the whole Stable Diffusion pipeline call "
           "in one CUDA graph although DSUNet/DSVAE hold local graphs; the pipeline's host copies fail the capture")

VOCAB, TXT, SEQ = 16, 8, 5
LAT_C, LAT_HW, UNET_H = 4, 4, 16
STEPS, GUIDANCE = 4, 7.5

_variant = "bug"


# --- the reduced diffusers models -----------------------------------------------------------------------------------

@dataclasses.dataclass
class UNet2DConditionOutput:
    sample: torch.Tensor


@dataclasses.dataclass
class DecoderOutput:
    sample: torch.Tensor


class CLIPTextModel:
    def __init__(self, device, gen):
        self.embed = randn(VOCAB, TXT, gen=gen, device=device)
        self.w = randn(TXT, TXT, gen=gen, device=device, scale=0.4)

    def __call__(self, input_ids):
        return torch.tanh(self.embed[input_ids] @ self.w)                  # [B, SEQ, TXT]


class UNet2DConditionModel:
    in_channels = LAT_C

    def __init__(self, device, gen):
        self.device, self.dtype = device, torch.float32
        self.config = {"in_channels": LAT_C}
        self.w_in = randn(LAT_C, UNET_H, gen=gen, device=device, scale=0.5)
        self.w_ctx = randn(TXT, UNET_H, gen=gen, device=device, scale=0.5)
        self.w_out = randn(UNET_H, LAT_C, gen=gen, device=device, scale=0.3)
        self.freqs = torch.arange(1, UNET_H + 1, dtype=torch.float32).to(device) / 700.0

    def __call__(self, sample, timestep, encoder_hidden_states, return_dict=True):
        b, c, h, w = sample.shape
        x = sample.permute(0, 2, 3, 1).reshape(b, h * w, c)
        temb = torch.sin(timestep.float() * self.freqs)                   # [UNET_H]
        ctx = encoder_hidden_states.mean(1) @ self.w_ctx                   # [b, UNET_H]
        hidden = torch.tanh(x @ self.w_in + temb + ctx[:, None, :])
        out = (hidden @ self.w_out).reshape(b, h, w, c).permute(0, 3, 1, 2)
        return UNet2DConditionOutput(sample=out)


class AutoencoderKL:
    def __init__(self, device, gen):
        self.device, self.dtype = device, torch.float32
        self.w_dec = randn(LAT_C, 3, gen=gen, device=device, scale=0.5)

    def decode(self, z, return_dict=True):
        img = torch.tanh(z.permute(0, 2, 3, 1) @ self.w_dec).permute(0, 3, 1, 2)
        return DecoderOutput(sample=img.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3))


class DDIMScheduler:
    """eta=0 DDIM; ``step`` takes the step index (the alphas are host floats)."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).tolist()
        self.num_train_timesteps, self.init_noise_sigma = num_train_timesteps, 1.0

    def set_timesteps(self, num_inference_steps, device):
        ratio = self.num_train_timesteps // num_inference_steps
        self._ts = [(num_inference_steps - 1 - i) * ratio + 1 for i in range(num_inference_steps)]
        self.timesteps = torch.tensor(self._ts, dtype=torch.float32).to(device)

    def step(self, model_output, step_index, sample):
        a_t = self.alphas_cumprod[self._ts[step_index]]
        a_prev = self.alphas_cumprod[self._ts[step_index + 1]] if step_index + 1 < len(self._ts) else 1.0
        pred_x0 = (sample - math.sqrt(1 - a_t) * model_output) / math.sqrt(a_t)
        return math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev) * model_output


class StableDiffusionPipeline:                                            # a DiffusionPipeline, not an nn.Module
    def __init__(self, device):
        gen = generator(2941)
        self.device = device
        self.text_encoder = CLIPTextModel(device, gen)
        self.unet = UNet2DConditionModel(device, gen)
        self.vae = AutoencoderKL(device, gen)
        self.scheduler = DDIMScheduler()

    def _encode_prompt(self, prompt_ids):
        text_input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)   # tokenizer output -> GPU
        prompt_embeds = self.text_encoder(text_input_ids)
        uncond_embeds = self.text_encoder(torch.zeros_like(text_input_ids))
        return torch.cat([uncond_embeds, prompt_embeds])

    def __call__(self, prompt_ids, latents=None, num_inference_steps=STEPS, guidance_scale=GUIDANCE):
        prompt_embeds = self._encode_prompt(prompt_ids)
        self.scheduler.set_timesteps(num_inference_steps, self.device)
        latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(self.scheduler.timesteps):
            latent_model_input = torch.cat([latents] * 2)
            noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds).sample
            noise_uncond, noise_text = noise_pred.chunk(2)
            noise_pred = noise_uncond + guidance_scale * (noise_text - noise_uncond)
            latents = self.scheduler.step(noise_pred, i, latents)
        image = self.vae.decode(latents / 0.18215).sample
        image = (image / 2 + 0.5).clamp(0, 1)
        return image.cpu().permute(0, 2, 3, 1).float().numpy()            # output_type="np"


# --- deepspeed/model_implementations/diffusers/{unet,vae}.py ---------------------------------------------------------

class DSUNet:
    def __init__(self, unet, enable_cuda_graph=True):
        self.unet, self.in_channels, self.device = unet, unet.in_channels, unet.device
        self.dtype, self.config = unet.dtype, unet.config
        self.cuda_graph_created = False
        self.enable_cuda_graph = enable_cuda_graph

    def _graph_replay(self, *inputs, **kwargs):
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                self.static_inputs[i].copy_(inputs[i])
        for k in kwargs:
            if torch.is_tensor(kwargs[k]):
                self.static_kwargs[k].copy_(kwargs[k])
        return UNet2DConditionOutput(sample=replay(self._cuda_graphs, self.static_output))

    def __call__(self, *inputs, **kwargs):                               # forward
        if self.enable_cuda_graph:
            if not self.cuda_graph_created:
                self._create_cuda_graph(*inputs, **kwargs)
            return self._graph_replay(*inputs, **kwargs)
        return self._forward(*inputs, **kwargs)

    def _create_cuda_graph(self, *inputs, **kwargs):
        self.static_inputs, self.static_kwargs = inputs, kwargs         # the first call's own tensors
        static = {f"static_inputs[{i}]": t for i, t in enumerate(inputs) if torch.is_tensor(t)}
        static.update({f"static_kwargs[{k}]": t for k, t in kwargs.items() if torch.is_tensor(t)})
        self._cuda_graphs, self.static_output = capture(
            lambda: self._forward(*self.static_inputs, **self.static_kwargs).sample, device=self.device,
            warmups=3, name="DSUNet", owner="DSUNet", static=static)
        self.cuda_graph_created = True

    def _forward(self, sample, timestamp, encoder_hidden_states, return_dict=True):
        return self.unet(sample, timestamp, encoder_hidden_states, return_dict)


class DSVAE:
    def __init__(self, vae, enable_cuda_graph=True):
        self.vae, self.device, self.dtype = vae, vae.device, vae.dtype
        self.decoder_cuda_graph_created = False
        self.enable_cuda_graph = enable_cuda_graph

    def _graph_replay_decoder(self, *inputs, **kwargs):
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                self.static_decoder_inputs[i].copy_(inputs[i])
        return DecoderOutput(sample=replay(self._decoder_cuda_graph, self.static_decoder_output))

    def _decode(self, x, return_dict=True):
        return self.vae.decode(x, return_dict=return_dict)

    def _create_cuda_graph_decoder(self, *inputs, **kwargs):
        self.static_decoder_inputs, self.static_decoder_kwargs = inputs, kwargs
        self._decoder_cuda_graph, self.static_decoder_output = capture(
            lambda: self._decode(*self.static_decoder_inputs, **self.static_decoder_kwargs).sample,
            device=self.device, warmups=3, name="DSVAE.decode", owner="DSVAE",
            static={f"static_decoder_inputs[{i}]": t for i, t in enumerate(inputs) if torch.is_tensor(t)})
        self.decoder_cuda_graph_created = True

    def decode(self, *inputs, **kwargs):
        if self.enable_cuda_graph:
            if not self.decoder_cuda_graph_created:
                self._create_cuda_graph_decoder(*inputs, **kwargs)
            return self._graph_replay_decoder(*inputs, **kwargs)
        return self._decode(*inputs, **kwargs)


# --- deepspeed/module_inject (containers/unet.py, containers/vae.py, replace_module.generic_injection) ---------------

class UNetPolicy:
    def match(self, module):
        return isinstance(module, UNet2DConditionModel)

    def match_replaced(self, module):
        return isinstance(module, DSUNet)

    def apply(self, module, enable_cuda_graph=True):
        return DSUNet(module, enable_cuda_graph=enable_cuda_graph)


class VAEPolicy:
    def match(self, module):
        return isinstance(module, AutoencoderKL)

    def match_replaced(self, module):
        return isinstance(module, DSVAE)

    def apply(self, module, enable_cuda_graph=True):
        return DSVAE(module, enable_cuda_graph=enable_cuda_graph)


generic_policies = [UNetPolicy, VAEPolicy]


def generic_injection(module, enable_cuda_graph=True):
    for name in list(module.__dict__.keys()):
        sub_module = getattr(module, name)
        for policy in generic_policies:
            policy = policy()
            if policy.match(sub_module):
                setattr(module, name, policy.apply(sub_module, enable_cuda_graph=enable_cuda_graph))


# --- deepspeed/inference/engine.py ----------------------------------------------------------------------------------

@dataclasses.dataclass
class DeepSpeedInferenceConfig:
    enable_cuda_graph: bool = False


class InferenceEngine:
    def __init__(self, model, config: DeepSpeedInferenceConfig, device):
        self.module, self._config, self.device = model, config, device
        self.cuda_graph_created = False
        generic_injection(self.module, enable_cuda_graph=config.enable_cuda_graph)
        if _variant == "fix":
            # Check if local CUDA graphs can be created in replacement modules
            self.local_cuda_graph = self._local_cuda_graph_used(self.module)

    def _module_match(self, module):
        for policy in generic_policies:
            policy = policy()
            if policy.match_replaced(module):
                return True
        return False

    def _local_cuda_graph_used(self, module):
        if isinstance(module, torch.nn.Module):
            return False
        sub_module_cuda_graph = False
        for name in module.__dict__.keys():
            sub_module = getattr(module, name)
            if self._module_match(sub_module) and hasattr(sub_module, "enable_cuda_graph"):
                sub_module_cuda_graph = True
        return sub_module_cuda_graph

    def _create_cuda_graph(self, *inputs, **kwargs):
        # warmup to create the workspace and cublas handle (three calls), then capture
        self.static_inputs, self.static_kwargs = inputs, kwargs
        static = {f"static_kwargs[{k}]": t for k, t in kwargs.items() if torch.is_tensor(t)}
        self._cuda_graphs, self.static_output = capture(
            lambda: self.module(*self.static_inputs, **self.static_kwargs), device=self.device, warmups=3,
            name="InferenceEngine", owner="InferenceEngine", static=static)
        self.cuda_graph_created = True

    def _graph_replay(self, *inputs, **kwargs):
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                self.static_inputs[i].copy_(inputs[i])
        for k in kwargs:
            if torch.is_tensor(kwargs[k]):
                self.static_kwargs[k].copy_(kwargs[k])
        return replay(self._cuda_graphs, self.static_output)

    def forward(self, *inputs, **kwargs):
        use_engine_graph = self._config.enable_cuda_graph
        if _variant == "fix":
            use_engine_graph = use_engine_graph and not self.local_cuda_graph
        if use_engine_graph:
            if not self.cuda_graph_created:
                self._create_cuda_graph(*inputs, **kwargs)
            return self._graph_replay(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    __call__ = forward


# --- the workload ---------------------------------------------------------------------------------------------------

PROMPTS = [[3, 7, 1, 12, 9], [5, 2, 14, 4, 11]]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(29410)
    latents = [randn(1, LAT_C, LAT_HW, LAT_HW, gen=gen, device=device) for _ in PROMPTS]

    def serve(enable_cuda_graph):
        engine = InferenceEngine(StableDiffusionPipeline(device), DeepSpeedInferenceConfig(enable_cuda_graph), device)
        return [torch.from_numpy(engine(ids, latents=lat)) for ids, lat in zip(PROMPTS, latents)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
