"""V0 LoRA: the per-prompt kernel metadata is sized by ``max_num_seqs``, but V0 captures a larger graph size.

Upstream: https://github.com/vllm-project/vllm/pull/15308 ("[Bugfix] LoRA V0 - Fix case where
`max_num_seqs` is between cudagraph capture sizes"), fixing issue #15269.
Symptom: vLLM V0 with ``--enable-lora`` and CUDA graphs dies at startup while capturing graphs,
``RuntimeError: The size of tensor a (50) must match the size of tensor b (56) at non-singleton
dimension 0`` in ``LoRAKernelMeta.prepare_tensors``, whenever ``--max-num-seqs`` (50) is not itself a
capture size; ``--enforce-eager`` or ``max_num_seqs`` = 56 starts fine (vLLM 0.8.1, March 2025).
Mechanism: #14685 moved the punica LoRA kernels onto persistent ``LoRAKernelMeta`` buffers (so that
CUDA graphs read stable addresses) and sized the per-prompt one (``prompt_mapping_meta``, used by the
LoRA logits processor through ``sampler_indices``) by ``max_batches`` = ``max_num_seqs``. The V0 model
runner pads ``max_num_seqs`` up to the next capture size (``_get_graph_batch_size``: 50 -> 56) and
captures that many dummy sequences: ``capture_model`` activates a dummy ``LoRAMapping`` of 56 prompts,
``update_metadata`` copies 56 sampler indices into ``token_lora_mapping[:56]`` of a 50-row buffer, and
the copy raises. An eager runner never pads, so the scheduler's cap keeps every batch within 50 rows.
Doctor: undersized-buffer, at ``prepare_tensors`` (the capture batch's mapping copied into a static
buffer sized for fewer rows than the graph serves).
Fix (upstream): in ``PunicaWrapperGPU.__init__``, size ``prompt_mapping_meta`` by
``max_num_batched_tokens`` on V0 ("When cudagraph capture size is greater than max_num_seqs
(max_batches, here), V0 captures the graph as if max_num_seqs is set to the capture size"); V1 keeps
``max_batches``, since V1 always respects ``max_num_seqs``.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/15308"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "prepare_tensors"
SYMPTOM = "V0 + LoRA + CUDA graphs: startup dies with 'size of tensor a (50) must match ... b (56)' at capture"
VOCAB, DIM, RANK, MAX_LORAS = 12, 4, 2, 2
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 5, 16       # upstream: 50 and 8192
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [8 * i for i in range(1, 4)]
VLLM_USE_V1 = False


def _get_graph_batch_size(batch_size: int) -> int:
    """V0's padding rule: the next capture size (multiples of 8 past 4)."""
    if batch_size <= 2:
        return batch_size
    if batch_size <= 4:
        return 4
    return (batch_size + 7) // 8 * 8


@dataclasses.dataclass
class LoRAMapping:
    index_mapping: list[int]
    prompt_mapping: list[int]
    is_prefill: bool = False


class LoRAKernelMeta:
    """Persistent per-token (or per-prompt) LoRA mapping that the captured punica kernels read."""

    def __init__(self, token_lora_mapping: torch.Tensor):
        self.token_lora_mapping = token_lora_mapping

    @staticmethod
    def make(max_loras: int, max_num_tokens: int, device) -> "LoRAKernelMeta":
        return LoRAKernelMeta(token_lora_mapping=torch.empty(max_num_tokens, dtype=torch.int32, device=device))

    def prepare_tensors(self, token_lora_mapping: torch.Tensor) -> None:
        num_tokens = token_lora_mapping.size(0)
        self.token_lora_mapping[:num_tokens].copy_(token_lora_mapping, non_blocking=True)

    def meta_args(self, token_nums: int) -> torch.Tensor:
        return self.token_lora_mapping[:token_nums]


class PunicaWrapperGPU:
    def __init__(self, max_num_batched_tokens: int, max_batches: int, device, *, max_loras: int, variant: str):
        self.device = device
        self.max_loras = max_loras
        self.token_mapping_meta = LoRAKernelMeta.make(self.max_loras, max_num_batched_tokens, device=device)
        if variant == "bug":
            max_num_prompts = max_batches
        else:
            # When cudagraph capture size is greater than max_num_seqs (max_batches, here), V0 captures
            # the graph as if max_num_seqs is set to the capture size. V1 always respects max_num_seqs.
            max_num_prompts = max_batches if VLLM_USE_V1 else max_num_batched_tokens
        self.prompt_mapping_meta = LoRAKernelMeta.make(self.max_loras, max_num_prompts, device=device)

    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: list) -> None:
        def slot(lora_id):                                   # lora id 0 = no LoRA = -1
            return lora_index_to_id.index(lora_id) if lora_id > 0 else -1
        token_lora_indices = torch.tensor([slot(i) for i in mapping.index_mapping], dtype=torch.int32)
        sampler_indices = torch.tensor([slot(i) for i in mapping.prompt_mapping], dtype=torch.int32)
        self.token_mapping_meta.prepare_tensors(token_lora_indices.to(self.device))
        self.prompt_mapping_meta.prepare_tensors(sampler_indices.to(self.device))


