"""FULL decode graphs are captured for batch sizes larger than the Mamba state cache has lines.

Upstream: https://github.com/vllm-project/vllm/pull/34571 ("[Bugfix] Cap FULL decode cudagraph sizes for
Mamba/hybrid models (#34094)"), fixing https://github.com/vllm-project/vllm/issues/34094.
Symptom: hybrid linear-attention / Mamba models (Qwen3-Coder-Next, granite-4.0) fail at startup, during
"Capturing CUDA graphs (decode, FULL)", with ``AssertionError`` (``assert num_cache_lines >= batch`` in
``causal_conv1d_update``) whenever the KV-cache budget leaves fewer Mamba blocks than the largest capture
size; ``--enforce-eager`` or PIECEWISE graphs start and serve fine (vLLM main, February 2026).
Mechanism: the capture sizes are fixed from ``max_num_seqs`` / ``max_cudagraph_capture_size`` before the
KV cache is sized. ``capture_model`` then runs, for every size, a dummy uniform-decode batch of that many
requests and captures it. In a FULL decode graph the Mamba/GDN layers take the decode path
(``max_query_len == 1``), ``causal_conv1d_update`` on the state cache, which needs one cache line per
request of the batch; the dummy batch at the largest sizes has more requests than the state cache has
lines. (PIECEWISE captures run the mixer eagerly on the prefill path and never meet the check; real batches
never exceed the cache, since the scheduler cannot admit more requests than there are Mamba blocks.)
Doctor: undersized-buffer, at ``_check_and_update_cudagraph_mode`` (it keeps capture sizes whose rows do not
fit the Mamba state cache).
Fix (upstream): ``CompilationConfig.adjust_cudagraph_sizes_for_mamba_cache(num_mamba_blocks)``, called from
``_check_and_update_cudagraph_mode`` after ``initialize_kv_cache`` when the mode has FULL decode graphs and
the model has Mamba layers, caps ``max_cudagraph_capture_size`` and drops larger capture sizes.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34571"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_check_and_update_cudagraph_mode"
SYMPTOM = "hybrid models crash at FULL decode capture: assert num_cache_lines >= batch in causal_conv1d_update"

VOCAB, DIM, WIDTH = 12, 4, 3                      # d_conv = WIDTH
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8]            # from max_num_seqs, before the KV cache is sized
NUM_MAMBA_BLOCKS = 6                              # what the KV-cache budget left (block 0: the null block)
NULL_BLOCK = 0


class CompilationConfig:
    def __init__(self, cudagraph_capture_sizes):
        self.cudagraph_capture_sizes = list(cudagraph_capture_sizes)
        self.max_cudagraph_capture_size = max(cudagraph_capture_sizes)

    def adjust_cudagraph_sizes_for_mamba_cache(self, num_mamba_blocks: int) -> None:
        """The fix: a FULL decode batch needs one Mamba cache line per request."""
        if self.max_cudagraph_capture_size <= num_mamba_blocks:
            return
        self.cudagraph_capture_sizes = [s for s in self.cudagraph_capture_sizes if s <= num_mamba_blocks]
        self.max_cudagraph_capture_size = max(self.cudagraph_capture_sizes)


def _check_and_update_cudagraph_mode(compilation_config: CompilationConfig, num_mamba_blocks: int,
                                     has_mamba_layers: bool, variant: str) -> None:
    """Runs after ``initialize_kv_cache``, once the number of Mamba blocks is known."""
    if variant == "fix" and has_mamba_layers:
        compilation_config.adjust_cudagraph_sizes_for_mamba_cache(num_mamba_blocks)


def causal_conv1d_update(x, conv_state, weight, conv_state_indices):
    """Decode step of the short convolution: roll each request's state line and convolve."""
    batch = x.shape[0]
    num_cache_lines = conv_state.size(0)
    assert num_cache_lines >= batch
    window = torch.cat([conv_state[conv_state_indices], x[:, :, None]], dim=-1)      # [b, dim, width]
    conv_state[conv_state_indices] = window[:, :, 1:]
    return torch.nn.functional.silu((window * weight).sum(-1))


class Qwen3NextModel:
    """One GDN-style layer (its short conv on the Mamba state cache) and the LM head."""

    def __init__(self, device):
        gen = generator(34571)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.conv_weight = randn(DIM, WIDTH, gen=gen, device=device, scale=0.6)
        self.w_out = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, input_ids, state_indices, conv_state):
        x = self.emb[input_ids]
        return (x + causal_conv1d_update(x, conv_state, self.conv_weight, state_indices)) @ self.w_out


# three requests and their Mamba blocks, prompt state (after prefill) derived from the prompt
REQUESTS = [(1, [3, 7, 1]), (2, [5, 2]), (3, [8, 6, 4, 9])]


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextModel(device)

    def prefill_state(conv_state):
        for block, prompt in REQUESTS:
            tail = model.emb[torch.tensor(prompt[-(WIDTH - 1):], device=device)]     # last d_conv-1 inputs
            conv_state[block, :, WIDTH - 1 - tail.shape[0]:] = tail.t()

    def eager():
        conv_state = torch.zeros(NUM_MAMBA_BLOCKS, DIM, WIDTH - 1, device=device)
        prefill_state(conv_state)
        outs = []
        for step in range(3):
            ids = torch.tensor([(p[-1] + step + i) % VOCAB for i, (_, p) in enumerate(REQUESTS)], device=device)
            idx = torch.tensor([b for b, _ in REQUESTS], device=device)
            outs.append(model.forward(ids, idx, conv_state))
        return outs

    def served():
        # initialize_kv_cache: the Mamba state cache gets NUM_MAMBA_BLOCKS lines
        conv_state = torch.zeros(NUM_MAMBA_BLOCKS, DIM, WIDTH - 1, device=device)
        compilation_config = CompilationConfig(CUDAGRAPH_CAPTURE_SIZES)
        _check_and_update_cudagraph_mode(compilation_config, NUM_MAMBA_BLOCKS, True, variant)
        max_size = compilation_config.max_cudagraph_capture_size
        input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        state_indices = torch.full((max_size,), NULL_BLOCK, dtype=torch.long, device=device)

        def forward(num_tokens):     # the dummy decode batch of a capture runs every request on the null block
            return model.forward(input_ids[:num_tokens], state_indices[:num_tokens], conv_state)

        manager = GraphManager(forward, compilation_config.cudagraph_capture_sizes, device=device,
                               mode=CUDAGraphMode.FULL, static_buffers={"input_ids": input_ids,
                                                                        "state_indices": state_indices},
                               name="GPUModelRunner (FULL decode)")
        manager.capture()                                  # capture_model()
        conv_state.zero_()                                 # the dummy runs' state is discarded
        prefill_state(conv_state)
        outs = []
        n = len(REQUESTS)
        for step in range(3):
            size = manager.dispatch(n)
            input_ids[:n].copy_(torch.tensor([(p[-1] + step + i) % VOCAB for i, (_, p) in enumerate(REQUESTS)]))
            state_indices[:n].copy_(torch.tensor([b for b, _ in REQUESTS]))
            input_ids[n:].zero_()
            state_indices[n:].fill_(NULL_BLOCK)            # padded rows use the null block
            outs.append(manager.replay(size, n).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
