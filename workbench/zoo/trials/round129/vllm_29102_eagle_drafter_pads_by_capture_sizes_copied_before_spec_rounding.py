"""vLLM V1 EAGLE/MTP drafter with PIECEWISE graphs and an even ``num_speculative_tokens``:
``EagleProposer.__init__`` copies ``compilation_config.cudagraph_capture_sizes`` into ``self.cudagraph_batch_sizes``;
later the runner's ``_check_and_update_cudagraph_mode`` rounds the capture sizes up to multiples of
``num_speculative_tokens + 1`` (dropping those that round past the maximum) and recomputes the padding table, so the
largest captured size shrinks. ``propose`` still gates "pad to a captured graph" on the stale list, so a step whose
drafter batch lies between the new and the old maximum asks ``pad_for_cudagraph`` for a graph size no capture covers
and dies with ``IndexError``.

Upstream: https://github.com/vllm-project/vllm/pull/29102 ("[BugFix] Fix Eagle `IndexError: list index out of range`
for even `num_speculative_tokens`", vllm-project/vllm, by LucasWilkinson, description dated 2025-11-20, merged
2025-11-22 as commit 30d64662387a; fixes issue #29091). Read: the PR description (search corpus: the fix for #29091,
tested with ``vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct ... --speculative-config.method qwen3_next_mtp
--speculative-config.num_speculative_tokens 4`` and one chat request), the full diff (``git show 30d646623`` in a
vLLM mirror, local-inference-lab/vllm: ``vllm/v1/spec_decode/eagle.py``, ``vllm/config/compilation.py``,
``tests/conftest.py``) and at its parent: ``vllm/v1/spec_decode/eagle.py`` (``EagleProposer.__init__``, ``propose``,
``prepare_next_token_ids_padded``, ``prepare_inputs_padded``, ``dummy_run``), ``vllm/config/compilation.py``
(``adjust_cudagraph_sizes_for_spec_decode``, ``compute_bs_to_padded_graph_size``), ``vllm/config/vllm.py``
(``pad_for_cudagraph``: "if batch_size > max_cudagraph_capture_size, it should raise an IndexError"),
``vllm/v1/worker/gpu_model_runner.py`` (the drafter built in ``__init__``, ``propose_draft_token_ids``, the drafter
part of ``_dummy_run``, ``capture_model``, ``_capture_cudagraphs``, ``initialize_attn_backend`` ->
``_check_and_update_cudagraph_mode`` with its call of ``adjust_cudagraph_sizes_for_spec_decode``),
``vllm/compilation/cuda_graph.py`` (``CUDAGraphWrapper.__call__``) and ``vllm/forward_context.py``
(``set_forward_context``: the batch descriptor defaults to ``BatchDescriptor(num_tokens)``).
Not read: the text of issue #29091 (its traceback), the rejection sampler, the EAGLE/MTP model files, the attention
backends' ``build_for_drafting``, the scheduler, ``propose_tree`` beyond the changed lines.
Symptom: the PR title: ``IndexError: list index out of range`` from the EAGLE drafter for even
``num_speculative_tokens`` (reproduced with Qwen3-Next MTP, 4 speculative tokens, default FULL_AND_PIECEWISE graphs):
serving fails on the step whose drafter batch hits the gap. Eager drafting (``enforce_eager``) is unaffected.
Mechanism: with a FULL decode mode, a separate decode routine and ``uniform_decode_query_len = 1 + k > 1``, the runner
calls ``adjust_cudagraph_sizes_for_spec_decode`` from ``initialize_kv_cache``, long after the drafter was built:
every capture size is rounded up to a multiple of ``k + 1``, sizes that round past ``max_cudagraph_capture_size`` are
dropped, ``max_cudagraph_capture_size`` becomes the largest rounded size and ``bs_to_padded_graph_size`` is recomputed
with that many entries. The runner refreshes its own ``cudagraph_batch_sizes`` and captures the drafter's PIECEWISE
graphs at the rounded sizes only. The drafter keeps the list it copied in ``__init__``. When the old maximum is not
a multiple of ``k + 1`` (a power of two such as 512 and an odd ``k + 1``: even ``k``) it rounds past itself and is
dropped, so the new maximum is smaller; a drafter batch in between passes the stale check in ``propose`` and indexes
the padding table past its end. Eager runs never pad.
Doctor: undersized-buffer, at propose. A served step asks for a graph (a padded size) serving more rows than the largest
graph captured; ``propose`` decides that from the capture sizes it copied before they were rounded, where the table it
then indexes holds only the rounded ones.
Fix (upstream): ``EagleProposer`` keeps ``self.compilation_config`` instead of a copy of the sizes and gates padding on
``self.compilation_config.max_cudagraph_capture_size`` at use (``propose``, its draft loop, ``propose_tree``,
``dummy_run``); ``adjust_cudagraph_sizes_for_spec_decode`` also falls back to ``[k + 1]`` when rounding leaves no size
and raises ``ValueError`` (instead of a warning) when even that does not fit.
Modelled: ``CUDAGraphMode`` (``decode_mode``, ``mixed_mode``, ``separate_routine``, ``has_mode``),
``CompilationConfig`` (``compute_bs_to_padded_graph_size``, ``adjust_cudagraph_sizes_for_spec_decode``),
``VllmConfig.pad_for_cudagraph``, ``BatchDescriptor`` / ``set_forward_context``,
``set_cudagraph_capturing_enabled`` / ``validate_cudagraph_capturing_enabled``, ``CUDAGraphWrapper`` (lazy capture per
batch descriptor, replay), ``EagleProposer`` (``__init__`` with its persistent ``input_ids`` / ``positions`` /
``hidden_states``, ``load_model``, ``propose`` with the first pass and the draft loop,
``prepare_next_token_ids_padded``, ``prepare_inputs_padded``, ``dummy_run``), ``GPUModelRunner`` (``__init__``,
``initialize_kv_cache`` -> ``initialize_attn_backend`` -> ``_check_and_update_cudagraph_mode``, ``capture_model`` /
``_capture_cudagraphs`` with NONE warmups then the PIECEWISE capture, ``_dummy_run``, ``_prepare_inputs``,
``execute_model``, ``propose_draft_token_ids`` on the padded-drafter-batch path) and a greedy rejection sampler.
Stand-ins: capture sizes [1, 2, 4, 8] (for 512) and k = 2 (``uniform_decode_query_len`` 3), so the rounded sizes are
[3, 6] and the stale maximum 8; the target model (embedding, one causal attention layer over a per-request KV cache,
lm_head) runs eagerly (its own graphs are not what the fix changed; its dummy runs skip attention as PIECEWISE dummy
runs do); the EAGLE head is one token-wise layer (``fc`` over its embedding plus position and the target hidden state,
a norm scale, its lm_head) without its attention layer, captured as a single piece; no attention metadata is built for
the drafter; greedy sampling; float64. The FULL decode capture pass (target only) is not modelled.
Workload: requests A (prompt 5) and B (prompt 2); step 0 prefills both (7 tokens: the drafter's first pass gets 7
tokens, between the new maximum 6 and the stale 8), then 3 decode steps with 1 + 2 tokens per request (drafter passes
of 6 tokens, draft-loop batches of 2 padded to 3).
Measured: bug: raises IndexError ("list index out of range") in ``pad_for_cudagraph(7)`` at step 0's first draft pass
(the table holds sizes 0..6). Fix: the 7-token pass runs eagerly, the other passes replay the size-6 and size-3 graphs
(one padded row in the draft loop of every step), and equals eager (max error 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/29102"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "propose"
SYMPTOM = ("EAGLE/MTP drafting with an even num_speculative_tokens: the drafter pads to a graph size from the capture "
           "sizes it copied before the runner rounded them to multiples of k+1, and pad_for_cudagraph raises "
           "IndexError: list index out of range")

NUM_SPECULATIVE_TOKENS = 2
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8]
CUDAGRAPH_NUM_OF_WARMUPS = 1
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 4, 16, 32
VOCAB, HIDDEN = 16, 8
DTYPE = torch.float64

_variant = "bug"


def round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


# --- vllm/config/compilation.py, vllm/config/vllm.py (reduced) --------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: "CUDAGraphMode") -> bool:
        assert not mode.separate_routine()
        if self.separate_routine():
            return mode.value in self.value
        return self == mode


@dataclasses.dataclass
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode
    cudagraph_capture_sizes: list
    mode: str = "VLLM_COMPILE"
    cudagraph_num_of_warmups: int = CUDAGRAPH_NUM_OF_WARMUPS
    max_cudagraph_capture_size: int | None = None
    bs_to_padded_graph_size: list | None = None

    def __post_init__(self):
        self.cudagraph_capture_sizes = sorted(self.cudagraph_capture_sizes)
        self.max_cudagraph_capture_size = self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0
        self.compute_bs_to_padded_graph_size()

    def adjust_cudagraph_sizes_for_spec_decode(self, uniform_decode_query_len: int, tensor_parallel_size: int):
        multiple_of = uniform_decode_query_len          # (sequence parallelism off: tp is not a factor)
        if not self.cudagraph_capture_sizes or multiple_of <= 1:
            return
        assert self.max_cudagraph_capture_size is not None
        rounded_sizes = sorted(set(round_up(size, multiple_of) for size in self.cudagraph_capture_sizes
                                   if round_up(size, multiple_of) <= self.max_cudagraph_capture_size))
        if _variant == "bug":
            if len(rounded_sizes) == 0:
                # logger.warning("No valid cudagraph sizes after rounding to multiple of ...")
                return
        else:
            if len(rounded_sizes) == 0 and multiple_of <= self.max_cudagraph_capture_size:
                # if one valid but would be round_down use that
                rounded_sizes = [multiple_of]
            if len(rounded_sizes) == 0:
                raise ValueError(f"No valid cudagraph sizes after rounding to multiple of {multiple_of} "
                                 f"(num_speculative_tokens + 1 or tp if sequence parallelism is enabled)")
        self.max_cudagraph_capture_size = rounded_sizes[-1]
        self.cudagraph_capture_sizes = rounded_sizes
        # Recompute after adjusting the cudagraph sizes
        self.compute_bs_to_padded_graph_size()

    def compute_bs_to_padded_graph_size(self):
        # pre-compute the mapping from batch size to padded graph size
        self.bs_to_padded_graph_size = [0 for _ in range(self.max_cudagraph_capture_size + 1)]
        for end, start in zip(self.cudagraph_capture_sizes + [self.max_cudagraph_capture_size + 1],
                              [0] + self.cudagraph_capture_sizes):
            for bs in range(start, end):
                self.bs_to_padded_graph_size[bs] = start if bs == start else end


@dataclasses.dataclass
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "eagle"
    enforce_eager: bool = False
    disable_padded_drafter_batch: bool = False

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")


@dataclasses.dataclass
class VllmConfig:
    compilation_config: CompilationConfig
    speculative_config: SpeculativeConfig
    tensor_parallel_size: int = 1

    def pad_for_cudagraph(self, batch_size: int) -> int:
        # if batch_size > self.compilation_config.max_cudagraph_capture_size,
        # it should raise an IndexError.
        # the caller should make sure the batch_size is within the range,
        # i.e., batch_size <= self.compilation_config.max_cudagraph_capture_size
        return self.compilation_config.bs_to_padded_graph_size[batch_size]


# --- vllm/forward_context.py, vllm/compilation/monitor.py, vllm/compilation/cuda_graph.py (reduced) ------------------

@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool = False


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: object
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    num_actual_tokens: int          # stand-in: the real rows of the (padded) batch, from the attention metadata


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, vllm_config, num_tokens=None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                        batch_descriptor: BatchDescriptor | None = None, num_actual_tokens: int | None = None):
    global _forward_context
    prev = _forward_context
    batch_descriptor = batch_descriptor or BatchDescriptor(num_tokens=num_tokens)
    _forward_context = ForwardContext(attn_metadata, cudagraph_runtime_mode, batch_descriptor,
                                      num_tokens if num_actual_tokens is None else num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None
    return _forward_context


cudagraph_capturing_enabled = True


def set_cudagraph_capturing_enabled(enabled: bool):
    global cudagraph_capturing_enabled
    cudagraph_capturing_enabled = enabled


def validate_cudagraph_capturing_enabled():
    if not cudagraph_capturing_enabled:
        raise RuntimeError("CUDA graph capturing detected at an inappropriate time. This operation is currently "
                           "disabled.")


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: object = None
    output: object = None


class CUDAGraphWrapper:
    """One piece of the drafter's piecewise-compiled model (the EAGLE head has no splitting op in this stand-in)."""

    def __init__(self, runnable, runtime_mode: CUDAGraphMode, device, graph_pool, static: dict):
        self.runnable, self.runtime_mode, self.device = runnable, runtime_mode, device
        self.graph_pool, self.static = graph_pool, static
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __call__(self, *args):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        cudagraph_runtime_mode = forward_context.cudagraph_runtime_mode
        if cudagraph_runtime_mode == CUDAGraphMode.NONE or cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        if batch_descriptor not in self.concrete_cudagraph_entries:
            self.concrete_cudagraph_entries[batch_descriptor] = CUDAGraphEntry(batch_descriptor=batch_descriptor)
        entry = self.concrete_cudagraph_entries[batch_descriptor]
        if entry.cudagraph is None:
            validate_cudagraph_capturing_enabled()
            # the runner's NONE-mode dummy runs were this shape's warmups
            entry.cudagraph, entry.output = capture(
                lambda: self.runnable(*args), device=self.device, pool=self.graph_pool, warmups=0,
                static=self.static, owner="EagleProposer (PIECEWISE drafter)",
                name=f"drafter PIECEWISE num_tokens={batch_descriptor.num_tokens}")
            return entry.output
        size = batch_descriptor.num_tokens
        real = forward_context.num_actual_tokens
        return replay(entry.cudagraph, entry.output, real=real, size=size,
                      padded=dict(self.static) if real < size else None)


