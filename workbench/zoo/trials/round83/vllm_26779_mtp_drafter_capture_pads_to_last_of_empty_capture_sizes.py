"""EAGLE/MTP drafter's dummy_run pads by the runner's use_cudagraphs flag during capture, and looks up the last entry of its own empty capture-size list.

Upstream: https://github.com/vllm-project/vllm/pull/26779 ("[Bugfix] DeepSeek V3.2 MTP metadata & CUDA graph
issues", vllm-project/vllm, xiaohajiayou, merged 2025-10), fixing part of
https://github.com/vllm-project/vllm/issues/26711; a regression from #25109 ("[Spec-Decode] Support piecewise
cudagraphs for Eagle head").
Symptom: DeepSeek V3.2 with MTP speculative decoding and PIECEWISE CUDA graphs does not start. CUDA-graph capture
dies with ``IndexError: list index out of range`` at ``self.cudagraph_batch_sizes[-1]`` in
``EagleProposer.dummy_run``. With ``--enforce-eager`` nothing is captured and the engine serves (inferred from the
code; the PR does not say so).
Mechanism: vLLM cannot yet run V3.2's MTP head under cudagraphs (#25982), so ``SpeculativeConfig`` forces
``enforce_eager = True`` for a ``deepseek_v32`` target. ``EagleProposer.__init__`` (vllm/v1/spec_decode/eagle.py) then sets
``self.use_cuda_graph = False`` and ``self.cudagraph_batch_sizes = []``, because a drafter without graphs has no
capture sizes. ``propose`` checks ``self.use_cuda_graph`` before it pads, so serving steps never read the list.
``GPUModelRunner.capture_model`` (vllm/v1/worker/gpu_model_runner.py) still captures the *target* model PIECEWISE. For
each capture size it makes warm-up ``_dummy_run`` calls (runtime mode NONE) and then one capture ``_dummy_run``
(PIECEWISE). At the end of every ``_dummy_run`` it calls ``self.drafter.dummy_run(num_tokens, use_cudagraphs=...)``
with ``use_cudagraphs`` taken from its own runtime mode. #25109 made ``dummy_run`` decide padding and the
drafter's runtime mode from that argument alone: ``if use_cudagraphs and num_tokens <=
self.cudagraph_batch_sizes[-1]``. The warm-ups pass False and skip the lookup. The first capture pass passes True
and reads the last entry of an empty list, so capture raises IndexError. With enforce_eager the runner captures
nothing, and the profile run passes ``use_cudagraphs=False``, so the list is never read.
Doctor: undersized-buffer, at dummy_run (the capture pass asks the drafter for its largest captured graph size, and
its capture-size table is empty because the drafter captures no graphs. ``dummy_run`` is the function that trusted
the caller's flag instead of the drafter's own ``use_cuda_graph``, and the only one the fix changes).
Fix (upstream): ``dummy_run`` computes ``cudagraphs_enabled = use_cudagraphs and self.use_cuda_graph`` and gates
both the padding and ``cudagraph_runtime_mode`` on it. A drafter without graphs then runs its dummy batch eagerly
and unpadded, as it runs every live step. (Read: the PR description and post-fix ``dummy_run`` copies in stored vLLM
forks. The pre-fix line is reconstructed from the description: "PR #25109 ignored ``self.use_cuda_graph`` in
``dummy_run``". The runner's ``use_cudagraphs = cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE`` also comes from the
description ("gpu_model_runner passes ``use_cudagraphs=True``"). Later vLLM also ANDs in
``not speculative_config.enforce_eager`` on the runner side. The PR's second part, which keeps V3.2 Indexer layers
out of the drafter's attention-layer lists, is not graph-related and is not modelled.)
Modelled: the target is a DeepSeek stand-in: token embedding plus a sinusoidal position term, one MLP block, and an
RMS norm. It has no attention (tokens are independent) and a shared lm_head. The MTP head (``DeepSeekMTP``) embeds
the shifted input ids with the target's ``embed_tokens``, zeroes position 0, concatenates the enorm'd embedding with
the hnorm'd target hidden state, projects with ``eh_proj``, runs one MLP block and computes logits with the shared
lm_head. There is one speculative token, so ``propose`` returns the first draft's logits. Torch.compile's piecewise
split is reduced to one piece per model. ``CUDAGraphWrapper`` captures on the first PIECEWISE call for a
``BatchDescriptor`` (token count only) and replays after that. It reads the real token count from the forward
context's attention metadata only so that it can announce padded rows, which vLLM's wrapper does not do. Capture sizes are
[1, 2, 4, 8] with at most 8 batched tokens. One warm-up runs per size. There is no DP padding, no multimodal input
and no tree drafting. The eager reference is the same engine with ``enforce_eager`` (cudagraph mode NONE).
"""
from __future__ import annotations

