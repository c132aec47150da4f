"""The LoRA decode graph keeps the capture batch's active-adapter count: a second adapter's tokens get no delta.

Upstream: https://github.com/a710128/nanovllm-voxcpm/commit/4e3a14010563425613b00ebdf339c9dca74e1bba
("fix: stabilize LoRA CUDA graph replay buckets"; no issue).
Symptom: with LoRA and CUDA graphs, in a decode batch using two adapters the second adapter's tokens get
the base projection only; the new test ``test_runner_lora_cuda_graph_replay_supports_active_lora_count_changes``
(a step with 1 active adapter, then 2) fails ``allclose(graph_out, eager_out)`` before the fix.
Mechanism: ``BaseModelRunner.capture_cudagraph`` allocates static LoRA buffers per domain with
``_make_graph_domain_buffers(max_rows)`` (``active_slot_ids``, ``num_tokens_per_slot``, ``slot_start_offsets``,
sized by rows) and captures the "lora" graph with a dummy context where every token uses slot 0.
``_set_graph_lora_contexts`` copies a context's compacted metadata into the buffers' first rows and installs
a ``LoRAContext`` of views ``active_slot_ids[:num_active_slots]`` etc. with ``num_active_loras =
num_active_slots``, the current batch's count of distinct adapters. ``lora_shrink``/``lora_expand`` launch
``grid = (..., num_slices, num_active_loras)``, one z-block per adapter; at capture that Python int was the
dummy batch's 1. Before each ``graph.replay()``, ``run_model`` calls ``_set_graph_lora_contexts`` again: the
buffers get both adapters' ids, counts and offsets, but the replay runs z-block 0 only, so slot 1's tokens
get no LoRA delta (eager launches 2 z-blocks).
Doctor: host-work-frozen, at ``_set_graph_lora_contexts`` (the Python active-adapter count it derives from
the batch sizes the kernels' grid at capture; replays keep the capture-time count of 1).
Fix (upstream): a fixed slot-indexed table of ``max_lora_buckets = max_loras + 1``:
``_make_graph_domain_buffers(max_rows, max_lora_buckets)`` sets ``active_slot_ids = arange(-1,
max_lora_buckets - 1)`` (bucket 0 = no LoRA); ``_copy_lora_domain_to_graph_vars`` zeroes
``num_tokens_per_slot``, scatters counts into bucket ``active_slot_ids + 1``, sets ``slot_start_offsets[1:] =
cumsum``; ``_set_graph_lora_contexts`` passes whole buffers with ``num_active_loras=num_lora_buckets``, so the
grid covers every bucket and empty buckets do nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/a710128/nanovllm-voxcpm/commit/4e3a14010563425613b00ebdf339c9dca74e1bba"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_set_graph_lora_contexts"
SYMPTOM = "LoRA graph decode of a two-adapter batch drops the second adapter's delta (graph != eager)"

VOCAB, HIDDEN, OUT, MAX_LORA_RANK, MAX_LORAS, MAX_NUM_SEQS = 16, 4, 3, 1, 2, 4
LM_LORA_DOMAIN, _LORA_CONTEXTS = "lm_domain", {}        # set_lora_context / get_lora_context, per domain


@dataclasses.dataclass
class LoRAContext:
    token_to_slot: torch.Tensor | None = None
    token_indices_sorted_by_slot: torch.Tensor | None = None
    active_slot_ids: torch.Tensor | None = None
    num_tokens_per_slot: torch.Tensor | None = None
    slot_start_offsets: torch.Tensor | None = None
    no_lora_flag: bool = True
    num_active_loras: int = 0


def set_lora_context(context: LoRAContext, domain: str = LM_LORA_DOMAIN) -> None:
    _LORA_CONTEXTS[domain] = context


def get_lora_context(domain: str = LM_LORA_DOMAIN) -> LoRAContext:   # (only the lm domain is modelled)
    return _LORA_CONTEXTS.get(domain, LoRAContext())


def build_lora_context_from_token_to_slot(token_to_slot: list[int], device) -> LoRAContext:
    """Compacted per-batch metadata: sorted distinct slots, their token counts, offsets, grouped tokens."""
    active = sorted({s for s in token_to_slot if s >= 0})
    if not active:
        return LoRAContext(torch.tensor(token_to_slot, dtype=torch.int32, device=device))
    groups = [[i for i, s in enumerate(token_to_slot) if s == slot] for slot in active]
    offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups) + 1)]

    def t(xs):
        return torch.tensor(xs, dtype=torch.int32, device=device)
    return LoRAContext(t(token_to_slot), t([i for g in groups for i in g]), t(active), t([len(g) for g in groups]),
                       t(offsets), no_lora_flag=False, num_active_loras=len(active))


def _lora_block(lora_idx, M, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids):
    """What one z-block of the Triton kernels reads: its adapter id and its rows (``if lora_id == -1: return``)."""
    lora_id = lora_ids[lora_idx:lora_idx + 1].long()
    offs = torch.arange(M, device=lora_ids.device)
    valid = (offs < num_tokens_per_lora[lora_idx:lora_idx + 1]) & (lora_id != -1)
    pos = (lora_token_start_loc[lora_idx:lora_idx + 1] + offs).clamp(max=token_indices_sorted_by_lora_ids.shape[0] - 1)
    ram = token_indices_sorted_by_lora_ids[pos].long()
    return lora_id.clamp(min=0), ram, valid[:, None].to(torch.float32)


def lora_shrink(inputs, lora_a, output, token_indices_sorted, num_tokens_per_lora, lora_token_start_loc, lora_ids,
                no_lora_flag: bool, num_active_loras: int, scaling: float):
    if no_lora_flag:
        return
    output.zero_()
    for lora_idx in range(num_active_loras):               # grid = (..., num_slices, num_active_loras)
        lid, ram, valid = _lora_block(lora_idx, inputs.shape[0], token_indices_sorted, num_tokens_per_lora,
                                      lora_token_start_loc, lora_ids)
        output.index_add_(0, ram, inputs[ram] @ lora_a.index_select(0, lid)[0].T * scaling * valid)


def lora_expand(inputs, lora_b, output, token_indices_sorted, num_tokens_per_lora, lora_token_start_loc, lora_ids,
                no_lora_flag: bool, num_active_loras: int):
    if no_lora_flag:
        return
    for lora_idx in range(num_active_loras):               # add_inputs=True
        lid, ram, valid = _lora_block(lora_idx, inputs.shape[0], token_indices_sorted, num_tokens_per_lora,
                                      lora_token_start_loc, lora_ids)
        output.index_add_(0, ram, inputs[ram] @ lora_b.index_select(0, lid)[0].T * valid)


class LoRALinear:
    def __init__(self, gen, device):
        self.weight = randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lora_a = randn(MAX_LORAS, MAX_LORA_RANK, HIDDEN, gen=gen, device=device)     # per slot
        self.lora_b = randn(MAX_LORAS, OUT, MAX_LORA_RANK, gen=gen, device=device)

    def forward(self, x):
        y = x @ self.weight.T
        c = get_lora_context(LM_LORA_DOMAIN)
        if c.token_to_slot is None or c.no_lora_flag:
            return y
        meta = (c.token_indices_sorted_by_slot, c.num_tokens_per_slot, c.slot_start_offsets, c.active_slot_ids,
                c.no_lora_flag, c.num_active_loras)
        tmp, out = torch.empty(x.shape[0], MAX_LORA_RANK, device=x.device), y.clone()
        lora_shrink(x, self.lora_a, tmp, *meta, 1.0)
        lora_expand(tmp, self.lora_b, out, *meta)
        return out


class _TinyDecodeModel:
    def __init__(self, device):
        gen = generator(4140)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(8, HIDDEN, gen=gen, device=device, scale=0.5)
        self.proj = LoRALinear(gen, device)

    def __call__(self, tokens, positions):
        return torch.tanh(self.proj.forward(self.embed[tokens] + self.pos_embed[positions]))


class BaseModelRunner:
    def __init__(self, variant, device):
        self.variant, self.device, self.max_loras = variant, device, MAX_LORAS
        self.model = _TinyDecodeModel(device)

    def _lora_context_from_slots(self, token_to_slot):
        return build_lora_context_from_token_to_slot(token_to_slot, self.device)

    def _make_graph_domain_buffers(self, max_rows, max_lora_buckets):
        d, i32 = self.device, torch.int32
        n_slots = max_lora_buckets if self.variant == "fix" else max_rows
        active = (torch.arange(-1, max_lora_buckets - 1, dtype=i32, device=d) if self.variant == "fix"
                  else torch.zeros(max_rows, dtype=i32, device=d))              # fix: bucket 0 = no LoRA
        return {"token_to_slot": torch.full((max_rows,), -1, dtype=i32, device=d),
                "token_indices_sorted_by_slot": torch.arange(max_rows, dtype=i32, device=d),
                "active_slot_ids": active,
                "num_tokens_per_slot": torch.zeros(n_slots, dtype=i32, device=d),
                "slot_start_offsets": torch.zeros(n_slots + 1, dtype=i32, device=d)}

    def _copy_lora_domain_to_graph_vars(self, graph_vars, domain, context: LoRAContext):
        v = graph_vars["lora_domains"][domain]
        v["token_to_slot"].fill_(-1)
        v["token_to_slot"][:context.token_to_slot.size(0)] = context.token_to_slot
        idx, ctx_idx = v["token_indices_sorted_by_slot"], context.token_indices_sorted_by_slot
        idx.copy_(torch.arange(idx.size(0), dtype=torch.int32, device=self.device))
        if ctx_idx is not None:
            idx[:ctx_idx.size(0)] = ctx_idx
        v["num_tokens_per_slot"].zero_()
        if self.variant == "fix":
            if context.active_slot_ids is not None:
                v["num_tokens_per_slot"].scatter_(0, context.active_slot_ids.long() + 1, context.num_tokens_per_slot)
            v["slot_start_offsets"].zero_()
            v["slot_start_offsets"][1:] = torch.cumsum(v["num_tokens_per_slot"], dim=0)
            return
        v["active_slot_ids"].zero_()
        v["slot_start_offsets"].zero_()
        if context.active_slot_ids is not None:
            v["active_slot_ids"][:context.active_slot_ids.size(0)] = context.active_slot_ids
            v["num_tokens_per_slot"][:context.num_tokens_per_slot.size(0)] = context.num_tokens_per_slot
            v["slot_start_offsets"][:context.slot_start_offsets.size(0)] = context.slot_start_offsets

    def _set_graph_lora_contexts(self, graph_vars, contexts):
        for domain, context in contexts.items():
            self._copy_lora_domain_to_graph_vars(graph_vars, domain, context)
            v = graph_vars["lora_domains"][domain]
            token_count = context.token_to_slot.size(0)
            if self.variant == "fix":
                active, counts, offsets = v["active_slot_ids"], v["num_tokens_per_slot"], v["slot_start_offsets"]
                num_active_loras = v["active_slot_ids"].size(0)                       # every bucket, always
            else:
                num_active_slots = 0 if context.active_slot_ids is None else context.active_slot_ids.size(0)
                num_slot_offsets = 1 if context.slot_start_offsets is None else context.slot_start_offsets.size(0)
                active, counts = v["active_slot_ids"][:num_active_slots], v["num_tokens_per_slot"][:num_active_slots]
                offsets, num_active_loras = v["slot_start_offsets"][:num_slot_offsets], num_active_slots
            set_lora_context(LoRAContext(v["token_to_slot"][:token_count],
                                         v["token_indices_sorted_by_slot"][:token_count], active, counts, offsets,
                                         no_lora_flag=context.no_lora_flag, num_active_loras=num_active_loras),
                             domain=domain)

    def capture_cudagraph(self):
        max_bs, d = MAX_NUM_SEQS, self.device
        inputs = {"tokens": torch.zeros(max_bs, dtype=torch.long, device=d),
                  "positions": torch.zeros(max_bs, dtype=torch.long, device=d)}
        lora_domains = {LM_LORA_DOMAIN: self._make_graph_domain_buffers(max_bs, self.max_loras + 1)}
        outputs = torch.zeros(max_bs, OUT, device=d)
        self.graph_vars = dict(inputs=inputs, lora_domains=lora_domains, outputs=outputs)
        self.graph_bs, self.graphs = [max_bs], {"lora": {}}
        for bs in reversed(self.graph_bs):
            dummy = {LM_LORA_DOMAIN: self._lora_context_from_slots([0 for _ in range(bs)])}   # one adapter
            self._set_graph_lora_contexts(self.graph_vars, dummy)

            def step(bs=bs):
                outputs[:bs] = self.model(inputs["tokens"][:bs], inputs["positions"][:bs])
                return outputs[:bs]
            static = {**inputs, **{"lora." + k: t for k, t in lora_domains[LM_LORA_DOMAIN].items()}}
            self.graphs["lora"][bs] = capture(step, device=d, static=static, name=f"lora_bs{bs}", owner="runner")
            _LORA_CONTEXTS.clear()                                      # reset_all_contexts()

    def run_model(self, inputs, lora_context: LoRAContext):
        bs = inputs["tokens"].size(0)
        g, out = self.graphs["lora"][next(x for x in self.graph_bs if x >= bs)]
        for kw, buf in self.graph_vars["inputs"].items():
            buf[:bs] = inputs[kw]
        self._set_graph_lora_contexts(self.graph_vars, {LM_LORA_DOMAIN: lora_context})
        result = replay(g, out)[:bs].clone()
        _LORA_CONTEXTS.clear()
        return result


# decode steps: (token per request, position, adapter slot per request; -1 = no adapter)
STEPS = [([3, 5, 7, 1], [1, 2, 1, 3], [0, -1, 0, 0]),      # one active adapter, as at capture
         ([4, 9, 2, 6], [2, 3, 2, 4], [0, 1, 1, -1]),      # two active adapters
         ([8, 1, 11, 13], [3, 4, 3, 5], [1, -1, 0, 1])]


def run(variant: str, device: str = "cpu"):
    def batch(tokens, positions):
        return {"tokens": torch.tensor(tokens, device=device), "positions": torch.tensor(positions, device=device)}

    def eager():                                                   # enforce_eager: self.model(**inputs)
        runner, outs = BaseModelRunner(variant, device), []
        for tokens, positions, slots in STEPS:
            set_lora_context(runner._lora_context_from_slots(slots))
            outs.append(runner.model(**batch(tokens, positions)))
        return outs

    def served():
        runner = BaseModelRunner(variant, device)
        runner.capture_cudagraph()
        return [runner.run_model(batch(t, p), runner._lora_context_from_slots(s)) for t, p, s in STEPS]

    return compare("nanovllmvoxcpm_4e3a140_active_lora_count_baked_into_graph_grid", variant, device, served, eager)
