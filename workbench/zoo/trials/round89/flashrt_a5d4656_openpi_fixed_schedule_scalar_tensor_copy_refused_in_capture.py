"""FlashRT fixed-iteration OpenPI (PI0.5) action schedule: ``torch.tensor(scalar, device=cuda)`` for ``dt``/``timestep`` runs inside the capturing stream and the capture refuses the pageable copy.

Upstream: https://github.com/flashrt-project/FlashRT/commit/a5d46561c6c07646594b0966c8dc1241c8d57d61 ("openpi schedule:
device-native scalar constants survive a seated capture", flashrt-project/FlashRT, 2026-08-10). Read: the commit
message and its diff of ``flash_rt/structures/impls/fixed_iter/openpi.py``, plus that file's pre-fix version
(``_fixed_forward``, ``_observation_windows``, ``OpenPIFixedIterationAdapter.lower`` and its ``lowered()`` closure,
``_attention_masks``). Not read: FlashRT's capture machinery around the lowering (``FixedIterationLowering``, the
seat/graph-break logic of the structures layer) or OpenPI's own ``sample_actions`` source; the eager reference below
follows OpenPI's loop as the adapter's ``details`` describe it ("source_form": "tensor_controlled_while").
Symptom: graphing a PI0.5 policy's action sampling through the fixed-iteration adapter fails at capture once a
compiled seat sits inside the schedule: "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the
CPU tensor is pinned". Without seats the compiler had folded the two constants, so the same line worked or failed
depending on where a graph break landed.
Mechanism: ``OpenPIFixedIterationAdapter.lower`` rewrites OpenPI's tensor-controlled ``while`` into
``_fixed_forward`` (a fixed ``for`` over ``num_steps``), which the structures layer captures into one graph with the
observation and noise as swap windows. ``_fixed_forward`` builds the flow-matching step ``dt`` and the start
``timestep`` with ``torch.tensor(python_float, device=device)``: torch materialises the scalar on the host and copies
it to the device with a blocking copy from pageable memory. Run eagerly inside the capturing stream (a seat's graph
break makes these lines ordinary Python again), that copy is refused by the capture.
Doctor: sync-in-capture, at _fixed_forward. The captured function turns Python floats into device tensors through a
pageable host-to-device copy, which a capturing stream refuses (torch's synchronous staging).
Fix (upstream): create both scalars on the device directly (``torch.full((), -1.0 / steps, ...)`` and
``torch.ones((), ...)``), fill kernels whose value is a graph constant, so the schedule captures identically seated
or bare. The values are the same every call, so a baked constant is correct.
Modelled: ``_fixed_forward`` (its prefix part, preprocess -> ``embed_prefix`` -> masks -> ``paligemma_with_expert``
KV, is folded into the stand-in's ``_prefix`` helper, and the ``_attn_implementation`` assignment is left out),
``_attention_masks``, ``_observation_windows`` (trimmed to the windows this stand-in has) and the adapter's
``lowered`` forward as upstream writes them; a ``CapturedStage`` stand-in of the structures layer (warm up, capture ``lowered`` with the
windows as static buffers, copy each call's observation and noise in, replay). The PI0.5 model is a stand-in with
OpenPI's method names (``_preprocess_observation``, ``embed_prefix``, ``_prepare_attention_masks_4d``,
``paligemma_with_expert.forward`` returning the prefix KV, ``denoise_step``, ``sample_actions``): one attention
layer, float32. Sizes: batch 2, 3 image patches + 3 prompt tokens, width 8, action horizon 4 x 3, 5 denoise steps.
Workload: three control ticks, each a fresh observation (state, image patches, prompt) and fresh noise. Eager runs
OpenPI's ``sample_actions``. The bug's capture raises on the ``dt`` line; the fix captures once and replays the
three ticks, equal to eager.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashrt-project/FlashRT/commit/a5d46561c6c07646594b0966c8dc1241c8d57d61"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_fixed_forward"
SYMPTOM = ("graph capture of the fixed OpenPI action schedule dies on dt = torch.tensor(-1.0 / steps, device=cuda): "
           "the scalar is staged on the host and its pageable copy is refused by the capturing stream")

BATCH, PATCHES, TOKENS, WIDTH = 2, 3, 3, 8
HORIZON, ACTION_DIM, STATE_DIM, VOCAB = 4, 3, 5, 11
NUM_STEPS = 5

_variant = "bug"


# --- the host policy (OpenPI PI0Pytorch stand-in) ----------------------------------------------------------------------

class PaliGemmaWithExpert:
    def __init__(self, r):
        self.wk, self.wv = r(WIDTH, WIDTH), r(WIDTH, WIDTH)
        self.paligemma = SimpleNamespace(language_model=SimpleNamespace(config=SimpleNamespace(
            _attn_implementation="sdpa")))

    def forward(self, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache):
        prefix = inputs_embeds[0]
        pos = position_ids.to(prefix.dtype).unsqueeze(-1) * 0.1
        mixed = torch.softmax(torch.where(attention_mask[:, 0], (prefix @ prefix.transpose(1, 2)) * WIDTH ** -0.5,
                                          torch.full_like(attention_mask[:, 0], -1e9, dtype=prefix.dtype)), -1)
        h = mixed @ prefix + pos
        return None, (h @ self.wk, h @ self.wv)


class PI05Policy(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(5461)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.config = SimpleNamespace(action_horizon=HORIZON, action_dim=ACTION_DIM)
        self.patch_proj, self.tok_embed = r(WIDTH, WIDTH), r(VOCAB, WIDTH, scale=1.0)
        self.state_proj, self.action_in, self.action_out = r(STATE_DIM, WIDTH), r(ACTION_DIM, WIDTH), r(WIDTH, ACTION_DIM)
        self.time_proj, self.wq = r(WIDTH, WIDTH), r(WIDTH, WIDTH)
        self.paligemma_with_expert = PaliGemmaWithExpert(r)
        self.freqs = torch.arange(1, WIDTH // 2 + 1, device=device, dtype=torch.float32)

    def _preprocess_observation(self, observation, train=False):
        images = observation.images * 2.0 - 1.0
        return (images, observation.image_masks, observation.tokenized_prompt,
                observation.tokenized_prompt_mask, observation.state)

    def embed_prefix(self, images, image_masks, tokens, token_masks):
        emb = torch.cat([images @ self.patch_proj, self.tok_embed[tokens]], 1)
        pad = torch.cat([image_masks, token_masks], 1)
        ar = torch.zeros_like(pad, dtype=torch.int64)                  # bidirectional prefix
        return emb, pad, ar

    def _prepare_attention_masks_4d(self, mask):
        return mask[:, None]

    def denoise_step(self, state, prefix_pad, prefix_kv, x_t, timestep):
        k, v = prefix_kv
        t = timestep[:, None] * self.freqs[None]
        t_emb = torch.cat([torch.sin(t), torch.cos(t)], -1) @ self.time_proj           # [B, W]
        h = x_t @ self.action_in + (state @ self.state_proj)[:, None] + t_emb[:, None]
        scores = (h @ self.wq) @ k.transpose(1, 2) * WIDTH ** -0.5
        scores = torch.where(prefix_pad[:, None], scores, torch.full_like(scores, -1e9))
        return (h + torch.softmax(scores, -1) @ v) @ self.action_out

    def _prefix(self, observation):
        images, image_masks, tokens, token_masks, state = self._preprocess_observation(observation, train=False)
        prefix, prefix_pad, prefix_ar = self.embed_prefix(images, image_masks, tokens, token_masks)
        prefix_mask = _attention_masks(prefix_pad, prefix_ar)
        prefix_positions = torch.cumsum(prefix_pad, dim=1) - 1
        _, prefix_kv = self.paligemma_with_expert.forward(
            attention_mask=self._prepare_attention_masks_4d(prefix_mask), position_ids=prefix_positions,
            past_key_values=None, inputs_embeds=[prefix, None], use_cache=True)
        return state, prefix_pad, prefix_kv

    def sample_actions(self, device, observation, noise=None, num_steps=10):
        """OpenPI's schedule: a tensor-controlled while loop (eager reference)."""
        state, prefix_pad, prefix_kv = self._prefix(observation)
        dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32, device=device)
        x_t = noise
        time = torch.tensor(1.0, dtype=torch.float32, device=device)
        while time >= -dt / 2:
            v_t = self.denoise_step(state, prefix_pad, prefix_kv, x_t, time.expand(state.shape[0]))
            x_t = x_t + dt * v_t
            time += dt
        return x_t


