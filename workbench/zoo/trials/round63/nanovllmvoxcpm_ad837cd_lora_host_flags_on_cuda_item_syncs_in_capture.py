"""LoRA "host flag" tensors land on the GPU under ``set_default_device("cuda")``: ``.item()`` on them syncs inside capture.

Upstream: https://github.com/a710128/nanovllm-voxcpm/commit/ad837cd9183cd1235392028dad52d2ac2a075121
("fix: align LoRA loading and graph capture"; no issue, the regression tests define the failure).
Symptom: with a LoRA config and CUDA graphs on, engine start-up fails in ``capture_cudagraph``: the first
graph capture hits a device-to-host sync (stream-capture error), so no graph ("base" or "lora") is built;
the new test ``test_lora_capture_cudagraph_keeps_host_flags_on_cpu`` asserts the flags stay on the CPU and
that ``runner.graphs["lora"]`` holds a graph.
Mechanism: ``BaseModelRunner.__init__`` runs ``capture_cudagraph()`` under ``torch.set_default_device("cuda")``.
There the static LoRA graph vars are allocated, including the host flags
``lora_no_lora_flag_cpu = torch.tensor([True], dtype=torch.bool)`` and
``lora_num_active_loras_cpu = torch.tensor([0], dtype=torch.int32)``: with no ``device=`` they land on the GPU.
They reach the vendored punica ops through ``set_lora_context(no_lora_flag_cpu=..., num_active_loras_cpu=...)``,
and ``lora_shrink``/``lora_expand`` read them on the host: ``if no_lora_flag_cpu.item(): return`` and
``grid = (..., num_slices, num_active_loras.item())``. Inside ``torch.cuda.graph(base_graph, self.graph_pool)``
that ``.item()`` of a CUDA tensor is a device-to-host synchronisation, which a capturing stream refuses; the
warmup just before it (eager) passed. The flags are meant to be host values read at launch time.
Doctor: sync-in-capture, at ``capture_cudagraph`` (the flags it allocates on the default CUDA device are
read with ``.item()`` inside the captured region).
Fix (upstream): every construction of the flags pins the CPU -- ``torch.tensor([True], dtype=torch.bool,
device="cpu")`` and ``torch.tensor([0], dtype=torch.int32, device="cpu")`` -- in ``capture_cudagraph``,
``_prepare_default_lora_context`` and the per-step ``_prepare_lora_context``; ``.item()`` of host memory
needs no sync. (Here host memory is ``host(...)``, pinned on CUDA.)
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/a710128/nanovllm-voxcpm/commit/ad837cd9183cd1235392028dad52d2ac2a075121"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "capture_cudagraph"
SYMPTOM = "LoRA CUDA-graph capture fails: .item() on the GPU-resident no_lora_flag_cpu inside torch.cuda.graph"

HIDDEN, OUT, RANK, MAX_LORAS = 6, 5, 2, 2
GRAPH_BS = [1, 2, 4]
_LORA_CONTEXT: dict = {}


def set_lora_context(**kwargs):
    _LORA_CONTEXT.clear()
    _LORA_CONTEXT.update(kwargs)


def reset_all_contexts():
    _LORA_CONTEXT.clear()


def _segment(j, start, count, dtype):
    return ((j >= start) & (j < start + count)).unsqueeze(1).to(dtype)


def lora_shrink(inputs, lora_a, output, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling):
    if no_lora_flag_cpu.item():
        return
    output.zero_()
    j = torch.arange(inputs.size(0), device=inputs.device)
    tokens = token_indices_sorted_by_lora_ids.long()
    for z in range(int(num_active_loras.item())):          # grid z: one program per active adapter
        a = lora_a.index_select(0, lora_ids[z:z + 1].long())[0]
        valid = _segment(j, lora_token_start_loc[z], num_tokens_per_lora[z], inputs.dtype)
        output.index_add_(0, tokens, (inputs[tokens] @ a.T) * valid * scaling)


def lora_expand(inputs, lora_b, output, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras):
    if no_lora_flag_cpu.item():
        return
    j = torch.arange(inputs.size(0), device=inputs.device)
    tokens = token_indices_sorted_by_lora_ids.long()
    for z in range(int(num_active_loras.item())):
        b = lora_b.index_select(0, lora_ids[z:z + 1].long())[0]
        valid = _segment(j, lora_token_start_loc[z], num_tokens_per_lora[z], inputs.dtype)
        output.index_add_(0, tokens, (inputs[tokens] @ b.T) * valid)


class LoRALinear:
    def __init__(self, device, gen):
        self.weight = randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lora_A = randn(MAX_LORAS, RANK, HIDDEN, gen=gen, device=device, scale=0.5)   # slots 0, 1 loaded
        self.lora_B = randn(MAX_LORAS, OUT, RANK, gen=gen, device=device, scale=0.5)

    def forward(self, x):
        out = x @ self.weight.T
        ctx = _LORA_CONTEXT
        if ctx.get("token_to_slot") is None:
            return out
        meta = (ctx["token_indices_sorted_by_slot"], ctx["num_tokens_per_slot"], ctx["slot_start_offsets"],
                ctx["active_slot_ids"], ctx["no_lora_flag_cpu"], ctx["num_active_loras_cpu"])
        scratch = torch.zeros(x.size(0), RANK, device=x.device)
        lora_shrink(x, self.lora_A, scratch, *meta, 1.0)
        lora_expand(scratch, self.lora_B, out, *meta)
        return out


class VoxCPMToy:
    def __init__(self, device):
        gen = generator(837)
        self.qkv = LoRALinear(device, gen)
        self.proj = randn(OUT, OUT, gen=gen, device=device, scale=0.5)

    def __call__(self, inputs):
        return torch.tanh(self.qkv.forward(inputs)) @ self.proj


class BaseModelRunner:
    def __init__(self, device, variant, enforce_eager):
        self.device, self.variant, self.enforce_eager = device, variant, enforce_eager
        self.model = VoxCPMToy(device)
        self.graphs = {"base": {}, "lora": {}}
        if not enforce_eager:
            with torch.device(device):        # torch.set_default_device(device) around the capture
                self.capture_cudagraph()

    def _flags(self, no_lora, num_active):
        if self.variant == "bug":             # no device=: the default device (CUDA during capture)
            return (torch.tensor([no_lora], dtype=torch.bool), torch.tensor([num_active], dtype=torch.int32))
        return (host(torch.tensor([no_lora], dtype=torch.bool, device="cpu"), self.device),
                host(torch.tensor([num_active], dtype=torch.int32, device="cpu"), self.device))

    def _prepare_lora_context(self, adapter_ids):
        if all(a is None for a in adapter_ids):
            no_lora_flag_cpu, num_active_loras_cpu = self._flags(True, 0)      # _prepare_default_lora_context
            return set_lora_context(no_lora_flag_cpu=no_lora_flag_cpu, num_active_loras_cpu=num_active_loras_cpu)
        active = sorted({a for a in adapter_ids if a is not None})
        order = [i for s in active for i, a in enumerate(adapter_ids) if a == s]
        order += [i for i, a in enumerate(adapter_ids) if a is None]
        counts = [sum(a == s for a in adapter_ids) for s in active]
        offsets = [0] + torch.tensor(counts).cumsum(0).tolist()
        no_lora_flag_cpu, num_active_loras_cpu = self._flags(False, len(active))
        dev = lambda v: torch.tensor(v, dtype=torch.int32).to(self.device)   # noqa: E731
        set_lora_context(token_to_slot=dev([-1 if a is None else a for a in adapter_ids]),
                         token_indices_sorted_by_slot=dev(order), active_slot_ids=dev(active),
                         num_tokens_per_slot=dev(counts), slot_start_offsets=dev(offsets),
                         no_lora_flag_cpu=no_lora_flag_cpu, num_active_loras_cpu=num_active_loras_cpu)

    def capture_cudagraph(self):
        max_bs = GRAPH_BS[-1]
        inputs = torch.zeros(max_bs, HIDDEN)
        lora_token_to_slot = torch.full((max_bs,), -1, dtype=torch.int32)
        lora_token_indices_sorted_by_slot = torch.arange(max_bs, dtype=torch.int32)
        lora_active_slot_ids = torch.zeros(max_bs, dtype=torch.int32)
        lora_num_tokens_per_slot = torch.zeros(max_bs, dtype=torch.int32)
        lora_slot_start_offsets = torch.zeros(max_bs + 1, dtype=torch.int32)
        lora_no_lora_flag_cpu, lora_num_active_loras_cpu = self._flags(True, 0)
        outputs = torch.zeros(max_bs, OUT)
        self.graph_vars = dict(inputs=inputs, lora_token_to_slot=lora_token_to_slot,
                               lora_token_indices_sorted_by_slot=lora_token_indices_sorted_by_slot,
                               lora_active_slot_ids=lora_active_slot_ids, lora_num_tokens_per_slot=lora_num_tokens_per_slot,
                               lora_slot_start_offsets=lora_slot_start_offsets, outputs=outputs)
        static = {k: v for k, v in self.graph_vars.items() if k != "outputs"}
        self.graph_pool = graph_pool_handle(self.device)

        def step(bs):
            outputs[:bs] = self.model(inputs[:bs])
            return outputs[:bs]

        def context(bs, n):
            set_lora_context(token_to_slot=lora_token_to_slot[:bs],
                             token_indices_sorted_by_slot=lora_token_indices_sorted_by_slot[:bs],
                             active_slot_ids=lora_active_slot_ids[:n or bs],
                             num_tokens_per_slot=lora_num_tokens_per_slot[:n or bs],
                             slot_start_offsets=lora_slot_start_offsets[:(n or bs) + 1],
                             no_lora_flag_cpu=lora_no_lora_flag_cpu, num_active_loras_cpu=lora_num_active_loras_cpu)

        for bs in reversed(GRAPH_BS):
            context(bs, 0)
            self.graphs["base"][bs] = capture(lambda bs=bs: step(bs), device=self.device, pool=self.graph_pool,
                                              name=f"base bs={bs}", static=static, owner="BaseModelRunner")
            n = min(MAX_LORAS, bs)                       # dummy context: n active slots, tokens split evenly
            lora_active_slot_ids.zero_()
            lora_active_slot_ids[:n] = torch.arange(n, dtype=torch.int32)
            lora_num_tokens_per_slot.zero_()
            for s in range(n):
                lora_num_tokens_per_slot[s] = bs // n + (1 if s < bs % n else 0)
            lora_slot_start_offsets.zero_()
            lora_slot_start_offsets[1:n + 1] = torch.cumsum(lora_num_tokens_per_slot[:n], dim=0)
            lora_no_lora_flag_cpu.fill_(False)
            lora_num_active_loras_cpu.fill_(n)
            context(bs, n)
            self.graphs["lora"][bs] = capture(lambda bs=bs: step(bs), device=self.device, pool=self.graph_pool,
                                              name=f"lora bs={bs}", static=static, owner="BaseModelRunner")
            lora_no_lora_flag_cpu.fill_(True)
            lora_num_active_loras_cpu.fill_(0)
            reset_all_contexts()

    def run_model(self, x, adapter_ids):
        self._prepare_lora_context(adapter_ids)
        ctx = dict(_LORA_CONTEXT)
        if self.enforce_eager:
            ret = self.model(x)
            reset_all_contexts()
            return ret
        bs = x.size(0)
        kind = "lora" if ctx.get("token_to_slot") is not None else "base"
        g, out = self.graphs[kind][next(b for b in GRAPH_BS if b >= bs)]
        gv = self.graph_vars
        gv["inputs"][:bs] = x
        gv["lora_token_to_slot"].fill_(-1)
        gv["lora_token_indices_sorted_by_slot"].copy_(torch.arange(GRAPH_BS[-1], dtype=torch.int32))
        for name in ("active_slot_ids", "num_tokens_per_slot", "slot_start_offsets"):
            gv["lora_" + name].zero_()
        for name in ("token_to_slot", "token_indices_sorted_by_slot", "active_slot_ids", "num_tokens_per_slot",
                     "slot_start_offsets"):
            if ctx.get(name) is not None:
                gv["lora_" + name][:ctx[name].size(0)] = ctx[name]
        ret = replay(g, out)[:bs].clone()
        reset_all_contexts()
        return ret


def run(variant: str, device: str = "cpu"):
    gen = generator(8370)
    steps = [([0, 1, None, 0], 4), ([None, None], 2), ([1, 1, 1, 1], 4), ([1, 0], 2)]
    data = [(randn(bs, HIDDEN, gen=gen, device=device), ids) for ids, bs in steps]

    def serve(graphed: bool):
        runner = BaseModelRunner(device, variant, enforce_eager=not graphed)
        return [runner.run_model(x, ids) for x, ids in data]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
