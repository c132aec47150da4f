"""FBGEMM's TBE backward takes its fp16 stochastic-rounding seed from the host philox generator, so a graph-captured training step is refused.

Upstream: https://github.com/pytorch/FBGEMM/pull/493 ("Use the latest philox_cuda_state API for stochastic
rounding", exported as pytorch/pytorch#51004; commit d2445120875ea751bb4ec590a4127bb9b538df9d, 2021-01-31,
reviewed by ngimel: "philox_engine_inputs is deprecated ... it will be important to use philox_cuda_state with
graph capture").
Symptom: a DLRM-style training step captured whole (the TBE ``SplitTableBatchedEmbeddingBagsCodegen`` lookup,
the loss, and the TBE backward with its fused row-wise Adagrad update) fails at capture when the embedding
tables are fp16 and ``stochastic_rounding=True``: PyTorch's CUDA generator raises "Refactor this op to use
CUDAGeneratorImpl::philox_cuda_state. Cannot call CUDAGeneratorImpl::philox_engine_inputs during CUDA graph
capture". Eager training works, and so does capture with fp32 tables (no rounding, no RNG draw).
Mechanism: the generated host launcher ``split_embedding_backward_codegen_{{optimizer}}_{{wdesc}}_exact_cuda``
(``fbgemm_gpu/codegen/embedding_backward_split_template.cu``) asks the default CUDA generator for
``philox_engine_inputs(4)``: a host ``(seed, offset)`` pair, the host offset advanced by the call. It folds that
pair into one ``uint64_t stochastic_rounding_seed`` (``splitmix64_stateless(seed) ^ splitmix64_stateless(offset)``)
and passes it by value to ``..._kernel_warp_per_row_1`` / ``_cta_per_row_1``. Each kernel thread seeds its
xorshift state with ``stochastic_rounding_init(stochastic_rounding_seed, threadIdx.x + run_id * blockDim.x)`` and
rounds the updated fp32 row into fp16 with it (``WeightRow::store``). That seed is host work. Inside a capture
it would run once, the kernel node would keep the capture's seed, and every replay would round every step's
update with the same random bits, while the generator's host offset would no longer advance per step.
PyTorch's graph-safe RNG makes ``philox_engine_inputs`` ``assertNotCapturing`` for that reason, so the
capture raises. The same host draw sits in ``lxu_cache_flush_cuda`` and ``lru_cache_insert_cuda``
(``src/split_embeddings_cache_cuda.cu``), which the fix changed as well. (The commit names a non-graph fp16
rounding failure, pytorch#50148, as its first motivation; the switch to ``philox_cuda_state`` itself is the
graph-safety change the reviewer asked for.)
Doctor: host-work-frozen, at split_embedding_backward_codegen_rowwise_adagrad_unweighted_exact_cuda. The host
launcher draws the rounding seed/offset on the host for a kernel in the captured region. Its value would be
frozen at capture, and PyTorch's generator refuses that host draw while a capture is open. The fix changed
exactly this call (``philox_engine_inputs`` -> ``philox_cuda_state``).
Fix (upstream): the launcher takes ``PhiloxCudaState rng_engine_inputs = gen->philox_cuda_state(4)`` and
passes it to the kernels. Each kernel does ``auto seeds = at::cuda::philox::unpack(stochastic_rounding_philox_args);
stochastic_rounding_init(std::get<0>(seeds) ^ std::get<1>(seeds), threadIdx.x + run_id * blockDim.x, &state)``.
Under capture the state points at the graph's ``seed_extragraph_`` / ``offset_extragraph_`` device tensors
plus a capture-relative ``offset_intragraph_``. ``CUDAGraph::replay`` fills those tensors from the generator
before every replay and advances the host offset by the graph's whole increment, so each replay rounds with
fresh bits, exactly as eager does.
Modelled: two fp16 tables (6 and 5 rows, D=4) in one flat ``weights_dev``, sum pooling, 3 bags per table with a
fixed pooling factor of 2, and an MSE loss against a per-step target. The TBE backward is the exact row-wise
Adagrad path: per-row gradient sum over the lookups hitting that row, ``momentum1 += mean(g^2)``,
``w -= lr / (sqrt(momentum1) + eps) * g``, and a stochastic-rounding store into fp16 (round away from zero with
the probability of the dropped fraction, as ``stochastic_rounding_scalar`` does). The kernel's run id is the
row's linear index (upstream: its rank among the sorted unique rows of the batch). The xorshift/philox bits
are a counter-based float hash of ``(seed, thread id, lane)``. The row sums use one-hot reductions instead of
radix sort and run-length encoding. The default CUDA generator (host seed/offset, the graph's extragraph
tensors, ``capture_prologue``/``capture_epilogue``, and the replay-time fill that ``CUDAGraph::replay`` does)
is written out, since the emulated graph does not own it. The training script runs the first batch eagerly
as its real warmup step, captures the step, and replays it for the rest. The LXU-cache paths and the
weighted, CTA-per-row and int8 variants are left out.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/FBGEMM/pull/493"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "split_embedding_backward_codegen_rowwise_adagrad_unweighted_exact_cuda"
SYMPTOM = ("capturing a TBE training step with fp16 tables and stochastic_rounding=True raises: Cannot call "
           "CUDAGeneratorImpl::philox_engine_inputs during CUDA graph capture")

TABLE_ROWS = (6, 5)          # E per table
D = 4                        # embedding dim (same for both tables)
B = 3                        # bags per table per batch
L = 2                        # fixed pooling factor
STEPS = 5
SEED = 493
LEARNING_RATE, EPS = 0.05, 1e-2
kWarpSize = 32
_U64 = (1 << 64) - 1


# --- ATen: the default CUDA generator (CUDAGeneratorImpl.cpp, CUDAGraphsUtils.cuh) -------------------------

def capturing() -> bool:
    """``at::cuda::currentStreamCaptureStatus() != CaptureStatus::None``."""
    return torch.cuda.is_current_stream_capturing()


class CUDAGeneratorImpl:
    """Host ``seed_`` / ``philox_offset_per_thread_``; under capture, the graph's seed/offset device tensors."""

    def __init__(self, device):
        self.seed_, self.philox_offset_per_thread_ = 0, 0
        self.seed_extragraph_ = None
        self.offset_extragraph_ = None
        self.offset_intragraph_ = 0
        self.graph_expects_this_gen_ = False

    def set_current_seed(self, seed: int) -> None:
        self.seed_, self.philox_offset_per_thread_ = seed, 0

    def current_seed(self) -> int:
        return self.seed_

    def capture_prologue(self, seed_extragraph, offset_extragraph) -> None:
        self.seed_extragraph_, self.offset_extragraph_ = seed_extragraph, offset_extragraph
        self.offset_intragraph_ = 0
        self.graph_expects_this_gen_ = True

    def capture_epilogue(self) -> int:
        self.graph_expects_this_gen_ = False
        return self.offset_intragraph_                    # the graph's wholegraph_increment

    def philox_cuda_state(self, increment: int):
        """``PhiloxCudaState``: (seed, offset) by value eagerly; (seed ptr, offset ptr, intragraph) in capture."""
        increment = (increment + 3) // 4 * 4
        if capturing():
            if not self.graph_expects_this_gen_:
                raise RuntimeError("philox_cuda_state for an unexpected CUDA generator used during capture.")
            intragraph = self.offset_intragraph_
            self.offset_intragraph_ += increment
            return PhiloxCudaState(self.seed_extragraph_, self.offset_extragraph_, intragraph, captured=True)
        offset = self.philox_offset_per_thread_
        self.philox_offset_per_thread_ += increment
        return PhiloxCudaState(self.seed_, offset, 0, captured=False)

    def philox_engine_inputs(self, increment: int) -> tuple[int, int]:
        """Deprecated: a host (seed, offset) pair. ``at::cuda::assertNotCapturing`` refuses it in a capture."""
        if capturing():
            raise RuntimeError("Refactor this op to use CUDAGeneratorImpl::philox_cuda_state. Cannot call "
                               "CUDAGeneratorImpl::philox_engine_inputs during CUDA graph capture. If you need "
                               "this call to be captured, please file an issue. Current cudaStreamCaptureStatus: "
                               "cudaStreamCaptureStatusActive")
        increment = (increment + 3) // 4 * 4
        offset = self.philox_offset_per_thread_
        self.philox_offset_per_thread_ += increment
        return self.seed_, offset


