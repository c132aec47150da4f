"""A small Mamba (selective SSM) language model, served the way vLLM serves it.

vLLM keeps each request's recurrent state in a **state table**: one slot per request (the request's
Mamba "block"), addressed by a per-row state index. A model step therefore has two paths
(``vllm/model_executor/layers/mamba/mamba_mixer.py``, ``MambaMixer.forward_cuda``):

* **prefill** (``causal_conv1d_fn`` + ``selective_scan_fn``): one request's prompt chunk; it starts
  from the slot's state when the request already has computed tokens (chunked prefill,
  ``has_initial_state``) and from zeros otherwise, and writes the final state back to the slot.
* **decode** (``causal_conv1d_update`` + ``selective_state_update``): one token per row; each row
  gathers its state from ``state_table[state_indices[row]]``, advances it one token and scatters it
  back. A row whose index is ``NULL_BLOCK_ID`` (slot 0, reserved) leaves the table unchanged, as the
  kernels skip null rows. Under a FULL CUDA graph ``state_indices`` is the Mamba builder's
  persistent buffer, so the graph reads whatever that buffer holds at replay.

The model has no ``bug``/``fix`` variant: the upstream bug (#41873) is in the runner's metadata,
which decides what the state-index buffer holds (``upstream.py`` beside this file has the variants).
The arithmetic is ``transformers``' ``MambaForCausalLM`` (``modeling_mamba.py``: ``MambaMixer``
slow path, ``MambaRMSNorm``, tied ``lm_head``); parameter names match its ``state_dict`` so the same
weights load into both, and the tests compare prefill and step-by-step decode against it.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

NULL_BLOCK_ID = 0   # vLLM's null block: padded rows point here; never a request's slot


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """The fields of ``transformers.MambaConfig`` this model uses (tiny defaults)."""

    vocab_size: int = 64
    hidden_size: int = 32
    state_size: int = 8
    num_hidden_layers: int = 2
    conv_kernel: int = 4
    expand: int = 2
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @property
    def time_step_rank(self) -> int:
        return math.ceil(self.hidden_size / 16)     # transformers' "auto"

    def to_transformers(self):
        """The equivalent ``transformers.MambaConfig`` (imported lazily: only the tests need it)."""
        from transformers import MambaConfig as HFConfig
        return HFConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, state_size=self.state_size,
                        num_hidden_layers=self.num_hidden_layers, conv_kernel=self.conv_kernel,
                        expand=self.expand, layer_norm_epsilon=self.layer_norm_epsilon,
                        use_associative_scan=False, tie_word_embeddings=self.tie_word_embeddings)


@dataclasses.dataclass
class StateTable:
    """Per-layer conv and SSM state, one row per slot (slot 0 = ``NULL_BLOCK_ID``)."""

    conv: torch.Tensor   # [layers, slots, intermediate, conv_kernel - 1]: the last inputs of the conv
    ssm: torch.Tensor    # [layers, slots, intermediate, state_size]: the recurrent state h

    @classmethod
    def empty(cls, config: MambaConfig, num_slots: int, *, device="cpu", dtype=torch.float64) -> StateTable:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the null block), got {num_slots}")
        d, layers = config.intermediate_size, config.num_hidden_layers
        return cls(torch.zeros(layers, num_slots, d, config.conv_kernel - 1, device=device, dtype=dtype),
                   torch.zeros(layers, num_slots, d, config.state_size, device=device, dtype=dtype))

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MambaMixer(nn.Module):
    """The selective SSM block; ``forward`` advances a batch of sequences from given states."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        d, n, r, k = config.intermediate_size, config.state_size, config.time_step_rank, config.conv_kernel
        self.in_proj = nn.Linear(config.hidden_size, 2 * d, bias=False)
        self.conv1d = nn.Conv1d(d, d, kernel_size=k, groups=d, padding=k - 1)   # holds the weights (see forward)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, config.hidden_size, bias=False)
        self.rank, self.state_size = r, n

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """``h[b, t, hidden]`` from ``conv_state[b, d, k-1]`` and ``ssm_state[b, d, n]``.

        Returns ``(out[b, t, hidden], new_conv_state, new_ssm_state)``; the inputs are not modified.
        """
        x, gate = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)            # [b, d, t] each
        seq = torch.cat([conv_state, x], dim=-1)                              # [b, d, k-1+t]
        new_conv_state = seq[..., -conv_state.shape[-1]:]
        # The depthwise causal conv as a sum over the kernel window (F.conv1d is the same arithmetic
        # but very slow in float64 on the CPU).
        windows = seq.unfold(-1, self.conv1d.kernel_size[0], 1)                # [b, d, t, k]
        x = F.silu((windows * self.conv1d.weight[:, 0, None, :]).sum(-1) + self.conv1d.bias[:, None])
        dt, B, C = torch.split(self.x_proj(x.transpose(1, 2)), [self.rank, self.state_size, self.state_size], dim=-1)
        dt = F.softplus((self.dt_proj.weight @ dt.transpose(1, 2)) + self.dt_proj.bias[:, None])   # [b, d, t]
        A = -torch.exp(self.A_log)                                            # [d, n]
        state, ys = ssm_state, []
        for i in range(x.shape[-1]):
            dA = torch.exp(A * dt[:, :, i, None])
            dBx = dt[:, :, i, None] * B[:, None, i, :] * x[:, :, i, None]
            state = dA * state + dBx
            ys.append((state @ C[:, i, :, None])[..., 0])
        y = torch.stack(ys, dim=-1) + x * self.D[:, None]
        y = y * F.silu(gate)
        return self.out_proj(y.transpose(1, 2)), new_conv_state, state


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = MambaMixer(config)


