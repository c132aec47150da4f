"""mori EP bumps the dispatch/combine cross-device barrier epoch on the host and passes it by value, so a captured MoE step waits for the capture-time epoch forever from its second replay on.

Upstream: https://github.com/ROCm/mori/pull/86 ("Fix: fix cuda graph hang && fix test error", merged 2025-10-15 as
05b3bce96f60a49805211163ae58d7de3d01c479).
Symptom: MoE expert parallelism through mori's inter-node dispatch/combine (``EpDispatchCombineKernelType.InterNode``)
under a captured HIP/CUDA graph: the first replay completes, the second replay hangs in ``EpCombineInterNodeKernel``
on every rank (the PR's "cuda graph hang"). Eager steps are correct, however many there are.
Mechanism: ``EpDispatchCombineHandle`` (include/mori/ops/dispatch_combine/dispatch_combine.hpp) keeps the barrier
epoch as ``uint32_t crossDeviceBarrierFlag{1}`` and ``GetEpDispatchCombineArgs`` copies it by value into the
``EpDispatchCombineArgs`` kernel argument of each launch. ``EpDispatchCombineOp.combine(..., call_reset=True)``
(python/mori/ops/dispatch_combine.py) then calls ``launch_reset`` -> ``EpDispatchCombineHandle::LaunchReset``
(src/ops/dispatch_combine/dispatch_combine.cpp), which is ``crossDeviceBarrierFlag++`` on the host. In
``EpCombineInterNodeKernel`` (src/ops/dispatch_combine/internode.hpp) every block sending back to ``srcPe`` adds 1
(``AMO_ADD``) to ``srcPe``'s ``crossDeviceBarrierMemObj[myPe]``, a counter in symmetric memory that is never reset,
and ``CrossDeviceBarrierInterNodeKernel`` spins ``while (currentVal != args.crossDeviceBarrierFlag * numQps)`` on
every peer's slot (``numQps`` = blocks per peer). After n combines the counter holds n * numQps and the epoch is n,
so eager calls always meet. The epoch's parity also picks the half of the double-buffered
``recvTokenNumMemObj``/``sendAtomicSignalMemObj`` that dispatch fills and combine reads and zeroes. Under capture the
host ``flag++`` runs once and the kernel nodes keep the capture-time epoch F as a literal: replay 1 brings the
counter to F * numQps and passes; replay 2 brings it to (F + 1) * numQps and waits for F * numQps, which never
comes.
Doctor: host-work-frozen, at ``LaunchReset`` (the epoch advance is a host attribute increment inside the captured
region: it runs once at capture, and the kernels keep its capture-time value as a launch argument, so every replay
waits for one stale epoch while the device counter moves on; the fix empties this function).
Fix (upstream): ``crossDeviceBarrierFlag`` becomes ``uint32_t*``: ``InitializeBarrier`` ``hipMalloc``s it and
``hipMemsetD32``s it to 1; the kernels read ``args.crossDeviceBarrierFlag[0]`` (wait target and parity) and
``EpCombineInterNodeKernel`` ends with ``__hip_atomic_fetch_add(args.crossDeviceBarrierFlag, 1, ...)`` by its first
thread; ``LaunchReset`` does nothing and ``combine``'s default becomes ``call_reset=False``.
Modelled: two PEs (ranks) of the inter-node kernels, both in one process: the symmetric heap is one tensor per PE
per allocation, a put or an ``AMO_ADD`` writes the peer's tensor, xGMI and RDMA transports are the same copy. Each
kernel is split at its cross-device wait into a send half and a receive half; a launch runs once every PE has
launched its matching kernel (the PEs run concurrently upstream), and then runs all PEs' send halves before any
receive half, so every put and signal of a launch has landed before any PE polls. A wait whose first poll fails
can therefore never be met: instead of spinning for ever, it marks the PE in a per-PE ``stuck`` word (model only)
and the kernel runs on; the host's device synchronize after the step raises ``TimeoutError`` for a stuck PE (the
hang). 4 blocks per launch (2 per peer, numQps 2; 80 upstream), 4 tokens per rank, hidden 4, 2 experts per rank,
top-2; a PE's experts are one weight (a token is sent once per PE, as the dedup upstream). Dispatch places received
tokens in source-PE order (upstream an atomic counter decides it); no weights, scales or fp8. The captured step is
dispatch -> experts -> combine of both ranks; one capture warmup, as a serving engine does (any number of warmups
gives the same hang). The intra-node kernels (``CrossDeviceBarrierIntraNodeKernel``, an equality barrier) are left out.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/mori/pull/86"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "LaunchReset"
SYMPTOM = ("mori inter-node EP dispatch/combine under a CUDA/HIP graph hangs on the second replay: the host-side "
           "barrier epoch (crossDeviceBarrierFlag++) is frozen into the captured combine, which waits for it forever")

WORLD_SIZE = 2
MAX_NUM_INP_TOKEN_PER_RANK = 4
HIDDEN_DIM = 4
NUM_EXPERTS_PER_RANK = 2
NUM_EXPERTS_PER_TOKEN = 2
BLOCK_NUM = 4                     # 80 upstream; numsBlockPerDestPe = numQps = BLOCK_NUM // WORLD_SIZE
STEPS = 4
_variant = {"v": "bug"}


# --- mori::shmem: the symmetric heap of every PE, as this one process sees it (model only) -------------------

class ShmemWorld:
    def __init__(self, npes: int, device):
        self.npes, self.device = npes, device
        self.heap: dict[str, list] = {}
        self.pending: dict[int, tuple] = {}
        self.stuck = torch.zeros(npes, dtype=torch.int32, device=device)    # a spin that can never end, per PE

    def ShmemMalloc(self, pe: int, name: str, shape, dtype) -> "SymmMemObj":
        peers = self.heap.setdefault(name, [None] * self.npes)
        peers[pe] = torch.zeros(shape, dtype=dtype, device=self.device)
        return SymmMemObj(self, name, pe)

    def launch(self, pe: int, kernel, args) -> None:
        """A PE's launch on its stream. The PEs run concurrently: once each has launched its matching kernel,
        every send half runs, then every receive half (which starts at the kernel's cross-device wait)."""
        self.pending[pe] = (kernel, args)
        if len(self.pending) < self.npes:
            return
        halves = [k(a) for _, (k, a) in sorted(self.pending.items())]
        self.pending.clear()
        for send, _ in halves:
            send()
        for _, recv in halves:
            recv()

    def wait_until(self, pe: int, met: torch.Tensor) -> None:
        """``shmem::ShmemUint32WaitUntilEquals`` & co.: the spin. Every signal of this launch has landed, so a
        poll that fails now fails for ever: the PE is stuck (upstream: the kernel never returns)."""
        self.stuck[pe:pe + 1] += (~met).any().to(torch.int32)

    def synchronize(self) -> None:
        """``hipDeviceSynchronize`` of every PE's stream after a step: it never returns on a stuck PE."""
        stuck = [pe for pe, s in enumerate(self.stuck.tolist()) if s]
        if stuck:
            raise TimeoutError(f"PE {stuck}: CrossDeviceBarrierInterNodeKernel / dispatch wait spins for ever "
                               "(barrier slot never reaches crossDeviceBarrierFlag * numQps)")


class SymmMemObj:
    """``mori::application::SymmMemObjPtr``: one allocation at the same place of every PE's heap."""

    def __init__(self, world: ShmemWorld, name: str, pe: int):
        self.world, self.name, self.pe = world, name, pe

    @property
    def localPtr(self) -> torch.Tensor:
        return self.world.heap[self.name][self.pe]

    def GetAs(self, pe: int | None = None) -> torch.Tensor:
        return self.world.heap[self.name][self.pe if pe is None else pe]


# --- include/mori/ops/dispatch_combine/dispatch_combine.hpp --------------------------------------------------

class EpDispatchCombineConfig:
    def __init__(self, rank, worldSize, hiddenDim, maxNumInpTokenPerRank, numExpertPerRank, numExpertPerToken,
                 blockNum):
        self.rank, self.worldSize, self.hiddenDim = rank, worldSize, hiddenDim
        self.maxNumInpTokenPerRank = maxNumInpTokenPerRank
        self.numExpertPerRank, self.numExpertPerToken, self.blockNum = numExpertPerRank, numExpertPerToken, blockNum

    def MaxNumTokensToRecvPerRank(self) -> int:
        return self.maxNumInpTokenPerRank

    def MaxNumTokensToRecv(self) -> int:
        return self.worldSize * self.maxNumInpTokenPerRank


class EpDispatchCombineArgs:
    """The kernels' by-value argument struct (``GetEpDispatchCombineArgs`` fills it at each launch)."""
    FIELDS = ("config", "curRankNumToken", "tokenIndices", "inpTokenBuf", "shmemDispatchInpTokMemObj",
              "shmemCombineInpTokMemObj", "shmemOutTokMemObj", "recvTokenNumMemObj", "sendAtomicSignalMemObj",
              "dispSenderIdxMap", "srcPeTokenIdxMap", "totalRecvTokenNum", "crossDeviceBarrierMemObj",
              "crossDeviceBarrierFlag",          # uint32_t (a value) before PR #86, uint32_t* after
              "world")


class EpDispatchCombineHandle:
    def __init__(self, config: EpDispatchCombineConfig, world: ShmemWorld):
        self.config, self.world = config, world
        pe, c = config.rank, config
        self.shmemDispatchInpTokMemObj = world.ShmemMalloc(pe, "dispatchInpTok", (c.MaxNumTokensToRecv(), c.hiddenDim), torch.float32)
        self.shmemCombineInpTokMemObj = world.ShmemMalloc(pe, "combineInpTok", (c.MaxNumTokensToRecv(), c.hiddenDim), torch.float32)
        self.shmemOutTokMemObj = world.ShmemMalloc(pe, "outTok", (c.MaxNumTokensToRecv(), c.hiddenDim), torch.float32)
        self.recvTokenNumMemObj = world.ShmemMalloc(pe, "recvTokenNum", (2 * c.worldSize,), torch.int64)
        self.sendAtomicSignalMemObj = world.ShmemMalloc(pe, "sendAtomicSignal", (2 * c.worldSize,), torch.int64)
        self.dispSenderIdxMap = torch.zeros(c.maxNumInpTokenPerRank * c.numExpertPerToken, dtype=torch.int64,
                                            device=world.device)
        self.srcPeTokenIdxMap = torch.zeros(c.MaxNumTokensToRecv(), dtype=torch.int64, device=world.device)
        self.totalRecvTokenNum = torch.zeros(1, dtype=torch.int64, device=world.device)
        self.curRankNumToken = 0
        self.tokenIndices = self.inpTokenBuf = None
        self.InitializeBarrier()

    def InitializeBarrier(self) -> None:
        if _variant["v"] == "fix":                                         # PR #86
            self.crossDeviceBarrierFlag = torch.ones(1, dtype=torch.int64, device=self.world.device)
        else:
            self.crossDeviceBarrierFlag = 1                                # uint32_t crossDeviceBarrierFlag{1}
        self.crossDeviceBarrierMemObj = self.world.ShmemMalloc(self.config.rank, "crossDeviceBarrier",
                                                               (self.config.worldSize,), torch.int64)

    def PrepareInference(self, input, indices, numToken: int) -> None:
        self.inpTokenBuf, self.tokenIndices, self.curRankNumToken = input, indices, numToken

    def LaunchDispatch(self) -> None:
        self.world.launch(self.config.rank, EpDispatchInterNodeKernel, GetEpDispatchCombineArgs(self))

    def LaunchCombine(self) -> None:
        self.world.launch(self.config.rank, EpCombineInterNodeKernel, GetEpDispatchCombineArgs(self))

    def LaunchReset(self) -> None:
        if _variant["v"] == "fix":
            return                                                         # "no need for a separate reset kernel now"
        self.crossDeviceBarrierFlag += 1                                   # crossDeviceBarrierFlag++ (host)


def GetEpDispatchCombineArgs(handle: EpDispatchCombineHandle) -> EpDispatchCombineArgs:
    args = EpDispatchCombineArgs()
    for field in EpDispatchCombineArgs.FIELDS:
        setattr(args, field, getattr(handle, field))  # args.crossDeviceBarrierFlag = handle.crossDeviceBarrierFlag
    return args


# --- src/ops/dispatch_combine/internode.hpp -------------------------------------------------------------------

def _barrier_flag(args) -> torch.Tensor:
    """The epoch as the kernel sees it: ``args.crossDeviceBarrierFlag`` (a launch constant) before PR #86,
    ``args.crossDeviceBarrierFlag[0]`` (device memory, read when the kernel runs) after."""
    flag = args.crossDeviceBarrierFlag
    if isinstance(flag, torch.Tensor):
        return flag[0:1]
    return torch.full((1,), flag, dtype=torch.int64, device=args.world.device)


def _parity_slots(args) -> torch.Tensor:
    """``pe + (crossDeviceBarrierFlag & 1) * npes`` for every pe: this call's half of the double buffers."""
    npes = args.config.worldSize
    return (_barrier_flag(args) & 1) * npes + torch.arange(npes, device=args.world.device)


def EpDispatchInterNodeKernel(args: EpDispatchCombineArgs):
    c = args.config
    myPe, npes, dev = c.rank, c.worldSize, args.world.device
    perRank, maxRecv = c.MaxNumTokensToRecvPerRank(), c.MaxNumTokensToRecv()
    numsBlockPerDestPe = c.blockNum // npes
    cur = args.curRankNumToken

    def send():
        destPe = args.tokenIndices[:cur] // c.numExpertPerRank                              # [cur, k]
        onehot = (destPe[..., None] == torch.arange(npes, device=dev)).long()               # [cur, k, npes]
        first = onehot.cumsum(1).gather(2, destPe[..., None]).squeeze(2) == 1              # dedup per dest PE
        sent = onehot.amax(1)                                                               # [cur, npes]
        destPeTokenIdx = sent.cumsum(0) - 1
        destPeTokenCounter = sent.sum(0)
        peSorted = destPe * perRank + destPeTokenIdx.gather(1, destPe)
        args.dispSenderIdxMap[:cur * c.numExpertPerToken].copy_(
            (peSorted * first + maxRecv * ~first).view(-1))                                 # dup -> MaxNumTokensToRecv
        row = torch.arange(perRank, device=dev)
        match = (sent[:, None, :] == 1) & (destPeTokenIdx[:, None, :] == row[None, :, None])  # [cur, perRank, npes]
        destPeTokenIdxMap = (match.long() * torch.arange(cur, device=dev)[:, None, None]).sum(0)
        slot = _parity_slots(args)[myPe:myPe + 1]
        for d in range(npes):
            remote = args.shmemDispatchInpTokMemObj.GetAs(d)[myPe * perRank:(myPe + 1) * perRank]
            remote.copy_(torch.where(match[:, :, d].any(0)[:, None], args.inpTokenBuf[destPeTokenIdxMap[:, d]], remote))
            args.recvTokenNumMemObj.GetAs(d).index_copy_(0, slot, destPeTokenCounter[d:d + 1])   # ShmemPutInt32Imm
            args.sendAtomicSignalMemObj.GetAs(d).index_add_(                                     # AMO_ADD, per block
                0, slot, torch.full((1,), numsBlockPerDestPe, dtype=torch.int64, device=dev))

    def recv():
        slots = _parity_slots(args)
        signal = args.sendAtomicSignalMemObj.localPtr.index_select(0, slots)
        args.world.wait_until(myPe, signal > numsBlockPerDestPe - 1)                           # ShmemInt64WaitUntilGreaterThan
        recvTokenNum = args.recvTokenNumMemObj.localPtr.index_select(0, slots)                 # [npes]
        args.totalRecvTokenNum.copy_(recvTokenNum.sum(0, keepdim=True))
        end = recvTokenNum.cumsum(0)
        start = end - recvTokenNum
        r = torch.arange(maxRecv, device=dev)
        srcPe = (r[:, None] >= end[None, :]).long().sum(1).clamp(max=npes - 1)
        peSortedId = (srcPe * perRank + r - start[srcPe]).clamp(0, maxRecv - 1)
        out = args.shmemOutTokMemObj.localPtr
        out.copy_(torch.where((r < end[-1])[:, None], args.shmemDispatchInpTokMemObj.localPtr[peSortedId], out))
        i = torch.arange(perRank, device=dev)
        valid = i[None, :] < recvTokenNum[:, None]
        local = start[:, None] + i[None, :]
        args.srcPeTokenIdxMap.copy_((local * valid + maxRecv * ~valid).view(-1))

    return send, recv


def CrossDeviceBarrierInterNodeKernel(args: EpDispatchCombineArgs, numQps: int) -> None:
    localBarrierPtr = args.crossDeviceBarrierMemObj.localPtr
    # while (currentVal != args.crossDeviceBarrierFlag * numQps) { currentVal = AtomicLoadRelaxedSystem(...); }
    args.world.wait_until(args.config.rank, (localBarrierPtr == _barrier_flag(args) * numQps).all())


def EpCombineInterNodeKernel(args: EpDispatchCombineArgs):
    c = args.config
    myPe, npes, dev = c.rank, c.worldSize, args.world.device
    perRank, maxRecv = c.MaxNumTokensToRecvPerRank(), c.MaxNumTokensToRecv()
    numsBlockPerSrcPe = c.blockNum // npes
    cur = args.curRankNumToken

    def send():
        srcPeTokenNum = args.recvTokenNumMemObj.localPtr.index_select(0, _parity_slots(args))
        i = torch.arange(perRank, device=dev)
        for s in range(npes):
            tokenId = args.srcPeTokenIdxMap[s * perRank:(s + 1) * perRank].clamp(max=maxRecv - 1)
            remote = args.shmemCombineInpTokMemObj.GetAs(s)[myPe * perRank:(myPe + 1) * perRank]
            remote.copy_(torch.where((i < srcPeTokenNum[s])[:, None], args.inpTokenBuf[tokenId], remote))
            # each of the numsBlockPerSrcPe blocks: ShmemAtomicTypeNonFetchWarp(crossDeviceBarrierMemObj, myPe, 1, ADD)
            args.crossDeviceBarrierMemObj.GetAs(s)[myPe:myPe + 1] += numsBlockPerSrcPe

    def recv():
        CrossDeviceBarrierInterNodeKernel(args, numsBlockPerSrcPe)
        slots = _parity_slots(args)
        args.recvTokenNumMemObj.localPtr.index_fill_(0, slots, 0)
        args.sendAtomicSignalMemObj.localPtr.index_fill_(0, slots, 0)
        args.totalRecvTokenNum.zero_()
        idx = args.dispSenderIdxMap[:cur * c.numExpertPerToken].view(cur, c.numExpertPerToken)
        valid = (idx < maxRecv)[..., None]
        srcPtrs = args.shmemCombineInpTokMemObj.localPtr[idx.clamp(max=maxRecv - 1)]
        args.shmemOutTokMemObj.localPtr[:cur].copy_((srcPtrs * valid).sum(1))                 # WarpAccum
        if isinstance(args.crossDeviceBarrierFlag, torch.Tensor):                            # PR #86
            args.crossDeviceBarrierFlag += 1                    # __hip_atomic_fetch_add(flag, 1), globalThdId 0

    return send, recv


# --- src/pybind/mori.cpp + python/mori/ops/dispatch_combine.py -----------------------------------------------

def launch_dispatch(handle, input, topkIds):
    handle.PrepareInference(input, topkIds, input.size(0))
    handle.LaunchDispatch()
    out = handle.shmemOutTokMemObj.localPtr                   # from_blob(shmemOutTokMemObj, {MaxNumTokensToRecv, ...})
    return out, handle.totalRecvTokenNum


def launch_combine(handle, input, topkIds):
    handle.PrepareInference(input, topkIds, handle.curRankNumToken)
    handle.LaunchCombine()
    return handle.shmemOutTokMemObj.localPtr[:handle.config.maxNumInpTokenPerRank]


def launch_reset(handle):
    handle.LaunchReset()


class EpDispatchCombineOp:
    def __init__(self, config: EpDispatchCombineConfig, world: ShmemWorld):
        self.config = config
        self._handle = EpDispatchCombineHandle(config, world)

    def dispatch(self, input, weights, scales, indices):
        return launch_dispatch(self._handle, input, indices)

    def combine(self, input, weights, indices, call_reset: bool | None = None):
        if call_reset is None:
            call_reset = _variant["v"] == "bug"          # default True before PR #86, False after
        output = launch_combine(self._handle, input, indices)
        if call_reset:
            launch_reset(self._handle)
        return output


# --- a serving engine's EP MoE layer over mori, captured as its decode step (both ranks in one process) -------

class MoriEpMoE:
    def __init__(self, device, graphed: bool):
        self.graphed = graphed
        self.world = ShmemWorld(WORLD_SIZE, device)
        self.ops = [EpDispatchCombineOp(EpDispatchCombineConfig(
            r, WORLD_SIZE, HIDDEN_DIM, MAX_NUM_INP_TOKEN_PER_RANK, NUM_EXPERTS_PER_RANK, NUM_EXPERTS_PER_TOKEN,
            BLOCK_NUM), self.world) for r in range(WORLD_SIZE)]
        gen = generator(86)
        self.w_experts = [randn(HIDDEN_DIM, HIDDEN_DIM, gen=gen, device=device, scale=0.5) for _ in range(WORLD_SIZE)]
        self.hidden_states = [torch.zeros(MAX_NUM_INP_TOKEN_PER_RANK, HIDDEN_DIM, device=device)
                              for _ in range(WORLD_SIZE)]
        self.topk_ids = [torch.zeros(MAX_NUM_INP_TOKEN_PER_RANK, NUM_EXPERTS_PER_TOKEN, dtype=torch.int64,
                                     device=device) for _ in range(WORLD_SIZE)]
        if graphed:
            state = {}
            for r, op in enumerate(self.ops):
                h = op._handle
                state[f"crossDeviceBarrierMemObj[pe{r}]"] = h.crossDeviceBarrierMemObj.localPtr
                state[f"recvTokenNumMemObj[pe{r}]"] = h.recvTokenNumMemObj.localPtr
                state[f"sendAtomicSignalMemObj[pe{r}]"] = h.sendAtomicSignalMemObj.localPtr
                if isinstance(h.crossDeviceBarrierFlag, torch.Tensor):
                    state[f"crossDeviceBarrierFlag[pe{r}]"] = h.crossDeviceBarrierFlag
            state["stuck"] = self.world.stuck
            static = {f"hidden_states[rank{r}]": t for r, t in enumerate(self.hidden_states)}
            static.update({f"topk_ids[rank{r}]": t for r, t in enumerate(self.topk_ids)})
            self.graph, self.out = capture(self.forward, device=device, name="ep moe decode", owner="MoriEpMoE",
                                           static=static, state=state)

    def forward(self):
        received = [op.dispatch(self.hidden_states[r], None, None, self.topk_ids[r])[0]
                    for r, op in enumerate(self.ops)]
        expert_out = [torch.tanh(x @ self.w_experts[r]) for r, x in enumerate(received)]
        return tuple(op.combine(expert_out[r], None, self.topk_ids[r]) for r, op in enumerate(self.ops))

    def step(self, hidden, topk):
        for r in range(WORLD_SIZE):
            self.hidden_states[r].copy_(hidden[r])
            self.topk_ids[r].copy_(topk[r])
        out = replay(self.graph, self.out) if self.graphed else self.forward()
        self.world.synchronize()
        return torch.stack([o.clone() for o in out])


def run(variant: str, device: str = "cpu"):
    gen = generator(8600)
    n_experts = WORLD_SIZE * NUM_EXPERTS_PER_RANK
    steps = []
    for _ in range(STEPS):
        hidden = [randn(MAX_NUM_INP_TOKEN_PER_RANK, HIDDEN_DIM, gen=gen, device=device) for _ in range(WORLD_SIZE)]
        topk = [torch.stack([torch.randperm(n_experts, generator=gen)[:NUM_EXPERTS_PER_TOKEN]
                             for _ in range(MAX_NUM_INP_TOKEN_PER_RANK)]).to(device) for _ in range(WORLD_SIZE)]
        steps.append((hidden, topk))

    def serve(graphed: bool):
        _variant["v"] = variant
        moe = MoriEpMoE(device, graphed)
        return [moe.step(h, t) for h, t in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