import contextlib
import enum
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/26779"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "dummy_run"
SYMPTOM = ("DeepSeek V3.2 + MTP with PIECEWISE CUDA graphs: capture crashes with IndexError (list index out of "
           "range) at cudagraph_batch_sizes[-1] in EagleProposer.dummy_run; --enforce-eager works")

VOCAB, HIDDEN, INTER = 16, 8, 12
CUDA_GRAPH_SIZES = [1, 2, 4, 8]
MAX_NUM_BATCHED_TOKENS = 8
NUM_SPECULATIVE_TOKENS = 1


# --- vllm/config -----------------------------------------------------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2

    def has_mode(self, mode: "CUDAGraphMode") -> bool:
        return self == mode


class CompilationLevel:
    NO_COMPILATION = 0
    PIECEWISE = 3


class CompilationConfig:
    def __init__(self, enforce_eager: bool):
        self.level = CompilationLevel.NO_COMPILATION if enforce_eager else CompilationLevel.PIECEWISE
        self.cudagraph_mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.PIECEWISE
        self.init_with_cudagraph_sizes([] if enforce_eager else CUDA_GRAPH_SIZES)

    def init_with_cudagraph_sizes(self, cudagraph_capture_sizes):
        # sort to make sure cudagraph capture sizes are in descending order
        self.cudagraph_capture_sizes = sorted(cudagraph_capture_sizes, reverse=True)
        self.max_capture_size = self.cudagraph_capture_sizes[0] if self.cudagraph_capture_sizes else 0
        # pre-compute the mapping from batch size to padded graph size
        self.bs_to_padded_graph_size = [0 for _ in range(self.max_capture_size + 1)]
        for end, start in zip(self.cudagraph_capture_sizes, self.cudagraph_capture_sizes[1:] + [0]):
            for bs in range(start, end):
                self.bs_to_padded_graph_size[bs] = start if bs == start else end
        if self.max_capture_size:
            self.bs_to_padded_graph_size[self.max_capture_size] = self.max_capture_size


class SpeculativeConfig:
    def __init__(self, method: str, num_speculative_tokens: int, target_model_type: str,
                 enforce_eager: bool = False):
        self.method, self.num_speculative_tokens = method, num_speculative_tokens
        self.target_model_type = target_model_type      # target_model_config.hf_text_config.model_type
        self.enforce_eager = enforce_eager
        if self.target_model_type == "deepseek_v32":
            # cudagraph for the V3.2 MTP head is not supported yet (#25982): run the drafter eagerly
            self.enforce_eager = True

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "deepseek_mtp")


class VllmConfig:
    def __init__(self, enforce_eager: bool):
        self.enforce_eager = enforce_eager
        self.compilation_config = CompilationConfig(enforce_eager)
        self.speculative_config = SpeculativeConfig("deepseek_mtp", NUM_SPECULATIVE_TOKENS, "deepseek_v32")
        self.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS

    def pad_for_cudagraph(self, batch_size: int) -> int:
        # if batch_size > self.compilation_config.max_capture_size,
        # it should raise an IndexError.
        # the caller should make sure the batch_size is within the range,
        # i.e., batch_size <= self.compilation_config.max_capture_size
        return self.compilation_config.bs_to_padded_graph_size[batch_size]


# --- vllm/forward_context.py -----------------------------------------------------------------------------------------

class BatchDescriptor(NamedTuple):
    num_tokens: int


class AttentionMetadata:
    def __init__(self, num_actual_tokens: int):
        self.num_actual_tokens = num_actual_tokens


class ForwardContext:
    def __init__(self, attn_metadata, num_tokens, cudagraph_runtime_mode, batch_descriptor):
        self.attn_metadata, self.num_tokens = attn_metadata, num_tokens
        self.cudagraph_runtime_mode, self.batch_descriptor = cudagraph_runtime_mode, batch_descriptor


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Forward context is not set."
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, vllm_config, num_tokens=None, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                        batch_descriptor=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, num_tokens, cudagraph_runtime_mode, batch_descriptor)
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm/compilation/cuda_graph.py ----------------------------------------------------------------------------------