class PhiloxCudaState:
    def __init__(self, seed, offset, offset_intragraph, captured):
        self.seed_, self.offset_, self.offset_intragraph_, self.captured_ = seed, offset, offset_intragraph, captured


def philox_unpack(arg: PhiloxCudaState):
    """``at::cuda::philox::unpack`` (device side): read the graph's tensors when captured, else the values."""
    if arg.captured_:
        return arg.seed_, arg.offset_ + arg.offset_intragraph_
    return arg.seed_, arg.offset_


_default_generator: CUDAGeneratorImpl | None = None


def getDefaultCUDAGenerator() -> CUDAGeneratorImpl:
    return _default_generator


def manual_seed(seed: int, device) -> None:
    global _default_generator
    _default_generator = CUDAGeneratorImpl(device)
    _default_generator.set_current_seed(seed)


class GraphRNGState:
    """What ``at::cuda::CUDAGraph`` does with the default generator: ``capture_begin`` hands it the graph's
    ``seed_extragraph_`` / ``offset_extragraph_``, ``capture_end`` keeps the whole-graph increment, and
    ``replay`` fills the two tensors from the generator (advancing it) before launching the graph."""

    def __init__(self, device):
        self.seed_extragraph_ = torch.zeros((), dtype=torch.int64, device=device)
        self.offset_extragraph_ = torch.zeros((), dtype=torch.int64, device=device)
        self.wholegraph_increment_ = 0

    def capture_begin(self):
        getDefaultCUDAGenerator().capture_prologue(self.seed_extragraph_, self.offset_extragraph_)

    def capture_end(self):
        self.wholegraph_increment_ = getDefaultCUDAGenerator().capture_epilogue()

    def replay_prologue(self):
        gen = getDefaultCUDAGenerator()
        rng_engine_inputs = gen.philox_cuda_state(self.wholegraph_increment_)     # "just like any RNG consumer"
        self.seed_extragraph_.fill_(gen.current_seed())
        self.offset_extragraph_.fill_(rng_engine_inputs.offset_)


