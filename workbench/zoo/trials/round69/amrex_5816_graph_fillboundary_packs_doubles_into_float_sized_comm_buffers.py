"""With CUDA graphs, FillBoundary<float> of a double MultiFab packs 8-byte doubles into comm buffers sized for floats.

Upstream: https://github.com/AMReX-Codes/amrex/pull/5816 ("Give GPU pack/unpack metadata that matches the comm
buffers", opened 2026-09-06, reviewed 2026-09-07, merged; fixes https://github.com/AMReX-Codes/amrex/issues/5687,
"GPU pack/unpack use wrong metadata: NonLocalBC Comm_nowait caches tags under unassigned id; cuda-graph FB ignores
BUF"). Only the second, CUDA-graph part of the PR is modelled (its NonLocalBC ``Comm_nowait`` id fix is no graph
bug). Symptom (an audit finding in the issue, no user report): in a CUDA build run with ``Gpu::setGraphRegion(true)``
on more than one MPI rank, a reduced-precision ``mf.FillBoundary<float>()`` of a ``MultiFab`` (``value_type``
double) writes past its send buffers and fills ghost cells from bytes that are not the neighbour's data (wrong ghost
cells, which then spread through the solution; an overrun past the arena block can also fault).
``FillBoundary<double>`` and all non-graph runs are right.
Mechanism: ``FabArray::FBEP_nowait<BUF>`` (Src/Base/AMReX_FabArrayCommI.H) sizes the receive and send buffers with
``PostRcvs<BUF>``/``PrepareSendBuffers<BUF>`` (``numPts * ncomp * sizeof(BUF)`` per tag) in The_Comms_Arena, then,
when ``Gpu::inGraphRegion()``, calls ``FB_pack_send_buffer_cuda_graph`` (Src/Base/AMReX_FBI.H) whatever BUF is. That
helper is not templated on BUF: its recorded kernels read and write ``value_type`` through the ``CopyMemory`` params
(``getDst<value_type>``), and ``setParams`` advances each tag's buffer pointer by ``numPts * ncomp *
sizeof(value_type)``. For BUF = float every tag is written at twice its stride, so a message's later tags land past
its end (in the next allocation, or past the block); MPI sends only ``send_size`` bytes, the first half. In
``FillBoundary_finish<BUF>`` the twin ``FB_unpack_recv_buffer_cuda_graph`` reads value_type at value_type strides
from receive buffers sized for float, so later tags are read from whatever follows the receive block in the arena.
The recorded graphs (``FB::m_copyToBuffer``/``m_copyFromBuffer``) are cached per FB with no BUF in the key, so the
graph recorded by a ``FillBoundary<double>`` is simply replayed with the float call's parameters. The non-graph path
(``pack_send_buffer_gpu<BUF>``/``unpack_recv_buffer_gpu<BUF>``) converts through BUF and is right.
Doctor: undersized-buffer, at ``FBEP_nowait`` (it hands comm buffers sized for sizeof(BUF) to the graph helper,
whose graph writes value_type-sized elements into them: the data does not fit the buffers; the unpack side in
``FillBoundary_finish`` then reads past the receive buffers).
Fix (upstream): the graph helpers are used only when BUF is value_type: ``FBEP_nowait`` and
``FillBoundary_finish`` route ``BUF != value_type`` to the templated ``pack_send_buffer_gpu<BUF>``/
``unpack_recv_buffer_gpu<BUF>`` (templating the helpers alone would not do, as the cached graph has no BUF key).
The diff itself was not readable here; where the condition sits is taken from the PR text and its review ("Both
CUDA-graph packing and unpacking now require BUF to equal value_type, leaving converted buffers on the templated path").
Modelled: 1-D, two boxes on two emulated MPI ranks run in lockstep, periodic, two ghost cells, two components, no
local copies; MPI is a host-side mailbox copying ``send_size`` bytes at ``Waitall``. Each rank's The_Comms_Arena is
one byte slab with a first-fit allocator (16-byte alignment), so the overrun lands inside it, as in a CArena chunk.
``CopyMemory`` is reduced to the comm-buffer byte address (fab, box, scomp and ncomp do not change here); as in
``startGraphRecording``, the graph's first node copies the host ``m_parms`` to the device array, so ``setParams``
before ``executeGraph`` is what a replay reads. A heat-equation update between FillBoundary calls spreads the ghosts.
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/AMReX-Codes/amrex/pull/5816"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "FBEP_nowait"
SYMPTOM = "with CUDA graphs, FillBoundary<float> of a double MultiFab overruns its comm buffers and fills wrong ghosts"

NCELL, NRANKS, NGHOST, NCOMP = 16, 2, 2, 2
value_type = torch.float64                                 # MultiFab = FabArray<FArrayBox>: Real = double
SIZEOF = {torch.float64: 8, torch.float32: 4}
ARENA_ALIGN, COMM_ALIGN, ARENA_BYTES = 16, 8, 512
# FillBoundary<BUF> of each step: the first records the FB's graphs with BUF = value_type
BUF_SCHEDULE = (torch.float64, torch.float32, torch.float64, torch.float32, torch.float32)
DT = 0.2


def aligned_size(align, size):
    return (size + align - 1) // align * align


class Box:
    def __init__(self, lo, hi):                            # cell-centred, [smallEnd, bigEnd]
        self.lo, self.hi = lo, hi

    def numPts(self):
        return max(self.hi - self.lo + 1, 0)

    def shift(self, s):
        return Box(self.lo + s, self.hi + s)

    def grow(self, n):
        return Box(self.lo - n, self.hi + n)

    def __and__(self, other):
        return Box(max(self.lo, other.lo), min(self.hi, other.hi))


class CopyComTag:
    def __init__(self, dbox, sbox, dstIndex, srcIndex):
        self.dbox, self.sbox, self.dstIndex, self.srcIndex = dbox, sbox, dstIndex, srcIndex


class Gpu:
    graph_region = False

    @classmethod
    def inGraphRegion(cls):
        return cls.graph_region


class CArena:
    """The_Comms_Arena: first-fit blocks of one device chunk (alloc per FillBoundary, freed in _finish)."""

    def __init__(self, device):
        self.chunk = torch.zeros(ARENA_BYTES, dtype=torch.uint8, device=device)
        self.busy = {}

    def alloc(self, nbytes):
        size, off = aligned_size(ARENA_ALIGN, nbytes), 0
        for o, s in sorted(self.busy.items()):
            if off + size <= o:
                break
            off = max(off, o + s)
        assert off + size <= ARENA_BYTES, "The_Comms_Arena chunk exhausted"
        self.busy[off] = size
        return off

    def free(self, off):
        del self.busy[off]


class ParallelDescriptor:
    """MPI between the emulated ranks: Asend copies send_size bytes out; Waitall delivers them."""

    def __init__(self):
        self.mailbox = {}

    def Asend(self, arena, off, nbytes, src, dst, tag):
        self.mailbox[(src, dst, tag)] = arena.chunk[off:off + nbytes].clone()

    def Waitall_recv(self, arena, off, nbytes, src, dst, tag):
        msg = self.mailbox.pop((src, dst, tag))
        assert msg.numel() == nbytes, "MPI_ERR_TRUNCATE"
        arena.chunk[off:off + nbytes].copy_(msg)


class CudaGraph:
    """amrex::CudaGraph<CopyMemory>: host params (m_parms), device params (m_parms_d), the recorded graph."""

    def __init__(self, device):
        self.device, self.m_graph, self.outputs, self.graph_is_ready = device, None, None, False
        self.m_parms = self.m_parms_d = None

    def resize(self, num):
        self.m_parms = host(torch.zeros(num, dtype=torch.int64), self.device)
        self.m_parms_d = torch.zeros(num, dtype=torch.int64, device=self.device)

    def setGraph(self, g, outputs):
        self.m_graph, self.outputs, self.graph_is_ready = g, outputs, True

    def setParams(self, idx, dptr):                        # makeCopyMemory(..., (value_type*)dptr, ...)
        self.m_parms[idx] = dptr

    def ready(self):
        return self.graph_is_ready

    def executeGraph(self):                                # Gpu::Device::executeGraph(m_graph, synch=true)
        out = replay(self.m_graph, self.outputs)
        synchronize(self.device)
        return out


class FB:
    """FabArrayBase::FB, cached per (nghost, period, ...) -- no BUF in the key."""

    def __init__(self, mf, nghost):
        self.m_SndTags, self.m_RcvTags, self.m_LocTags = {}, {}, []
        L = NCELL
        for d, dbox in enumerate(mf.boxarray):
            for s, sbox in enumerate(mf.boxarray):
                for shift in (0, -L, L):                   # periodic images of the source box
                    for ghost in (Box(dbox.lo - nghost, dbox.lo - 1), Box(dbox.hi + 1, dbox.hi + nghost)):
                        isect = ghost & sbox.shift(shift)
                        if isect.numPts() == 0:
                            continue
                        tag = CopyComTag(isect, isect.shift(-shift), d, s)
                        src_rank, dst_rank = mf.distributionMap[s], mf.distributionMap[d]
                        if src_rank == mf.rank and dst_rank == mf.rank:
                            self.m_LocTags.append(tag)
                        elif src_rank == mf.rank:
                            self.m_SndTags.setdefault(dst_rank, []).append(tag)
                        elif dst_rank == mf.rank:
                            self.m_RcvTags.setdefault(src_rank, []).append(tag)
        self.m_copyToBuffer, self.m_copyFromBuffer = CudaGraph(mf.device), CudaGraph(mf.device)


class FBData:
    pass


class FabArray:
    """The part of a MultiFab one MPI rank owns: here one box, one fab with NGHOST ghost cells."""

    def __init__(self, rank, comm, data, device, variant):
        self.rank, self.comm, self.device, self.variant = rank, comm, device, variant
        n = NCELL // NRANKS
        self.boxarray = [Box(i * n, i * n + n - 1) for i in range(NRANKS)]
        self.distributionMap = list(range(NRANKS))
        self.box = self.boxarray[rank]
        self.fab = torch.zeros(NCOMP, self.box.numPts() + 2 * NGHOST, dtype=value_type, device=device)
        self.fab[:, NGHOST:NGHOST + self.box.numPts()] = data
        self.arena = CArena(device)
        self.m_TheFBCache, self.fbd = {}, None

    def cols(self, box):
        lo = box.lo - (self.box.lo - NGHOST)
        return slice(lo, lo + box.numPts())

    def getFB(self, nghost):
        if nghost not in self.m_TheFBCache:
            self.m_TheFBCache[nghost] = FB(self, nghost)
        return self.m_TheFBCache[nghost]

    # -- PostRcvs<BUF> / PrepareSendBuffers<BUF> (AMReX_FabArrayCommI.H) ---------------------------------
    def _comm_buffers(self, tags, ncomp, BUF, which):
        offset, sizes, ranks, total = [], [], [], 0
        for rank, cctc in tags.items():
            nbytes = sum(getattr(t, which).numPts() for t in cctc) * ncomp * SIZEOF[BUF]
            nbytes = aligned_size(COMM_ALIGN, nbytes)
            total = aligned_size(max(SIZEOF[BUF], COMM_ALIGN), total)
            offset.append(total)
            sizes.append(nbytes)
            ranks.append(rank)
            total += nbytes
        the_data = self.arena.alloc(total)
        return the_data, [the_data + o for o in offset], sizes, ranks

    def PostRcvs(self, RcvTags, ncomp, BUF):
        return self._comm_buffers(RcvTags, ncomp, BUF, "dbox")

    def PrepareSendBuffers(self, SndTags, ncomp, BUF):
        return self._comm_buffers(SndTags, ncomp, BUF, "sbox")

    # -- non-graph path, templated on BUF (AMReX_FBI.H) ---------------------------------------------------
    def pack_send_buffer_gpu(self, BUF, scomp, ncomp, send_data, send_size, send_cctc):
        for j, cctc in enumerate(send_cctc):
            dptr = send_data[j]
            for tag in cctc:
                vals = self.fab[scomp:scomp + ncomp, self.cols(tag.sbox)].to(BUF).contiguous().view(torch.uint8)
                self.arena.chunk[dptr:dptr + vals.numel()] = vals.reshape(-1)
                dptr += tag.sbox.numPts() * ncomp * SIZEOF[BUF]
            assert dptr <= send_data[j] + send_size[j]

    def unpack_recv_buffer_gpu(self, BUF, dcomp, ncomp, recv_data, recv_size, recv_cctc):
        for k, cctc in enumerate(recv_cctc):
            dptr = recv_data[k]
            for tag in cctc:
                nbytes = tag.dbox.numPts() * ncomp * SIZEOF[BUF]
                vals = self.arena.chunk[dptr:dptr + nbytes].view(BUF).view(ncomp, tag.dbox.numPts())
                self.fab[dcomp:dcomp + ncomp, self.cols(tag.dbox)] = vals.to(value_type)
                dptr += nbytes
            assert dptr <= recv_data[k] + recv_size[k]

    # -- CUDA-graph path: value_type throughout (AMReX_FBI.H) ---------------------------------------------
    def FB_pack_send_buffer_cuda_graph(self, TheFB, scomp, ncomp, send_data, send_size, send_cctc):
        cg = TheFB.m_copyToBuffer
        if not cg.ready():
            tags = [tag for cctc in send_cctc for tag in cctc]
            cg.resize(len(tags))

            def record():                                  # startGraphRecording .. stopGraphRecording
                cg.m_parms_d.copy_(cg.m_parms, non_blocking=True)
                for idx, tag in enumerate(tags):           # AMREX_HOST_DEVICE_FOR_3D(bx, ...) per tag
                    vals = self.fab[scomp:scomp + ncomp, self.cols(tag.sbox)].contiguous()   # getSrc<value_type>
                    raw = vals.view(torch.uint8).reshape(-1)                                   # getDst<value_type>
                    pos = cg.m_parms_d[idx] + torch.arange(raw.numel(), device=self.device)
                    self.arena.chunk[pos] = raw
                return self.arena.chunk

            g, out = capture(record, device=self.device, warmups=0, name=f"rank {self.rank} m_copyToBuffer",
                             owner="FabArrayBase::FB (m_copyToBuffer)", static={"m_parms": cg.m_parms},
                             state={"fab": self.fab})
            cg.setGraph(g, out)
        idx = 0
        for j, cctc in enumerate(send_cctc):               # Setup Launch Parameters
            dptr = send_data[j]
            for tag in cctc:
                cg.setParams(idx, dptr)
                idx += 1
                dptr += tag.sbox.numPts() * ncomp * SIZEOF[value_type]
        cg.executeGraph()

    def FB_unpack_recv_buffer_cuda_graph(self, TheFB, dcomp, ncomp, recv_data, recv_size, recv_cctc):
        cg = TheFB.m_copyFromBuffer
        recv_copy_tags = []
        for k, cctc in enumerate(recv_cctc):
            dptr = recv_data[k]
            for tag in cctc:
                recv_copy_tags.append((dptr, tag))
                dptr += tag.dbox.numPts() * ncomp * SIZEOF[value_type]
        if not cg.ready():
            cg.resize(len(recv_copy_tags))

            def record():
                cg.m_parms_d.copy_(cg.m_parms, non_blocking=True)
                for idx, (_, tag) in enumerate(recv_copy_tags):
                    n = tag.dbox.numPts()
                    pos = cg.m_parms_d[idx] + torch.arange(n * ncomp * SIZEOF[value_type], device=self.device)
                    vals = self.arena.chunk[pos].view(value_type).view(ncomp, n)                # getSrc<value_type>
                    self.fab[dcomp:dcomp + ncomp, self.cols(tag.dbox)] = vals
                return self.fab

            g, out = capture(record, device=self.device, warmups=0, name=f"rank {self.rank} m_copyFromBuffer",
                             owner="FabArrayBase::FB (m_copyFromBuffer)", static={"m_parms": cg.m_parms},
                             state={"fab": self.fab})
            cg.setGraph(g, out)
        for idx, (dptr, _) in enumerate(recv_copy_tags):
            cg.setParams(idx, dptr)
        cg.executeGraph()

    # -- FillBoundary_nowait / FillBoundary_finish (AMReX_FabArrayCommI.H) ---------------------------------
    def FBEP_nowait(self, BUF, scomp, ncomp, nghost, SeqNum):
        TheFB = self.getFB(nghost)
        fbd = self.fbd = FBData()
        fbd.fb, fbd.scomp, fbd.ncomp, fbd.tag = TheFB, scomp, ncomp, SeqNum
        fbd.the_recv_data, fbd.recv_data, fbd.recv_size, fbd.recv_from = self.PostRcvs(TheFB.m_RcvTags, ncomp, BUF)
        the_send_data, send_data, send_size, send_rank = self.PrepareSendBuffers(TheFB.m_SndTags, ncomp, BUF)
        fbd.the_send_data = the_send_data
        send_cctc = [TheFB.m_SndTags[r] for r in send_rank]
        graph_path = Gpu.inGraphRegion()
        if self.variant == "fix":
            graph_path = graph_path and BUF is value_type  # converted buffers take the templated path
        if graph_path:
            self.FB_pack_send_buffer_cuda_graph(TheFB, scomp, ncomp, send_data, send_size, send_cctc)
        else:
            self.pack_send_buffer_gpu(BUF, scomp, ncomp, send_data, send_size, send_cctc)
        for j, rank in enumerate(send_rank):               # PostSnds
            self.comm.Asend(self.arena, send_data[j], send_size[j], self.rank, rank, SeqNum)

    def FillBoundary_finish(self, BUF):
        fbd, TheFB = self.fbd, self.fbd.fb
        for k, src in enumerate(fbd.recv_from):            # ParallelDescriptor::Waitall(recv_reqs)
            self.comm.Waitall_recv(self.arena, fbd.recv_data[k], fbd.recv_size[k], src, self.rank, fbd.tag)
        recv_cctc = [TheFB.m_RcvTags[r] for r in fbd.recv_from]
        graph_path = Gpu.inGraphRegion()
        if self.variant == "fix":
            graph_path = graph_path and BUF is value_type
        if graph_path:
            self.FB_unpack_recv_buffer_cuda_graph(TheFB, fbd.scomp, fbd.ncomp, fbd.recv_data, fbd.recv_size,
                                                  recv_cctc)
        else:
            self.unpack_recv_buffer_gpu(BUF, fbd.scomp, fbd.ncomp, fbd.recv_data, fbd.recv_size, recv_cctc)
        self.arena.free(fbd.the_recv_data)
        self.arena.free(fbd.the_send_data)
        self.fbd = None


def FillBoundary(ranks, BUF, SeqNum):
    """mf.FillBoundary<BUF>() on every rank (FBEP_nowait, then FillBoundary_finish), in lockstep."""
    for mf in ranks:
        mf.FBEP_nowait(BUF, 0, NCOMP, NGHOST, SeqNum)
    for mf in ranks:
        mf.FillBoundary_finish(BUF)


def advance(mf):
    """One explicit heat-equation step on the valid cells (reads the ghost cells FillBoundary filled)."""
    phi = mf.fab
    n = mf.box.numPts()
    lap = phi[:, NGHOST - 1:NGHOST - 1 + n] - 2 * phi[:, NGHOST:NGHOST + n] + phi[:, NGHOST + 1:NGHOST + 1 + n]
    phi[:, NGHOST:NGHOST + n] += DT * lap


def run(variant: str, device: str = "cpu"):
    gen = generator(5816)
    init = randn(NCOMP, NCELL, gen=gen, device=device).to(value_type)
    n = NCELL // NRANKS

    def serve(graphed: bool):
        Gpu.graph_region = graphed                         # Gpu::setGraphRegion(true) in a CUDA build
        try:
            comm = ParallelDescriptor()
            ranks = [FabArray(r, comm, init[:, r * n:(r + 1) * n], device, variant) for r in range(NRANKS)]
            outs = []
            for step, BUF in enumerate(BUF_SCHEDULE):
                FillBoundary(ranks, BUF, SeqNum=step)
                outs.extend(mf.fab.clone() for mf in ranks)
                for mf in ranks:
                    advance(mf)
            outs.extend(mf.fab.clone() for mf in ranks)
            return outs
        finally:
            Gpu.graph_region = False

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
