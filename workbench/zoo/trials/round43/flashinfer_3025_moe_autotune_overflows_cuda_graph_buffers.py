"""The MoE autotuner profiles token buckets larger than the CUDA-graph buffers and the GEMM writes past them.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/3025 ("Prevent MoE autotuner buffer overflow on
large token buckets", commit a1166dc0).
Symptom: "CuteDslMoEWrapper pre-allocates intermediate buffers sized for max_num_tokens, but the autotuner
can probe buckets larger than that (e.g. 8192 tokens vs 2048 max). The GEMM kernels then write past buffer
bounds, silently corrupting model weights and eventually triggering cudaErrorIllegalAddress."
Mechanism: with ``use_cuda_graph=True`` the wrapper's ``_allocate_buffers`` sizes the GEMM1 output
(``_gemm1_output``: ``get_max_num_permuted_tokens(max_num_tokens, ...)`` rows) and ``_moe_output`` once,
so that captured graphs see fixed addresses. ``run()`` refuses ``num_tokens > max_num_tokens``, but under
``autotune(True)`` ``AutoTuner.choose_one`` profiles every bucket of the runner's ``tuning_config``
(``get_last_power_of_2_num_tokens_buckets(8192)``) with dummy tensors of that many tokens, calling
``_forward_with_tactic`` directly. Its guard was ``use_prealloc = self.use_cuda_graph and tile_size ==
self.tile_size``: a probe with more tokens than ``max_num_tokens`` gets the graph buffers, and the GEMM1
kernel writes its permuted rows from the buffer's address on, past its end, into the memory that follows.
Nothing raises (the tuner would skip a tactic that did), so the serving run goes on with that memory
overwritten. Modelled with tiny sizes (max 4 tokens, tuning buckets up to 16: the same 4x), float32 instead
of NVFP4 (no scale factors), the memset on the main stream, and moe_sort's outputs allocated per call (its
preallocated outputs overflow the same way upstream). The device memory after a layer's graph buffers is
modelled as the next layer's router and expert weights: tensors allocated one after another in one
caching-allocator segment (``Segment``), as the report says weights were hit; kernels write through the
buffer's address (``as_strided``), as a raw-pointer kernel does.
Doctor: undersized-buffer, at ``_forward_with_tactic`` (hands the buffers sized for ``max_num_tokens`` to a
profiling batch that does not fit them).
Fix (upstream): ``use_prealloc`` also requires ``num_tokens <= self.max_num_tokens`` (larger probes allocate
dynamically). The fix also moved ``tuning_config`` to the instance so dummy expert ids are drawn from
``randint(0, num_experts)`` instead of a hard-coded 8; with this program's 8 experts that change draws the
same ids.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/3025"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_forward_with_tactic"
SYMPTOM = "autotune probes of large token buckets overflow the CUDA-graph MoE buffers into model weights"

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 4, 4
MAX_NUM_TOKENS, TILE_SIZE = 4, 2
TUNE_MAX_TOKENS = 16                      # get_last_power_of_2_num_tokens_buckets(8192) vs max 2048 upstream
ALL_MOE_TACTICS = [(2,), (4,)]            # (tile_size,) of each tactic
NUM_LAYERS = 2


# ------------------------------------------------------------------ memory and helpers
class Segment:
    """One caching-allocator segment: tensors allocated in turn sit back to back in it."""

    def __init__(self, device, numel=2048):
        self.storage, self.top = torch.zeros(numel, device=device), 0

    def empty(self, *shape):
        n = math.prod(shape)
        t = self.storage[self.top:self.top + n].view(*shape)
        self.top += n
        return t


def _at_address(out, rows):
    """What a kernel given ``out``'s pointer writes: ``rows`` rows from that address on."""
    return out.as_strided((rows, out.shape[1]), out.stride())


def get_max_num_tiles(num_tokens, top_k, num_local_experts, tile_size):
    num_expanded_tokens = num_tokens * top_k
    if num_expanded_tokens <= num_local_experts:
        return num_expanded_tokens
    return num_local_experts + (num_expanded_tokens - num_local_experts + tile_size - 1) // tile_size