# --- fbgemm_gpu/include/fbgemm_gpu/fbgemm_cuda_utils.cuh ---------------------------------------------------

def splitmix64_stateless(index: int) -> int:
    z = (index + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def stochastic_rounding_init(s0, thread_id: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Per-thread RNG state seeded from ``s0`` (a host int, or a device int64 tensor after ``unpack``) and the
    thread id; ``stochastic_rounding_rand4`` gives each thread 4 lanes. Returns uniforms in [0, 1)."""
    s = (s0 % 1000003) if isinstance(s0, int) else torch.remainder(s0, 1000003)
    if isinstance(s, torch.Tensor):
        s = s.to(torch.float64)
    x = torch.sin((s + 1.0) * 12.9898 + (thread_id * 4 + lane + 1.0) * 78.233) * 43758.5453
    return x - torch.floor(x)


def stochastic_rounding_store_fp16(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``stochastic_rounding_scalar``: fp32 -> fp16, away from zero with the probability of the dropped part."""
    a = x.to(torch.float64).abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -14)))
    ulp = torch.pow(2.0, e - 10)
    q = a / ulp
    lo = torch.floor(q)
    mag = (lo + (u < q - lo).to(torch.float64)) * ulp
    return (torch.sign(x.to(torch.float64)) * mag).to(torch.float16)


# --- fbgemm_gpu/codegen/embedding_forward_split_template.cu --------------------------------------------------

def linearize_index(hash_size_cumsum, indices, offsets, num_bags):
    """``linearize_index_kernel``: each lookup's ``b_t`` (bag of table t) and linear row index."""
    lookup = torch.arange(indices.numel(), device=indices.device)
    b_t = torch.searchsorted(offsets, lookup, right=True) - 1             # [N]
    t = torch.div(b_t, num_bags, rounding_mode="floor")
    return b_t, hash_size_cumsum[t] + indices