class CUDAGraphWrapper:
    """The piecewise backend's wrapper: eager unless the forward context asks for its runtime mode; then capture
    on the first call for a batch descriptor and replay on later ones."""

    def __init__(self, runnable, vllm_config, runtime_mode, device, owner, static):
        self.runnable, self.vllm_config, self.runtime_mode = runnable, vllm_config, runtime_mode
        self.device, self.owner, self.static = device, owner, static
        self.concrete_cudagraph_entries: dict[BatchDescriptor, tuple] = {}

    def __call__(self, *args):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        cudagraph_runtime_mode = forward_context.cudagraph_runtime_mode
        if cudagraph_runtime_mode == CUDAGraphMode.NONE or cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        entry = self.concrete_cudagraph_entries.get(batch_descriptor)
        if entry is None:
            # warm-ups were the runner's eager dummy runs; capture now
            entry = capture(lambda: self.runnable(*args), device=self.device, warmups=0, owner=self.owner,
                            static=self.static, name=f"{self.owner} {batch_descriptor}")
            self.concrete_cudagraph_entries[batch_descriptor] = entry
            return entry[1]
        g, out = entry
        meta = forward_context.attn_metadata
        real = meta.num_actual_tokens if meta is not None else batch_descriptor.num_tokens
        return replay(g, out, real=real, size=batch_descriptor.num_tokens, padded=self.static)


# --- vllm/model_executor/models/deepseek_v2.py, deepseek_mtp.py --------------------------------------------------------

def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class DeepseekV2ForCausalLM:
    def __init__(self, gen, device):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.freqs = randn(HIDDEN, gen=gen, device=device, scale=0.3)
        self.w_up = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.w_down = randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + torch.sin(positions[:, None].to(torch.float32) * self.freqs)
        h = h + F.silu(h @ self.w_up) @ self.w_down
        return rms_norm(h)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class DeepSeekMTP:
    def __init__(self, gen, device, target: DeepseekV2ForCausalLM):
        self.embed_tokens = target.embed_tokens            # shared with the target (load_model)
        self.lm_head = target.lm_head
        self.eh_proj = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.w_up = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.w_down = randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions, hidden_states):
        inputs_embeds = self.embed_tokens[input_ids]
        # masking inputs at position 0, as not needed by MTP
        inputs_embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        h = torch.cat([rms_norm(inputs_embeds), rms_norm(hidden_states)], dim=-1) @ self.eh_proj
        h = h + F.silu(h @ self.w_up) @ self.w_down
        return rms_norm(h)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/v1/spec_decode/eagle.py ------------------------------------------------------------------------------------

class EagleProposer:
    def __init__(self, vllm_config: VllmConfig, device, target, variant):
        self.vllm_config, self.device, self.variant = vllm_config, device, variant
        self.speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = self.speculative_config.num_speculative_tokens
        self.max_num_tokens = vllm_config.max_num_batched_tokens

        self.use_cuda_graph = False
        compilation_config = vllm_config.compilation_config
        if compilation_config.level == CompilationLevel.PIECEWISE:
            cudagraph_mode = compilation_config.cudagraph_mode
            self.use_cuda_graph = (cudagraph_mode.has_mode(CUDAGraphMode.PIECEWISE)
                                   and not self.speculative_config.enforce_eager)
        self.cudagraph_batch_sizes = (list(reversed(compilation_config.cudagraph_capture_sizes))
                                      if self.use_cuda_graph else [])

        # persistent buffers for cuda graph
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(self.max_num_tokens, HIDDEN, device=device)
        self.load_model(target)

    def load_model(self, target):
        gen = generator(267790)
        mtp = DeepSeekMTP(gen, self.device, target)
        self.compute_logits = mtp.compute_logits
        # set_model_tag("eagle_head"): the drafter is compiled with the piecewise backend as well
        self.model = CUDAGraphWrapper(mtp.forward, self.vllm_config, CUDAGraphMode.PIECEWISE, self.device,
                                      "EagleProposer (PIECEWISE)",
                                      {"input_ids": self.input_ids, "positions": self.positions,
                                       "hidden_states": self.hidden_states})

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices):
        num_tokens = target_token_ids.shape[0]
        # Shift the input ids by one token.
        self.input_ids[:num_tokens - 1] = target_token_ids[1:]
        # Replace the last token with the next token.
        self.input_ids[last_token_indices] = next_token_ids

        cudagraph_runtime_mode = CUDAGraphMode.NONE
        if self.use_cuda_graph and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            num_input_tokens = num_tokens

        # copy inputs to buffer for cudagraph
        self.positions[:num_tokens] = target_positions
        self.hidden_states[:num_tokens] = target_hidden_states

        with set_forward_context(AttentionMetadata(num_tokens), self.vllm_config, num_tokens=num_input_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode,
                                 batch_descriptor=BatchDescriptor(num_input_tokens)):
            last_hidden_states = self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens],
                                            self.hidden_states[:num_input_tokens])
        sample_hidden_states = last_hidden_states[last_token_indices]
        logits = self.compute_logits(sample_hidden_states)
        # Early exit if there is only one draft token to be generated.
        assert self.num_speculative_tokens == 1
        return logits                                  # draft_token_ids = logits.argmax(dim=-1)

    def dummy_run(self, num_tokens: int, use_cudagraphs=True) -> None:
        if self.variant == "fix":
            # Determine if CUDA graphs should be used for this run.
            cudagraphs_enabled = use_cudagraphs and self.use_cuda_graph
        else:
            cudagraphs_enabled = use_cudagraphs        # #25109: the caller's flag alone
        if cudagraphs_enabled and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)

        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE if cudagraphs_enabled
                                 else CUDAGraphMode.NONE,
                                 batch_descriptor=BatchDescriptor(num_tokens)):
            self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self.hidden_states[:num_tokens])