class MambaBackbone(nn.Module):
    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class MambaLM(nn.Module):
    """Mamba language model with vLLM's two paths over a ``StateTable``: ``prefill`` and ``decode``."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = MambaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def _run(self, input_ids: torch.Tensor, states: StateTable, rows: torch.Tensor, keep: torch.Tensor | None):
        """Advance sequences ``input_ids[b, t]`` whose states live in ``states[:, rows[b]]``.

        ``keep`` (``[b]`` bool) marks rows whose slot must stay unchanged (null rows). Everything is
        fixed-shape tensor work, so the decode path can be captured into a graph.
        """
        h = self.backbone.embeddings(input_ids)
        for layer, block in enumerate(self.backbone.layers):
            conv_table, ssm_table = states.conv[layer], states.ssm[layer]
            conv0 = conv_table.index_select(0, rows)
            ssm0 = ssm_table.index_select(0, rows)
            out, conv1, ssm1 = block.mixer(block.norm(h), conv0, ssm0)
            if keep is not None:
                conv1 = torch.where(keep[:, None, None], conv0, conv1)
                ssm1 = torch.where(keep[:, None, None], ssm0, ssm1)
            conv_table.index_copy_(0, rows, conv1)
            ssm_table.index_copy_(0, rows, ssm1)
            h = h + out
        return self.lm_head(self.backbone.norm_f(h))

    def decode(self, input_ids: torch.Tensor, states: StateTable, state_indices: torch.Tensor) -> torch.Tensor:
        """One token per row: ``input_ids[rows]``, ``state_indices[rows]`` (int32, a slot per row).

        Returns ``logits[rows, vocab]``. Rows whose index is ``NULL_BLOCK_ID`` compute garbage and
        leave the table unchanged. Graph-safe: no host synchronisation, no data-dependent shapes.
        """
        rows = state_indices.long()
        logits = self._run(input_ids[:, None], states, rows, keep=rows == NULL_BLOCK_ID)
        return logits[:, 0]

    def prefill(self, input_ids: torch.Tensor, states: StateTable, slot: int, has_initial_state: bool) -> torch.Tensor:
        """One request's prompt chunk ``input_ids[t]``; returns ``logits[t, vocab]``.

        Starts from the slot's state if ``has_initial_state`` (a later chunk of a chunked prefill),
        else from zeros, whatever the slot held before (its previous owner's state).
        """
        if not NULL_BLOCK_ID < slot < states.num_slots:
            raise ValueError(f"slot must be in [1, {states.num_slots}), got {slot}")
        rows = torch.tensor([slot], device=input_ids.device)
        if not has_initial_state:
            for layer in range(self.config.num_hidden_layers):
                states.conv[layer, slot].zero_()
                states.ssm[layer, slot].zero_()
        return self._run(input_ids[None, :], states, rows, keep=None)[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain full-sequence logits ``[batch, t, vocab]`` from zero state (the reference path)."""
        b = input_ids.shape[0]
        table = StateTable.empty(self.config, b + 1, device=input_ids.device, dtype=self.lm_head.weight.dtype)
        rows = torch.arange(1, b + 1, device=input_ids.device)
        return self._run(input_ids, table, rows, keep=None)


def tiny_mamba(seed: int = 0, config: MambaConfig | None = None, *, device: str = "cpu",
               dtype: torch.dtype = torch.float64) -> MambaLM:
    """A seeded random ``MambaLM`` in eval mode, identical on every machine.

    Weights are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` and only then moved to
    ``device``, so a GPU run serves the very same weights as the CPU. ``A_log = log(1..n)`` and
    ``D = 1`` as in Mamba. Three choices make the *next token depend on the recurrent state*, as in
    a trained model (with Mamba's default init a random model keeps almost no memory, and with tied
    embeddings it just repeats its input token, so a served-state bug would change nothing):
    ``dt`` is log-uniform in [0.1, 1] (Mamba: [0.001, 0.1]), ``out_proj`` has gain 8 and the
    embeddings std 0.3 (the mixers dominate the residual stream), and ``lm_head`` is untied, N(0, 1).
    """
    config = config or MambaConfig()
    gen = torch.Generator().manual_seed(seed)
    model = MambaLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith(".D") or "norm" in name:
                continue                                               # keep the structured init
            if name.endswith("dt_proj.bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(1.0) - math.log(0.1)) + math.log(0.1))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))             # softplus^-1(dt)
            elif name.endswith("embeddings.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:                                                      # nn.Linear / Conv1d's uniform
                gain = 8.0 if name.endswith("out_proj.weight") else 1.0
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                bound = gain / math.sqrt(fan_in)
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return model.to(device=device, dtype=dtype).eval()