def split_embedding_codegen_forward_unweighted_cuda(dev_weights, hash_size_cumsum, indices, offsets, T):
    """Sum pooling: ``[B, T * D]`` from the fp16 rows (loaded as fp32)."""
    rows = dev_weights.view(-1, D)
    b_t, linear = linearize_index(hash_size_cumsum, indices, offsets, B)
    emb = rows[linear].to(torch.float32)                                   # [N, D]
    bag_of = (b_t[None, :] == torch.arange(T * B, device=indices.device)[:, None]).to(torch.float32)
    pooled = (bag_of[:, :, None] * emb[None]).sum(1)                       # [T * B, D]
    return pooled.view(T, B, D).permute(1, 0, 2).reshape(B, T * D)


# --- fbgemm_gpu/codegen/embedding_backward_split_template.cu (optimizer = rowwise_adagrad, unweighted) -------

def split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_warp_per_row_1(
        grad_output, dev_weights, hash_size_cumsum, indices, offsets, T, stochastic_rounding,
        stochastic_rounding_arg, momentum1_dev, eps, learning_rate, thread_id, lane, variant):
    rows = dev_weights.view(-1, D)
    num_rows = rows.shape[0]
    b_t, linear = linearize_index(hash_size_cumsum, indices, offsets, B)
    grad_bt = grad_output.view(B, T, D).permute(1, 0, 2).reshape(T * B, D)
    grad_lookup = grad_bt[b_t]                                             # [N, D]
    hits = (linear[None, :] == torch.arange(num_rows, device=indices.device)[:, None])
    grad_sum = (hits.to(torch.float32)[:, :, None] * grad_lookup[None]).sum(1)   # per run (row)
    touched = hits.any(1)
    # split_precomputation (rowwise_adagrad)
    g_avg_square = (grad_sum * grad_sum).sum(1) / D
    new_sum_square_grads = momentum1_dev + g_avg_square
    multiplier = learning_rate / (torch.sqrt(new_sum_square_grads) + eps)
    weight_new = rows.to(torch.float32) - multiplier[:, None] * grad_sum        # weight_new.fma_(grad, -multiplier)
    if stochastic_rounding:
        if variant == "fix":     # auto seeds = at::cuda::philox::unpack(stochastic_rounding_philox_args)
            seed, offset = philox_unpack(stochastic_rounding_arg)
            s0 = seed ^ offset
        else:                    # the launcher's uint64_t stochastic_rounding_seed
            s0 = stochastic_rounding_arg
        u = stochastic_rounding_init(s0, thread_id, lane)
        stored = stochastic_rounding_store_fp16(weight_new, u)
    else:
        stored = weight_new.to(torch.float16)
    rows.copy_(torch.where(touched[:, None], stored, rows))
    momentum1_dev.copy_(torch.where(touched, new_sum_square_grads, momentum1_dev))


def split_embedding_backward_codegen_rowwise_adagrad_unweighted_exact_cuda(
        grad_output, dev_weights, hash_size_cumsum, indices, offsets, T, stochastic_rounding,
        momentum1_dev, eps, learning_rate, thread_id, lane, variant):
    """The host launcher: draws the stochastic-rounding RNG inputs, then launches the warp-per-row kernel."""
    if indices.numel() == 0:
        return
    if variant == "fix":
        rng_engine_inputs = None
        if stochastic_rounding and dev_weights.dtype != torch.float32:
            rng_engine_inputs = getDefaultCUDAGenerator().philox_cuda_state(4)
        arg = rng_engine_inputs
    else:
        rng_engine_inputs = (0, 0)
        if stochastic_rounding and dev_weights.dtype != torch.float32:
            rng_engine_inputs = getDefaultCUDAGenerator().philox_engine_inputs(4)
        arg = splitmix64_stateless(rng_engine_inputs[0]) ^ splitmix64_stateless(rng_engine_inputs[1])
    split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_warp_per_row_1(
        grad_output, dev_weights, hash_size_cumsum, indices, offsets, T, stochastic_rounding, arg,
        momentum1_dev, eps, learning_rate, thread_id, lane, variant)


# --- fbgemm_gpu/split_table_batched_embeddings_ops.py --------------------------------------------------------