def add_lora(y, x, lora_a_stacked, lora_b_stacked, token_lora_mapping):
    """punica shrink + expand: rows mapped to -1 take no LoRA."""
    idx = token_lora_mapping.long()
    a = lora_a_stacked[idx.clamp(min=0)]                    # [n, r, d]
    b = lora_b_stacked[idx.clamp(min=0)]                    # [n, out, r]
    delta = torch.einsum("nor,nr->no", b, torch.einsum("nrd,nd->nr", a, x))
    return y + delta * (idx >= 0).unsqueeze(1).to(y.dtype)


class LlamaForCausalLMWithLoRA:
    def __init__(self, device):
        gen = generator(15308)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.qkv_lora_a = randn(MAX_LORAS, RANK, DIM, gen=gen, device=device)
        self.qkv_lora_b = randn(MAX_LORAS, DIM, RANK, gen=gen, device=device)
        self.lm_lora_a = randn(MAX_LORAS, RANK, DIM, gen=gen, device=device)
        self.lm_lora_b = randn(MAX_LORAS, VOCAB, RANK, gen=gen, device=device)

    def forward(self, input_ids, punica: PunicaWrapperGPU):
        n = input_ids.shape[0]                               # decode: one token per sequence
        x = self.embed[input_ids]
        h = torch.tanh(add_lora(x @ self.w, x, self.qkv_lora_a, self.qkv_lora_b,
                                punica.token_mapping_meta.meta_args(n)))
        # LogitsProcessorWithLoRA: per-prompt adapters through sampler_indices
        return add_lora(h @ self.lm_head, h, self.lm_lora_a, self.lm_lora_b, punica.prompt_mapping_meta.meta_args(n))


class ModelRunner:
    """V0's runner, the LoRA part: ``set_active_loras`` before every step and every capture."""

    def __init__(self, model, device, variant: str, enforce_eager: bool):
        self.model, self.device, self.enforce_eager = model, device, enforce_eager
        self.punica = PunicaWrapperGPU(MAX_NUM_BATCHED_TOKENS, max_batches=MAX_NUM_SEQS, device=device,
                                       max_loras=MAX_LORAS, variant=variant)
        self.lora_index_to_id = [1, 2]                       # adapters 1 and 2 resident in slots 0, 1
        self.max_batchsize_to_capture = _get_graph_batch_size(MAX_NUM_SEQS)
        self.batch_size_capture_list = [bs for bs in _BATCH_SIZES_TO_CAPTURE if bs <= self.max_batchsize_to_capture]
        self.input_tokens = torch.zeros(self.max_batchsize_to_capture, dtype=torch.long, device=device)
        self.graph_runners, self.graph_outputs = {}, {}

    def set_active_loras(self, lora_mapping: LoRAMapping) -> None:
        self.punica.update_metadata(lora_mapping, self.lora_index_to_id)

    def capture_model(self) -> None:
        pool = graph_pool_handle(self.device)
        static = {"input_tokens": self.input_tokens, "token_lora_mapping": self.punica.token_mapping_meta.token_lora_mapping,
                  "sampler_indices": self.punica.prompt_mapping_meta.token_lora_mapping}
        for batch_size in reversed(self.batch_size_capture_list):
            lora_mapping = LoRAMapping(index_mapping=[0] * batch_size, prompt_mapping=[0] * batch_size)
            self.set_active_loras(lora_mapping)
            g, out = capture(lambda bs=batch_size: self.model.forward(self.input_tokens[:bs], self.punica),
                             device=self.device, pool=pool, name=f"size {batch_size}", static=static,
                             owner="ModelRunner (V0 decode graphs)")
            self.graph_runners[batch_size], self.graph_outputs[batch_size] = g, out

    def execute_model(self, token_ids: list[int], lora_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        if self.enforce_eager:
            self.set_active_loras(LoRAMapping(lora_ids, lora_ids))
            return self.model.forward(torch.tensor(token_ids, device=self.device), self.punica).clone()
        bs = self.batch_size_capture_list[bisect.bisect_left(self.batch_size_capture_list, n)]
        pad = [0] * (bs - n)                                 # padded sequences: token 0, no LoRA
        self.set_active_loras(LoRAMapping(lora_ids + pad, lora_ids + pad))
        self.input_tokens[:bs].copy_(torch.tensor(token_ids + pad, device=self.device))
        return replay(self.graph_runners[bs], self.graph_outputs[bs], real=n, size=bs, padded={})[:n].clone()


STEPS = [([3, 7, 1], [1, 0, 2]), ([5, 2, 9, 4, 6], [2, 2, 0, 1, 1]), ([8, 11], [0, 1])]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLMWithLoRA(device)

    def serve(enforce_eager: bool):
        runner = ModelRunner(model, device, variant, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        return [runner.execute_model(ids, loras) for ids, loras in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