# --- the models (stand-ins) ------------------------------------------------------------------------------------------

class TargetModel:
    """Embedding + one causal attention layer over a per-request KV cache + lm_head; runs eagerly."""

    def __init__(self, device):
        gen = generator(29102)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.k_cache = torch.zeros(MAX_NUM_SEQS, MAX_MODEL_LEN, HIDDEN, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, input_ids, positions, req_slots=None):
        x = self.embed[input_ids] + self.pos[positions]
        if req_slots is None:                  # dummy run without attention metadata: attention skipped
            return x
        self.k_cache[req_slots, positions] = x @ self.wk
        self.v_cache[req_slots, positions] = x @ self.wv
        q = x @ self.wq
        keys, values = self.k_cache[req_slots], self.v_cache[req_slots]          # [T, L, H]
        scores = torch.einsum("th,tlh->tl", q, keys) / HIDDEN ** 0.5
        visible = torch.arange(MAX_MODEL_LEN, device=x.device)[None, :] <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return x + torch.einsum("tl,tlh->th", probs, values) @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class EagleHead:
    """The EAGLE head, token-wise: fc([embed(token) + pos, target hidden]) -> (normed, pre-norm) hidden states."""

    def __init__(self, device):
        gen = generator(2910)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.fc, self.norm_w = r(2 * HIDDEN, HIDDEN), 1.0 + r(HIDDEN, scale=0.1)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def forward(self, input_ids, positions, hidden_states):
        h = torch.tanh(torch.cat([self.embed[input_ids] + self.pos[positions], hidden_states], dim=-1) @ self.fc)
        return h * self.norm_w, h                                     # (last_hidden_states, hidden_states)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/v1/spec_decode/eagle.py (reduced) ---------------------------------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int


