"""A CUDA-graphed policy projects its actions with a Bounded spec that copies its host bounds to the device on every call: capture fails.

Upstream: https://github.com/pytorch/rl/pull/3453 ("[BugFix] Fix CUDA graph capture for Bounded spec
projection", commit fca4e76a8, merged Feb 2026).
Symptom: wrapping a policy (or ``spec.project``) in ``tensordict.nn.CudaGraphModule`` failed at capture with
"operation not permitted when stream is capturing" (the PR's description; it also reports graph-partition
warnings under compile); eager collection was fine.
Mechanism: ``Bounded._project`` (torchrl/data/tensor_specs.py) read ``self.space.low`` / ``self.space.high``
and, when the spec's device differs from the value's (``if self.device != val.device``), ran
``low = low.to(val.device)`` / ``high = high.to(val.device)`` on every call (``is_in`` did the same
unconditionally). For a spec kept on the CPU (host memory) and a policy on the GPU, the step the graph
captures issues a host-to-device copy of the bounds from pageable memory, which a capturing stream refuses.
Warmup calls do the copy too, but they are eager, so nothing fails before capture.
Doctor: sync-in-capture, at _project (the per-call ``low/high.to(val.device)`` host-to-device copy).
Fix (upstream): ``Bounded._get_space_bounds(device)`` returns the bounds directly when the spec is on the
value's device, otherwise caches ``(low.to(device), high.to(device))`` per device in
``self.__dict__["_bounds_cache"]`` (dropped in ``__getstate__``); ``_project`` and ``is_in`` use it. The
cache is filled during the eager warmup calls, so capture and replays read device tensors and copy nothing.
The captured policy runs under the collector's ``compile_policy``, where ``project`` short-circuits
``is_in`` (``if is_compiling() or not self.is_in(val)``) and calls ``_project`` directly: modelled as
``project`` calling ``_project``. ``CudaGraphModule``'s warmup-then-capture is ``kit.capture(warmups=2)``.
(Read: the diff of fca4e76a8 and the PR description.) The spec's bounds are pageable host memory
(``host(...).clone()``, a plain CPU tensor on CUDA).
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/rl/pull/3453"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_project"
SYMPTOM = "CudaGraphModule capture of a policy projecting onto a CPU Bounded spec fails (bounds copied H2D in capture)"

OBS_DIM, ACT_DIM, NUM_ENVS, STEPS = 3, 4, 2, 4


class _Space:
    def __init__(self, low, high):
        self.low, self.high = low, high


class Bounded:
    """``torchrl.data.Bounded``, kept on the CPU (its bounds are pageable host memory)."""

    def __init__(self, low, high, shape, device, variant):
        # torch.full on the CPU: pageable host memory on CUDA; host(...).clone() is the same on the CPU backend
        self.space = _Space(host(torch.full(shape, float(low)), device).clone(),
                            host(torch.full(shape, float(high)), device).clone())
        self.variant = variant

    def _spec_on(self, device) -> bool:
        """``self.device == device``: the spec lives on the host, the value on the device."""
        low = self.space.low
        return not is_host(low) and low.device == torch.device(device)

    def _get_space_bounds(self, device):
        """Get space bounds on the specified device, using cache to avoid .to() during CUDA graph capture."""
        if self._spec_on(device):
            return self.space.low, self.space.high
        cache = self.__dict__.get("_bounds_cache")
        if cache is None:
            cache = self.__dict__["_bounds_cache"] = {}
        if device not in cache:
            cache[device] = (self.space.low.to(device), self.space.high.to(device))
        return cache[device]

    def _project(self, val: torch.Tensor) -> torch.Tensor:
        if self.variant == "bug":
            low = self.space.low
            high = self.space.high
            if not self._spec_on(val.device):
                low = low.to(val.device)           # H2D copy of the bounds, on every call
                high = high.to(val.device)
        else:
            low, high = self._get_space_bounds(val.device)
        low = low.expand_as(val)
        high = high.expand_as(val)
        return torch.clamp(val, low, high)

    def project(self, val: torch.Tensor) -> torch.Tensor:
        # under the collector's compiled policy, is_compiling() is True: straight to _project
        return self._project(val)


class SafeModule:
    """The policy: an MLP whose action is projected onto the action spec (``safe=True``)."""

    def __init__(self, spec, device):
        gen = generator(3453)
        self.w1 = randn(OBS_DIM, 8, gen=gen, device=device)
        self.w2 = randn(8, ACT_DIM, gen=gen, device=device, scale=0.8)
        self.spec = spec

    def __call__(self, observation):
        action = torch.relu(observation @ self.w1) @ self.w2
        return self.spec.project(action)


def run(variant: str, device: str = "cpu"):
    gen = generator(0)
    observations = [randn(NUM_ENVS, OBS_DIM, gen=gen, device=device) for _ in range(STEPS)]

    def make_policy():
        spec = Bounded(low=-1.0, high=1.0, shape=(ACT_DIM,), device=device, variant=variant)
        return SafeModule(spec, device)

    def served():
        policy = make_policy()
        obs = torch.zeros(NUM_ENVS, OBS_DIM, device=device)      # CudaGraphModule's static input
        obs.copy_(observations[0])
        graph, action = capture(lambda: policy(obs), device=device, warmups=2, name="policy",
                                owner="CudaGraphModule(policy)", static={"observation": obs})
        outs = []
        for o in observations:
            obs.copy_(o)
            outs.append(replay(graph, action).clone())
        return outs

    def eager():
        policy = make_policy()
        return [policy(o).clone() for o in observations]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
