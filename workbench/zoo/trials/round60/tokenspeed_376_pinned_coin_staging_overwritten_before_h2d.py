"""The next step's coin refill overwrites the reused pinned staging buffer before the H2D into ``_coins_buf`` runs.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/376 ("fix: cpu buffer racing for sampling"),
merge commit 0f948c87.
Symptom: gpt-oss-120b with EAGLE3 speculative decoding under the overlap scheduler hangs "in some extreme
cases" (reproduced with test/stress/scripts/gpt-oss-120b-eagle3-hang-repro.sh). Before any hang, verify
makes its accept/reject decisions with another step's random coins.
Mechanism: ``FlashInferSamplingBackend._init_shared_buffers`` allocates the persistent device coin
buffers ``_coins_buf`` [max_bs, max_draft_tokens_per_req] and ``_final_coins_buf`` [max_bs], "filled
per-request in prepare() outside the CUDA graph so verify() only reads from them". The captured
``verify()`` reads them through ``chain_speculative_sampling_target_only`` (``uniform_samples`` and
``uniform_samples_for_final_sampling``). ``_init_shared_buffers`` also allocates the pinned host
staging buffers ``_cpu_coins_buf`` and ``_cpu_final_coins_buf`` once. At warm-up and capture,
``_prepare_step_hook(request_pool_indices=None)`` fills the device buffers directly from
``_capture_gen``, with no staging. At serve time it slices the pinned buffers, fills each row on the host
from the slot's ``_cpu_generator_per_slot`` and issues ``_coins_buf[:bs, :n].copy_(cpu_coins,
non_blocking=True)``; the replay that reads ``_coins_buf`` is queued behind it. Under the overlap
scheduler the host prepares step N+1 while the device is still behind on step N. An async H2D reads its
pinned source when the copy engine reaches it, so step N+1's refill overwrites the pinned bytes before
step N's H2D has run. Replay N then verifies with step N+1's coins.
(The device stream is modelled as a queue that runs only when the host waits on an event: the host runs
one step ahead, the extreme case the PR describes. Eager is the same backend with the device keeping up.)
Doctor: persistent-mutation, at ``_prepare_step_hook``. The host rewrites a persistent pinned staging
buffer in place while the previous step's queued copy into the graph-read ``_coins_buf`` still has to
read it.
Fix (upstream): drop the persistent ``_cpu_coins_buf`` / ``_cpu_final_coins_buf``. ``_prepare_step_hook``
stages into a fresh ``torch.empty(..., pin_memory=True)`` every step. The caching host allocator does not
recycle a block before the copy that reads it has run, so every step's H2D reads its own coins.
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/376"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "_prepare_step_hook"
SYMPTOM = "overlap-scheduled EAGLE3 verify accepts/rejects draft tokens with the next step's coins"

MAX_BS, MAX_DRAFT, VOCAB, STEPS = 4, 3, 6, 5
POOL_INDICES = [1, 2, 3]              # request pool slots of the decode batch (slot 0: capture stub)
SEEDS = {1: 11, 2: 22, 3: 33}


def coin_eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


class Stream:
    """The device stream as the host sees it: launches queue up and the device runs them later. An
    event's ``synchronize()`` runs the queue up to the point where the event was recorded."""

    def __init__(self, device: str, runs_behind: bool):
        self.device, self.runs_behind, self.queue, self.done = device, runs_behind, [], 0

    def launch(self, fn) -> None:
        self.queue.append(fn)
        if not self.runs_behind:
            self.run_until(len(self.queue))

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            self.queue[self.done]()
            self.done += 1
        synchronize(self.device)


class Event:
    def __init__(self, stream: Stream):
        self.stream, self.mark = stream, len(stream.queue)

    def synchronize(self) -> None:
        self.stream.run_until(self.mark)


def chain_speculative_sampling_target_only(predicts, accept_token_num, candidates, uniform_samples,
                                           uniform_samples_for_final_sampling, target_probs):
    """Chain verification (flashinfer, draft_probs=None): draft j+1 is accepted while its coin is below the
    target probability; the final token is drawn from the target at the first rejected position."""
    bs, n = candidates.shape
    p_draft = target_probs[:, : n - 1].gather(2, candidates[:, 1:, None]).squeeze(2)
    accepted = (uniform_samples[:, : n - 1] < p_draft).to(torch.int64).cumprod(1)
    accept_num = accepted.sum(1)
    probs = target_probs.gather(1, accept_num[:, None, None].expand(bs, 1, target_probs.shape[2])).squeeze(1)
    final = (probs.cumsum(1) < uniform_samples_for_final_sampling[:, None]).sum(1).clamp(max=probs.shape[1] - 1)
    pos = torch.arange(n, device=candidates.device)[None]
    drafts = torch.cat([candidates[:, 1:], torch.zeros_like(candidates[:, :1])], 1)
    predicts.copy_(torch.where(pos < accept_num[:, None], drafts,
                               torch.where(pos == accept_num[:, None], final[:, None], -1)).reshape(-1))
    accept_token_num.copy_(accept_num)