@dataclasses.dataclass
class SpecDecodeMetadata:
    num_draft_tokens: list
    cu_num_draft_tokens: torch.Tensor
    draft_token_ids: torch.Tensor
    logits_indices: torch.Tensor


class EagleProposer:
    def __init__(self, vllm_config: VllmConfig, device, runner=None):
        self.vllm_config = vllm_config
        self.speculative_config = vllm_config.speculative_config
        self.runner, self.device = runner, device
        self.num_speculative_tokens = self.speculative_config.num_speculative_tokens
        self.max_num_tokens = MAX_NUM_BATCHED_TOKENS
        self.max_model_len = MAX_MODEL_LEN
        self.hidden_size = HIDDEN

        self.use_cuda_graph = False
        if _variant == "bug":
            compilation_config = self.vllm_config.compilation_config
        else:
            self.compilation_config = compilation_config = self.vllm_config.compilation_config
        if compilation_config.mode == "VLLM_COMPILE":
            cudagraph_mode = compilation_config.cudagraph_mode
            self.use_cuda_graph = (cudagraph_mode.has_mode(CUDAGraphMode.PIECEWISE)
                                   and not self.speculative_config.enforce_eager)

        if _variant == "bug":
            self.cudagraph_batch_sizes = (sorted(self.vllm_config.compilation_config.cudagraph_capture_sizes)
                                          if self.use_cuda_graph else [])
            self.use_cuda_graph = self.use_cuda_graph and bool(self.cudagraph_batch_sizes)
        # persistent buffers for cuda graph
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(self.max_num_tokens, self.hidden_size, dtype=DTYPE, device=device)
        self.arange = torch.arange(max(MAX_NUM_SEQS + 1, self.max_num_tokens), device=device)

    def load_model(self, device):
        self.eagle_head = EagleHead(device)
        self.model = self.eagle_head.forward
        if self.use_cuda_graph:                       # @support_torch_compile -> piecewise backend -> CUDAGraphWrapper
            events.static_buffers("EagleProposer (PIECEWISE drafter)", {
                "input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states})
            self.model = CUDAGraphWrapper(
                self.eagle_head.forward, CUDAGraphMode.PIECEWISE, device, graph_pool_handle(device),
                {"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states})

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices,
                common_attn_metadata: CommonAttentionMetadata):
        num_tokens = target_token_ids.shape[0]
        batch_size = next_token_ids.shape[0]
        if last_token_indices is None:
            last_token_indices = common_attn_metadata.query_start_loc[1:] - 1

        # Shift the input ids by one token.
        self.input_ids[:num_tokens - 1] = target_token_ids[1:]
        # Replace the last token with the next token.
        self.input_ids[last_token_indices] = next_token_ids

        cudagraph_runtime_mode = CUDAGraphMode.NONE
        if self.use_cuda_graph and num_tokens <= (self.cudagraph_batch_sizes[-1] if _variant == "bug"
                                                  else self.compilation_config.max_cudagraph_capture_size):
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            num_input_tokens = num_tokens
        # copy inputs to buffer for cudagraph
        self.positions[:num_tokens] = target_positions
        self.hidden_states[:num_tokens] = target_hidden_states

        with set_forward_context(None, self.vllm_config, num_tokens=num_input_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode, num_actual_tokens=num_tokens):
            last_hidden_states, hidden_states = self.model(self.input_ids[:num_input_tokens],
                                                           self.positions[:num_input_tokens],
                                                           self.hidden_states[:num_input_tokens])
        sample_hidden_states = last_hidden_states[last_token_indices]
        logits = self.eagle_head.compute_logits(sample_hidden_states)

        positions = target_positions[last_token_indices]
        hidden_states = hidden_states[last_token_indices]
        draft_token_ids = logits.argmax(dim=-1)

        # Generate the remaining draft tokens.
        draft_token_ids_list = [draft_token_ids]
        if self.use_cuda_graph and batch_size <= (self.cudagraph_batch_sizes[-1] if _variant == "bug"
                                                  else self.compilation_config.max_cudagraph_capture_size):
            input_batch_size = self.vllm_config.pad_for_cudagraph(batch_size)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            input_batch_size = batch_size
            cudagraph_runtime_mode = CUDAGraphMode.NONE

        common_attn_metadata.num_actual_tokens = batch_size
        common_attn_metadata.max_query_len = 1
        common_attn_metadata.query_start_loc = self.arange[:batch_size + 1]
        for _token_index in range(self.num_speculative_tokens - 1):
            input_ids = draft_token_ids_list[-1]
            positions += 1
            exceeds_max_model_len = positions >= self.max_model_len
            clamped_positions = torch.where(exceeds_max_model_len, 0, positions)
            common_attn_metadata.seq_lens += 1
            common_attn_metadata.seq_lens.masked_fill_(exceeds_max_model_len, 1)

            # copy inputs to buffer for cudagraph
            self.input_ids[:batch_size] = input_ids
            self.positions[:batch_size] = clamped_positions
            self.hidden_states[:batch_size] = hidden_states
            with set_forward_context(None, self.vllm_config, num_tokens=input_batch_size,
                                     cudagraph_runtime_mode=cudagraph_runtime_mode, num_actual_tokens=batch_size):
                last_hidden_states, hidden_states = self.model(self.input_ids[:input_batch_size],
                                                               self.positions[:input_batch_size],
                                                               self.hidden_states[:input_batch_size])
            hidden_states = hidden_states[:batch_size]
            logits = self.eagle_head.compute_logits(last_hidden_states[:batch_size])
            draft_token_ids = logits.argmax(dim=-1)
            draft_token_ids_list.append(draft_token_ids)

        # [batch_size, num_speculative_tokens]
        return torch.stack(draft_token_ids_list, dim=1)

    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor):
        valid_mask = (sampled_token_ids != -1) & (sampled_token_ids < VOCAB)
        valid_sampled_tokens_count = valid_mask.sum(dim=1)
        last_valid_indices_safe = torch.clamp(valid_sampled_tokens_count - 1, min=0)
        next_token_ids = torch.gather(sampled_token_ids, 1, last_valid_indices_safe.unsqueeze(1)).squeeze(1)
        return next_token_ids, valid_sampled_tokens_count

    def prepare_inputs_padded(self, common_attn_metadata: CommonAttentionMetadata,
                              spec_decode_metadata: SpecDecodeMetadata, valid_sampled_tokens_count: torch.Tensor):
        cu = spec_decode_metadata.cu_num_draft_tokens
        num_draft_tokens_gpu = torch.cat([cu[0:1], cu[1:] - cu[:-1]])
        num_rejected_tokens_gpu = torch.where(num_draft_tokens_gpu > 0,
                                              num_draft_tokens_gpu + 1 - valid_sampled_tokens_count,
                                              torch.zeros_like(num_draft_tokens_gpu))
        total_num_tokens = common_attn_metadata.num_actual_tokens
        token_indices = self.arange[:total_num_tokens]
        token_indices_to_sample = common_attn_metadata.query_start_loc[1:] - 1 - num_rejected_tokens_gpu
        return common_attn_metadata, token_indices, token_indices_to_sample

    def dummy_run(self, num_tokens: int, use_cudagraphs=True) -> None:
        cudagraphs_enabled = use_cudagraphs and self.use_cuda_graph
        if cudagraphs_enabled and num_tokens <= (self.cudagraph_batch_sizes[-1] if _variant == "bug"
                                                 else self.compilation_config.max_cudagraph_capture_size):
            num_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=(CUDAGraphMode.PIECEWISE if cudagraphs_enabled
                                                         else CUDAGraphMode.NONE)):
            self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self.hidden_states[:num_tokens])


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ---------------------------------------------------------------------

