"""The GPE thread tears down a captured TCP-DM receive's unpack pool after the first replay; later replays use released pages.

Upstream: https://github.com/meta-pytorch/torchcomms/pull/2884 ("ctran/tcpdm: keep TCPDM unpack pools alive
for CUDA graphs", commit 7ddc68a650b6, D108339330).
Symptom: "Returning the pool during the first replay lets it be reused or reset while the captured graph still
references it": CUDA-graph replays of TCP-DM receives after the first one unpack from memory the transport has
taken back (wrong data or illegal accesses); TCP-DM PAFT runs had CUDA graph scopes disabled as a workaround.
Mechanism: for a TCP-DM receive, ``prepareUnpackConsumer()`` takes an unpack pool (bounce pages and the
unpack queues) from the transport; the pool goes through ``kernelConfig.unpackPool`` into the GPE kernel's
arguments and into ``cmd->unpackPool``. Captured, the kernel node keeps those addresses and the command is
persistent: its host node (``cmdCb``) enqueues the same command to the GPE thread at every replay. In
``gpeThreadFn()``, after the kernel's handshake, ``if (cmd->unpackPool != nullptr)
teardownUnpackConsumer(cmd->unpackPool)`` returns the pool: right for an eager command, which runs once,
but for the persistent one it runs at the first replay. The transport then resets the pool (here: its pages
go back, to be re-armed by the next ``prepareUnpackConsumer``), and every later replay receives into and
unpacks from pages nobody owns any more. (Host nodes do not run in the CPU emulation: the runner calls
``host_node`` after each replay, as CUDA runs the captured node at each replay.)
Doctor: dangling-reference, at ``gpeThreadFn`` (the per-kernel teardown returns a pool that the persistent
command's graph still references).
Fix (upstream): ``gpeThreadFn`` tears down only ``if (cmd->unpackPool != nullptr && !cmd->persistent)``;
while capturing, ``submit()`` wraps ``cmd->postKernelCleanup`` in a lambda that calls
``teardownUnpackConsumer(unpackPool)`` at graph destruction; ``needsKernelFlag`` also ORs in
``kernelConfig.unpackPool != nullptr`` so such a command always takes the GPE-command path.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/meta-pytorch/torchcomms/pull/2884"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "gpeThreadFn"
SYMPTOM = "replays after the first receive into and unpack from a TCP-DM unpack pool the transport took back"

ROWS, DIM, NUM_POOLS = 4, 3, 2


class UnpackPool:
    """One unpack pool of the transport: its bounce pages (the NIC receives into them)."""

    def __init__(self, device: str):
        self.device = device
        self.pages: torch.Tensor | None = None

    def arm(self):
        self.pages = torch.zeros(max(own_segment_elems(self.device), ROWS * DIM), device=self.device)


class CtranTcpDm:
    """The TCP-DM transport: hands unpack pools out and takes them back, round robin."""

    def __init__(self, device: str):
        self.device = device
        self.free = [UnpackPool(device) for _ in range(NUM_POOLS)]
        for pool in self.free:
            pool.arm()

    def prepareUnpackConsumer(self) -> UnpackPool:
        pool = self.free.pop(0)
        if pool.pages is None:
            pool.arm()
        return pool

    def teardownUnpackConsumer(self, pool: UnpackPool):
        pool.pages = None                   # reset: the pages go back until the pool is re-armed
        release_to_driver(self.device)
        self.free.append(pool)


class CtranGpeCmd:
    def __init__(self, unpackPool, persistent):
        self.unpackPool, self.persistent, self.postKernelCleanup = unpackPool, persistent, None


class CtranGpe:
    def __init__(self, device: str, variant: str):
        self.mapper, self.variant = CtranTcpDm(device), variant
        self.graph_cmds: list[CtranGpeCmd] = []

    def submit(self, wire: torch.Tensor) -> tuple[torch.Tensor, CtranGpeCmd]:
        """``ctranRecv`` with the TCP-DM backend: prepare the unpack consumer, build the command, launch."""
        unpackPool = self.mapper.prepareUnpackConsumer()             # kernelConfig.unpackPool
        capturing = torch.cuda.is_current_stream_capturing()
        cmd = CtranGpeCmd(unpackPool, persistent=capturing)      # opGroup holds the RECV: GPE-command path
        if capturing:
            if self.variant == "fix":
                cmd.postKernelCleanup = lambda: self.mapper.teardownUnpackConsumer(unpackPool)
            self.graph_cmds.append(cmd)                              # addHostNode(cmdCb, cmdDestroy)
        return recv_unpack_kernel(unpackPool, wire), cmd

    def gpeThreadFn(self, cmd: CtranGpeCmd):
        """The GPE thread's handling of one command, after the kernel's handshake."""
        # ... run cmd->coll.func, setFlagPerGroup(KERNEL_TERMINATE) ...
        if cmd.unpackPool is not None and (self.variant == "bug" or not cmd.persistent):
            self.mapper.teardownUnpackConsumer(cmd.unpackPool)

    def host_node(self):
        """``cmdCb``, captured as a host node: at each replay it enqueues the persistent commands."""
        for cmd in self.graph_cmds:
            self.gpeThreadFn(cmd)

    def destroy_graph(self):
        """``cmdDestroy``: the graph's user object releases its commands."""
        for cmd in self.graph_cmds:
            if cmd.postKernelCleanup is not None:
                cmd.postKernelCleanup()
        self.graph_cmds.clear()


def recv_unpack_kernel(pool: UnpackPool, wire: torch.Tensor) -> torch.Tensor:
    """RECV_UNPACK: the payload lands in the pool's bounce pages (the transport's receive, driven by the
    GPE thread at each run), then the kernel unpacks it from the pages into the receive buffer."""
    pages = pool.pages[:ROWS * DIM].view(ROWS, DIM)
    pages.copy_(wire)                                   # irecvConnected: packets into bounce pages
    return pages.flip(0) * 0.5 + 1.0                    # unpack: pages -> recvbuff, in queue order


def run(variant: str, device: str = "cpu"):
    gen = generator(2884)
    payloads = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(4)]
    eager_traffic = randn(ROWS, DIM, gen=gen, device=device)

    def eager():
        gpe = CtranGpe(device, variant)
        outs = []
        for x in payloads:
            out, cmd = gpe.submit(x)
            outs.append(out.clone())
            gpe.gpeThreadFn(cmd)
            gpe.gpeThreadFn(gpe.submit(eager_traffic)[1])       # an eager TCP-DM receive
        return outs

    def served():
        gpe = CtranGpe(device, variant)
        wire = payloads[0].clone()

        def recv():
            out, cmd = gpe.submit(wire)
            if not cmd.persistent:                              # the warmup is an eager command
                gpe.gpeThreadFn(cmd)
            return out

        g, out = capture(recv, device=device, name="recv",
                         static={"wire": wire}, owner="torchcomms CTRAN")
        outs = []
        for x in payloads:
            wire.copy_(x)
            outs.append(replay(g, out).clone())
            gpe.host_node()
            gpe.gpeThreadFn(gpe.submit(eager_traffic)[1])       # an eager TCP-DM receive
        gpe.destroy_graph()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
