"""Marlin's FP16xINT4 GEMM launched its lock memset and its kernel on the legacy default stream, so a CUDA graph
around a model of Marlin layers never contained either: both ran once, eagerly, while the graph was captured.

Marlin (IST-DASLab/marlin, v0.1 of 2024-01-17) multiplies FP16 activations by 4-bit weights. Its host launcher
``marlin_cuda`` zeroed the layer's workspace (one lock counter per output-column slice) with a synchronous
``cudaMemset`` and then launched ``Marlin<<<blocks, THREADS, SHARED_MEM>>>`` with no stream argument: both on stream 0.
Threadblocks that split one column slice over ``k`` reduce their partial sums through the output ``C`` in an order
the locks enforce (``barrier_acquire`` spins until the lock counts this block's turn; ``barrier_release`` increments
it). Eagerly that is correct, since PyTorch's current stream is then the legacy stream. ``torch.cuda.graph`` captures
on a side stream created non-blocking, so a launch on stream 0 neither joins the graph nor invalidates the capture: it
executes once, during capture. Every replay of a decode step then runs the norm, the SiLU, the residuals and the LM
head, but no Marlin GEMM: each layer's output ``C`` is a block of the graph's pool that no node writes, so every
replayed step reads what the capture left there instead of this step's product. Two days later the author launched
on the current stream and made the kernel itself reset each lock when the slice's last block releases it (the
workspace is zeroed once, at allocation, and every launch leaves it zeroed), so no host memset is needed per call.

Upstream: https://github.com/IST-DASLab/marlin/commit/e7a312a40d93b40ff2bf0a74907b209e37f9485e ("Fixed workspace
related bugs and added compatibility with CUDA graphs", IST-DASLab/marlin, by Elias Frantar (efrantar), committed
2024-01-19 on ``main``, a direct commit without a pull request; its parent ac6988b is "Version 0.1" of 2024-01-17).
Read, in a mirror of the repository: the whole diff of e7a312a (``marlin/__init__.py``: ``mul``'s docstring,
``Layer.__init__``'s workspace; ``marlin/marlin_cuda.cpp``: ``mul`` and the ``marlin_cuda`` declaration;
``marlin/marlin_cuda_kernel.cu``: ``barrier_release``, the kernel's slice epilogue, ``CALL_IF``, ``marlin_cuda``;
``test.py``); at the parent ac6988b: ``marlin/__init__.py`` (``mul``, ``Layer``: ``__init__``, ``forward``,
``pack``), ``marlin_cuda.cpp`` (``mul``), ``marlin_cuda_kernel.cu`` (``barrier_acquire``, ``barrier_release``, the
``Marlin`` kernel's partitioning ``init_slice``, ``global_reduce``, ``write_result``, the main loop and slice
epilogue, ``CALL_IF``, ``marlin_cuda`` with its ``m``-chunk loop and tile choice). Also the same fix ported to AutoGPTQ
the next day (AutoGPTQ/AutoGPTQ df4d940, same commit message, part of its PR #514 that added Marlin), whose
``QuantLinear`` workspace and ``marlin_cuda.cpp`` changes are identical.
Not read: any issue or report (none is linked; the commit message is the only description); the CUDA graph runner of
whoever captured Marlin (vLLM integrated Marlin in its PR #2497 the same week; not read); Marlin's later history
beyond the log. Not established: whether CUDA would instead refuse the synchronous ``cudaMemset`` during a
global-mode capture (then the capture fails rather than replaying stale outputs); I model the non-blocking side
stream, as for the earlier legacy-stream programs of this set.
Symptom: inferred, no report: with the model's decode step captured, every replayed step's Marlin outputs are the
products the capture-time launches computed from the capture's inputs, not this step's, so logits and greedy tokens
go wrong; without graphs the outputs are correct.
Mechanism: the launch site in ``marlin_cuda`` (``CALL_IF``) issues ``cudaMemset(locks)`` and ``Marlin<<<...>>>`` on
stream 0. During the capture both execute at once on the host thread's legacy stream and are recorded nowhere; the
output buffer ``C`` that ``Layer.forward`` allocated inside the capture is a pool block that no graph node writes, so
each replay's MLP reads what the capture-time launch left in it. The locks play no part in the wrong numbers (they
are zeroed before each eager launch), but they are why the fix needs more than a stream argument: a captured kernel
that left each lock at ``slice_count`` would make the next replay's first ``barrier_acquire`` spin forever.
Doctor: host-work-frozen, at marlin_cuda: the GEMM (and the memset) is work that ran once, during capture, outside
the graph, and that no replay repeats; ``marlin_cuda`` is where the fix puts the launch on ``stream`` and drops the
memset (the kernel's lock reset and ``mul``'s ``getCurrentCUDAStream`` only support that launch).
Fix (upstream): ``mul`` passes ``at::cuda::getCurrentCUDAStream(dev)``; ``marlin_cuda`` takes ``cudaStream_t stream``
and launches ``<<<blocks, THREADS, SHARED_MEM, stream>>>`` with no ``cudaMemset``; ``barrier_release(lock, reset)``
writes ``lock[0] = 0`` for the slice's last block instead of incrementing; ``Layer``'s workspace becomes
``torch.zeros(n // 128)`` (128 being the smallest ``tile_n``; the old ``torch.empty(256)`` assumed one lock per SM,
while locks are indexed by column slice, an eager overflow for ``n > 256 * 128``).
Modelled: ``mul``, ``marlin_cuda.mul`` (the C++ ``mul``, here ``marlin_cuda_mul``), ``marlin_cuda`` (tile choice,
``m``-chunk loop, ``CALL_IF`` as one check), the ``Marlin`` kernel (``init_slice``, per-slice accumulation,
``barrier_acquire``, ``global_reduce`` through ``C``, ``barrier_release``, ``write_result`` with the per-column scale),
``cudaMemset`` and ``Layer`` (``__init__``'s buffers, ``forward``).
Stand-ins: tiles of 8 rows and 8 columns stand for 128x128 (``prob_m <= 16``), 5 SMs for the device's count (the
kernel's own comment draws a 5-SM partition); weights are unpacked int codes 0..15 in ``[k, n]`` order (``pack``'s
permutation and bit packing left out), dequantized as ``q - 8`` with per-column scales (``groupsize=-1``); partial sums
stay in float64 in ``C`` (Marlin rounds them to FP16); threadblocks run one after another in an order the locks admit,
computed on the host from the partition (a Python loop cannot spin on device memory), while the lock counters are
real device memory the kernel increments and, after the fix, resets. A launch on stream 0 is a launch from another
thread, whose current stream is the default one: the CPU engine records only the capturing thread, as CUDA captures
only the capturing stream. The model (an MLP language model with learned positions, two blocks of RMSNorm, Marlin up
``32 -> 48``, SiLU, Marlin down ``48 -> 32``, residual; a dense LM head) and the runner that captures one decode step
with static ``input_ids``/``input_pos`` and replays it per step are mine.
Workload: a batch of 2 sequences, greedy decoding of 5 tokens from one prompt token each; outputs are each step's
logits and tokens. Both Marlin shapes split column slices over two threadblocks (24 tiles over 5 threadblocks of 5
tiles each), so the lock-ordered reduction through ``C`` runs in every call.
Measured: the check printed
marlin_e7a312a_gemm_and_lock_memset_on_legacy_stream_not_captured [bug] on cpu: misbehaves (max |graph - eager| = 19.9)
marlin_e7a312a_gemm_and_lock_memset_on_legacy_stream_not_captured [fix] on cpu: equals eager (max |graph - eager| = 0)
In the bug every replayed step reads, as each layer's Marlin outputs, what the launches on the other thread wrote
during capture (from the capture's zero ids and positions; the two blocks' up outputs share one pool block, and so
do their down outputs, so both blocks read block 1's): logits off by 2.7 to 19.9, tokens [12, 1], [22, 5], [13, 3],
[23, 0], [14, 13] where eager decodes [10, 1], [23, 5], [4, 3], [10, 0], [11, 11]. With the fix the five steps'
logits and tokens equal eager's, and every workspace is all zeros after each call. The emulated kernel equals
``x @ ((B - 8) * s)`` to 1e-15. About 4 s for both variants.
"""
from __future__ import annotations

