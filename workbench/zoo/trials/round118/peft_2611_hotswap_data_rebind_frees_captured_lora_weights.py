"""PEFT LoRA hotswap on a CUDA-graphed model: ``hotswap_adapter_from_state_dict`` swaps same-shape LoRA weights with ``old_val.data = new_val.data``, rebinding each parameter to the loaded tensor's storage; the captured graph keeps the old storage's address, whose only owner was the parameter.

Upstream: https://github.com/huggingface/peft/pull/2611 ("FIX: Avoid possible CUDA Graph re-record when hotswapping
LoRAs.", huggingface/peft, author keepdying (Emre Cakiroglu), opened 2025-06-25, merged 2025-06-27 as bbc9f5dc8).
Read: the PR description (``static input data pointer changed`` at ``result = result + lora_B(lora_A(dropout(x))) *
scaling`` in ``peft/tuners/lora/layer.py``, a diffusers UNet compiled with ``mode="reduce-overhead"``), the diff of
bbc9f5dc8 (``src/peft/utils/hotswap.py``), and at its parent ``hotswap_adapter_from_state_dict`` (the swapping loop:
``_update_scaling``, ``swap_tensors`` only for models not detected as compiled, then the same-shape branch and the
zero-padded smaller-rank branch), ``_update_scaling`` and ``_convert_scalings_to_tensor`` (from
``prepare_model_for_compiled_hotswap``), and ``lora.Linear.forward``; the review thread of #2177 (scalings as tensors).
Symptom: after hotswapping a LoRA into a compiled diffusers model, cudagraph trees report "static input data pointer
changed" for the LoRA weights and silently re-record the CUDA graphs (the recording is thrown away after every swap).
Mechanism: the compiled path of the hotswap keeps the parameter objects (``swap_tensors`` fails on compiled models) but
``old_val.data = new_val.data`` points each of them at the new adapter's storage. The graph captured before the swap
reads the LoRA weights by address: the old storage. The parameter was that storage's only owner, so the rebind
releases it. cudagraph trees notice the changed static-input pointer and re-record (the cost the PR removes); a graph
that is simply replayed, as a hand-made ``torch.cuda.graph`` of the UNet is, reads the released memory: on a GPU an
illegal address once the allocator gives the segment back (or the old adapter's numbers, or whatever reused the block),
here the emulation's IllegalMemoryAccess at the first replay after the swap. The scaling, a tensor after
``prepare_model_for_compiled_hotswap``, is updated in place with ``fill_`` and stays correct.
Doctor: dangling-reference, at hotswap_adapter_from_state_dict (the graph reads the LoRA weight storage that the
``.data`` rebind of this function released).
Fix (upstream): copy in place, ``old_val.data.copy_(new_val.data)`` (and ``.copy_`` for the zero-padded slices), so the
parameters keep their storage and the recorded addresses see the new adapter.
Modelled: ``hotswap_adapter_from_state_dict``'s swapping loop (module name from the key, ``_update_scaling``, the
``is_compiled`` detection and both shape branches) line by line, ``_update_scaling``, ``_convert_scalings_to_tensor``,
``lora.Linear.forward`` (``result + lora_B(lora_A(dropout(x))) * scaling``, dropout identity at inference).
Stand-ins: a two-block toy transformer with LoRA on ``to_q`` and ``to_v`` (rank 4, 8 features) instead of a UNet;
the compiled model is a hand-made graph runner (warm up, capture once, copy the latent into a static input, replay);
``load_adapter_state_dict`` draws the "file" with a seeded generator; the LoRA weights of the first adapter are views
of storages big enough to own their allocator segment (``own_segment_elems``) and ``release_to_driver`` runs after
each swap (a serving process reclaiming memory); float64.
Workload: load adapter ``a0`` (alpha 8), prepare for compiled hotswap, compile, 2 denoising calls; hotswap ``a1``
(alpha 8), 2 calls; hotswap ``a2`` (alpha 16: scaling changes), 2 calls. Bug: the first call after the first swap
raises IllegalMemoryAccess (the graph reads the released LoRA weight storage of ``a0``). Fix: equals eager (max
|graph - eager| = 0, every call; the graph reads the parameters' own storage, refreshed in place).
"""
from __future__ import annotations

