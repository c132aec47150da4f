"""Qwen-Image true CFG under VisualGen CUDA graphs: the negative-prompt replay overwrites the positive ``noise_pred``.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/16391 ("[None][fix] Fix Qwen image CUDA graph with CFG",
merged July 2026). Read: the PR description, the post-fix ``models/qwen_image/pipeline_qwen_image.py`` (the added
lines) and ``visual_gen/cuda_graph_runner.py``; the same hazard was flagged in review of #16095 (Qwen-Image-Edit).
Symptom: Qwen-Image images generated with CUDA graphs on, true CFG (``true_cfg_scale > 1``) and a negative prompt
differ from eager mode (guidance lost); after the fix the PR reports LPIPS 0.000000 between eager and graphs.
Mechanism: VisualGen's ``CUDAGraphRunner.wrap()`` keys graphs by ``get_graph_key()``: the shapes of the tensor
kwargs of ``transformer.forward`` (no values). On a new key ``capture()`` clones the inputs into
``static_inputs[key]``, runs ``WARMUP_STEPS = 2`` eager warmups, captures into the pool and stores
``graph_outputs[key] = make_weak_ref(output)``; ``replay()`` ``copy_``s the live tensors into the static inputs,
replays and returns that same graph-owned output every time. ``QwenImagePipeline.forward`` calls the transformer
with ``prompt_embeds`` (``noise_pred = ...[0]``) and then, with true CFG and no CFG-parallel, with
``neg_prompt_embeds`` (``neg_noise_pred``). Both embeddings have the same padded shape, so both calls have the same
key: the negative replay writes into the buffer ``noise_pred`` still points to, and ``_combine_true_cfg`` computes
``neg + s * (neg - neg)``: every step uses the negative prediction. Eager allocates a fresh output per call.
Doctor: overwritten-output, at ``forward`` (``QwenImagePipeline.forward`` holds the positive replay's graph-owned
output across the negative replay of the same graph and reads it afterwards in ``_combine_true_cfg``).
Fix (upstream): in ``forward``, ``if do_true_cfg and not do_cfg_parallel: if cuda_graph_enabled: noise_pred =
noise_pred.clone()`` before the negative transformer call ("CUDA graph outputs are graph-owned buffers; the
negative CFG replay may reuse the same pool before guidance consumes this one").
(Miniature transformer: timestep, text and image projections; text masks are ``None`` (every token valid, as
``_encode_prompt`` returns); ``make_weak_ref`` is the graph's output as is; FlowMatch Euler step on host sigmas.)
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/16391"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "forward"
SYMPTOM = "true CFG with CUDA graphs: noise_pred aliases neg_noise_pred, guidance collapses to the negative prompt"

IN_CHANNELS, INNER, JOINT, IMG_SEQ, TXT_SEQ, BATCH = 8, 12, 6, 4, 5, 1
STEPS, TRUE_CFG_SCALE = 4, 4.0


class QwenImageTransformer2DModel(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(16391)
        self.time_w = randn(1, 1, INNER, gen=gen, device=device, scale=2.0)
        self.img_in = randn(IN_CHANNELS, INNER, gen=gen, device=device, scale=0.5)
        self.txt_in = randn(JOINT, INNER, gen=gen, device=device, scale=0.5)
        self.proj_out = randn(INNER, IN_CHANNELS, gen=gen, device=device, scale=0.5)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask=None,
                img_shapes=None, return_dict=False):
        temb = torch.sin(timestep[:, None, None] * self.time_w)                        # [B, 1, inner]
        txt = (encoder_hidden_states @ self.txt_in).mean(dim=1, keepdim=True)          # [B, 1, inner]
        h = torch.tanh(hidden_states @ self.img_in + temb + txt)
        return (h @ self.proj_out,)


class CUDAGraphRunner:
    WARMUP_STEPS = 2

    def __init__(self, device):
        self.device = device
        self.enabled = True
        self.graphs, self.graph_outputs, self.static_inputs = {}, {}, {}
        self.memory_pool = graph_pool_handle(device)

    def get_graph_key(self, *args, **kwargs):
        # Base VisualGen graphs are keyed by tensor shapes from the wrapped model.forward call.
        return tuple(
            [(f"arg{i}", tuple(a.shape)) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            + [(k, tuple(kwargs[k].shape)) for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor)])

    def capture(self, key, fn, args, kwargs):
        # One time clone of inputs
        static_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        static_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        graph, output = capture(
            lambda: fn(*static_args, **static_kwargs), device=self.device, pool=self.memory_pool,
            warmups=self.WARMUP_STEPS, name=f"visual_gen graph {key}", owner="VisualGen CUDAGraphRunner",
            static={k: v for k, v in static_kwargs.items() if isinstance(v, torch.Tensor)})
        self.graphs[key] = graph
        self.static_inputs[key] = (static_args, static_kwargs)
        self.graph_outputs[key] = output                      # make_weak_ref(output): the graph-owned buffer

    def replay(self, key, args, kwargs):
        static_args, static_kwargs = self.static_inputs[key]
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                static_args[i].copy_(arg)
            else:
                static_args[i] = arg
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                static_kwargs[k].copy_(v)
            else:
                static_kwargs[k] = v
        return replay(self.graphs[key], self.graph_outputs[key])

    def wrap(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            key = self.get_graph_key(*args, **kwargs)
            if key not in self.graphs:
                self.capture(key, fn, args, kwargs)
            return self.replay(key, args, kwargs)
        return wrapper


class FlowMatchEulerDiscreteScheduler:
    def __init__(self, device):
        self.sigmas = [1.0 - i * (1.0 - 1.0 / STEPS) / (STEPS - 1) for i in range(STEPS)] + [0.0]
        self.timesteps = torch.tensor([s * 1000.0 for s in self.sigmas[:-1]]).to(device)
        self.step_index = 0

    def step(self, model_output, timestep, sample, return_dict=False):
        dt = self.sigmas[self.step_index + 1] - self.sigmas[self.step_index]
        self.step_index += 1
        return (sample + dt * model_output,)


class QwenImagePipeline:
    def __init__(self, transformer, device, cuda_graph_enabled, variant):
        self.device, self.variant = device, variant
        self.cuda_graph_enabled = cuda_graph_enabled
        self.transformer = CUDAGraphRunner(device).wrap(transformer.forward) if cuda_graph_enabled else transformer

    @staticmethod
    def _combine_true_cfg(noise_pred, neg_noise_pred, true_cfg_scale):
        comb = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
        return comb * (cond_norm / noise_norm)

    def forward(self, prompt_embeds, neg_prompt_embeds, latents, true_cfg_scale=TRUE_CFG_SCALE):
        do_true_cfg = true_cfg_scale > 1.0
        do_cfg_parallel = False
        img_shapes = [[(1, 2, IMG_SEQ // 2)]] * BATCH
        self.scheduler = FlowMatchEulerDiscreteScheduler(self.device)
        cuda_graph_enabled = self.cuda_graph_enabled
        trajectory = []
        for t in self.scheduler.timesteps:
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            noise_pred = self.transformer(hidden_states=latents, timestep=timestep / 1000,
                                          encoder_hidden_states_mask=None, encoder_hidden_states=prompt_embeds,
                                          img_shapes=img_shapes, return_dict=False)[0]
            if do_true_cfg and not do_cfg_parallel:
                if cuda_graph_enabled and self.variant == "fix":
                    # CUDA graph outputs are graph-owned buffers; the negative CFG
                    # replay may reuse the same pool before guidance consumes this one.
                    noise_pred = noise_pred.clone()
                neg_noise_pred = self.transformer(hidden_states=latents, timestep=timestep / 1000,
                                                  encoder_hidden_states_mask=None,
                                                  encoder_hidden_states=neg_prompt_embeds,
                                                  img_shapes=img_shapes, return_dict=False)[0]
                noise_pred = self._combine_true_cfg(noise_pred, neg_noise_pred, true_cfg_scale)
            latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            trajectory.append(latents.clone())
        return trajectory


def run(variant: str, device: str = "cpu"):
    transformer = QwenImageTransformer2DModel(device)
    gen = generator(163911)
    prompt_embeds = randn(BATCH, TXT_SEQ, JOINT, gen=gen, device=device)
    neg_prompt_embeds = randn(BATCH, TXT_SEQ, JOINT, gen=gen, device=device)       # same padded length
    latents = randn(BATCH, IMG_SEQ, IN_CHANNELS, gen=gen, device=device)

    def serve(graphed: bool):
        pipe = QwenImagePipeline(transformer, device, cuda_graph_enabled=graphed, variant=variant)
        with torch.no_grad():
            return pipe.forward(prompt_embeds, neg_prompt_embeds, latents)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
