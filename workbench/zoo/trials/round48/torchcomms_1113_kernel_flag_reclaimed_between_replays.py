"""The KernelFlagItem baked into a captured collective is reclaimed by the pool between replays and handed to an eager op.

Upstream: https://github.com/meta-pytorch/torchcomms/pull/1113 ("Fix KernelFlagItem pool ownership in CUDA
graph mode", commit 4df7bd469a51, D96779614).
Symptom: "The graph still holds a baked-in pointer to that flag -- next replay corrupts/crashes": a graph
replay and a concurrent eager CTRAN collective drive the same pinned flag words, so one of them hangs in its
handshake or reads the other's state (the pre-fix test asserted ``numInUseKernelFlags()==0`` after a replay).
Mechanism: ``CtranGpe::Impl::submit()`` pops a ``KernelFlagItem`` from ``KernelFlagPool``
(``PinnedHostPool``) and passes ``flag_`` to the GPE kernel; under stream capture that pointer is baked into
the kernel node and the command becomes persistent. Every run (eager or replay) follows one handshake on those
words: the kernel stores ``KERNEL_STARTED`` (``KernelStartGpe``), the GPE thread runs the op and stores
``KERNEL_TERMINATE`` (``setFlagPerGroup``), the kernel waits for it and stores ``KERNEL_UNSET``
(``KernelWaitGpeTerminate``). ``KernelFlagItem::inUse()`` is true only while a flag is not ``KERNEL_UNSET``,
so after each replay the graph's item looks free: the next eager ``submit()`` that finds the pool empty calls
``reclaim()``, which pushes it back on the free stack, and ``pop()`` hands the same words to the eager op.
Here that eager op is a side-stream collective still in flight (its GPE thread has stored ``TERMINATE``, its
kernel has not yet seen it) when the graph replays: the replay's handshake runs on the same words and ends
with ``KERNEL_UNSET``, so the eager kernel never sees ``TERMINATE`` and spins forever (raised here).
Doctor: persistent-mutation, at ``submit`` (the capture-time submit leaves the graph's flag item reclaimable,
so every replay writes flag words the pool has handed to someone else).
Fix (upstream): ``KernelFlagItem`` gets ``persistent_`` (``setPersistent``/``clearPersistent``); ``inUse()``
returns true while it is set and ``reset()`` keeps it; ``submit()`` calls ``kernelFlag->setPersistent()``
while capturing; the new ``~CtranGpeCmd`` (run from ``cmdDestroy`` at graph destruction) clears it and resets.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/meta-pytorch/torchcomms/pull/1113"
FAMILY = "dangling references"
KIND = "persistent-mutation"
SITE = "submit"
SYMPTOM = "an eager CTRAN collective issued between replays gets the graph's flag item and hangs in its handshake"

KERNEL_UNSET, KERNEL_SCHEDULED, KERNEL_STARTED, KERNEL_TERMINATE = 0, 1, 2, 3
CTRAN_ALGO_MAX_THREAD_BLOCKS, CAPACITY, NUM_BLOCKS, ROWS, DIM = 4, 2, 2, 4, 3


class CtranHang(RuntimeError):
    """A kernel spinning in ``KernelWaitGpeTerminate`` for a ``KERNEL_TERMINATE`` that never comes."""


class KernelFlagItem:
    def __init__(self, flag: torch.Tensor, variant: str):
        self.flag_, self.numGroups_, self.persistent_, self.variant = flag, 1, False, variant

    def reset(self):
        self.flag_[:self.numGroups_].fill_(KERNEL_UNSET)

    def inUse(self) -> bool:
        if self.variant == "fix" and self.persistent_:
            return True
        return bool((self.flag_[:self.numGroups_] != KERNEL_UNSET).any())

    def onPop(self):
        # a host store into pinned memory (no graph node); the model's pool is device memory, so a
        # capture leaves it out instead of recording it (no replay reads the capture-time value)
        if not torch.cuda.is_current_stream_capturing():
            self.flag_.fill_(KERNEL_SCHEDULED)
        self.numGroups_ = 1

    def setPersistent(self):
        self.persistent_ = True

    def clearPersistent(self):
        self.persistent_ = False


class KernelFlagPool:
    """``PinnedHostPool<KernelFlagItem>``: a stack of free items and a list of in-use ones."""

    def __init__(self, device: str, variant: str):
        self.mem = torch.zeros(CAPACITY, CTRAN_ALGO_MAX_THREAD_BLOCKS, dtype=torch.int32, device=device)
        self.freeItems_ = [KernelFlagItem(self.mem[i], variant) for i in range(CAPACITY)]
        self.inuseItems_: list[KernelFlagItem] = []

    def pop(self) -> KernelFlagItem:
        item = self.freeItems_.pop()
        item.onPop()
        self.inuseItems_.append(item)
        return item

    def reclaim(self):
        for item in list(self.inuseItems_):
            if not item.inUse():
                self.inuseItems_.remove(item)
                item.reset()
                self.freeItems_.append(item)

    def size(self) -> int:
        return len(self.freeItems_)


class CtranGpeCmd:
    def __init__(self, kernelFlag, persistent):
        self.kernelFlag, self.persistent = kernelFlag, persistent

    def destroy(self):                       # ~CtranGpeCmd (fix), via cmdDestroy at graph destruction
        if self.persistent and self.kernelFlag is not None and self.kernelFlag.variant == "fix":
            self.kernelFlag.clearPersistent()
            self.kernelFlag.reset()


class CtranGpe:
    def __init__(self, device: str, variant: str):
        self.kernelFlagPool, self.variant = KernelFlagPool(device, variant), variant
        self.cmds: list[CtranGpeCmd] = []

    def submit(self, send: torch.Tensor, recvbuff: torch.Tensor, peer: torch.Tensor) -> torch.Tensor:
        """Submit a CTRAN collective: pop a flag item, launch the kernel, let the GPE thread run the op.
        Returns the kernel's output; the handshake of ``run_kernel`` completes it."""
        if self.kernelFlagPool.size() == 0:
            self.kernelFlagPool.reclaim()            # Reclaim once to gain back available flags
        kernelFlag = self.kernelFlagPool.pop()
        kernelFlag.numGroups_ = NUM_BLOCKS          # per-block flags (ALLREDUCE, SEND/RECV kernels)
        capturing = torch.cuda.is_current_stream_capturing()
        cmd = CtranGpeCmd(kernelFlag, persistent=capturing)
        if capturing:
            if self.variant == "fix":
                kernelFlag.setPersistent()           # reclaim() won't steal it between replays
            self.cmds.append(cmd)                    # owned by the graph (addHostNode's user object)
        return run_kernel(kernelFlag.flag_[:NUM_BLOCKS], send, recvbuff, peer)

    def start_side_stream(self, send, recvbuff, peer):
        """An eager collective on a side stream: submitted, kernel started, GPE op done and
        ``KERNEL_TERMINATE`` stored; its kernel has yet to observe it (``finish``)."""
        if self.kernelFlagPool.size() == 0:
            self.kernelFlagPool.reclaim()
        item = self.kernelFlagPool.pop()
        item.numGroups_ = NUM_BLOCKS
        flag = item.flag_[:NUM_BLOCKS]
        flag.fill_(KERNEL_STARTED)                   # KernelStartGpe
        recvbuff.copy_(send.flip(0) + peer)          # the GPE thread's op (cmd->coll.func)
        flag.fill_(KERNEL_TERMINATE)                 # setFlagPerGroup(KERNEL_TERMINATE)
        return flag, recvbuff

    @staticmethod
    def finish(flag, recvbuff):
        """The side-stream kernel's ``KernelWaitGpeTerminate``: it spins until it reads TERMINATE."""
        if not bool((flag == KERNEL_TERMINATE).all()):
            raise CtranHang(f"KernelWaitGpeTerminate spins: flag words {flag.tolist()}, never KERNEL_TERMINATE")
        flag.fill_(KERNEL_UNSET)
        return recvbuff.clone()