# --- flash_rt/structures/impls/fixed_iter/openpi.py ---------------------------------------------------------------------

def _attention_masks(pad_masks, att_masks):
    """OpenPI's prefix-mask dataflow, expressed without a host import."""
    cumsum = torch.cumsum(att_masks, dim=1)
    causal = cumsum[:, None, :] <= cumsum[:, :, None]
    valid = pad_masks[:, None, :] * pad_masks[:, :, None]
    return causal & valid


def _fixed_forward(model, *, device, observation, noise, steps):
    """The host schedule with only its fixed loop spelling normalized."""
    batch = observation.state.shape[0]
    state, prefix_pad, prefix_kv = model._prefix(observation)
    if _variant == "fix":       # upstream fix: device-native creation, no host staging copy
        dt = torch.full((), -1.0 / steps, dtype=torch.float32, device=device)
        value = noise
        timestep = torch.ones((), dtype=torch.float32, device=device)
    else:                       # stages the scalar on the host and copies it: refused inside a capture
        dt = torch.tensor(-1.0 / steps, dtype=torch.float32, device=device)
        value = noise
        timestep = torch.tensor(1.0, dtype=torch.float32, device=device)
    for _ in range(steps):
        velocity = model.denoise_step(state, prefix_pad, prefix_kv, value, timestep.expand(batch))
        value = value + dt * velocity
        timestep += dt
    return value