# --- vllm/v1/worker/gpu_model_runner.py ------------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device, variant):
        self.vllm_config, self.device = vllm_config, device
        self.compilation_config = vllm_config.compilation_config
        self.speculative_config = vllm_config.speculative_config
        self.max_num_tokens = vllm_config.max_num_batched_tokens
        self.cudagraph_batch_sizes = list(reversed(self.compilation_config.cudagraph_capture_sizes))
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.long, device=device)
        target = DeepseekV2ForCausalLM(generator(26711), device)
        self.compute_logits = target.compute_logits
        self.model = CUDAGraphWrapper(target.forward, vllm_config, CUDAGraphMode.PIECEWISE, device,
                                      "GPUModelRunner (PIECEWISE)",
                                      {"input_ids": self.input_ids, "positions": self.positions})
        self.drafter = EagleProposer(vllm_config, device, target, variant)

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE):
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode,
                                 batch_descriptor=BatchDescriptor(num_tokens)):
            hidden_states = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])
        if self.speculative_config and self.speculative_config.use_eagle():
            assert isinstance(self.drafter, EagleProposer)
            use_cudagraphs = cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE
            self.drafter.dummy_run(num_tokens, use_cudagraphs=use_cudagraphs)
        return hidden_states

    def profile_run(self):
        self._dummy_run(self.max_num_tokens)

    def capture_model(self):
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            return
        cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        # capture the larger shapes first
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            with events.warmup():
                self._dummy_run(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE)
            self._dummy_run(num_tokens, cudagraph_runtime_mode=cudagraph_runtime_mode)

    def execute_model(self, requests):
        """``requests``: per request, (its scheduled token ids, the position of the first)."""
        tokens = [t for toks, _ in requests for t in toks]
        positions = [p + i for toks, p in requests for i in range(len(toks))]
        num_tokens = len(tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens).to(self.device))
        self.positions[:num_tokens].copy_(torch.tensor(positions).to(self.device))
        ends, total = [], 0
        for toks, _ in requests:
            total += len(toks)
            ends.append(total - 1)
        last_token_indices = torch.tensor(ends).to(self.device)

        if (self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
                and num_tokens <= self.cudagraph_batch_sizes[-1]):
            # Use CUDA graphs. Add padding to the batch size.
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            num_input_tokens, cudagraph_runtime_mode = num_tokens, CUDAGraphMode.NONE

        with set_forward_context(AttentionMetadata(num_tokens), self.vllm_config, num_tokens=num_input_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode,
                                 batch_descriptor=BatchDescriptor(num_input_tokens)):
            hidden_states = self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        hidden_states = hidden_states[:num_tokens]
        logits = self.compute_logits(hidden_states[last_token_indices])
        next_token_ids = logits.argmax(dim=-1)
        draft_logits = self.drafter.propose(self.input_ids[:num_tokens], self.positions[:num_tokens], hidden_states,
                                            next_token_ids, last_token_indices)
        return logits, draft_logits


def run(variant: str, device: str = "cpu"):
    gen = generator(2677900)
    # steps: a prefill of two requests (7 tokens, padded to graph 8), then decode steps of 2 and 3 requests
    # with one draft token each (4 and 6 tokens: graphs 4 and 8), and a 3-token step (graph 4)
    shapes = [[(3, 0), (4, 0)], [(2, 3), (2, 4)], [(2, 5), (2, 6), (2, 0)], [(1, 7), (1, 8), (1, 2)]]
    steps = [[(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), p) for n, p in step] for step in shapes]

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(VllmConfig(enforce_eager), device, variant)
        runner.profile_run()
        runner.capture_model()
        outs = []
        for step in steps:
            outs.extend(t.clone() for t in runner.execute_model(step))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
