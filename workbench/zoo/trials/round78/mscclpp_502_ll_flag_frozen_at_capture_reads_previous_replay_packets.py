"""mscclpp's NCCL-shim all-reduce bumps its LL-protocol flag on the host, so a captured all-reduce replays one flag and one scratch half forever and a rank accepts its peer's packets from the previous replay.

Upstream: https://github.com/microsoft/mscclpp/pull/502 ("apps/nccl: fix a bug in allreduce kernels for graph
mode", merged 2025-04-24 as 9df2bdb2bf71f529e6c2516bf5b6cb89ec98ec58).
Symptom: the PR: "``allreduce7`` and ``allreduceAllpairs`` kernels were updating the LL protocol flag on the host
side. So, it was not properly captured in graph mode." With the mscclpp NCCL shim (``apps/nccl``, single node)
and a CUDA-graph-captured all-reduce of up to 1 MiB, from the second replay on a rank that reaches the all-reduce
before its peer has sent takes the peer's contribution of the previous replay: the all-reduce result is silently
wrong (and differs between ranks). No error is raised. Eager all-reduces are right.
Mechanism: ``apps/nccl/src/allreduce.hpp`` ``allreduce<OpType, T>()`` (host) keeps ``static uint32_t flag = 1``
and launches ``allreduceAllPairs<<<...>>>(..., nelems, flag++)`` (``allreduce7`` likewise); the flag is a by-value
kernel argument. ``apps/nccl/src/nccl.cu`` ``ncclAllReduceFallback`` also picks the scratch double-buffer half
on the host (``scratchBuffIdx = (++(comm->buffFlag)) % comm->numScratchBuff``, ``offsetScratch``). The kernel uses
the LL protocol: step 1 ``putPackets`` writes its ``buff`` into each peer's scratch as ``LL8Packet``s
``{data, flag}``; step 2 reads the peers' packets from its own scratch with ``LL8Packet::read(flag, -1)``, which
spins until the packet's flag equals ``flag``, and reduces. A fresh flag per call (and the other scratch half)
makes a packet left over from an earlier call never match. Under capture both host counters run once: every
replay puts and waits for the same flag in the same scratch half, and the scratch is never cleared. From the
second replay on, the receiver's slot already holds the peer's packets of the previous replay, tagged with that
very flag, so ``read`` returns at once with the old data before the late peer has put this replay's packets.
Doctor: host-work-frozen, at ``allreduce`` (the ``static uint32_t flag`` and its ``flag++``, host work run once at
capture whose value the kernel node keeps as a literal, so every replay waits for the capture-time flag; the
host-side scratch-half selector ``++comm->buffFlag`` in ``ncclAllReduceFallback`` is frozen with it).
Fix (upstream): ``ncclCommInitRankFallbackSingleNode`` allocates per-block device counters
``deviceFlag7/28/56 = gpuCallocShared<uint32_t>(N)`` initialised to 1; ``allreduce`` passes the counter array and
``numScratchBuff`` instead of ``flag++``; the kernels read ``flag = deviceFlag[blockIdx.x]``, derive the scratch
half on the device (``scratchBaseOffset = (flag % numScratchBuff) ? SCRATCH_SIZE / numScratchBuff : 0``) and end
with ``__syncthreads(); if (threadIdx.x == 0) deviceFlag[blockIdx.x] += 1``: each replay advances the flag.
Modelled: the small-message path only (``allreduceAllPairs``, 28 blocks; ``allreduce7`` and the 7-block branch are
left out), float32 SUM, two ranks of one node (``NRANKS_PER_NODE`` is 8 upstream). Each rank is its own process
upstream; here both ranks' communicators live in one process, each with its own ``static flag``, and the peer's
scratch is the rank's CUDA-IPC-registered scratch (``remoteScratchRegMemories``) seen through a
``MemoryChannel``. Packets are two tensors (data, flag); offsets count packets, not bytes; a kernel's blocks act
as one (they all hold the same per-block count). The two GPUs' execution is one fixed interleaving of the two
kernels' steps (``Node.execute``, the emulation's own): rank 1's kernel starts one step after rank 0's, so rank 0
polls once before rank 1 has put its packets; the spin of ``read(flag, -1)`` is a bounded number of polls (two
suffice for this schedule), each accepting the packets whose flag matches. One graph captures the node's step
(both ranks' all-reduces), as each rank captures its own all-reduce upstream.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/mscclpp/pull/502"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "allreduce"
SYMPTOM = ("all-reduce through the mscclpp NCCL shim under CUDA graphs returns the peer's contribution of the "
           "previous replay (LL flag and scratch half frozen at capture): silent wrong sums")

NRANKS_PER_NODE = 2          # 8 upstream
COUNT = 8                    # float32 elements per all-reduce: 32 bytes, the allreduceAllPairs path
SCRATCH_SIZE = 2 * NRANKS_PER_NODE * 16     # packets: double buffer, each half holds every rank's packets
LAUNCH_LAG = 1               # rank r's kernel starts r steps after rank 0's (its host launched later)
SPIN_POLLS = 2               # polls of LL8Packet::read(flag, -1) (it spins for ever upstream)
STEPS = 5

_variant = {"v": "bug"}


# --- include/mscclpp/packet_device.hpp, memory_channel_device.hpp -------------------------------------------

class LL8PacketBuffer:
    """An array of ``mscclpp::LL8Packet`` (``{uint32_t data; uint32_t flag;}``), as two tensors."""

    def __init__(self, n: int, device):
        self.data = torch.zeros(n, device=device)
        self.flag = torch.zeros(n, dtype=torch.int32, device=device)   # GpuBuffer: zero-initialised


def _flags(flag, n: int, like: torch.Tensor) -> torch.Tensor:
    """``flag`` as each of ``n`` packets' flag field (a kernel argument, or the device counter)."""
    if isinstance(flag, torch.Tensor):
        return flag.to(torch.int32).expand(n)
    return torch.full((n,), flag, dtype=torch.int32, device=like.device)