def get_max_num_permuted_tokens(num_tokens, top_k, num_local_experts, tile_size):
    return get_max_num_tiles(num_tokens, top_k, num_local_experts, tile_size) * tile_size


def get_last_power_of_2_num_tokens_buckets(max_num_tokens):
    buckets, m = [], 1 << (max_num_tokens.bit_length() - 1)
    while m >= 1:
        buckets.append(m)
        m //= 2
    return tuple(buckets)


# ------------------------------------------------------------------ kernels
def moe_sort(token_selected_experts, num_local_experts, top_k, tile_tokens_dim):
    """Expanded (token, k) slots grouped by expert, each expert's group padded to whole tiles."""
    n = token_selected_experts.shape[0]
    experts = token_selected_experts.reshape(-1)
    onehot = (experts[:, None] == torch.arange(num_local_experts, device=experts.device)[None]).long()
    counts = onehot.sum(0)
    padded = (counts + tile_tokens_dim - 1) // tile_tokens_dim * tile_tokens_dim
    start = padded.cumsum(0) - padded
    expanded_idx_to_permuted_idx = start[experts] + (onehot.cumsum(0) * onehot).sum(1) - 1
    max_permuted = get_max_num_permuted_tokens(n, top_k, num_local_experts, tile_tokens_dim)
    permuted_idx_to_expanded_idx = torch.full((max_permuted,), -1, dtype=torch.long, device=experts.device)
    permuted_idx_to_expanded_idx.scatter_(0, expanded_idx_to_permuted_idx,
                                          torch.arange(n * top_k, device=experts.device))
    return permuted_idx_to_expanded_idx, padded.sum()