def run_kernel(flag, send, recvbuff, peer):
    """The GPE kernel and, between its two halves, the GPE thread's part (triggered by the captured
    host node at every replay): the handshake on ``flag`` that every run goes through."""
    flag.fill_(KERNEL_STARTED)                                        # KernelStartGpe
    recvbuff.copy_(send.flip(0) + peer)                               # GPE thread: cmd->coll.func
    flag.fill_(KERNEL_TERMINATE)                                      # GPE thread: setFlagPerGroup
    out = torch.where((flag == KERNEL_TERMINATE).all(), recvbuff, torch.zeros_like(recvbuff)) * 2.0
    flag.fill_(KERNEL_UNSET)                                          # KernelWaitGpeTerminate
    return out


def run(variant: str, device: str = "cpu"):
    gen = generator(1113)
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(3)]
    side = randn(ROWS, DIM, gen=gen, device=device)
    peer = randn(ROWS, DIM, gen=gen, device=device)

    def eager():
        gpe = CtranGpe(device, variant)
        recv, side_recv = torch.zeros(ROWS, DIM, device=device), torch.zeros(ROWS, DIM, device=device)
        outs = [gpe.submit(xs[0], recv, peer).clone()]
        pending = gpe.start_side_stream(side, side_recv, peer)
        outs.append(gpe.submit(xs[1], recv, peer).clone())
        outs.append(gpe.finish(*pending))
        outs.append(gpe.submit(xs[2], recv, peer).clone())
        return outs

    def served():
        gpe = CtranGpe(device, variant)
        side_recv = torch.zeros(ROWS, DIM, device=device)
        x_buf = xs[0].clone()
        g, out = capture(lambda: gpe.submit(x_buf, torch.empty_like(x_buf), peer), device=device,
                         name="allreduce", static={"sendbuff": x_buf}, owner="torchcomms CTRAN")
        outs = [replay(g, out).clone()]
        pending = gpe.start_side_stream(side, side_recv, peer)      # eager traffic between replays
        x_buf.copy_(xs[1])
        outs.append(replay(g, out).clone())
        outs.append(gpe.finish(*pending))
        x_buf.copy_(xs[2])
        outs.append(replay(g, out).clone())
        for cmd in gpe.cmds:
            cmd.destroy()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
