"""The active-LoRA count reaches the LoRA kernels as a Python int: the compile trace bakes 0 and every graph skips LoRA.

Upstream: https://github.com/vllm-project/vllm/pull/34119 ("[Fix Bug]`num_active_loras` always equals to
zero", commit ada4f4fadd20372b1bf349961a1e442b2d07c53d).
Symptom: with ``specialize_active_lora`` (one CUDA graph per active-LoRA count) "Every subsequent call to the
compiled function passes 0 to ``num_active_loras``": the LoRA kernels launch a z-grid of 0, adapters are ignored.
Mechanism: ``LoRAKernelMeta.prepare_tensors`` runs on the host each step and sets the Python int
``self.num_active_loras = lora_ids.size(0)`` (rounded up over ``captured_lora_counts``); ``meta_args``
returns it and ``PunicaWrapperGPU.add_shrink``/``add_expand`` pass it to the custom ops ``lora_shrink`` /
``lora_expand``, whose grid is ``(..., NUM_SLICES, num_active_loras)``. Dynamo traces the model once, at
the profile run, when no LoRA is active and the int is 0; a Python scalar argument of a custom op becomes
a constant of the traced graph (tensors stay inputs), and vLLM drops the guards, so it is never re-traced.
Each capture (one per LoRA count, after ``prepare_tensors`` set the count to 1, 2, 3) runs the compiled
graph, whose ops launch 0 z-blocks: no shrink/expand is recorded, and every replay serves base-model rows.
An eager step (no compile) reads the live count and applies the adapters.
Doctor: warmup-divergence, at ``meta_args`` (the Python int it hands the kernels was fixed at 0 by the
profile-run trace; captures and replays reuse it while an eager step reads the real count).
Fix (upstream): the count becomes a CPU tensor ``num_active_loras_cpu`` (plus ``default_num_active_loras_cpu
= [max_loras + 1]``) written in place by ``prepare_tensors`` (``self.num_active_loras_cpu[0] = n``),
``_reset`` fills it with 0 and keeps ``captured_lora_counts``, ``meta_args`` returns the tensor, and the
kernels read ``num_active_loras.item()`` at launch: the trace keeps it an input, so each capture sees its count.
"""
from __future__ import annotations

import bisect
import functools
import types

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34119"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "meta_args"
SYMPTOM = "specialize_active_lora + compile + CUDA graphs: LoRA deltas never applied (num_active_loras baked as 0)"

VOCAB, DIM, RANK, MAX_LORAS, MAX_NUM_TOKENS = 16, 4, 2, 2, 4
SPECIALIZE_ACTIVE_LORA = True


def get_captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    if not specialize:
        return [max_loras + 1]
    return [n for n in range(1, max_loras + 2) if (n & (n - 1)) == 0 or n == max_loras + 1]


_ACTIVE: list = [None]      # the traced graph running now: custom-op calls with their Python scalars as constants


def direct_register_custom_op(fn):
    """``torch.ops.vllm.<fn>``: opaque to Dynamo; tensors are graph inputs, Python scalars are baked."""
    @functools.wraps(fn)
    def op(*args):
        fx = _ACTIVE[0]
        if fx is not None:
            if fx.tracing:
                fx.constants.append({i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)})
            else:
                baked = fx.constants[fx.cursor]
                args = tuple(baked.get(i, a) for i, a in enumerate(args))
            fx.cursor += 1
        return fn(*args)
    return op


class support_torch_compile:  # noqa: N801 - vLLM's decorator name
    """Traced on the first call (the profile run); guards dropped, so never re-traced."""
    def __init__(self, model):
        self.model, self.fx = model, None

    def __call__(self, *args):
        if self.fx is None:
            self.fx = types.SimpleNamespace(tracing=True, cursor=0, constants=[])
        self.fx.cursor, _ACTIVE[0] = 0, self.fx
        try:
            return self.model(*args)
        finally:
            _ACTIVE[0], self.fx.tracing = None, False


def _lora_block(z, M, token_indices_sorted, num_tokens_per_lora, lora_token_start_loc, lora_ids):
    """What z-block ``z`` of the Triton kernels reads (``if lora_id == -1: return``)."""
    lora_id = lora_ids[z:z + 1].long()
    offs = torch.arange(M, device=lora_ids.device)
    valid = (offs < num_tokens_per_lora[z:z + 1]) & (lora_id != -1)
    ram = token_indices_sorted[(lora_token_start_loc[z:z + 1] + offs).clamp(max=M - 1)].long()
    return lora_id.clamp(min=0), ram, valid[:, None].to(torch.float32)


