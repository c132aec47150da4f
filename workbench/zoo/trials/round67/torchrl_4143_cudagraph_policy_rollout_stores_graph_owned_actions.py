"""cudagraph_policy=True: the collector stores the CudaGraphModule's graph-owned action tensors, so every step's action becomes the last replay's.

Upstream: https://github.com/pytorch/rl/pull/4143 ("[BugFix] Fix cudagraph_policy instability and add action std
test", merged 2026-08), fixing https://github.com/pytorch/rl/issues/3002 ("CUDAgraph policy changes the learning
process").
Symptom: with ``SyncDataCollector(..., cudagraph_policy=True)`` (policy compiled by the user beforehand, so
``compile_policy`` is off) PPO learning became unstable and "the standard deviation of the actions determined by
the CUDAgraph'd policy tends to zero": the collected batch no longer holds the actions the env was stepped with.
Mechanism: ``_compile_wrapped_policy`` wraps the policy in tensordict's ``CudaGraphModule``. For a TensorDict
module that writes into its input (``_out_matches_in``), each replay copies the inputs into the static
``_tensordict`` (``update_``), replays, and returns ``tensordict.update(self._out, keys_to_update=...)``: the
caller's tensordict now holds *references* to the graph's static output tensors (``action``,
``sample_log_prob``). ``SyncDataCollector.rollout`` (torchrl/collectors/_single.py) cloned the policy output only
``if self.compiled_policy:``; with cudagraph only it merges the output into the carrier by reference, steps the
env (which reads the right action at that moment) and appends the carrier to ``tensordicts``; the next step's
replay overwrites the same static tensors in place. At the end of the batch ``torch.stack(tensordicts,
out=self._final_rollout)`` reads every step's action from the one graph buffer: all steps carry the last
replay's action (zero spread across time), while rewards/observations come from the true actions.
Doctor: overwritten-output, at ``rollout`` (it keeps graph outputs handed out by a replay in the per-step
tensordicts and reads them, at the final stack, after later replays overwrote them).
Fix (upstream): the PR extends the collector's existing compiled-policy handling to the cudagraph policy: a
``cudagraph_mark_step_begin()`` before the call and ``policy_output.select(*self._policy_output_keys).clone()``
after it, so the carrier holds copies, not the graph's buffers.
Modelled: the PR diff itself was not readable here (the stored mirror stops at #4141); the pre-fix collector
(``rollout``, ``_compile_wrapped_policy``) and tensordict's ``CudaGraphModule._call`` were read, and the fix is
modelled as the PR text describes it (the clone, now also for ``cudagraphed_policy``). The PR's other
explanation (Inductor's Philox seed/offset frozen in the graph) is not modelled: a probe on an H200 (torch 2.11)
showed ``torch.cuda.graph`` replays of eager and ``torch.compile``d Normal/Beta sampling drawing fresh samples
each replay. Exploration noise therefore comes in with the observation (drawn from a seeded CPU generator); the
TensorDict is a dict; one env, no device casts, no storing device (the same-device default).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/rl/pull/4143"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "rollout"
SYMPTOM = "cudagraph_policy rollouts record the last replay's action at every step (action std collapses to 0)"

OBS_DIM, ACT_DIM, FRAMES_PER_BATCH, NUM_BATCHES = 3, 2, 6, 2


class TensorDict(dict):
    """The bits of ``TensorDict`` the collector uses: ``update`` sets entries by reference."""

    def update(self, other, keys_to_update=None, clone=False):  # noqa: D102
        for k, v in other.items():
            if keys_to_update is None or k in keys_to_update:
                self[k] = v.clone() if clone else v
        return self

    def update_(self, other):
        """In place: copy ``other``'s values into this tensordict's tensors."""
        for k in self:
            if k in other:
                self[k].copy_(other[k])
        return self

    def select(self, *keys):
        return TensorDict({k: self[k] for k in keys if k in self})

    def clone(self):
        return TensorDict({k: v.clone() for k, v in self.items()})


class ProbabilisticActor:
    """Policy head: ``loc = tanh(obs @ W)``, ``action = loc + scale * noise``, with its log-prob; writes into the input."""

    out_keys = ("action", "sample_log_prob")

    def __init__(self, device):
        gen = generator(4143)
        self.w = randn(OBS_DIM, ACT_DIM, gen=gen, device=device, scale=0.8)
        self.scale = 0.3

    def __call__(self, td: TensorDict) -> TensorDict:
        loc = torch.tanh(td["observation"] @ self.w)
        td["action"] = loc + self.scale * td["noise"]
        td["sample_log_prob"] = (-0.5 * td["noise"] ** 2).sum(-1) - ACT_DIM * math.log(self.scale)
        return td


class CudaGraphModule:
    """tensordict.nn.CudaGraphModule (TensorDict path): warm up, capture on a static copy, replay by reference."""

    def __init__(self, module, device, warmup=2):
        self.module, self.device, self._warmup = module, device, warmup
        self.counter, self._out_matches_in = 0, None

    def __call__(self, tensordict: TensorDict) -> TensorDict:
        if self.counter >= self._warmup:
            self._tensordict.update_(tensordict)
            views = replay(self.graph, self._static_out)
            graph_out = dict(zip(self._selected_keys, views))
            if self._out_matches_in:    # the output IS the input: hand back the graph's tensors, not copies
                return tensordict.update(graph_out, keys_to_update=self._selected_keys)
            return TensorDict(graph_out).clone()
        for k in list(tensordict):
            tensordict[k] = tensordict[k].clone()
        if self.counter < self._warmup - 1:
            out = self.module(tensordict)
            if self._out_matches_in is None:
                self._out_matches_in = out is tensordict
            self.counter += 1
            return out
        self._tensordict = TensorDict(tensordict)                 # tensordict.copy(): the static inputs
        this_out = self.module(tensordict)
        inputs = dict(self._tensordict)

        def fn():
            out = self.module(self._tensordict)
            return tuple(out[k] for k in self._selected_keys)
        self._selected_keys = [k for k in this_out if k not in inputs]
        self.graph, self._static_out = capture(fn, device=self.device, warmups=0, name="CudaGraphModule(policy)",
                                               static=inputs, owner="tensordict.nn.CudaGraphModule")
        self.counter += 1
        return this_out


class PointEnv:
    """``obs' = obs + 0.5 * action``, reward ``-|obs'|^2``; each step brings the next exploration noise."""

    def __init__(self, device):
        self.device = device
        gen = generator(3002)
        self.noise = randn(NUM_BATCHES * FRAMES_PER_BATCH + 2, ACT_DIM, gen=gen, device=device)
        self.obs0 = randn(OBS_DIM, gen=gen, device=device)
        self.proj = randn(ACT_DIM, OBS_DIM, gen=gen, device=device, scale=0.5)
        self.t = 0

    def reset(self) -> TensorDict:
        self.t = 0
        return TensorDict(observation=self.obs0.clone(), noise=self.noise[0].clone())

    def step_and_maybe_reset(self, td: TensorDict):
        self.t += 1
        obs = td["observation"] + td["action"] @ self.proj * 0.5
        nxt = TensorDict(observation=obs, reward=-(obs ** 2).sum(-1, keepdim=True))
        td["next"] = nxt
        return td, TensorDict(observation=obs.clone(), noise=self.noise[self.t].clone())


class SyncDataCollector:
    def __init__(self, env, policy, device, variant, cudagraph_policy=False, compile_policy=False):
        self.env, self.variant = env, variant
        self.compiled_policy, self.cudagraphed_policy = compile_policy, cudagraph_policy
        self._wrapped_policy = self._compile_wrapped_policy(policy, device)
        self._carrier = env.reset()
        # _make_final_rollout: one policy call on a copy of the carrier to learn the output keys
        self._policy_output_keys = set(self._wrapped_policy(TensorDict(self._carrier))) - set(self._carrier)

    def _compile_wrapped_policy(self, policy, device):
        if self.cudagraphed_policy:
            policy = CudaGraphModule(policy, device)
        return policy

    def rollout(self):
        tensordicts = []
        for _ in range(FRAMES_PER_BATCH):
            policy_input = self._carrier
            policy_output = self._wrapped_policy(policy_input)
            clone_output = self.compiled_policy
            if self.variant == "fix":                  # the fix: the cudagraph policy's outputs are cloned too
                clone_output = self.compiled_policy or self.cudagraphed_policy
            if clone_output:
                policy_output = policy_output.select(*self._policy_output_keys).clone()
            if self._carrier is not policy_output:
                self._carrier.update(policy_output, keys_to_update=self._policy_output_keys)
            env_output, env_next_output = self.env.step_and_maybe_reset(self._carrier)
            tensordicts.append(self._carrier)
            self._carrier = env_next_output
        # torch.stack(tensordicts, out=self._final_rollout): reads every step's entries now
        return {k: torch.stack([td[k] for td in tensordicts]) for k in ("action", "sample_log_prob")} | {
            "next_reward": torch.stack([td["next"]["reward"] for td in tensordicts])}

    def __iter__(self):
        for _ in range(NUM_BATCHES):
            yield self.rollout()


def run(variant: str, device: str = "cpu"):
    def collect(cudagraph_policy: bool):
        env, policy = PointEnv(device), ProbabilisticActor(device)
        collector = SyncDataCollector(env, policy, device, variant, cudagraph_policy=cudagraph_policy)
        outs = []
        for batch in collector:
            outs += [batch["action"], batch["sample_log_prob"], batch["next_reward"]]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: collect(True), lambda: collect(False))
