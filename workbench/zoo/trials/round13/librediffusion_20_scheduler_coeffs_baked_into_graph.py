"""A live timestep edit reuses the 1-step graph: the scheduler coefficients it baked in stay the old ones.

Upstream: https://github.com/jcelerier/librediffusion/pull/20 ("fix: live-update correctness — scheduler
stale-graph + do_add_noise at 1 step"), part 1.
Symptom: in a 1-step streaming pipeline (SD-Turbo, SDXS, SDXL-Turbo, 1-step LCM) with the CUDA graph of the
denoise step enabled, the first frame is right, but any live edit of the Timesteps parameter that keeps the
step count corrupts every later frame (mean abs difference 38.85 against a pipeline rebuilt from scratch);
only a full ``reinit_buffers`` recovers (librediffusion, July 2026).
Mechanism: ``predict_x0_batch_impl_single_step`` captures ``run_single_step_body`` once and replays it while
``capture_signature()`` (config + the device addresses of the buffers the body reads) is unchanged. The body
reads the timestep from the device buffer ``sub_timesteps_`` by address, so a replay sees a new timestep;
but ``scheduler_step_batch`` takes ``alpha``, ``beta``, ``c_skip`` and ``c_out`` from the *host* copies and
passes them to the kernel by value: host work that ran once, at capture. A same-count edit goes through
``prepare_scheduler``, which updates the host copies and rewrites the device buffers in place (stable
addresses, so the signature does not change and nothing invalidates the graph): replays run the new
timestep through the UNet with the old scheduler coefficients.
Doctor: host-work-frozen, at ``scheduler_step_batch`` (host scalars read inside the captured step become
constants of the graph).
Fix (upstream): ``prepare_scheduler`` sets ``graph_ready_ = false`` on every scheduler update (as
``set_lora_scale`` does), so the next frame re-captures with the new coefficients.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jcelerier/librediffusion/pull/20"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "scheduler_step_batch"
SYMPTOM = "after a live Timesteps edit every frame is denoised with the previous timestep's scheduler coefficients"
CHANNELS, HEIGHT, WIDTH = 4, 2, 2
# (timestep, alpha_prod_t_sqrt, beta_prod_t_sqrt, c_skip, c_out): one denoising step each
SCHEDULE_A = ([999.0], [0.068], [0.998], [0.0], [1.0])
SCHEDULE_B = ([499.0], [0.52], [0.854], [0.0004], [0.999])


class UNet:
    """A stand-in noise predictor conditioned on the timestep it reads from a device buffer."""

    def __init__(self, device):
        gen = generator(20)
        n = CHANNELS * HEIGHT * WIDTH
        self.w = randn(n, n, gen=gen, device=device, scale=0.4)
        self.freqs = randn(n, gen=gen, device=device, scale=0.01)

    def __call__(self, x_t_latent, timestep):
        flat = x_t_latent.reshape(1, -1)
        emb = torch.sin(timestep * self.freqs)
        return torch.tanh(flat @ self.w + emb).reshape_as(x_t_latent)


def launch_scheduler_step(model_pred, x_t_latent, alpha, beta, c_skip, c_out):
    """``SchedulerStepFunctor``: LCM's x0 prediction and boundary condition, coefficients by value."""
    f_theta = (x_t_latent - beta * model_pred) / alpha
    return c_out * f_theta + c_skip * x_t_latent


