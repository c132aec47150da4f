"""Mamba decode graphs keep reading the ``-exp(A_log)`` cache filled at warmup: after a train step, replays use the old A.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/6672 ("Fix Refit Cache for mamba", merged 2026-08-20, commit
fbbc142b80). The cache came with https://github.com/NVIDIA/Megatron-LM/pull/4414 ("Mamba inference opt"). An
independent report and fix is https://github.com/NVIDIA/Megatron-LM/pull/6723 ("fix(ssm): refresh the mamba decode
cache after a refit").
Symptom: no error. In NeMo-RL GRPO with Megatron generation on a Mamba-hybrid model (nemotron-nano-3.5), generation
logprobs stop matching the training policy even though every parameter reached the inference model:
``token_mult_prob_error`` reached 1.59e12 and ``gen_kl_error`` was about 0.5. The drift grows as ``A_log`` trains.
Mechanism: ``MambaMixer.__init__`` (megatron/core/ssm/mamba_mixer.py) allocates a persistent ``_A_neg_exp_cache``
with a stale flag. In inference, ``MambaMixer._get_decode_A_neg_exp`` refills it with ``-exp(A_log)`` only when the
Python flag ``_A_neg_exp_cache_stale`` is set. Then it returns a stride-0 expand of the cache, which ``ssm_decode``
passes to ``selective_state_update``. The decode CUDA graph is captured after eager warmup, and warmup has already
taken the refill branch and cleared the flag. So the graph records only a read of the cache's fixed address. The
``if stale: copy_`` decision ran in Python, at warmup. ``MambaMixer.train(True)`` marks the cache stale before the
optimizer updates ``A_log`` in place, and ``eval()`` keeps the flag. The next eager decode step sees the flag and
refills the cache. A graph replay runs no Python, so it keeps reading the ``-exp(A_log)`` of the policy it was
warmed up with. Every other parameter is read in place and is current; only the derived A is stale.
Doctor: warmup-divergence, at _get_decode_A_neg_exp (the lazy refill of the cache is decided by a Python flag at
warmup. The captured decode step reuses the cache as warmup left it, while an eager step after train()/eval() now
takes the branch and copies the new ``-exp(A_log)`` in).
Fix (upstream): a new ``MambaMixer.refresh_cache`` copies ``-exp(A_log)`` into the existing cache in place (same
address) and clears the flag. ``_get_decode_A_neg_exp`` calls it for its lazy refill, and
``MambaMixer.train(False)`` calls it eagerly when the flag is set ("CUDA graph replay bypasses the Python
lazy-refresh path"). ``MegatronModule.refresh_cache`` is a no-op hook. ``execute_reshard_plan``
(megatron/core/resharding/execution.py) calls ``_refresh_module_caches`` after the refit writebacks.
Modelled: a 2-layer Mamba-only ``MambaModel`` (``MambaLayer`` = RMS norm + ``MambaMixer`` + residual; no conv1d, one
group, ``rmsnorm=False``), a torch ``selective_state_update``, and a torch ``_ssm_training`` scan for the train step.
The inference side is a single full decode graph over a fixed batch of 3 requests (static hidden-state input,
persistent ``ssm_state`` per layer). It is warmed up and captured once by ``DynamicInferenceEngine.create_cuda_graphs``
and replayed on every decode step. The RL loop is colocated: generate, then ``model.train()`` with one SGD step on all
parameters, written in place as the distributed optimizer writes them back, then ``model.eval()``, then generate
again. The refit path (``execute_reshard_plan``) is left out: with the bug a refit in eval mode never sets the flag,
so eager decode is stale too. The graph-only divergence is the train()/eval() path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/6672"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_get_decode_A_neg_exp"
SYMPTOM = ("after a train step the Mamba decode graphs still use -exp(A_log) of the old policy; generation logprobs "
           "drift from the training policy")

HIDDEN, NHEADS, HEADDIM, D_STATE, LAYERS = 8, 2, 4, 4, 2
D_INNER = NHEADS * HEADDIM
BATCH, DECODE_STEPS, TRAIN_SEQ, LR = 3, 4, 5, 0.5
EPS = 1e-5


# --- megatron/core/transformer/module.py ------------------------------------------------------------

class MegatronModule(torch.nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config

    def refresh_cache(self) -> None:
        """Refresh state derived from parameters after an in-place weight refit (a no-op here)."""


# --- megatron/core/ssm/ops/mamba2 (selective_state_update, torch form) -----------------------------

def selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=None, dt_softplus=False):
    """state (b, h, p, n); x, dt (b, s=1, h, p); A (h, p, n); B, C (b, s, g=1, n); D, dt_bias (h, p)."""
    x, dt, B, C = x[:, 0], dt[:, 0], B[:, 0, 0], C[:, 0, 0]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt.unsqueeze(-1) * A)                                        # (b, h, p, n)
    dBx = (dt * x).unsqueeze(-1) * B.view(-1, 1, 1, D_STATE)
    state.copy_(state * dA + dBx)
    y = (state * C.view(-1, 1, 1, D_STATE)).sum(-1) + D * x
    if z is not None:
        y = y * F.silu(z[:, 0])
    return y.unsqueeze(1)                                                       # (b, 1, h, p)


# --- megatron/core/ssm/mamba_mixer.py ---------------------------------------------------------------

class MambaMixer(MegatronModule):
    def __init__(self, gen, variant, device):
        super().__init__()
        self.variant = variant
        self.headdim, self.d_state, self.nheads_local_tp = HEADDIM, D_STATE, NHEADS
        self.d_inner_local_tp, self.ngroups_local_tp, self.rmsnorm = D_INNER, 1, False
        in_dim = 2 * D_INNER + 2 * D_STATE + NHEADS
        self.in_proj = torch.nn.Parameter((torch.randn(HIDDEN, in_dim, generator=gen) * 0.4).to(device))
        self.out_proj = torch.nn.Parameter((torch.randn(D_INNER, HIDDEN, generator=gen) * 0.4).to(device))
        A = torch.empty(NHEADS).uniform_(1.0, 4.0, generator=gen)
        A_log = torch.log(A).to(device)                                                    # keep A_log in fp32
        self.A_log = torch.nn.Parameter(A_log)
        self.dt_bias = torch.nn.Parameter((torch.randn(NHEADS, generator=gen) * 0.3).to(device))
        self.D = torch.nn.Parameter(torch.ones(NHEADS, device=device))
        # Persistent inference cache for -exp(A_log.float()), allocated outside any capture so its address
        # stays valid across every graph capture and replay, including RL train/eval cycles.
        self._A_neg_exp_cache = torch.empty_like(A_log, dtype=torch.float32)
        self._A_neg_exp_cache_stale = True

    def _split(self, zxBCdt):
        return torch.split(zxBCdt, [D_INNER, D_INNER, D_STATE, D_STATE, NHEADS], dim=-1)

    @torch.no_grad()
    def refresh_cache(self) -> None:
        """Refresh the existing decode-cache storage from the current ``A_log`` (same address)."""
        self._A_neg_exp_cache.copy_(-torch.exp(self.A_log.float()))
        self._A_neg_exp_cache_stale = False

    def _get_decode_A_neg_exp(self) -> torch.Tensor:
        """Cached ``-exp(A_log.float())`` pre-expanded to ``(nheads, headdim, dstate)``."""
        if self.training or torch.is_grad_enabled():
            base = -torch.exp(self.A_log.float())
            return base.view(-1, 1, 1).expand(-1, self.headdim, self.d_state)
        # Inference path. Refill when stale
        if self._A_neg_exp_cache_stale:
            if self.variant == "fix":
                self.refresh_cache()
            else:
                with torch.no_grad():
                    self._A_neg_exp_cache.copy_(-torch.exp(self.A_log.float()))
                self._A_neg_exp_cache_stale = False
        return self._A_neg_exp_cache.view(-1, 1, 1).expand(-1, self.headdim, self.d_state)

    def train(self, mode: bool = True):
        if mode:
            self._A_neg_exp_cache_stale = True
        elif self.variant == "fix" and self._A_neg_exp_cache_stale:
            # CUDA graph replay bypasses the Python lazy-refresh path.
            self.refresh_cache()
        return super().train(mode)

    def ssm_decode(self, zxBCdt, ssm_state):
        """One decode token per request: zxBCdt (b, 1, d) -> y (b, 1, d_inner)."""
        z, x, B, C, dt = self._split(zxBCdt)
        A = self._get_decode_A_neg_exp()
        dt = dt.unsqueeze(-1).expand(-1, -1, -1, self.headdim)                  # b s h -> b s h p
        dt_bias = self.dt_bias.view(-1, 1).expand(-1, self.headdim)
        D = self.D.view(-1, 1).expand(-1, self.headdim)
        B, C = B.view(B.shape[0], 1, 1, D_STATE), C.view(C.shape[0], 1, 1, D_STATE)
        x_reshaped = x.view(x.shape[0], 1, NHEADS, HEADDIM)
        z = z.view(z.shape[0], 1, NHEADS, HEADDIM)
        y = selective_state_update(ssm_state, x_reshaped, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)
        return y.reshape(y.shape[0], 1, D_INNER)

    def _ssm_training(self, zxBCdt):
        """Training scan over a sequence (b, s, d) with A recomputed from A_log (autograd-friendly)."""
        z, x, B, C, dt = self._split(zxBCdt)
        A = self._get_decode_A_neg_exp()                                        # training branch
        dt = F.softplus(dt + self.dt_bias)                                      # (b, s, h)
        x = x.view(*x.shape[:2], NHEADS, HEADDIM)
        state = torch.zeros(x.shape[0], NHEADS, HEADDIM, D_STATE, device=x.device)
        ys = []
        for t in range(x.shape[1]):
            dA = torch.exp(dt[:, t].view(-1, NHEADS, 1, 1) * A)
            dBx = (dt[:, t].view(-1, NHEADS, 1) * x[:, t]).unsqueeze(-1) * B[:, t].view(-1, 1, 1, D_STATE)
            state = state * dA + dBx
            y = (state * C[:, t].view(-1, 1, 1, D_STATE)).sum(-1) + self.D.view(-1, 1) * x[:, t]
            ys.append((y * F.silu(z[:, t].view(-1, NHEADS, HEADDIM))).reshape(-1, D_INNER))
        return torch.stack(ys, dim=1)

    def forward(self, hidden_states, ssm_state=None):
        zxBCdt = hidden_states @ self.in_proj
        y = self._ssm_training(zxBCdt) if ssm_state is None else self.ssm_decode(zxBCdt, ssm_state)
        return y @ self.out_proj


# --- megatron/core/ssm/mamba_layer.py, mamba_model.py -----------------------------------------------

def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class MambaLayer(MegatronModule):
    def __init__(self, gen, variant, device):
        super().__init__()
        self.mixer = MambaMixer(gen, variant, device)

    def forward(self, hidden_states, ssm_state=None):
        return hidden_states + self.mixer(rms_norm(hidden_states), ssm_state)


class MambaModel(MegatronModule):
    def __init__(self, gen, variant, device):
        super().__init__()
        self.layers = torch.nn.ModuleList([MambaLayer(gen, variant, device) for _ in range(LAYERS)])

    def forward(self, hidden_states, ssm_states=None):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, None if ssm_states is None else ssm_states[i])
        return rms_norm(hidden_states)


# --- megatron/core/inference/engines/dynamic_engine.py (decode loop with one full CUDA graph) -------

class DynamicInferenceEngine:
    def __init__(self, model, device, enable_cuda_graph):
        self.model, self.device, self.enable_cuda_graph = model, device, enable_cuda_graph
        self.hidden_states = torch.zeros(BATCH, 1, HIDDEN, device=device)                    # static input
        self.mamba_ssm_states = [torch.zeros(BATCH, NHEADS, HEADDIM, D_STATE, device=device)
                                 for _ in range(LAYERS)]                                      # per-request state
        self.cuda_graph = None

    def _decode_step(self):
        with torch.no_grad():
            return self.model(self.hidden_states, self.mamba_ssm_states)

    def create_cuda_graphs(self):
        static = {"hidden_states": self.hidden_states}
        state = {f"mamba_ssm_states[{i}]": s for i, s in enumerate(self.mamba_ssm_states)}
        self.cuda_graph = capture(self._decode_step, device=self.device, warmups=1, name="decode",
                                  owner="DynamicInferenceEngine.create_cuda_graphs", static=static, state=state)
        for s in self.mamba_ssm_states:                                 # warmup/capture tokens are discarded
            s.zero_()

    def generate(self, prompts):
        for s in self.mamba_ssm_states:
            s.zero_()
        self.hidden_states.copy_(prompts)
        if self.enable_cuda_graph and self.cuda_graph is None:
            self.create_cuda_graphs()
        outs = []
        for _ in range(DECODE_STEPS):
            if self.enable_cuda_graph:
                g, out = self.cuda_graph
                hidden = replay(g, out)
            else:
                hidden = self._decode_step()
            outs.append(hidden.clone())
            self.hidden_states.copy_(hidden)                            # next token's input
        return torch.cat(outs, dim=1)


# --- NeMo-RL colocated GRPO loop (policy train step, then generation) -------------------------------

def train_step(model, batch, target):
    model.train()
    loss = (model(batch) - target).pow(2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():                                               # optimizer writes params back in place
        for p, g in zip(model.parameters(), grads):
            p.add_(g, alpha=-LR)


def run(variant: str, device: str = "cpu"):
    def workload(graphed: bool):
        gen = generator(6672)
        model = MambaModel(gen, variant, device)
        prompts = [(torch.randn(BATCH, 1, HIDDEN, generator=gen)).to(device) for _ in range(2)]
        batch = torch.randn(BATCH, TRAIN_SEQ, HIDDEN, generator=gen).to(device)
        target = torch.randn(BATCH, TRAIN_SEQ, HIDDEN, generator=gen).to(device)
        engine = DynamicInferenceEngine(model, device, enable_cuda_graph=graphed)
        model.eval()
        before = engine.generate(prompts[0])                            # warmup + capture happen here
        train_step(model, batch, target)
        model.eval()                                                    # prepare_for_generation
        after = engine.generate(prompts[1])
        return [before, after]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