@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    slot: int
    token_ids: list
    num_computed_tokens: int = 0
    spec_token_ids: list = dataclasses.field(default_factory=list)


class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device):
        self.vllm_config, self.device = vllm_config, device
        self.compilation_config = vllm_config.compilation_config
        self.speculative_config = vllm_config.speculative_config
        self.uniform_decode_query_len = 1 + self.speculative_config.num_speculative_tokens
        self.cudagraph_batch_sizes = sorted(self.compilation_config.cudagraph_capture_sizes)
        self.model = TargetModel(device)
        self.drafter = EagleProposer(vllm_config, device, self)
        self.drafter.load_model(device)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i64)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i64)
        self.req_slots = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i64)
        self.requests: list[CachedRequestState] = []

    # initialize_kv_cache -> initialize_attn_backend -> _check_and_update_cudagraph_mode
    def initialize_kv_cache(self):
        self.initialize_attn_backend()

    def initialize_attn_backend(self):
        self._check_and_update_cudagraph_mode()

    def _check_and_update_cudagraph_mode(self):
        cudagraph_mode = self.compilation_config.cudagraph_mode
        # if we have dedicated decode cudagraphs, and spec-decode is enabled,
        # we need to adjust the cudagraph sizes to be a multiple of the uniform
        # decode query length to avoid: https://github.com/vllm-project/vllm/issues/28207
        if (cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine()
                and self.uniform_decode_query_len > 1):
            self.compilation_config.adjust_cudagraph_sizes_for_spec_decode(
                self.uniform_decode_query_len, self.vllm_config.tensor_parallel_size)
            capture_sizes = self.compilation_config.cudagraph_capture_sizes
            self.cudagraph_batch_sizes = capture_sizes if capture_sizes is not None else []

    def capture_model(self):
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            return
        set_cudagraph_capturing_enabled(True)
        cudagraph_mode = self.compilation_config.cudagraph_mode
        if cudagraph_mode.mixed_mode() != CUDAGraphMode.NONE:
            # make sure we capture the largest batch size first
            self._capture_cudagraphs(list(reversed(self.cudagraph_batch_sizes)),
                                     cudagraph_runtime_mode=cudagraph_mode.mixed_mode(), uniform_decode=False)
        # (the FULL uniform-decode pass captures the target model only: not modelled)
        set_cudagraph_capturing_enabled(False)

    def _capture_cudagraphs(self, compilation_cases, cudagraph_runtime_mode: CUDAGraphMode, uniform_decode: bool):
        for num_tokens in compilation_cases:
            for _ in range(self.compilation_config.cudagraph_num_of_warmups):
                with events.warmup():
                    self._dummy_run(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                    uniform_decode=uniform_decode)
            self._dummy_run(num_tokens, cudagraph_runtime_mode=cudagraph_runtime_mode, uniform_decode=uniform_decode)

    def _dummy_run(self, num_tokens: int, cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                   uniform_decode: bool = False):
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode):
            self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])
        if self.speculative_config and self.speculative_config.use_eagle():
            use_cudagraphs = (cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE
                              and not self.speculative_config.enforce_eager)
            self.drafter.dummy_run(num_tokens, use_cudagraphs=use_cudagraphs)

    def _prepare_inputs(self, num_scheduled_tokens: list):
        ids, pos, slots, num_draft_tokens, draft_ids = [], [], [], [], []
        for req, n in zip(self.requests, num_scheduled_tokens):
            tokens = req.token_ids + req.spec_token_ids
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(req.slot)
            num_draft_tokens.append(len(req.spec_token_ids))
            draft_ids.extend(req.spec_token_ids)
        total = len(ids)
        self.input_ids[:total] = torch.tensor(ids, device=self.device)
        self.positions[:total] = torch.tensor(pos, device=self.device)
        self.req_slots[:total] = torch.tensor(slots, device=self.device)
        query_start_loc = torch.tensor([0] + num_scheduled_tokens, device=self.device).cumsum(0)
        seq_lens = torch.tensor([r.num_computed_tokens + n for r, n in zip(self.requests, num_scheduled_tokens)],
                                device=self.device)
        common_attn_metadata = CommonAttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens,
                                                       num_reqs=len(self.requests), num_actual_tokens=total,
                                                       max_query_len=max(num_scheduled_tokens))
        if sum(num_draft_tokens) == 0:
            return common_attn_metadata, None, query_start_loc[1:] - 1
        cu_num_draft_tokens = torch.tensor(num_draft_tokens, device=self.device).cumsum(0)
        logits_indices = torch.arange(total, device=self.device)     # every draft and bonus position
        spec_decode_metadata = SpecDecodeMetadata(num_draft_tokens, cu_num_draft_tokens,
                                                  torch.tensor(draft_ids, device=self.device), logits_indices)
        return common_attn_metadata, spec_decode_metadata, logits_indices

    def _sample(self, logits, spec_decode_metadata, query_start_loc):
        """Greedy sampling; with drafts, the rejection sampler's greedy path ([num_reqs, k + 1], -1 = rejected)."""
        if spec_decode_metadata is None:
            return logits.argmax(dim=-1).view(-1, 1)
        k = self.speculative_config.num_speculative_tokens
        out = torch.full((len(self.requests), k + 1), -1, dtype=torch.int64, device=self.device)
        target_argmax = logits.argmax(dim=-1)
        for i, req in enumerate(self.requests):
            start = int(query_start_loc[i])
            accepted = 0
            drafts = req.spec_token_ids
            while accepted < len(drafts) and drafts[accepted] == int(target_argmax[start + accepted]):
                accepted += 1
            out[i, :accepted + 1] = target_argmax[start:start + accepted + 1]
        return out

    def execute_model(self, num_scheduled_tokens: list):
        common_attn_metadata, spec_decode_metadata, logits_indices = self._prepare_inputs(num_scheduled_tokens)
        total = common_attn_metadata.num_actual_tokens
        hidden_states = self.model.forward(self.input_ids[:total], self.positions[:total], self.req_slots[:total])
        logits = self.model.compute_logits(hidden_states[logits_indices])
        sampled_token_ids = self._sample(logits, spec_decode_metadata, common_attn_metadata.query_start_loc)
        draft_token_ids = self.propose_draft_token_ids(sampled_token_ids, hidden_states, spec_decode_metadata,
                                                       common_attn_metadata)
        # bookkeeping
        for i, req in enumerate(self.requests):
            valid = [t for t in sampled_token_ids[i].tolist() if t != -1]     # accepted drafts + bonus token
            req.num_computed_tokens += len(valid) if req.spec_token_ids else num_scheduled_tokens[i]
            req.token_ids = req.token_ids + valid
            req.spec_token_ids = draft_token_ids[i].tolist()
        return [logits, sampled_token_ids.to(DTYPE), draft_token_ids.to(DTYPE)]

    def propose_draft_token_ids(self, sampled_token_ids, hidden_states, spec_decode_metadata,
                                common_attn_metadata):
        num_scheduled_tokens = common_attn_metadata.num_actual_tokens
        # padded drafter batch (the default): next token = last valid sampled token of each request
        next_token_ids, valid_sampled_tokens_count = self.drafter.prepare_next_token_ids_padded(sampled_token_ids)
        if spec_decode_metadata is None:
            token_indices_to_sample = None
            target_token_ids = self.input_ids[:num_scheduled_tokens]
            target_positions = self.positions[:num_scheduled_tokens]
            target_hidden_states = hidden_states[:num_scheduled_tokens]
        else:
            common_attn_metadata, token_indices, token_indices_to_sample = self.drafter.prepare_inputs_padded(
                common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)
            target_token_ids = self.input_ids[token_indices]
            target_positions = self.positions[token_indices]
            target_hidden_states = hidden_states[token_indices]
        return self.drafter.propose(target_token_ids=target_token_ids, target_positions=target_positions,
                                    target_hidden_states=target_hidden_states, next_token_ids=next_token_ids,
                                    last_token_indices=token_indices_to_sample,
                                    common_attn_metadata=common_attn_metadata)


# --- a reduced engine: two requests, a prefill step, then decode steps with k drafts each ----------------------------

def _serve(device, use_cuda_graph):
    compilation_config = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE if use_cuda_graph else CUDAGraphMode.NONE,
        cudagraph_capture_sizes=list(CUDAGRAPH_CAPTURE_SIZES))
    vllm_config = VllmConfig(compilation_config, SpeculativeConfig(NUM_SPECULATIVE_TOKENS,
                                                                   enforce_eager=not use_cuda_graph))
    runner = GPUModelRunner(vllm_config, device)
    runner.initialize_kv_cache()
    runner.capture_model()

    gen = generator(91)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 2)]
    runner.requests = [CachedRequestState("A", 0, prompts[0]), CachedRequestState("B", 1, prompts[1])]
    outs = []
    scheduled = [len(p) for p in prompts]                    # step 0: both prompts, 7 tokens
    for _ in range(4):
        outs.extend(runner.execute_model(scheduled))
        scheduled = [1 + len(r.spec_token_ids) for r in runner.requests]   # decode: 1 + k tokens per request
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