import math
from operator import attrgetter

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/huggingface/peft/pull/2611"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "hotswap_adapter_from_state_dict"
SYMPTOM = ("Hotswapping a LoRA into a CUDA-graphed model rebinds each LoRA weight with `.data =`: the captured graph "
           "keeps reading the old weight storage, which the rebind released")

DTYPE = torch.float64
HIDDEN, RANK, TOKENS, NUM_BLOCKS = 8, 4, 6, 2
ADAPTER_NAME = "default"
TARGET_MODULES = ("to_q", "to_v")

_variant = "bug"


class LoraConfig:
    def __init__(self, r, lora_alpha, use_rslora=False):
        self.r, self.lora_alpha, self.use_rslora = r, lora_alpha, use_rslora
        self.rank_pattern, self.alpha_pattern = {}, {}


# --- peft/tuners/lora/layer.py ---------------------------------------------------------------------------------------

class Linear(torch.nn.Module):
    """``lora.Linear`` with one adapter: ``base_layer`` plus ``lora_B(lora_A(dropout(x))) * scaling``."""

    def __init__(self, base_layer, adapter_name, config, weights, device):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = torch.nn.ModuleDict({adapter_name: torch.nn.Linear(HIDDEN, config.r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({adapter_name: torch.nn.Linear(config.r, HIDDEN, bias=False)})
        for lora, w in ((self.lora_A, weights[0]), (self.lora_B, weights[1])):
            storage = torch.zeros(max(own_segment_elems(device), w.numel()), dtype=DTYPE, device=device)
            storage[: w.numel()].copy_(w.reshape(-1))      # the parameter is its storage's only owner
            lora[adapter_name].weight = torch.nn.Parameter(storage[: w.numel()].view_as(w), requires_grad=False)
        self.lora_dropout = torch.nn.ModuleDict({adapter_name: torch.nn.Identity()})
        self.scaling = {adapter_name: config.lora_alpha / config.r}
        self.active_adapters = [adapter_name]

    def forward(self, x):
        result = self.base_layer(x)
        for active_adapter in self.active_adapters:
            lora_A, lora_B = self.lora_A[active_adapter], self.lora_B[active_adapter]
            dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
            result = result + lora_B(lora_A(dropout(x))) * scaling
        return result


# --- the model (a toy denoiser standing in for the diffusers UNet) -----------------------------------------------------

class Attention(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (self._linear(gen, device) for _ in range(4))

    @staticmethod
    def _linear(gen, device):
        lin = torch.nn.Linear(HIDDEN, HIDDEN, bias=True).to(device=device, dtype=DTYPE)
        with torch.no_grad():
            lin.weight.copy_(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE))
            lin.bias.copy_(randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE))
        return lin.requires_grad_(False)

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HIDDEN), dim=-1)
        return x + self.to_out(attn @ v)


class Denoiser(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(2611)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": Attention(gen, device)})
                                          for _ in range(NUM_BLOCKS))

    def forward(self, sample):
        for block in self.blocks:
            sample = torch.nn.functional.layer_norm(block["attn"](sample), (HIDDEN,))
        return sample