import threading

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/IST-DASLab/marlin/commit/e7a312a40d93b40ff2bf0a74907b209e37f9485e"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "marlin_cuda"
SYMPTOM = ("Marlin's lock memset and GEMM kernel ran on the legacy default stream, so a captured decode step contained "
           "neither and every replay read Marlin outputs no graph node wrote")

VOCAB, HIDDEN, INTER, MAX_POS, BATCH, STEPS, EPS = 24, 32, 48, 16, 2, 5, 1e-6
SMS = 5            # cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) (stand-in)
TILE = 8           # thread_k = thread_n = 128 for prob_m <= 16 (stand-in); also the smallest tile_n
KERNEL_SHAPES = {(m, k, n) for m in (1, 2, 3, 4) for k, n in ((TILE, TILE), (TILE // 2, 2 * TILE))}   # CALL_IF's
ERR_PROB_SHAPE, ERR_KERN_SHAPE = 1, 2
LEGACY_STREAM = 0
_variant = "bug"


def ceildiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# --- streams --------------------------------------------------------------------------------------------------------

def at_cuda_getCurrentCUDAStream(dev):
    return ("current stream", dev)


def launch(stream, kernel, *args):
    """``kernel<<<..., stream>>>``. Stream 0 is the legacy default stream: it orders itself only with blocking streams,
    and the capture's side stream is non-blocking, so such a launch executes now and is not captured (here: another
    thread, whose current stream is the default one)."""
    if stream == LEGACY_STREAM:
        worker = threading.Thread(target=kernel, args=args)
        worker.start()
        worker.join()
    else:
        kernel(*args)


def cudaMemset(locks, value, nbytes):
    locks.narrow(0, 0, nbytes // 4).fill_(value)


# --- marlin_cuda_kernel.cu ------------------------------------------------------------------------------------------

def init_slice(block, iters, k_tiles, n_tiles, slice_row, slice_col):
    """Rows left in this block's current column slice, how many blocks share the slice, and this block's index among
    them, numbered bottom to top (the top one, last, writes the result)."""
    slice_iters = iters * (block + 1) - (k_tiles * slice_col + slice_row)
    if slice_iters < 0 or slice_col >= n_tiles:
        slice_iters = 0
    if slice_iters == 0:
        return 0, 0, 0
    if slice_row + slice_iters > k_tiles:
        slice_iters = k_tiles - slice_row
    slice_count, slice_idx = 1, 0
    col_first = iters * ceildiv(k_tiles * slice_col, iters)
    if col_first <= k_tiles * (slice_col + 1):
        col_off = col_first - k_tiles * slice_col
        slice_count = ceildiv(k_tiles - col_off, iters)
        if col_off > 0:
            slice_count += 1
        delta_first = iters * block - col_first
        if delta_first < 0 or (col_off == 0 and delta_first == 0):
            slice_idx = slice_count - 1
        else:
            slice_idx = slice_count - 1 - delta_first // iters
            if col_off > 0:
                slice_idx -= 1
    return slice_iters, slice_count, slice_idx


def barrier_acquire(lock, count):
    """Spin until the lock reaches ``count``. The emulation schedules threadblocks in the order these spins admit when
    the locks start at zero (``Marlin``), so nothing is waited for here."""


def barrier_release(lock, reset=False):
    if reset:                                        # the fix: the slice's last block leaves its lock at zero
        lock.zero_()
        return
    lock.add_(1)                                     # red.relaxed.gpu.global.add.s32 [lock], 1


def global_reduce(C, cols, frag_c, first, last):
    """Blocks of a slice accumulate through ``C``: all but the first read the partial sum there, all but the last
    write theirs back."""
    if not first:
        frag_c = frag_c + C[:, cols]
    if not last:
        C[:, cols].copy_(frag_c)
    return frag_c


def write_result(C, cols, frag_c, s):
    C[:, cols].copy_(frag_c * s[0, cols])            # per-column quantization: the scale is applied at write-out


def Marlin(blocks, A, B, C, s, prob_m, prob_n, prob_k, locks, thread_k, thread_n):
    k_tiles, n_tiles = prob_k // thread_k, prob_n // thread_n
    iters = ceildiv(k_tiles * n_tiles, blocks)       # blocks = gridDim.x
    programs = []                                    # each threadblock's column slices, in its own order
    for block in range(blocks):
        slice_row, slice_col = (iters * block) % k_tiles, (iters * block) // k_tiles
        slices = []
        slice_iters, slice_count, slice_idx = init_slice(block, iters, k_tiles, n_tiles, slice_row, slice_col)
        while slice_iters:
            slices.append((slice_row, slice_iters, slice_col, slice_count, slice_idx))
            slice_row, slice_col = 0, slice_col + 1
            slice_iters, slice_count, slice_idx = init_slice(block, iters, k_tiles, n_tiles, slice_row, slice_col)
        programs.append(slices)
    visits = [0] * n_tiles                           # what each lock counts while the launch runs (from zero)
    while any(programs):
        progressed = False
        for slices in programs:
            if not slices:
                continue
            slice_row, slice_iters, slice_col, slice_count, slice_idx = slices[0]
            if slice_count > 1 and visits[slice_col] != slice_idx:
                continue                             # still spinning in barrier_acquire
            slices.pop(0)
            progressed = True
            rows = slice(slice_row * thread_k, (slice_row + slice_iters) * thread_k)
            cols = slice(slice_col * thread_n, (slice_col + 1) * thread_n)
            frag_c = A[:, rows] @ (B[rows, cols] - 8).to(A.dtype)      # dequantize 4-bit codes, accumulate
            last = slice_idx == slice_count - 1
            if slice_count > 1:                      # only globally reduce if more than one block is in the slice
                lock = locks.narrow(0, slice_col, 1)
                barrier_acquire(lock, slice_idx)
                frag_c = global_reduce(C, cols, frag_c, slice_idx == 0, last)
                barrier_release(lock, last and _variant == "fix")
                visits[slice_col] += 1
            if last:                                 # only the last block in a slice writes the result
                write_result(C, cols, frag_c, s)
        if not progressed:
            raise RuntimeError("Marlin: threadblocks spin in barrier_acquire forever (kernel hang)")


def marlin_cuda(A, B, C, s, prob_m, prob_n, prob_k, workspace, groupsize=-1, dev=0, stream=LEGACY_STREAM,
                thread_k=-1, thread_n=-1, sms=-1):
    tot_m = prob_m
    tot_m_blocks = ceildiv(tot_m, 16)
    if sms == -1:
        sms = SMS                                    # cudaDeviceGetAttribute(&sms, MultiProcessorCount, dev)
    if thread_k == -1 or thread_n == -1:
        thread_k, thread_n = (TILE, TILE) if prob_m <= 16 else (TILE // 2, 2 * TILE)
    if prob_n % thread_n != 0 or prob_k % thread_k != 0:
        return ERR_PROB_SHAPE
    if prob_m == 0 or prob_n == 0 or prob_k == 0:
        return 0
    blocks = sms
    cols = prob_n // thread_n
    locks = workspace
    for i in range(0, tot_m_blocks, 4):              # at most 4 blocks of 16 rows per launch
        thread_m_blocks = min(tot_m_blocks - i, 4)
        prob_m = min(tot_m - 16 * i, 64)
        if (thread_m_blocks, thread_k, thread_n) not in KERNEL_SHAPES:          # CALL_IF(...) else
            return ERR_KERN_SHAPE
        A_ptr = A.narrow(0, 16 * i, prob_m)
        C_ptr = C.narrow(0, 16 * i, prob_m)
        if _variant == "bug":
            launch(LEGACY_STREAM, cudaMemset, locks, 0, 4 * cols)                      # cudaMemset(locks, 0, 4 * cols)
            launch(LEGACY_STREAM, Marlin, blocks, A_ptr, B, C_ptr, s, prob_m, prob_n, prob_k, locks,  # Marlin<<<blocks,
                   thread_k, thread_n)                                                       # THREADS, SHARED_MEM>>>
        else:
            launch(stream, Marlin, blocks, A_ptr, B, C_ptr, s, prob_m, prob_n, prob_k, locks,  # <<<..., stream>>>
                   thread_k, thread_n)
    return 0


# --- marlin_cuda.cpp ------------------------------------------------------------------------------------------------

def marlin_cuda_mul(A, B, C, s, workspace, thread_k=-1, thread_n=-1, sms=-1):
    prob_m, prob_n, prob_k = A.shape[0], C.shape[1], A.shape[1]
    groupsize = -1 if s.shape[0] == 1 else prob_k // s.shape[0]
    if groupsize != -1 and groupsize * s.shape[0] != prob_k:
        raise RuntimeError(f"k={prob_k} not compatible with {s.shape[0]} groups.")
    dev = A.device
    if _variant == "bug":
        err = marlin_cuda(A, B, C, s, prob_m, prob_n, prob_k, workspace, groupsize, dev,
                          thread_k=thread_k, thread_n=thread_n, sms=sms)
    else:
        err = marlin_cuda(A, B, C, s, prob_m, prob_n, prob_k, workspace, groupsize, dev,
                          at_cuda_getCurrentCUDAStream(dev), thread_k, thread_n, sms)
    if err == ERR_PROB_SHAPE:
        raise RuntimeError(f"Problem (m={prob_m}, n={prob_n}, k={prob_k}) not compatible with thread_k={thread_k}, "
                           f"thread_n={thread_n}.")
    if err == ERR_KERN_SHAPE:
        raise RuntimeError(f"No kernel implementation for thread_k={thread_k}, thread_n={thread_n}.")


# --- marlin/__init__.py ---------------------------------------------------------------------------------------------

def mul(A, B, C, s, workspace, thread_k=-1, thread_n=-1, sms=-1):
    """Marlin FP16xINT4 multiply (``marlin_cuda.mul``)."""
    marlin_cuda_mul(A, B, C, s, workspace, thread_k, thread_n, sms)


class Layer:
    """4-bit linear layer without bias; ``B`` holds the codes, ``s`` the per-column scales (groupsize -1)."""

    def __init__(self, infeatures, outfeatures, gen, device):
        self.k, self.n = infeatures, outfeatures
        self.B = torch.randint(0, 16, (self.k, self.n), generator=gen, dtype=torch.int32).to(device)
        self.s = (torch.rand(1, self.n, generator=gen, dtype=torch.float64) * 0.02 + 0.01).to(device)
        if _variant == "bug":
            # Essentially all reasonable GPUs have less than 256 SMs so this should be safe for now
            self.workspace = torch.empty(256, dtype=torch.int32, device=device)
        else:
            # 128 is currently the minimum `tile_n`, hence it gives the maximum workspace size
            self.workspace = torch.zeros(self.n // TILE, dtype=torch.int32, device=device)

    def forward(self, A):
        C = torch.empty(A.shape[:-1] + (self.s.shape[1],), dtype=A.dtype, device=A.device)
        mul(A.view((-1, A.shape[-1])), self.B, C.view((-1, C.shape[-1])), self.s, self.workspace)
        return C


# --- the model and the runner (mine) --------------------------------------------------------------------------------

def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


class MarlinLM:
    def __init__(self, device):
        gen = generator(7312)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5).double()
        self.blocks = [dict(norm=1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).double(),
                            up=Layer(HIDDEN, INTER, gen, device), down=Layer(INTER, HIDDEN, gen, device))
                       for _ in range(2)]
        self.final_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).double()
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).double()

    def forward(self, input_ids, input_pos):
        h = self.embed[input_ids] + self.pos[input_pos]
        for blk in self.blocks:
            h = h + blk["down"].forward(torch.nn.functional.silu(blk["up"].forward(rms_norm(h, blk["norm"]))))
        return rms_norm(h, self.final_norm) @ self.lm_head


class DecodeGraphRunner:
    """Captures one decode step over static ``input_ids``/``input_pos`` and replays it every step."""

    def __init__(self, model, device):
        self.model = model
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.input_pos = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.graph, self.logits = capture(lambda: self.model.forward(self.input_ids, self.input_pos), device=device,
                                          warmups=1, name=f"Marlin decode batch {BATCH}", owner="decode graph runner",
                                          static={"input_ids": self.input_ids, "input_pos": self.input_pos})

    def forward(self, input_ids, input_pos):
        self.input_ids.copy_(input_ids)
        self.input_pos.copy_(input_pos)
        return replay(self.graph, self.logits)


def serve(device, use_graph: bool):
    model = MarlinLM(device)
    runner = DecodeGraphRunner(model, device) if use_graph else None
    tokens = torch.randint(0, VOCAB, (BATCH,), generator=generator(2024)).to(device)
    outs = []
    for step in range(STEPS):
        pos = torch.full((BATCH,), step, dtype=torch.long, device=device)
        logits = runner.forward(tokens, pos).clone() if use_graph else model.forward(tokens, pos)
        tokens = logits.argmax(-1)
        outs += [logits, tokens]
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_graph=True), lambda: serve(device, use_graph=False))