class LibreDiffusionPipeline:
    def __init__(self, device, graph_enabled: bool, invalidate_on_scheduler_update: bool):
        self.device = device
        self.unet_ = UNet(device)
        self.graph_enabled_ = graph_enabled
        self.graph_ready_ = False
        self.graph_sig_ = None
        self.invalidate_on_scheduler_update = invalidate_on_scheduler_update
        self.denoising_steps = 1
        self.sub_timesteps_ = self.alpha_prod_t_sqrt_ = self.beta_prod_t_sqrt_ = None
        self.c_skip_ = self.c_out_ = None
        self.graph_in_staging_ = torch.zeros(1, CHANNELS, HEIGHT, WIDTH, device=device)

    def prepare_scheduler(self, timesteps, alpha_prod_t_sqrt, beta_prod_t_sqrt, c_skip, c_out):
        # Copy to host side
        self.alpha_prod_t_sqrt_host_ = list(alpha_prod_t_sqrt)
        self.beta_prod_t_sqrt_host_ = list(beta_prod_t_sqrt)
        self.c_skip_host_ = list(c_skip)
        self.c_out_host_ = list(c_out)

        # Grow-only / in-place: the captured graph reads sub_timesteps_ BY ADDRESS.
        def reuse(name):
            b = getattr(self, name)
            if b is None or b.numel() != self.denoising_steps:
                setattr(self, name, torch.zeros(self.denoising_steps, device=self.device))
                self.graph_ready_ = False

        for name in ("alpha_prod_t_sqrt_", "beta_prod_t_sqrt_", "c_skip_", "c_out_", "sub_timesteps_"):
            reuse(name)
        for name, values in (("alpha_prod_t_sqrt_", alpha_prod_t_sqrt), ("beta_prod_t_sqrt_", beta_prod_t_sqrt),
                             ("c_skip_", c_skip), ("c_out_", c_out), ("sub_timesteps_", timesteps)):
            getattr(self, name).copy_(torch.tensor(values))
        if self.invalidate_on_scheduler_update:
            # the fix: the captured graph bakes the coefficients by value -> force a recapture
            self.graph_ready_ = False

    def scheduler_step_batch(self, model_pred, x_t_latent, idx):
        # Access host-side copies (safe for CPU access)
        alpha = self.alpha_prod_t_sqrt_host_[idx]
        beta = self.beta_prod_t_sqrt_host_[idx]
        c_skip = self.c_skip_host_[idx]
        c_out = self.c_out_host_[idx]
        return launch_scheduler_step(model_pred, x_t_latent, alpha, beta, c_skip, c_out)

    def run_single_step_body(self, x_t_latent_in):
        model_pred = self.unet_(x_t_latent_in, self.sub_timesteps_[0])
        return self.scheduler_step_batch(model_pred, x_t_latent_in, 0)

    def capture_signature(self):
        """Recapture key: config geometry + the device addresses of the buffers the body reads."""
        return (CHANNELS, HEIGHT, WIDTH, self.graph_in_staging_.data_ptr(),
                *(getattr(self, n).data_ptr() for n in ("sub_timesteps_", "alpha_prod_t_sqrt_",
                                                        "beta_prod_t_sqrt_", "c_skip_", "c_out_")))

    def predict_x0_batch_impl_single_step(self, x_t_latent_in):
        if not self.graph_enabled_:
            return self.run_single_step_body(x_t_latent_in)
        # Stage the volatile caller input into the FIXED buffer the graph reads from.
        self.graph_in_staging_.copy_(x_t_latent_in)
        sig = self.capture_signature()
        if not self.graph_ready_ or sig != self.graph_sig_:
            # Warm enqueue: also produces a VALID output for THIS frame, so we return after capturing.
            with events.warmup(real=True):
                x_0_pred_out = self.run_single_step_body(self.graph_in_staging_).clone()
            self.graph_, self.graph_out_ = capture(
                lambda: self.run_single_step_body(self.graph_in_staging_), device=self.device, warmups=0,
                static={"graph_in_staging_": self.graph_in_staging_, "sub_timesteps_": self.sub_timesteps_},
                owner="LibreDiffusionPipeline (1-step graph)")
            self.graph_sig_ = self.capture_signature()
            self.graph_ready_ = True
            return x_0_pred_out
        return replay(self.graph_, self.graph_out_)


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(7)
    frames = [torch.randn(1, CHANNELS, HEIGHT, WIDTH, generator=gen) for _ in range(5)]

    def stream(graph_enabled: bool):
        pipe = LibreDiffusionPipeline(device, graph_enabled, invalidate_on_scheduler_update=(variant == "fix"))
        pipe.prepare_scheduler(*SCHEDULE_A)
        outs = []
        for i, frame in enumerate(frames):
            if i == 2:                                   # the user edits Timesteps live (same step count)
                pipe.prepare_scheduler(*SCHEDULE_B)
            outs.append(pipe.predict_x0_batch_impl_single_step(frame.to(device)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: stream(True), lambda: stream(False))