def load_adapter_state_dict(seed):
    """The adapter "file": LoRA weights for every targeted module, drawn on the CPU (as loaded from disk)."""
    gen, state_dict = generator(seed), {}
    for i in range(NUM_BLOCKS):
        for name in TARGET_MODULES:
            prefix = f"blocks.{i}.attn.{name}"
            state_dict[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"] = randn(RANK, HIDDEN, gen=gen, device="cpu", scale=0.3).to(DTYPE)
            state_dict[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"] = randn(HIDDEN, RANK, gen=gen, device="cpu", scale=0.3).to(DTYPE)
    return state_dict


def inject_adapter(model, state_dict, config, device):
    for i in range(NUM_BLOCKS):
        attn = model.blocks[i]["attn"]
        for name in TARGET_MODULES:
            prefix = f"blocks.{i}.attn.{name}"
            weights = (state_dict[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"].to(device),
                       state_dict[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"].to(device))
            setattr(attn, name, Linear(getattr(attn, name), ADAPTER_NAME, config, weights, device))


# --- peft/utils/hotswap.py ---------------------------------------------------------------------------------------------

def _convert_scalings_to_tensor(model):
    """Convert the LoRA scaling values into torch.tensors to prevent recompilation if they change."""
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        scaling = module.scaling
        for key, val in scaling.items():
            if isinstance(val, float):
                scaling[key] = torch.tensor(val, device=module.lora_A[key].weight.device, dtype=DTYPE)


def prepare_model_for_compiled_hotswap(model):
    _convert_scalings_to_tensor(model)      # ranks are equal here: no padding needed


def _update_scaling(lora_module, adapter_name, scaling=None):
    if isinstance(lora_module.scaling[adapter_name], torch.Tensor):
        lora_module.scaling[adapter_name].fill_(scaling)
    elif isinstance(lora_module.scaling[adapter_name], (float, int)):
        lora_module.scaling[adapter_name] = scaling


def hotswap_adapter_from_state_dict(model, state_dict, adapter_name, config, is_compiled):
    is_compiled_inplace = False
    for key, new_val in state_dict.items():
        # get LoRA parent module name by removing the 'lora_*.<adapter-name>.weight' part
        module_name = ".".join(key.split(".")[:-3])
        module = model.get_submodule(module_name)

        # swap alpha/scaling
        rank = config.rank_pattern.get(key, config.r)
        alpha = config.alpha_pattern.get(key, config.lora_alpha)
        scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        _update_scaling(module, adapter_name=adapter_name, scaling=scaling)

        # swap actual weights
        old_val = attrgetter(key)(model)
        new_val = new_val.to(old_val.data.device)

        if not is_compiled and not is_compiled_inplace:
            try:
                torch.utils.swap_tensors(old_val, new_val)
                continue
            except RuntimeError:
                is_compiled = True

        if old_val.shape == new_val.shape:
            if _variant == "bug":
                old_val.data = new_val.data                      # rebinds: the old storage is released
            else:
                old_val.data.copy_(new_val.data)                 # the fix: in place, the storage stays
        else:
            if old_val.dim() not in (2, 4):
                raise NotImplementedError("only Conv2d and Linear are supported")
            if old_val.shape[0] > new_val.shape[0]:
                old_val.data.fill_(0)
                old_val.data[: new_val.shape[0]].copy_(new_val.data)
            elif old_val.shape[1] > new_val.shape[1]:
                old_val.data.fill_(0)
                old_val.data[:, : new_val.shape[1]].copy_(new_val.data)
            else:
                raise ValueError(f"Incompatible shapes found for LoRA weights {key}")


# --- the compiled model: one CUDA graph of the denoiser (torch.compile(mode="reduce-overhead") stand-in) --------------

class CompiledModel:
    def __init__(self, model, device, use_cuda_graph):
        self.model, self.device, self.use_cuda_graph = model, device, use_cuda_graph
        self.static_sample = torch.zeros(TOKENS, HIDDEN, dtype=DTYPE, device=device)
        self.graph = self.output = None

    def __call__(self, sample):
        if not self.use_cuda_graph:
            return self.model(sample).clone()
        self.static_sample.copy_(sample)
        if self.graph is None:
            self.graph, self.output = capture(lambda: self.model(self.static_sample), device=self.device,
                                              name="denoiser", owner="compiled model",
                                              static={"sample": self.static_sample})
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    adapters = [("a0", 8.0, 100), ("a1", 8.0, 101), ("a2", 16.0, 102)]

    def serve(use_cuda_graph):
        model = Denoiser(device)
        name, alpha, seed = adapters[0]
        inject_adapter(model, load_adapter_state_dict(seed), LoraConfig(RANK, alpha), device)
        prepare_model_for_compiled_hotswap(model)
        compiled = CompiledModel(model, device, use_cuda_graph)
        gen, outs = generator(7), []
        for i, (name, alpha, seed) in enumerate(adapters):
            if i:
                hotswap_adapter_from_state_dict(model, load_adapter_state_dict(seed), ADAPTER_NAME,
                                                LoraConfig(RANK, alpha), is_compiled=True)
                release_to_driver(device)
            for _ in range(2):
                outs.append(compiled(randn(TOKENS, HIDDEN, gen=gen, device=device).to(DTYPE)))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