class SplitTableBatchedEmbeddingBagsCodegen:
    """fp16 device tables with the fused exact row-wise Adagrad optimizer (``OptimizerType.EXACT_ROWWISE_ADAGRAD``)."""

    def __init__(self, device, variant, stochastic_rounding=True):
        gen = generator(4930)
        self.T = len(TABLE_ROWS)
        total_rows = sum(TABLE_ROWS)
        self.weights_dev = randn(total_rows * D, gen=gen, device=device, scale=0.5).to(torch.float16)
        self.momentum1_dev = torch.zeros(total_rows, device=device)
        cumsum = [0]
        for e in TABLE_ROWS[:-1]:
            cumsum.append(cumsum[-1] + e)
        self.hash_size_cumsum = torch.tensor(cumsum, dtype=torch.int64, device=device)
        self.stochastic_rounding = stochastic_rounding
        self.learning_rate, self.eps = LEARNING_RATE, EPS
        self.variant = variant
        # the kernel's thread ids: threadIdx.x + run_id * blockDim.x, 4 lanes (rand4) per thread
        d = torch.arange(D, device=device)
        run_id = torch.arange(total_rows, device=device)
        self.thread_id = (d[None, :] // 4 + run_id[:, None] * kWarpSize).to(torch.float64)
        self.lane = (d % 4).to(torch.float64)[None, :].expand(total_rows, D).contiguous()

    def forward(self, indices, offsets):
        return split_embedding_codegen_forward_unweighted_cuda(self.weights_dev, self.hash_size_cumsum, indices,
                                                               offsets, self.T)

    def backward(self, grad_output, indices, offsets):
        """``SplitLookupFunction_rowwise_adagrad_Op::backward``: the fused update, no gradient returned."""
        split_embedding_backward_codegen_rowwise_adagrad_unweighted_exact_cuda(
            grad_output, self.weights_dev, self.hash_size_cumsum, indices, offsets, self.T,
            self.stochastic_rounding, self.momentum1_dev, self.eps, self.learning_rate, self.thread_id,
            self.lane, self.variant)


def train_step(tbe, indices, offsets, target):
    """Forward, MSE loss, and the TBE backward (the fused optimizer updates the tables in place)."""
    pooled = tbe.forward(indices, offsets)
    diff = pooled - target
    loss = (diff * diff).mean()
    grad_output = 2.0 * diff / diff.numel()
    tbe.backward(grad_output, indices, offsets)
    return loss


def batches(device):
    gen = generator(49301)
    out = []
    for _ in range(STEPS):
        idx = [torch.randint(0, e, (B * L,), generator=gen) for e in TABLE_ROWS]
        indices = torch.cat(idx).to(device)
        target = randn(B, len(TABLE_ROWS) * D, gen=gen, device=device)
        out.append((indices, target))
    offsets = torch.arange(0, len(TABLE_ROWS) * B * L + 1, L, dtype=torch.int64, device=device)
    return out, offsets


def run(variant: str, device: str = "cpu"):
    data, offsets = batches(device)

    def finish(tbe, losses):
        return losses + [tbe.weights_dev.to(torch.float32).view(-1, D), tbe.momentum1_dev.clone()]

    def eager():
        manual_seed(SEED, device)
        tbe = SplitTableBatchedEmbeddingBagsCodegen(device, variant)
        losses = [train_step(tbe, indices, offsets, target).clone() for indices, target in data]
        return finish(tbe, losses)

    def served():
        manual_seed(SEED, device)
        tbe = SplitTableBatchedEmbeddingBagsCodegen(device, variant)
        static_indices, static_offsets = data[0][0].clone(), offsets.clone()
        static_target = data[0][1].clone()
        rng = GraphRNGState(device)
        step = lambda: train_step(tbe, static_indices, static_offsets, static_target)  # noqa: E731
        with events.warmup(real=True):          # the first batch is a real (eager) training step
            losses = [step().clone()]
        rng.capture_begin()
        g, loss = capture(step, device=device, warmups=0, name="train step",
                          static={"indices": static_indices, "offsets": static_offsets, "target": static_target,
                                  "seed_extragraph": rng.seed_extragraph_,
                                  "offset_extragraph": rng.offset_extragraph_},
                          state={"weights_dev": tbe.weights_dev, "momentum1_dev": tbe.momentum1_dev},
                          owner="graphed DLRM train step")
        rng.capture_end()
        for indices, target in data[1:]:
            static_indices.copy_(indices)
            static_target.copy_(target)
            rng.replay_prologue()
            losses.append(replay(g, loss).clone())
        return finish(tbe, losses)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