def _launch(x, w, y, meta, num_active_loras, scaling):
    """``grid = (..., NUM_SLICES, num_active_loras)``: fix reads ``num_active_loras.item()`` at launch."""
    grid_z = num_active_loras.item() if isinstance(num_active_loras, torch.Tensor) else num_active_loras
    for z in range(grid_z):
        lid, ram, valid = _lora_block(z, x.shape[0], *meta)
        y.index_add_(0, ram, x[ram] @ w.index_select(0, lid)[0].T * scaling * valid)


@direct_register_custom_op
def lora_shrink(x, lora_a, y, token_lora_mapping, token_indices_sorted, num_tokens_per_lora, lora_token_start_loc,
                lora_ids, no_lora_flag_cpu, num_active_loras, scaling):
    if not no_lora_flag_cpu.item():
        _launch(x, lora_a, y, (token_indices_sorted, num_tokens_per_lora, lora_token_start_loc, lora_ids),
                num_active_loras, scaling)


@direct_register_custom_op
def lora_expand(x, lora_b, y, token_lora_mapping, token_indices_sorted, num_tokens_per_lora, lora_token_start_loc,
                lora_ids, no_lora_flag_cpu, num_active_loras):                     # add_inputs=True
    if not no_lora_flag_cpu.item():
        _launch(x, lora_b, y, (token_indices_sorted, num_tokens_per_lora, lora_token_start_loc, lora_ids),
                num_active_loras, 1.0)


class LoRAKernelMeta:
    def __init__(self, variant, device, captured_lora_counts):
        self.variant, i32 = variant, torch.int32

        def buf(n):
            return torch.zeros(n, dtype=i32, device=device)
        self.token_lora_mapping, self.token_indices_sorted_by_lora_ids = buf(MAX_NUM_TOKENS), buf(MAX_NUM_TOKENS)
        self.active_lora_ids, self.num_tokens_per_lora = buf(MAX_LORAS + 1), buf(MAX_LORAS + 1)
        self.lora_token_start_loc = buf(MAX_LORAS + 2)
        self.no_lora_flag_cpu = host(torch.tensor([False]), device)
        self.num_active_loras = 0                                              # bug: a Python int
        self.num_active_loras_cpu = host(torch.tensor([0], dtype=i32), device)           # fix
        self.default_num_active_loras_cpu = host(torch.tensor([MAX_LORAS + 1], dtype=i32), device)
        self.captured_lora_counts = sorted(captured_lora_counts)

    def _reset(self):
        self.active_lora_ids.fill_(-1)
        self.num_tokens_per_lora.fill_(0)
        self.lora_token_start_loc.fill_(0)
        self.no_lora_flag_cpu.fill_(False)
        if self.variant == "fix":
            self.num_active_loras_cpu.fill_(0)
        else:
            self.num_active_loras, self.captured_lora_counts = 0, []

    def prepare_tensors(self, token_lora_mapping: torch.Tensor) -> None:
        self._reset()
        no_lora = bool(torch.all(token_lora_mapping == -1))
        self.no_lora_flag_cpu[0] = no_lora
        if no_lora:
            return
        n = token_lora_mapping.size(0)
        self.token_lora_mapping[:n].copy_(token_lora_mapping)
        self.token_indices_sorted_by_lora_ids[:n].copy_(torch.sort(token_lora_mapping, stable=True)[1])
        lora_ids, num_tokens_per_lora = torch.unique(token_lora_mapping, sorted=True, return_counts=True)
        self.active_lora_ids[:lora_ids.size(0)].copy_(lora_ids)
        self.num_tokens_per_lora[:num_tokens_per_lora.size(0)].copy_(num_tokens_per_lora)
        num_active_loras = lora_ids.size(0)
        if self.captured_lora_counts and num_active_loras > 0:        # round up to a capture key
            idx = bisect.bisect_left(self.captured_lora_counts, num_active_loras)
            if idx < len(self.captured_lora_counts):
                num_active_loras = self.captured_lora_counts[idx]
        if self.variant == "fix":
            self.num_active_loras_cpu[0] = num_active_loras
        else:
            self.num_active_loras = num_active_loras
        self.lora_token_start_loc[1:1 + lora_ids.size(0)].copy_(torch.cumsum(num_tokens_per_lora, dim=0))

    def meta_args(self, token_nums: int, specialize_active_lora: bool):
        if self.variant == "fix":
            num_active_loras = (self.num_active_loras_cpu if specialize_active_lora
                                else self.default_num_active_loras_cpu)
        else:
            max_loras = self.active_lora_ids.size(0) - 1
            num_active_loras = self.num_active_loras if specialize_active_lora else max_loras + 1
        return (self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora_flag_cpu,
                num_active_loras)