def gather_grouped_gemm_swiglu(a, b, experts, token_id_mapping, total_num_padded_tokens, topk, out):
    """GEMM1 + SwiGLU over the permuted rows; the rows of tiles that exist are written at ``out``."""
    valid = token_id_mapping >= 0
    expanded = token_id_mapping.clamp(min=0)
    y = torch.bmm(a[expanded // topk][:, None, :], b[experts[expanded]])[:, 0]
    gate, up = y.chunk(2, -1)
    h = torch.nn.functional.silu(gate) * up * valid[:, None]
    rows = token_id_mapping.shape[0]
    if out is None:
        out = torch.empty(rows, h.shape[1], device=a.device)
    dst = _at_address(out, rows)
    in_tiles = torch.arange(rows, device=a.device) < total_num_padded_tokens
    dst.copy_(torch.where(in_tiles[:, None], h, dst))
    return dst


def grouped_gemm_finalize(a, b, experts, permuted_idx_to_expanded_idx, token_final_scales, topk, out):
    """GEMM2 + finalize: scatter-add of each permuted row, weighted, into its token's output row. Rows
    of no tile are never touched (masked by ``where``: the GEMM1 output there may be uninitialised)."""
    valid = permuted_idx_to_expanded_idx >= 0
    expanded = permuted_idx_to_expanded_idx.clamp(min=0)
    y = torch.bmm(a[:, None, :], b[experts[expanded]])[:, 0]
    y = torch.where(valid[:, None], y * token_final_scales.reshape(-1)[expanded][:, None], 0.0)
    out.index_add_(0, expanded // topk, y)


def _moe_core_impl(x, token_selected_experts, token_final_scales, w1_weight, w2_weight, num_experts, top_k,
                   num_local_experts, tile_size, gemm1_out=None, moe_output=None):
    num_tokens = token_selected_experts.size(0)
    if moe_output is None:
        moe_output = torch.empty(num_tokens, w2_weight.size(2), device=x.device)
    else:
        assert moe_output.size(0) == num_tokens
    permuted_idx_to_expanded_idx, total_num_padded_tokens = moe_sort(
        token_selected_experts, num_local_experts, top_k, tile_size)
    experts = token_selected_experts.reshape(-1)
    intermediate = gather_grouped_gemm_swiglu(x, w1_weight, experts, permuted_idx_to_expanded_idx,
                                              total_num_padded_tokens, top_k, gemm1_out)
    moe_output.zero_()
    grouped_gemm_finalize(intermediate, w2_weight, experts, permuted_idx_to_expanded_idx,
                          token_final_scales, top_k, moe_output)
    return moe_output[:num_tokens]


# ------------------------------------------------------------------ autotuner
class AutoTuner:
    _instance = None

    @classmethod
    def get(cls):
        return cls._instance

    def __init__(self, device):
        self.is_tuning_mode, self.cache, self.device = False, {}, device
        self.gen = generator(3025)

    def choose_one(self, custom_op, runners, tuning_config, inputs):
        runner = runners[0]
        bucket = tuning_config["map_to_tuning_buckets"](inputs[0].shape[0])
        if not self.is_tuning_mode:
            return runner, self.cache.get((custom_op, bucket), -1)
        for p in tuning_config["gen_tuning_buckets"]:
            if (custom_op, p) in self.cache:
                continue
            tensors = list(inputs)
            for idx, init in zip(tuning_config["input_idx"], tuning_config["tensor_initializers"]):
                tensors[idx] = init((p,) + tuple(inputs[idx].shape[1:]), self.gen).to(self.device)
            ran = []
            for tac in runner.get_valid_tactics():
                try:
                    runner(tensors, tactic=tac)          # profiled (timing omitted: the first that runs wins)
                    ran.append(tac)
                except Exception:  # noqa: BLE001 - the tuner skips a tactic that fails
                    continue
            self.cache[(custom_op, p)] = ran[0] if ran else -1
        return runner, self.cache.get((custom_op, bucket), -1)


@contextlib.contextmanager
def autotune(tune_mode=True):
    tuner = AutoTuner.get()
    old, tuner.is_tuning_mode = tuner.is_tuning_mode, tune_mode
    try:
        yield
    finally:
        tuner.is_tuning_mode = old


class CuteDslFusedMoENvfp4Runner:
    def __init__(self, forward_impl, num_experts, top_k, variant):
        self.forward_impl, self.num_experts, self.top_k = forward_impl, num_experts, top_k
        # before the fix a class attribute whose dummy expert ids were randint(0, 8); after it, per instance
        high = max(num_experts, 1) if variant == "fix" else 8
        self.tuning_config = {
            "input_idx": (0, 1, 2, 5),                      # x, experts, scales, moe_output
            "gen_tuning_buckets": get_last_power_of_2_num_tokens_buckets(TUNE_MAX_TOKENS),
            "map_to_tuning_buckets": lambda n: min(1 << (n.bit_length() - 1), TUNE_MAX_TOKENS),
            "tensor_initializers": [
                lambda shape, gen: torch.randn(shape, generator=gen),
                lambda shape, gen: torch.randint(0, high, shape, generator=gen),
                lambda shape, gen: torch.softmax(torch.randn(shape, generator=gen), -1),
                lambda shape, gen: torch.empty(shape),
            ],
        }

    def get_valid_tactics(self):
        return ALL_MOE_TACTICS

    def __call__(self, inputs, tactic=-1):
        x, experts, scales, w1, w2, moe_output = inputs
        tile_size = TILE_SIZE if tactic == -1 else tactic[0]
        return self.forward_impl(x, experts, scales, w1, w2, self.num_experts, self.top_k, self.num_experts,
                                 tile_size=tile_size, moe_output=moe_output)


class CuteDslMoEWrapper:
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph, max_num_tokens,
                 tile_size, segment, variant):
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size, self.use_cuda_graph = intermediate_size, use_cuda_graph
        self.max_num_tokens = max_num_tokens
        self.num_local_experts, self.tile_size, self.variant = num_experts, tile_size, variant
        self._gemm1_output = self._moe_output = None
        self._runner = CuteDslFusedMoENvfp4Runner(self._forward_with_tactic, num_experts, top_k, variant)
        if use_cuda_graph:
            self._allocate_buffers(segment)

    def _allocate_buffers(self, segment):
        max_num_permuted_tokens = get_max_num_permuted_tokens(
            self.max_num_tokens, self.top_k, self.num_local_experts, self.tile_size)
        self._gemm1_output = segment.empty(max_num_permuted_tokens, self.intermediate_size)
        self._moe_output = segment.empty(self.max_num_tokens, self.hidden_size)

    def _forward_with_tactic(self, x, token_selected_experts, token_final_scales, w1_weight, w2_weight,
                             num_experts, top_k, num_local_experts, tile_size=TILE_SIZE, moe_output=None):
        """Forward implementation called by auto-tuner."""
        if self.variant == "bug":
            use_prealloc = self.use_cuda_graph and tile_size == self.tile_size
        else:
            num_tokens = x.shape[0]
            use_prealloc = (self.use_cuda_graph and tile_size == self.tile_size
                            and num_tokens <= self.max_num_tokens)
        return _moe_core_impl(
            x, token_selected_experts, token_final_scales, w1_weight, w2_weight, num_experts, top_k,
            num_local_experts, tile_size,
            gemm1_out=self._gemm1_output if use_prealloc else None,
            moe_output=moe_output if moe_output is not None
            else (self._moe_output[:x.shape[0]] if use_prealloc else None))

    def run(self, x, token_selected_experts, token_final_scales, w1_weight, w2_weight):
        num_tokens = token_selected_experts.size(0)
        if self.use_cuda_graph and num_tokens > self.max_num_tokens:
            raise ValueError(f"num_tokens ({num_tokens}) exceeds max_num_tokens ({self.max_num_tokens})")
        if self.use_cuda_graph:
            moe_output = self._moe_output[:num_tokens]
        else:
            moe_output = torch.empty(num_tokens, self.hidden_size, device=x.device)
        inputs = [x, token_selected_experts, token_final_scales, w1_weight, w2_weight, moe_output]
        _, best_tactic = AutoTuner.get().choose_one(
            "CuteDslMoEWrapper::run", [self._runner], self._runner.tuning_config, inputs)
        return self._runner(inputs, tactic=best_tactic)


# ------------------------------------------------------------------ the model
class MoELayer:
    def __init__(self, segment, gen, device, use_cuda_graph, variant):
        self.gate = segment.empty(HIDDEN, NUM_EXPERTS).copy_(randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device))
        self.w1 = segment.empty(NUM_EXPERTS, HIDDEN, 2 * INTERMEDIATE).copy_(
            randn(NUM_EXPERTS, HIDDEN, 2 * INTERMEDIATE, gen=gen, device=device, scale=0.5))
        self.w2 = segment.empty(NUM_EXPERTS, INTERMEDIATE, HIDDEN).copy_(
            randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=0.5))
        self.moe = CuteDslMoEWrapper(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, use_cuda_graph, MAX_NUM_TOKENS,
                                     TILE_SIZE, segment, variant)

    def forward(self, h):
        topk_weights, topk_ids = torch.topk(torch.softmax(h @ self.gate, -1), TOP_K, dim=-1)
        return h + self.moe.run(h, topk_ids, topk_weights, self.w1, self.w2)


class Model:
    def __init__(self, device, use_cuda_graph, variant):
        segment, gen = Segment(device), generator(30250)
        self.layers = [MoELayer(segment, gen, device, use_cuda_graph, variant) for _ in range(NUM_LAYERS)]

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x


def run(variant: str, device: str = "cpu"):
    gen = generator(302500)
    x_tune = randn(MAX_NUM_TOKENS, HIDDEN, gen=gen, device=device)
    steps = [randn(MAX_NUM_TOKENS, HIDDEN, gen=gen, device=device) for _ in range(3)]

    def served():
        AutoTuner._instance = AutoTuner(device)
        model = Model(device, use_cuda_graph=True, variant=variant)
        with events.warmup(), autotune(True):                # the serving warmup tunes before capture
            model.forward(x_tune)
        static_x = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        g, out = capture(lambda: model.forward(static_x), device=device, static={"x": static_x},
                         owner="MoE decode graph (CuteDslMoEWrapper, use_cuda_graph=True)")
        outs = []
        for x in steps:
            static_x.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        AutoTuner._instance = AutoTuner(device)
        model = Model(device, use_cuda_graph=False, variant=variant)
        with autotune(True):
            model.forward(x_tune)
        return [model.forward(x).clone() for x in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