class FlashInferSamplingBackend:
    def __init__(self, device: str, variant: str, stream: Stream):
        self.device, self.variant, self.stream = device, variant, stream
        self._init_shared_buffers()
        self._cpu_generator_per_slot: list[torch.Generator | None] = [None] * (MAX_BS + 1)

    def _reset_slot(self, pool_idx: int, seed: int) -> None:
        self._cpu_generator_per_slot[pool_idx] = torch.Generator().manual_seed(seed)

    def _init_shared_buffers(self) -> None:
        # Persistent coin buffers. Filled per-request in prepare() outside the
        # CUDA graph so verify() only reads from them.
        self._coins_buf = torch.zeros(MAX_BS, MAX_DRAFT, device=self.device)
        self._final_coins_buf = torch.zeros(MAX_BS, device=self.device)
        if self.variant == "bug":
            self._cpu_coins_buf = host(torch.empty(MAX_BS, MAX_DRAFT), self.device)      # pinned, once
            self._cpu_final_coins_buf = host(torch.empty(MAX_BS), self.device)
        # Stub generator used during CUDA-graph capture/warm-up (no requests yet).
        self._capture_gen = generator(376)
        self._predict_buf = torch.zeros(MAX_BS * MAX_DRAFT, dtype=torch.int64, device=self.device)
        self._accept_length_buf = torch.zeros(MAX_BS, dtype=torch.int64, device=self.device)

    def _prepare_step_hook(self, num_tokens_per_req: int, bs: int, request_pool_indices=None) -> None:
        """Refill persistent coin buffers outside the captured graph."""
        n = min(num_tokens_per_req, MAX_DRAFT)
        lo = coin_eps(self._coins_buf.dtype)
        if request_pool_indices is None:                   # capture / warm-up: straight to the device
            self._coins_buf[:bs, :n].copy_(torch.rand(bs, n, generator=self._capture_gen).clamp(min=lo))
            self._final_coins_buf[:bs].copy_(torch.rand(bs, generator=self._capture_gen).clamp(min=lo))
            return
        if self.variant == "bug":
            cpu_coins = self._cpu_coins_buf[:bs, :n]
            cpu_final = self._cpu_final_coins_buf[:bs]
        else:
            cpu_coins = host(torch.empty(bs, n), self.device)   # torch.empty(..., pin_memory=True)
            cpu_final = host(torch.empty(bs), self.device)
        for i, pool_idx in enumerate(request_pool_indices):
            gen = self._cpu_generator_per_slot[pool_idx] or self._capture_gen
            cpu_coins[i, :n].uniform_(lo, 1.0, generator=gen)
            cpu_final[i].uniform_(lo, 1.0, generator=gen)
        coins, final = self._coins_buf[:bs, :n], self._final_coins_buf[:bs]
        self.stream.launch(lambda: coins.copy_(cpu_coins, non_blocking=True))      # async H2D
        self.stream.launch(lambda: final.copy_(cpu_final, non_blocking=True))

    def verify(self, logits: torch.Tensor, candidates: torch.Tensor):
        bs, n = candidates.shape
        predict = self._predict_buf[: bs * n]
        accept_length = self._accept_length_buf[:bs]
        target_probs = torch.softmax(logits, dim=-1)
        chain_speculative_sampling_target_only(
            predicts=predict, accept_token_num=accept_length, candidates=candidates,
            uniform_samples=self._coins_buf[:bs, :n], uniform_samples_for_final_sampling=self._final_coins_buf[:bs],
            target_probs=target_probs)
        return predict.view(bs, n), accept_length + 1


def make_steps(device: str):
    gen = generator(37600)
    bs = len(POOL_INDICES)
    logits = [randn(bs, MAX_DRAFT, VOCAB, gen=gen, device=device, scale=1.5) for _ in range(STEPS)]
    cands = [torch.randint(0, VOCAB, (bs, MAX_DRAFT), generator=gen).to(device) for _ in range(STEPS)]
    return logits, cands


def run(variant: str, device: str = "cpu"):
    bs = len(POOL_INDICES)
    logits, cands = make_steps(device)

    def new_backend(runs_behind: bool) -> FlashInferSamplingBackend:
        backend = FlashInferSamplingBackend(device, variant, Stream(device, runs_behind))
        for pool_idx in POOL_INDICES:
            backend._reset_slot(pool_idx, SEEDS[pool_idx])
        return backend

    def eager():
        backend, outs = new_backend(runs_behind=False), []
        for step in range(STEPS):
            backend._prepare_step_hook(MAX_DRAFT, bs, POOL_INDICES)
            predict, accept_length = backend.verify(logits[step], cands[step])
            outs += [predict.clone(), accept_length.clone()]
        return outs

    def served():
        backend = new_backend(runs_behind=True)
        stream = backend.stream
        logits_buf = torch.zeros(bs, MAX_DRAFT, VOCAB, device=device)
        cands_buf = torch.zeros(bs, MAX_DRAFT, dtype=torch.int64, device=device)
        backend._prepare_step_hook(MAX_DRAFT, bs, None)            # capture path: _capture_gen coins
        g, out = capture(lambda: backend.verify(logits_buf, cands_buf), device=device, name="eagle3_verify",
                         static={"logits": logits_buf, "candidates": cands_buf, "_coins_buf": backend._coins_buf,
                                 "_final_coins_buf": backend._final_coins_buf}, owner="tokenspeed cuda graph runner")
        results: list[list[torch.Tensor]] = []

        def forward(step: int) -> None:                              # queued on the device stream
            logits_buf.copy_(logits[step])
            cands_buf.copy_(cands[step])
            predict, accept_length = replay(g, out)
            results.append([predict.clone(), accept_length.clone()])  # the packed D2H of the outputs

        prev = None
        for step in range(STEPS):                                    # the overlap event loop
            backend._prepare_step_hook(MAX_DRAFT, bs, POOL_INDICES)   # host: fill coins, launch H2D
            stream.launch(lambda step=step: forward(step))           # host: launch forward N
            done = Event(stream)
            if prev is not None:
                prev.synchronize()                                   # resolve step N-1's result
            prev = done
        prev.synchronize()
        return [t for pair in results for t in pair]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