def _observation_windows(observation):
    """Expose every tensor the fixed schedule reads between replays."""
    windows = {}
    for attr in ("images", "image_masks", "state", "tokenized_prompt", "tokenized_prompt_mask"):
        value = getattr(observation, attr, None)
        if torch.is_tensor(value):
            windows[f"observation.{attr}"] = value
    return windows


class OpenPIFixedIterationAdapter:
    family = "cond_iter_pipeline.openpi_action"

    def lower(self, model, device, observation, noise, steps):
        def lowered():
            with torch.no_grad():
                return _fixed_forward(model, device=device, observation=observation, noise=noise, steps=steps)
        return lowered, {"noise": noise, **_observation_windows(observation)}


class CapturedStage:
    """The structures layer's captured arm (stand-in): capture ``lowered`` once, swap windows, replay."""

    def __init__(self, model, device, observation, noise, steps):
        forward, self.windows = OpenPIFixedIterationAdapter().lower(model, device, observation, noise, steps)
        self.graph, self.output = capture(forward, device=device, warmups=1, name="openpi fixed schedule",
                                          owner="flash_rt CapturedStage", static=self.windows)

    def __call__(self, observation, noise):
        fresh = {"noise": noise, **_observation_windows(observation)}
        for name, window in self.windows.items():
            window.copy_(fresh[name])
        return replay(self.graph, self.output)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(54610)

    def observation():
        return SimpleNamespace(
            images=torch.rand(BATCH, PATCHES, WIDTH, generator=gen).to(device),
            image_masks=torch.tensor([[True] * PATCHES, [True, True, False]]).to(device),
            state=randn(BATCH, STATE_DIM, gen=gen, device=device),
            tokenized_prompt=torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen).to(device),
            tokenized_prompt_mask=torch.tensor([[True] * TOKENS, [True, True, False]]).to(device))

    ticks = [(observation(), randn(BATCH, HORIZON, ACTION_DIM, gen=gen, device=device)) for _ in range(3)]

    def eager():
        model = PI05Policy(device)
        with torch.no_grad():
            return [model.sample_actions(device, obs, noise=noise, num_steps=NUM_STEPS) for obs, noise in ticks]

    def served():
        model = PI05Policy(device)
        seat_obs = SimpleNamespace(**{k: v.clone() for k, v in vars(ticks[0][0]).items()})
        stage = CapturedStage(model, device, seat_obs, ticks[0][1].clone(), NUM_STEPS)
        return [stage(obs, noise).clone() for obs, noise in ticks]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
