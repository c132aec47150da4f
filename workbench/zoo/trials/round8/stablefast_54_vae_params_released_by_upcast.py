"""The SDXL pipeline's VAE upcast replaces the parameters' storage: the graphed decode reads freed weights.

Upstream: https://github.com/chengzeyi/stable-fast/pull/54 ("closes #53; fix parameters getting released
with SDXL and CUDA graphs", commit db9ed75); issue https://github.com/chengzeyi/stable-fast/issues/53
("Black image with releases post1-post3 and nightly").
Symptom: SDXL compiled by stable-fast with ``enable_cuda_graph=True`` produces black images from the
second generation on (stable-fast 0.0.12.post1-post3, Nov 2023).
Mechanism: ``StableDiffusionXLPipeline`` upcasts the fp16 VAE to fp32 before decoding (``upcast_vae``)
and casts it back to fp16 afterwards; ``Module.to`` swaps every ``param.data`` for a new tensor, so the
fp32 weights the first decode was captured with lose their last reference and are freed. The graphed
``vae.decode`` only holds the bound method (hence the module), not the weight tensors it was captured
with, so each later replay reads the freed fp32 blocks while the new upcast lives elsewhere. On CUDA
the blocks are reused by other allocations: garbage / NaN latents decode to black images.
Doctor: dangling-reference, at ``decode`` (the VAE's matmuls that read the captured fp32 weights).
Fix (upstream): ``make_graphed_callable`` keeps, next to the callable, references to the ``.data`` of
every parameter of the module it was captured from, so the captured weights stay alive (and hold the
same values the next upcast produces).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/chengzeyi/stable-fast/pull/54"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "decode"
SYMPTOM = "black images after the first SDXL generation: replays read fp32 VAE weights freed by vae.to(fp16)"
LATENT, HIDDEN, PIXELS, SCALING = 4, 6, 3, 0.13025


class AutoencoderKL(torch.nn.Module):
    """A tiny VAE decoder: post-quant projection, one hidden layer, output projection (fp16 at rest)."""

    force_upcast = True

    def __init__(self):
        super().__init__()
        gen = generator(54)
        self.post_quant_conv = torch.nn.Parameter(torch.randn(LATENT, LATENT, generator=gen) * 0.5)
        self.conv_in = torch.nn.Parameter(torch.randn(LATENT, HIDDEN, generator=gen) * 0.5)
        self.conv_out = torch.nn.Parameter(torch.randn(HIDDEN, PIXELS, generator=gen) * 0.5)

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def decode(self, z):
        h = z @ self.post_quant_conv
        h = torch.nn.functional.silu(h @ self.conv_in)
        return torch.tanh(h @ self.conv_out)


class StableDiffusionXLPipeline:
    def __init__(self, vae):
        self.vae = vae

    def upcast_vae(self):
        self.vae.to(dtype=torch.float32)

    def decode_latents(self, latents):
        """The tail of ``__call__``: upcast the fp16 VAE, decode, cast it back."""
        needs_upcasting = self.vae.dtype == torch.float16 and self.vae.force_upcast
        if needs_upcasting:
            self.upcast_vae()
            latents = latents.to(self.vae.post_quant_conv.dtype)
        image = self.vae.decode(latents / SCALING)
        if needs_upcasting:
            self.vae.to(dtype=torch.float16)
        return image


def make_dynamic_graphed_callable(func, device, keep_params: bool):
    """stable-fast's lazily captured callable: one graph per input shape, captured on its first call."""
    graphs = {}

    def graphed(z):
        key = tuple(z.shape)
        if key not in graphs:
            static_z = z.clone()
            deps = [func]                                   # hold a reference to the callable
            if keep_params:                                 # the fix: and to the captured weights
                deps.extend(p.data for p in func.__self__.parameters())
            g, out = capture(lambda: func(static_z), device=device, warmups=1, name=f"vae.decode {key}",
                             static={"latents": static_z}, owner="sfast make_graphed_callable")
            graphs[key] = (g, out, static_z, deps)
        g, out, static_z, _ = graphs[key]
        static_z.copy_(z)
        return replay(g, out)

    return graphed


def run(variant: str, device: str = "cpu"):
    gen = generator(53)
    prompts_latents = [randn(2, LATENT, gen=gen, device=device) for _ in range(3)]

    def make_pipe():
        vae = AutoencoderKL().to(device=device, dtype=torch.float16)    # SDXL ships an fp16 VAE
        return StableDiffusionXLPipeline(vae)

    def eager():
        pipe = make_pipe()
        with torch.no_grad():
            return [pipe.decode_latents(z).clone() for z in prompts_latents]

    def served():
        pipe = make_pipe()
        pipe.vae.decode = make_dynamic_graphed_callable(pipe.vae.decode, device, keep_params=(variant == "fix"))
        with torch.no_grad():
            return [pipe.decode_latents(z).clone() for z in prompts_latents]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
