"""NeMo Flux training with a full-iteration CUDA graph: ``_prepare_latent_image_ids`` builds the positional image ids on the host and uploads them at every step, also inside the captured iteration, which the capturing stream refuses.
Upstream: https://github.com/NVIDIA/NeMo/pull/14744 ("[Flux] Add cuda_graph_scope and cache images ids for full
iteration cuda graph.", NVIDIA/NeMo, merged 2025-09-20 as commit 8cfedd7203). Read: the full diff
(``FluxConfig.cuda_graph_scope`` and ``@lru_cache`` on ``MegatronFluxModel._prepare_latent_image_ids``); the preceding
commit of the same author, #14711 ("[Flux] Remove redundant host & device sync.": ``flux_data_step``'s loss mask made by
``torch.ones(1, device="cuda")`` instead of ``torch.Tensor([1.0]).cuda(non_blocking=True)``, and ``non_blocking=True``
added to the ids' ``.to``); ``nemo/collections/diffusion/models/flux/model.py`` at 8cfedd7203 (``flux_data_step``,
``MegatronFluxModel.forward_step``, ``prepare_image_latent``, ``_pack_latents``/``_unpack_latents``, ``Flux.forward``),
``flux/layers.py`` (``rope``, ``EmbedND``); ``MegatronParallel.forward_backward_func``
(``nemo/lightning/megatron_parallel.py``: with ``cuda_graph_scope == "full_iteration"`` it returns
``FullCudaGraphWrapper(get_forward_backward_func())``) and ``wrapped_forward_step``; Megatron-LM's
``megatron/core/full_cuda_graph.py`` (``StaticBufferLoader``, ``FullCudaGraphWrapper.data_read``/``__call__``: eager
iterations up to ``cuda_graph_warmup_steps`` (default 1), capture of the whole ``forward_backward_func`` with
``capture_error_mode="thread_local"``, replay afterwards). The PR has no description or linked issue; the failure below
is reconstructed from the code.
Symptom: Flux training with ``enable_cuda_graph=True, cuda_graph_scope="full_iteration"`` fails at the capture
iteration: the forward step copies the CPU-built image ids to the GPU inside the captured forward/backward ("Cannot copy
between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"; a pageable copy cannot be
captured).
Mechanism: ``forward_step`` -> ``prepare_image_latent`` -> ``_prepare_latent_image_ids`` builds the [B, H/2*W/2, 3]
row/column ids with ``torch.zeros``/``torch.arange`` on the CPU, ``repeat``s them over the batch (a new pageable tensor)
and ``.to(device, non_blocking=True)``s them. Eagerly that is a small upload per step. ``FullCudaGraphWrapper`` runs the
first iteration eagerly and captures the second, whole ``forward_backward_func`` included, so the upload is attempted
while the stream is capturing. The ids depend only on (batch, height, width, device, dtype), so they never change
between steps.
Doctor: sync-in-capture, at _prepare_latent_image_ids. It copies pageable host memory to the device during the capture
of the training iteration.
Fix (upstream): ``@lru_cache`` on ``_prepare_latent_image_ids``: the eager warmup iteration builds and uploads the ids
once; the capture (and every later step) gets the cached device tensor, which the graph reads at each replay.
Modelled: ``flux_data_step`` (post-#14711), ``MegatronFluxModel.forward_step``, ``prepare_image_latent``,
``_pack_latents``, ``_unpack_latents`` and ``_prepare_latent_image_ids`` as upstream writes them (the fix's cached
method is the same function under ``functools.lru_cache``; the CPU-built ``torch.zeros``/``torch.arange`` go through the
workbench's ``host()``, pinned on CUDA, and the ``repeat`` result is pageable as upstream's), ``rope``/``EmbedND``, a
``MaskedTokenLossReduction``-style loss with ``loss_mask``, ``wrapped_forward_step``, Megatron's
``forward_backward_no_pipelining``, ``StaticBufferLoader`` and ``FullCudaGraphWrapper`` (side streams, barriers and the
RNG-state registration left out). Stand-ins: ``Flux`` is one joint attention block with interleaved rotary embeddings
from the ids, a timestep and pooled-text embedding and a projection back to the packed latents; the noise draw
(``randn_like``) and the timestep sampling of upstream ``prepare_image_latent`` are supplied by the batch (``noise``,
``sigmas``, ``timesteps``) so the workload is deterministic. That sampling runs on the host at this commit too
(logit-normal ``u`` on the CPU, ``scheduler.timesteps[indices].to(device)``, ``(schduler_timesteps ==
t).nonzero().item()``) and the PR left it as it was; this program models only the image-id upload that the PR fixed.
Latents and text embeddings are precached; Megatron DDP's ``main_grad`` buffers are filled by post-accumulate-grad
hooks; the optimizer is eager SGD on ``main_grad``; float64.
Workload: 4 training iterations, one microbatch of 2 latents [2, 4, 4, 4] (8 packed tokens), 3 text tokens; eager runs
the same steps with ``cuda_graph_scope=None``. The bug raises the engine's CaptureError at the capture iteration
(iteration 1); the fix captures there, replays iterations 1-3, and its per-iteration losses and final weights equal
eager (max error 0).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/14744"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_prepare_latent_image_ids"
SYMPTOM = ("Flux training with a full-iteration CUDA graph fails at the capture iteration: _prepare_latent_image_ids "
           "builds the latent image ids on the host and copies them (pageable) to the GPU inside the captured "
           "forward/backward")

BATCH, LAT_C, LAT_HW, TXT_LEN, CTX, POOLED = 2, 4, 4, 3, 6, 5
HIDDEN, AXES_DIM, THETA = 8, (2, 2, 4), 10000
ITERS, LR = 4, 0.05
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- nemo/collections/diffusion/models/flux/layers.py --------------------------------------------------------------

def rope(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    assert dim % 2 == 0, "The dimension must be even."
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta ** scale)
    return torch.einsum("...n,d->...nd", pos, omega)           # (upstream returns .float(); float64 here)


class EmbedND:
    def __init__(self, dim: int, theta: int, axes_dim):
        self.dim, self.theta, self.axes_dim = dim, theta, axes_dim

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-1)
        emb = emb.unsqueeze(1).permute(2, 0, 1, 3)
        return torch.stack([emb, emb], dim=-1).reshape(*emb.shape[:-1], -1)     # [S, B, 1, HIDDEN], interleaved


def _apply_rotary_pos_emb_interleaved(t, freqs):
    rot = torch.stack([-t[..., 1::2], t[..., 0::2]], dim=-1).reshape(t.shape)
    return t * torch.cos(freqs) + rot * torch.sin(freqs)


# --- Flux (stand-in: one joint attention block) -----------------------------------------------------------------------

class Flux:
    def __init__(self, gen):
        r = lambda *s, scale: randn(*s, gen=gen, device=_device, scale=scale).to(DTYPE).requires_grad_()  # noqa: E731
        self.w_img, self.w_txt = r(LAT_C * 4, HIDDEN, scale=0.4), r(CTX, HIDDEN, scale=0.4)
        self.w_t, self.w_y = r(HIDDEN, HIDDEN, scale=0.3), r(POOLED, HIDDEN, scale=0.3)
        self.w_q, self.w_k, self.w_v = (r(HIDDEN, HIDDEN, scale=0.4) for _ in range(3))
        self.w_out = r(HIDDEN, LAT_C * 4, scale=0.3)
        self.pos_embed = EmbedND(dim=HIDDEN, theta=THETA, axes_dim=AXES_DIM)

    def parameters(self):
        return [self.w_img, self.w_txt, self.w_t, self.w_y, self.w_q, self.w_k, self.w_v, self.w_out]

    def timestep_embedding(self, timesteps):
        half = HIDDEN // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=DTYPE, device=timesteps.device) / half)
        args = timesteps[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1) @ self.w_t

    def __call__(self, img, txt, y, timesteps, img_ids, txt_ids, guidance=None):
        hidden_states, encoder_hidden_states = img @ self.w_img, txt @ self.w_txt        # [S, B, HIDDEN]
        vec_emb = self.timestep_embedding(timesteps.to(img.dtype) * 1000) + y @ self.w_y   # [B, HIDDEN]
        ids = torch.cat((txt_ids, img_ids), dim=1)
        rotary_pos_emb = self.pos_embed(ids)[:, :, 0]                                    # [S_txt + S_img, B, HIDDEN]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=0) + vec_emb[None]
        q = _apply_rotary_pos_emb_interleaved(x @ self.w_q, rotary_pos_emb)
        k = _apply_rotary_pos_emb_interleaved(x @ self.w_k, rotary_pos_emb)
        attn = torch.softmax(torch.einsum("sbh,tbh->bst", q, k) / math.sqrt(HIDDEN), dim=-1)
        x = x + torch.einsum("bst,tbh->sbh", attn, x @ self.w_v)
        return torch.tanh(x[txt.shape[0]:]) @ self.w_out                                 # [S_img, B, C * 4]


# --- nemo/collections/diffusion/models/flux/model.py ------------------------------------------------------------------

def flux_data_step(dataloader_iter):
    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        _batch = batch[0]
    else:
        _batch = batch
    _batch['loss_mask'] = torch.ones(1, device=_device, dtype=DTYPE)
    return _batch


class MegatronFluxModel:
    def __init__(self):
        self.module = Flux(generator(14744))
        self.image_precached = self.text_precached = True
        self.guidance_embed = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward_step(self, batch) -> torch.Tensor:
        if self.image_precached:
            latents = batch['latents'].to(_device, non_blocking=True)
        latents, noise, packed_noisy_model_input, latent_image_ids, guidance_vec, timesteps = (
            self.prepare_image_latent(latents, batch)
        )
        if self.text_precached:
            prompt_embeds = batch['prompt_embeds'].to(_device, non_blocking=True).transpose(0, 1)
            pooled_prompt_embeds = batch['pooled_prompt_embeds'].to(_device, non_blocking=True)
            text_ids = batch['text_ids'].to(_device, non_blocking=True)
        noise_pred = self.forward(img=packed_noisy_model_input, txt=prompt_embeds, y=pooled_prompt_embeds,
                                  timesteps=timesteps / 1000, img_ids=latent_image_ids, txt_ids=text_ids,
                                  guidance=guidance_vec)
        noise_pred = self._unpack_latents(
            noise_pred.transpose(0, 1), latents.shape[2], latents.shape[3]).transpose(0, 1)
        target = noise - latents
        return F.mse_loss(noise_pred, target, reduction="mean")

    def prepare_image_latent(self, latents, batch):
        prepare_ids = (self._prepare_latent_image_ids_cached if _variant == "fix"
                       else self._prepare_latent_image_ids)
        latent_image_ids = prepare_ids(latents.shape[0], latents.shape[2], latents.shape[3], latents.device,
                                       latents.dtype)
        # stand-in: upstream draws the noise (randn_like) and samples the timesteps on the host here
        noise, timesteps, sigma = batch['noise'], batch['timesteps'], batch['sigmas'].flatten()
        while len(sigma.shape) < latents.ndim:
            sigma = sigma.unsqueeze(-1)
        noisy_model_input = (1.0 - sigma) * latents + sigma * noise
        packed_noisy_model_input = self._pack_latents(noisy_model_input, batch_size=latents.shape[0],
                                                      num_channels_latents=latents.shape[1],
                                                      height=latents.shape[2], width=latents.shape[3])
        guidance_vec = None                                     # guidance_embed is False
        return (latents.transpose(0, 1), noise.transpose(0, 1), packed_noisy_model_input.transpose(0, 1),
                latent_image_ids, guidance_vec, timesteps)

    def _unpack_latents(self, latents, height, width):
        batch_size, num_patches, channels = latents.shape
        latents = latents.view(batch_size, height // 2, width // 2, channels // 4, 2, 2)
        latents = latents.permute(0, 3, 1, 4, 2, 5)
        return latents.reshape(batch_size, channels // 4, height, width)

    def _prepare_latent_image_ids(self, batch_size: int, height: int, width: int, device, dtype):
        latent_image_ids = host(torch.zeros(height // 2, width // 2, 3), _device)         # built on the CPU
        latent_image_ids[..., 1] = latent_image_ids[..., 1] + host(torch.arange(height // 2), _device)[:, None]
        latent_image_ids[..., 2] = latent_image_ids[..., 2] + host(torch.arange(width // 2), _device)[None, :]
        latent_image_id_height, latent_image_id_width, latent_image_id_channels = latent_image_ids.shape
        latent_image_ids = latent_image_ids[None, :].repeat(batch_size, 1, 1, 1)
        latent_image_ids = latent_image_ids.reshape(
            batch_size, latent_image_id_height * latent_image_id_width, latent_image_id_channels
        )
        return latent_image_ids.to(device=device, dtype=dtype, non_blocking=True)

    _prepare_latent_image_ids_cached = lru_cache(_prepare_latent_image_ids)     # the fix: @lru_cache on the method

    def _pack_latents(self, latents, batch_size, num_channels_latents, height, width):
        latents = latents.view(batch_size, num_channels_latents, height // 2, 2, width // 2, 2)
        latents = latents.permute(0, 2, 4, 1, 3, 5)
        return latents.reshape(batch_size, (height // 2) * (width // 2), num_channels_latents * 4)


class MaskedTokenLossReduction:
    def forward(self, batch, forward_out):
        loss_mask = batch['loss_mask']
        loss = (forward_out.view(-1) * loss_mask).sum() / loss_mask.sum()
        return loss, {"avg": loss.detach()}


# --- Megatron DDP (main_grad buffers) and the schedule ---------------------------------------------------------------

class DistributedDataParallel:
    def __init__(self, module: MegatronFluxModel):
        self.module = module
        for param in module.module.parameters():
            param.main_grad = torch.zeros_like(param, requires_grad=False)
            param.register_post_accumulate_grad_hook(self._make_backward_post_hook())

    @staticmethod
    def _make_backward_post_hook():
        def hook(param):
            param.main_grad.add_(param.grad.data)
            param.grad = None
        return hook

    def zero_grad_buffer(self):
        for param in self.module.module.parameters():
            param.main_grad.zero_()


def wrapped_forward_step(forward_step, loss_reduction, data_step):                  # MegatronParallel
    def wrapped_forward_step_func(dataloader_iter, model):
        batch = data_step(dataloader_iter)
        output_tensor = forward_step(model, batch)
        return output_tensor, lambda out: loss_reduction.forward(batch, out)
    return wrapped_forward_step_func


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                                   micro_batch_size=None, forward_only=False):
    forward_data_store = []
    for _ in range(num_microbatches):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        loss, loss_reduced = loss_func(output_tensor)
        forward_data_store.append(loss_reduced)
        if not forward_only:
            torch.autograd.backward(loss / num_microbatches)
    return forward_data_store


# --- megatron/core/full_cuda_graph.py ---------------------------------------------------------------------------------

class StaticBufferLoader:
    static_buffers: dict = {'training': [], 'validation': []}

    def __call__(self, inputs, stage, microbatch):
        if microbatch == len(StaticBufferLoader.static_buffers[stage]):
            StaticBufferLoader.static_buffers[stage].append({k: v.clone().detach() for k, v in inputs.items()})
        else:
            for k in inputs:
                StaticBufferLoader.static_buffers[stage][microbatch][k].copy_(inputs[k], non_blocking=True)
        return StaticBufferLoader.static_buffers[stage][microbatch]


class FullCudaGraphWrapper:
    curr_iteration = {'training': 0, 'validation': 0}
    cuda_graph = {'training': None, 'validation': None}
    result = {'training': None, 'validation': None}

    def __init__(self, forward_backward_func, cuda_graph_warmup_steps=1):
        self.forward_backward_func = forward_backward_func
        self.static_loader = StaticBufferLoader()
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        StaticBufferLoader.static_buffers = {'training': [], 'validation': []}
        FullCudaGraphWrapper.curr_iteration = {'training': 0, 'validation': 0}
        FullCudaGraphWrapper.cuda_graph = {'training': None, 'validation': None}

    def data_read(self, data_iterator, model, training, num_microbatches):
        data_list = [self.static_loader(next(data_iterator), 'training' if training else 'validation', b)
                     for b in range(num_microbatches)]
        return iter(data_list)

    def __call__(self, *args, **kwargs):
        model, num_microbatches, training = kwargs['model'], kwargs['num_microbatches'], not kwargs['forward_only']
        data_list = self.data_read(kwargs['data_iterator'], model, training, num_microbatches)
        training_str = 'training' if training else 'validation'
        if FullCudaGraphWrapper.curr_iteration[training_str] == self.cuda_graph_warmup_steps:
            kwargs['data_iterator'] = data_list
            buffers = StaticBufferLoader.static_buffers[training_str]
            static = {f"static_buffers[{b}][{k}]": v for b, buf in enumerate(buffers) for k, v in buf.items()}
            state = {f"main_grad[{i}]": p.main_grad for i, p in enumerate(model.module.module.parameters())}
            graph, outputs = capture(
                lambda: tuple(d["avg"] for d in self.forward_backward_func(*args, **kwargs)), device=_device,
                warmups=0, name=f"full iteration ({training_str})", owner="FullCudaGraphWrapper", static=static,
                state=state, capture_error_mode="thread_local")
            FullCudaGraphWrapper.cuda_graph[training_str], FullCudaGraphWrapper.result[training_str] = graph, outputs
        if FullCudaGraphWrapper.cuda_graph[training_str] is None:
            kwargs['data_iterator'] = data_list
            with events.warmup(real=True):
                FullCudaGraphWrapper.result[training_str] = self.forward_backward_func(*args, **kwargs)
            result = FullCudaGraphWrapper.result[training_str]
        else:
            outputs = replay(FullCudaGraphWrapper.cuda_graph[training_str], FullCudaGraphWrapper.result[training_str],
                             size=1)
            result = [{"avg": o} for o in outputs]
        FullCudaGraphWrapper.curr_iteration[training_str] += 1
        return result


# --- the training loop (MegatronStrategy.training_step -> MegatronParallel.forward) -----------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(147440)
    batches = [{"latents": randn(BATCH, LAT_C, LAT_HW, LAT_HW, gen=gen, device=device).to(DTYPE),
                "prompt_embeds": randn(BATCH, TXT_LEN, CTX, gen=gen, device=device).to(DTYPE),
                "pooled_prompt_embeds": randn(BATCH, POOLED, gen=gen, device=device).to(DTYPE),
                "text_ids": torch.zeros(BATCH, TXT_LEN, 3, dtype=DTYPE).to(device),
                "noise": randn(BATCH, LAT_C, LAT_HW, LAT_HW, gen=gen, device=device).to(DTYPE),
                "sigmas": torch.rand(BATCH, generator=gen, dtype=DTYPE).to(device)}
               for _ in range(ITERS)]
    for b in batches:
        b["timesteps"] = b["sigmas"] * 1000

    def fit(cuda_graph_scope):
        model = MegatronFluxModel()
        ddp = DistributedDataParallel(model)
        forward_backward_func = forward_backward_no_pipelining
        if cuda_graph_scope == "full_iteration":
            forward_backward_func = FullCudaGraphWrapper(forward_backward_func)
        step = wrapped_forward_step(lambda m, batch: m.module.forward_step(batch), MaskedTokenLossReduction(),
                                    flux_data_step)
        data_iterator, outs = iter(batches), []
        for _ in range(ITERS):
            ddp.zero_grad_buffer()
            losses = forward_backward_func(forward_step_func=step, data_iterator=data_iterator, model=ddp,
                                           num_microbatches=1, seq_length=LAT_HW * LAT_HW // 4, forward_only=False)
            outs.append(losses[0]["avg"].clone())
            with torch.no_grad():                                       # optimizer.step() (eager, outside the graph)
                for p in model.module.parameters():
                    p.sub_(LR * p.main_grad)
        return outs + [p.detach().clone() for p in model.module.parameters()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: fit("full_iteration"), lambda: fit(None))