class MemoryChannel:
    """``DeviceHandle<MemoryChannel>``: local ``src`` buffer -> a peer's registered scratch (CUDA IPC)."""

    def __init__(self, remote_scratch: LL8PacketBuffer, src: torch.Tensor):
        self.dst, self.src = remote_scratch, src

    def putPackets(self, targetOffset, originOffset: int, nelems: int, flag) -> None:
        """Read ``nelems`` words at ``originOffset`` of ``src`` and write them as LL8Packets, each carrying
        ``flag``, at ``targetOffset`` of the peer's scratch."""
        idx = targetOffset + torch.arange(nelems, device=self.src.device)
        self.dst.data.index_put_((idx,), self.src[originOffset:originOffset + nelems])
        self.dst.flag.index_put_((idx,), _flags(flag, nelems, self.src))


def LL8Packet_readOnce(pkts: LL8PacketBuffer, idx: torch.Tensor, flag):
    """``LL8Packet::readOnce``: the packets' data, and whether their flag equals ``flag``."""
    return pkts.data[idx], pkts.flag[idx] == _flags(flag, idx.numel(), idx)


# --- apps/nccl/src/allreduce.hpp ------------------------------------------------------------------------------

def allreduceAllPairs(gridDim, buff, scratch, resultBuff, memoryChannels, channelDataOffset, channelScratchOffset,
                      rank, nRanksPerNode, worldSize, nelems, flag=None, deviceFlag=None, numScratchBuff=None):
    """The kernel, as a generator: each ``yield`` is a point where the other GPU makes progress."""
    if worldSize != nRanksPerNode:
        return
    nPeers = nRanksPerNode - 1
    if deviceFlag is not None:                                            # PR #502
        flag = deviceFlag[0:1]                                            # uint32_t flag = deviceFlag[blockIdx.x]
        scratchBaseOffset = (flag.long() % numScratchBuff) * (SCRATCH_SIZE // numScratchBuff)
        channelScratchOffset = scratchBaseOffset
    scratchOffset = channelScratchOffset + rank * nelems
    src = buff[channelDataOffset:channelDataOffset + nelems]

    # step 1: write data to each peer's scratch buffer
    for peerIdx in range(nPeers):
        memoryChannels[peerIdx].putPackets(scratchOffset, channelDataOffset, nelems, flag)
    yield

    # step 2: reduce data; dstPkt[idx].read(flag, -1) spins until the packet carries this call's flag
    lanes = torch.arange(nelems, device=buff.device)
    vals, got = [], []
    for index in range(nPeers):
        vals.append(torch.zeros_like(src))
        got.append(torch.zeros(nelems, dtype=torch.bool, device=buff.device))
    for poll in range(SPIN_POLLS):
        for index in range(nPeers):
            remoteRank = index if index < rank else index + 1
            val, ready = LL8Packet_readOnce(scratch, channelScratchOffset + remoteRank * nelems + lanes, flag)
            hit = ready & ~got[index]
            vals[index] = torch.where(hit, val, vals[index])
            got[index] = got[index] | hit
        if poll + 1 < SPIN_POLLS:
            yield
    data = src.clone()
    for index in range(nPeers):
        data = vals[index] + data
    resultBuff[:nelems].copy_(data)
    if deviceFlag is not None:                                            # PR #502
        deviceFlag[:gridDim] += 1           # __syncthreads(); if (threadIdx.x == 0) deviceFlag[blockIdx.x] += 1


# ``static uint32_t flag = 1;`` of ``allreduce<SUM, float>``: one per rank's process
_allreduce_static_flag: dict[int, int] = {}


def allreduce(buff, scratch, resultBuff, memoryChannels, channelInOffset, channelScratchOffset, rank,
              nRanksPerNode, worldSize, nelems, stream, deviceFlag7=None, deviceFlag28=None, deviceFlag56=None,
              numScratchBuff=None):
    """``mscclpp::allreduce<SUM, float>``: pick a kernel by message size and launch it on ``stream``."""
    nbytes = 4 * nelems
    if nbytes < worldSize * 4:
        nBlocks, deviceFlag = 7, deviceFlag7
    elif nbytes <= (1 << 14):
        nBlocks, deviceFlag = 28, deviceFlag28
    else:
        raise NotImplementedError("allreduce7 / allreduce8 are not modelled")
    if _variant["v"] == "fix":
        stream.launch(allreduceAllPairs(nBlocks, buff, scratch, resultBuff, memoryChannels, channelInOffset,
                                        channelScratchOffset, rank, nRanksPerNode, worldSize, nelems,
                                        deviceFlag=deviceFlag, numScratchBuff=numScratchBuff))
        return
    flag = _allreduce_static_flag.setdefault(rank, 1)
    _allreduce_static_flag[rank] = flag + 1                               # flag++ (host side)
    stream.launch(allreduceAllPairs(nBlocks, buff, scratch, resultBuff, memoryChannels, channelInOffset,
                                    channelScratchOffset, rank, nRanksPerNode, worldSize, nelems, flag))


# --- apps/nccl/src/nccl.cu ------------------------------------------------------------------------------------

class ncclComm:
    def __init__(self, rank: int, nranks: int):
        self.rank, self.nranks = rank, nranks
        self.numScratchBuff = 2
        self.buffFlag = 0
        self.scratchBuff: LL8PacketBuffer | None = None
        self.remoteScratchRegMemories: list[LL8PacketBuffer] = []
        self.channelScratchInfos: dict[int, list[MemoryChannel]] = {}
        self.deviceFlag7 = self.deviceFlag28 = self.deviceFlag56 = None


def ncclCommInitRankFallbackSingleNode(comm: ncclComm, scratch_of_rank: list, device) -> None:
    comm.scratchBuff = LL8PacketBuffer(SCRATCH_SIZE, device)
    scratch_of_rank[comm.rank] = comm.scratchBuff


def setupRemoteMemories(comm: ncclComm, scratch_of_rank: list) -> None:
    """Exchange of the registered scratch buffers (bootstrap + CUDA IPC), after every rank allocated its own."""
    comm.remoteScratchRegMemories = [scratch_of_rank[r] for r in range(comm.nranks) if r != comm.rank]
    if _variant["v"] == "fix":                                            # PR #502
        comm.deviceFlag7 = torch.ones(7, dtype=torch.int32, device=comm.scratchBuff.data.device)
        comm.deviceFlag28 = torch.ones(28, dtype=torch.int32, device=comm.scratchBuff.data.device)
        comm.deviceFlag56 = torch.ones(56, dtype=torch.int32, device=comm.scratchBuff.data.device)


def ncclAllReduceFallback(sendbuff, recvbuff, count, comm: ncclComm, stream) -> None:
    offsetIn = 0
    scratchBuffIdx = (comm.buffFlag + 1) % comm.numScratchBuff            # (++(comm->buffFlag)) % numScratchBuff
    comm.buffFlag += 1
    offsetScratch = (SCRATCH_SIZE // comm.numScratchBuff) * scratchBuffIdx
    sendKey = sendbuff.data_ptr()
    if sendKey not in comm.channelScratchInfos:                           # channels cached per send buffer
        comm.channelScratchInfos[sendKey] = [MemoryChannel(m, sendbuff) for m in comm.remoteScratchRegMemories]
    memoryChannels = comm.channelScratchInfos[sendKey]
    allreduce(sendbuff, comm.scratchBuff, recvbuff, memoryChannels, offsetIn, offsetScratch, comm.rank,
              NRANKS_PER_NODE, comm.nranks, count, stream, comm.deviceFlag7, comm.deviceFlag28,
              comm.deviceFlag56, comm.numScratchBuff)


# --- the node: two GPUs' streams (the emulation's own) ----------------------------------------------------------

class Stream:
    def __init__(self):
        self.queued = []

    def launch(self, kernel) -> None:
        self.queued.append(kernel)


class Node:
    """The GPUs of one node running their streams' kernels in a fixed interleaving: rank r's kernel starts
    ``r * LAUNCH_LAG`` steps after rank 0's, and at each step the ranks advance in rank order."""

    def __init__(self, nranks: int):
        self.streams = [Stream() for _ in range(nranks)]

    def execute(self) -> None:
        running = {}
        tick = 0
        while any(s.queued for s in self.streams) or running:
            for r, s in enumerate(self.streams):
                if r not in running and s.queued and tick >= r * LAUNCH_LAG:
                    running[r] = s.queued.pop(0)
                if r in running:
                    try:
                        next(running[r])
                    except StopIteration:
                        del running[r]
            tick += 1


# --- a TP all-reduce served step ---------------------------------------------------------------------------------

class AllReduceRunner:
    """Each step all-reduces every rank's partial result (a TP layer's) through ``ncclAllReduce``."""

    def __init__(self, device, graphed: bool):
        self.graphed = graphed
        self.node = Node(NRANKS_PER_NODE)
        self.comms = [ncclComm(r, NRANKS_PER_NODE) for r in range(NRANKS_PER_NODE)]
        scratch_of_rank = [None] * NRANKS_PER_NODE
        for comm in self.comms:
            ncclCommInitRankFallbackSingleNode(comm, scratch_of_rank, device)
        for comm in self.comms:
            setupRemoteMemories(comm, scratch_of_rank)
        self.sendbuff = [torch.zeros(COUNT, device=device) for _ in range(NRANKS_PER_NODE)]
        self.recvbuff = [torch.zeros(COUNT, device=device) for _ in range(NRANKS_PER_NODE)]
        if graphed:
            state = {}
            for comm in self.comms:
                state[f"scratchBuff[rank{comm.rank}].data"] = comm.scratchBuff.data
                state[f"scratchBuff[rank{comm.rank}].flag"] = comm.scratchBuff.flag
                if comm.deviceFlag28 is not None:
                    state[f"deviceFlag28[rank{comm.rank}]"] = comm.deviceFlag28
            self.graph, self.out = capture(
                self.forward, device=device, name="tp all-reduce", owner="AllReduceRunner (mscclpp NCCL shim)",
                static={f"sendbuff[rank{r}]": b for r, b in enumerate(self.sendbuff)}, state=state)

    def forward(self):
        for r, comm in enumerate(self.comms):
            ncclAllReduceFallback(self.sendbuff[r], self.recvbuff[r], COUNT, comm, self.node.streams[r])
        self.node.execute()
        return tuple(self.recvbuff)

    def step(self, partials):
        for r in range(NRANKS_PER_NODE):
            self.sendbuff[r].copy_(partials[r])
        out = replay(self.graph, self.out) if self.graphed else self.forward()
        return torch.stack([o.clone() for o in out])


def run(variant: str, device: str = "cpu"):
    gen = generator(502)
    steps = [[randn(COUNT, gen=gen, device=device) for _ in range(NRANKS_PER_NODE)] for _ in range(STEPS)]

    def serve(graphed: bool):
        _variant["v"] = variant
        _allreduce_static_flag.clear()                                    # fresh processes
        runner = AllReduceRunner(device, graphed)
        return [runner.step(partials) for partials in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