class PunicaWrapperGPU:
    def __init__(self, variant, device):
        counts = get_captured_lora_counts(MAX_LORAS, SPECIALIZE_ACTIVE_LORA)
        self.token_mapping_meta = LoRAKernelMeta(variant, device, counts)

    def add_lora_linear(self, y, x, lora_a, lora_b, scale):
        buffer = torch.zeros(x.size(0), RANK, device=x.device)
        lora_shrink(x, lora_a, buffer, *self.token_mapping_meta.meta_args(x.size(0), SPECIALIZE_ACTIVE_LORA), scale)
        lora_expand(buffer, lora_b, y, *self.token_mapping_meta.meta_args(x.size(0), SPECIALIZE_ACTIVE_LORA))


class TinyLoRAModel:
    def __init__(self, variant, device):
        gen = generator(34119)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.weight = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lora_a = randn(MAX_LORAS, RANK, DIM, gen=gen, device=device)
        self.lora_b = randn(MAX_LORAS, DIM, RANK, gen=gen, device=device)
        self.punica_wrapper = PunicaWrapperGPU(variant, device)

    def __call__(self, input_ids):
        x = self.embed[input_ids]
        y = x @ self.weight.T
        self.punica_wrapper.add_lora_linear(y, x, self.lora_a, self.lora_b, 1.0)
        return torch.tanh(y)


# dummy token->adapter mappings with 1, 2, 3 entries in ``unique`` (-1 = no adapter counts too)
META_BUFFERS = ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids", "num_tokens_per_lora",
                "lora_token_start_loc")
DUMMY_MAPPINGS = {1: [0, 0, 0, 0], 2: [0, 1, 0, 1], 3: [-1, 0, 1, -1]}
STEPS = [([3, 5, 7, 1], [0, 0, 1, 1]), ([4, 9, 2, 6], [-1, 0, -1, 0]),
         ([8, 1, 11, 13], [1, -1, 0, 1]), ([2, 12, 6, 15], [0, 0, 0, 0])]


class GPUModelRunner:
    def __init__(self, variant, device):
        self.device, self.model = device, TinyLoRAModel(variant, device)
        self.compiled = support_torch_compile(self.model)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.captured_lora_counts = get_captured_lora_counts(MAX_LORAS, SPECIALIZE_ACTIVE_LORA)
        self.graphs = {}

    def set_active_loras(self, mapping):
        self.model.punica_wrapper.token_mapping_meta.prepare_tensors(
            torch.tensor(mapping, dtype=torch.int32, device=self.device))

    def profile_run(self):                                  # no LoRA active: Dynamo traces here
        with events.warmup():
            self.set_active_loras([-1] * MAX_NUM_TOKENS)
            self.compiled(self.input_ids)

    def capture_model(self):
        for n in reversed(self.captured_lora_counts):        # one graph per num_active_loras
            self.set_active_loras(DUMMY_MAPPINGS[n])
            meta = self.model.punica_wrapper.token_mapping_meta
            static = {"input_ids": self.input_ids, **{k: getattr(meta, k) for k in META_BUFFERS}}
            self.graphs[n] = capture(lambda: self.compiled(self.input_ids), device=self.device, name=f"loras={n}",
                                     static=static, owner="GPUModelRunner")

    def execute_model(self, token_ids, mapping):
        self.input_ids.copy_(torch.tensor(token_ids, device=self.device))
        self.set_active_loras(mapping)
        n = len(set(mapping))                                # dispatcher: round up to a captured count
        g, out = self.graphs[self.captured_lora_counts[bisect.bisect_left(self.captured_lora_counts, n)]]
        return replay(g, out).clone()


def run(variant: str, device: str = "cpu"):
    def eager():                                             # enforce_eager: no compile, no graphs
        runner, outs = GPUModelRunner(variant, device), []
        for token_ids, mapping in STEPS:
            runner.set_active_loras(mapping)
            outs.append(runner.model(torch.tensor(token_ids, device=device)))
        return outs

    def served():
        runner = GPUModelRunner(variant, device)
        runner.profile_run()
        runner.capture_model()
        return [runner.execute_model(t, m) for t, m in STEPS]

    return compare("vllm_34119_num_active_loras_int_baked_by_compile_trace", variant, device, served, eager)
