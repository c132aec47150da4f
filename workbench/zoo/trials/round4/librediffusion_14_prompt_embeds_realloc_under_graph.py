"""A live prompt edit reallocates the embeddings buffer that the captured 1-step graph copies from.

Upstream: https://github.com/jcelerier/librediffusion/pull/14 ("fix(cuda-graph): keep graph-read
conditioning/scheduler buffers at a stable address", commit 307833a).
Symptom: with the whole-frame 1-step CUDA graph (SD-Turbo/SDXS, cfg-none), rendering works at first and
"any parameter change randomly breaks" it: after a live prompt switch the output stays byte-identical to
the previous prompt (the change is ignored), or the reclaimed block yields garbage/black frames
(librediffusion, June 2026).
Mechanism: the first graph-eligible frame runs the denoise step once, then captures it; later frames
replay it while ``capture_signature()`` (geometry and the staging/work buffers) is unchanged, and the
captured body copies ``prompt_embeds_`` into the UNet's input binding by its capture-time address.
``prepare_embeds`` allocated a new ``prompt_embeds_`` on every call and freed the old one, so a live prompt
edit moved the buffer without changing the signature. No re-capture happens and every replay copies from
the released block, which still holds the old prompt until something reuses it.
Doctor: dangling-reference, at ``run_single_step_body`` (the captured copy from ``prompt_embeds_``).
Fix (upstream): ``prepare_embeds`` (and the other setters) reuse the buffer in place when its size is
unchanged and only reallocate, invalidating the graph, on a size change; the signature also hashes those
buffers.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jcelerier/librediffusion/pull/14"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "run_single_step_body"
SYMPTOM = "after a live prompt switch, replayed frames still render the previous prompt"
NAME = "librediffusion_14_prompt_embeds_realloc_under_graph"

BATCH, LATENT, SEQ, HIDDEN = 1, 8, 3, 4


class UNet:
    """The TensorRT UNet engine: reads its input bindings, writes its output binding."""

    def __init__(self, device):
        gen = generator(14)
        self.w_lat = randn(LATENT, LATENT, gen=gen, device=device, scale=0.4)
        self.w_txt = randn(HIDDEN, LATENT, gen=gen, device=device, scale=0.6)
        self.w_t = randn(LATENT, gen=gen, device=device, scale=0.01)

    def enqueue(self, latent, timestep, ehs, out):
        out.copy_(torch.tanh(latent @ self.w_lat + ehs.mean(1) @ self.w_txt + timestep[:, None] * self.w_t))


class LibreDiffusionPipeline:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.unet = UNet(device)
        z = lambda *s: torch.zeros(*s, device=device)
        # persistent buffers the single-step body touches
        self.predict_x0_batch_x_t_latent = z(BATCH, LATENT)
        self.predict_x0_batch_unet_input_latent = z(BATCH, LATENT)
        self.predict_x0_batch_unet_input_timestep = z(BATCH)
        self.predict_x0_batch_unet_input_ehs = z(BATCH, SEQ, HIDDEN)
        self.predict_x0_batch_unet_output = z(BATCH, LATENT)
        self.predict_x0_batch_denoised = z(BATCH, LATENT)
        self.x_0_pred_out = z(BATCH, LATENT)
        self.graph_in_staging_ = None
        self.prompt_embeds_ = None
        self.sub_timesteps_ = self.alpha_prod_t_sqrt_ = self.beta_prod_t_sqrt_ = None
        self.c_skip_ = self.c_out_ = None
        self.graph = self.graph_out = None
        self.graph_ready_ = False
        self.graph_sig_ = None

    # ------------------------------------------------------------------------------- setters
    def prepare_scheduler(self, timestep, alpha, beta, c_skip, c_out):
        t = lambda v: torch.tensor([v], device=self.device)
        self.sub_timesteps_, self.alpha_prod_t_sqrt_, self.beta_prod_t_sqrt_ = t(timestep), t(alpha), t(beta)
        self.c_skip_, self.c_out_ = t(c_skip), t(c_out)
        self.graph_ready_ = False

    def prepare_embeds(self, prompt_embeds):
        prompt_size = prompt_embeds.numel()
        if self.variant == "bug":
            self.prompt_embeds_ = torch.empty(BATCH, SEQ, HIDDEN, device=self.device)   # a new buffer per call
        elif self.prompt_embeds_ is None or self.prompt_embeds_.numel() != prompt_size:   # reuse_or_realloc
            self.prompt_embeds_ = torch.empty(BATCH, SEQ, HIDDEN, device=self.device)
            self.graph_ready_ = False
        self.prompt_embeds_.copy_(prompt_embeds)

    # ------------------------------------------------------------------------------- the step
    def capture_signature(self):
        sig = [BATCH, LATENT, SEQ, HIDDEN]
        bufs = [self.graph_in_staging_, self.predict_x0_batch_x_t_latent, self.predict_x0_batch_unet_input_latent,
                self.predict_x0_batch_unet_output, self.predict_x0_batch_denoised]
        if self.variant == "fix":
            bufs += [self.prompt_embeds_, self.sub_timesteps_, self.alpha_prod_t_sqrt_, self.beta_prod_t_sqrt_,
                     self.c_skip_, self.c_out_]
        return tuple(sig + [b.data_ptr() for b in bufs if b is not None])

    def run_single_step_body(self, x_t_latent_in):
        self.predict_x0_batch_x_t_latent.copy_(x_t_latent_in)
        self.predict_x0_batch_unet_input_latent.copy_(self.predict_x0_batch_x_t_latent)
        self.predict_x0_batch_unet_input_timestep.copy_(self.sub_timesteps_)          # cudaMemcpyAsync by address
        self.predict_x0_batch_unet_input_ehs.copy_(self.prompt_embeds_)                # cudaMemcpyAsync by address
        self.unet.enqueue(self.predict_x0_batch_unet_input_latent, self.predict_x0_batch_unet_input_timestep,
                          self.predict_x0_batch_unet_input_ehs, self.predict_x0_batch_unet_output)
        x_t, eps = self.predict_x0_batch_x_t_latent, self.predict_x0_batch_unet_output
        self.predict_x0_batch_denoised.copy_((x_t - self.beta_prod_t_sqrt_ * eps) / self.alpha_prod_t_sqrt_)
        self.x_0_pred_out.copy_(self.c_skip_ * x_t + self.c_out_ * self.predict_x0_batch_denoised)
        return self.x_0_pred_out

    def predict_x0_batch_impl_single_step(self, x_t_latent_in, graphed: bool):
        if not graphed:
            return self.run_single_step_body(x_t_latent_in).clone()
        if self.graph_in_staging_ is None:
            self.graph_in_staging_ = torch.zeros(BATCH, LATENT, device=self.device)
            self.graph_ready_ = False
        self.graph_in_staging_.copy_(x_t_latent_in)     # stage the caller's input into the fixed buffer
        sig = self.capture_signature()
        if not self.graph_ready_ or sig != self.graph_sig_:
            self.graph = None
            with events.warmup(real=True):               # warm enqueue: this frame's output
                out = self.run_single_step_body(self.graph_in_staging_).clone()
            self.graph, self.graph_out = capture(lambda: self.run_single_step_body(self.graph_in_staging_),
                                                 device=self.device, warmups=0, name="1-step denoise",
                                                 static={"graph_in_staging": self.graph_in_staging_},
                                                 owner="librediffusion pipeline", on_freed="reuse")
            self.graph_sig_ = self.capture_signature()
            self.graph_ready_ = True
            return out
        return replay(self.graph, self.graph_out).clone()   # cudaGraphLaunch


def run(variant: str, device: str = "cpu"):
    gen = generator(1400)
    prompt_a = randn(BATCH, SEQ, HIDDEN, gen=gen, device=device)
    prompt_b = randn(BATCH, SEQ, HIDDEN, gen=gen, device=device)
    frames = [randn(BATCH, LATENT, gen=gen, device=device) for _ in range(5)]
    edits = {2: prompt_b}                                  # a live prompt switch before frame 2

    def serve(graphed: bool):
        pipe = LibreDiffusionPipeline(device, variant)
        pipe.prepare_scheduler(timestep=999.0, alpha=0.6, beta=0.8, c_skip=0.05, c_out=0.95)
        pipe.prepare_embeds(prompt_a)
        outs = []
        for i, frame in enumerate(frames):
            if i in edits:
                pipe.prepare_embeds(edits[i])
            outs.append(pipe.predict_x0_batch_impl_single_step(frame, graphed))
        return outs

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
