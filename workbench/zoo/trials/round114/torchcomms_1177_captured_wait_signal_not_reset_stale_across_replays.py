"""torchcomms / ctran RMA windows under CUDA graphs: the captured ``cuStreamWaitValue64`` on a window's signal slot (wait until the slot is >= the compare value) keeps the compare value it got at capture, and the peer's captured put writes the same signal value every replay; nothing resets the slot, so from the second replay on the wait finds the previous replay's value already there and passes before the peer's data has landed.

Upstream: https://github.com/meta-pytorch/torchcomms/pull/1177 ("reset window signal during replay",
meta-pytorch/torchcomms, by Dylan Maloy (dolpm), opened 2026-03-20, landed from Phabricator D97118960 on 2026-03-20
as commit cf765ca78 "reset window signal during replay (#1177)"). Read: the commit message and its diff of
``comms/ctran/algos/RMA/PutSignal.cc`` (``waitSignalDriverApi``: during capture, a ``cuStreamBatchMemOp`` of
``WAIT_VALUE_64`` (GEQ ``cmpVal``) then ``WRITE_VALUE_64`` (0) on the signal slot; ``cuStreamWaitValue64`` alone outside
capture), ``comms/ctran/utils/CudaWrap.cc`` (``canUseCuStreamBatchMemOp`` / ``canUse64BitStreamMemOps``) and the new test
``CtranWinDistTest.signalResetAcrossGraphReplays`` (each rank captures ``ctranPutSignal`` to its next peer on a put
stream and ``ctranWaitSignal`` on its previous peer on a wait stream, then replays 5 times checking the received chunk);
at the parent commit: ``ctranPutSignal`` (``signalVal = win->ctranNextSignalVal(peer)``, the NVL path copies the data
with ``cudaMemcpyAsync`` then stores ``signalVal`` into the peer's slot ``remWinInfo[peer].signalAddr + rank``),
``waitSignalDriverApi`` (``signalAddr = win->winSignalPtr + peer``, ``cmpVal = win->ctranNextWaitSignalVal(peer)``)
and ``CtranWin::ctranNextWaitSignalVal`` / ``ctranNextSignalVal`` (host ``fetch_add(1)`` counters per peer) in
``comms/ctran/window/CtranWin.h``.
Symptom: a CUDA graph that captured a put-with-signal and the matching wait-signal returns the right chunk on its first
replay and stale data (what the previous replay delivered, or whatever the window held) on later replays: the
consumer runs before the peer's put arrives. Eager calls are correct.
Mechanism: eagerly, every call takes fresh host counter values (put writes 1, 2, 3, ...; wait waits for >= 1, 2, 3,
...), so the monotonically growing slot never satisfies a wait early. Capture runs each host ``fetch_add`` once: the put
node stores the same ``signalVal`` and the wait node compares against the same ``cmpVal`` on every replay. After replay
1 the slot holds ``cmpVal``; on replay 2 the wait is already satisfied when it is reached, so the wait stream reads the
window while the peer's put of this replay is still in flight.
Doctor: stale-input, at waitSignalDriverApi. The captured wait reads the signal slot, which this replay has not yet
written: the value it passes on is the one the previous replay's put left there, because the wait never resets it.
Fix (upstream): while capturing, batch the wait with a write of 0 to the slot (``cuStreamBatchMemOp``), so every replay
starts from a clean slot; the eager path keeps the plain ``cuStreamWaitValue64``.
Modelled: ``ctranPutSignal`` (the intra-node NVL path: data copy into the peer's window at ``targetDisp``, then the
signal store of ``ctranNextSignalVal``), ``waitSignalDriverApi`` as read before and after the fix (the capture-status
branch, the batched wait + reset), ``CtranWin`` (data window, signal slots per peer, the two host counters starting at
1), and the test's ring: each rank puts its chunk to ``rank + 1`` and waits on ``rank - 1``. Stand-ins: the two ranks
live in one process and one graph; the asynchrony of the put is modelled by a ``Transport`` that holds each put in
flight until a stream waits on its slot with the wait not yet satisfied (the waiting stream then sees it land) or the
step ends (it lands anyway, after the consumer); the hardware wait is these tensor ops. The consumer of the received
chunk is a float64 projection (``chunk @ weight``); chunks are float64 rather than int32.
Workload: 2 ranks, chunks of 6, 4 steps; each step copies fresh chunks into the static put buffers, then replays one
graph (put to next peer, wait on previous peer, project the received chunk); eager runs the same calls without graphs.
Bug: step 1 equals eager; steps 2-4 return exactly eager's result of the previous step (the wait passed on the stale
slot value 1 and projected the chunk the previous replay delivered): errors 0, 9.13, 14.1, 8.31, max |graph - eager| =
14.1. Fix: equals eager (max 0).
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/meta-pytorch/torchcomms/pull/1177"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "waitSignalDriverApi"
SYMPTOM = ("a CUDA graph with a captured put-signal and wait-signal returns stale window data from its second replay "
           "on: the wait's slot still holds the previous replay's signal value, so the wait passes before the put lands")

N_RANKS, COUNT, OUT, N_STEPS = 2, 6, 4, 4
DTYPE = torch.float64

_variant = "bug"


# --- the in-flight put (stand-in for NVLink / the copy engine: a put is not visible to the peer at once) -----------

class Transport:
    """Puts in flight, one per (peer, slot): (destination view, staged data, signal slot, signal value, pending)."""

    def __init__(self):
        self.inflight = []

    def issue(self, dst, data, slot, value, pending):
        pending.fill_(1)
        self.inflight.append((dst, data, slot, value, pending))

    def land(self, slot, mask):
        """The puts into ``slot`` still pending land where ``mask`` holds (a stream blocked on the slot sees them)."""
        for dst, data, s, value, pending in self.inflight:
            if s.data_ptr() != slot.data_ptr():
                continue
            m = mask & pending.bool()
            dst.copy_(torch.where(m, data, dst))                  # data first (the copy is ordered before the signal)
            s.copy_(torch.where(m, torch.full_like(s, value), s))
            pending.copy_(torch.where(m, torch.zeros_like(pending), pending))

    def drain(self):
        """End of the step: every put still in flight lands (after whatever already ran on the waiting side)."""
        for _, _, slot, _, pending in self.inflight:
            self.land(slot, torch.ones_like(pending, dtype=torch.bool))
        self.inflight.clear()


# --- comms/ctran/window/CtranWin.h ----------------------------------------------------------------------------------

class CtranWin:
    def __init__(self, rank, device):
        self.rank = rank
        self.winBase = torch.zeros(N_RANKS * COUNT, dtype=DTYPE, device=device)      # data window
        self.winSignalPtr = torch.zeros(N_RANKS, dtype=torch.int64, device=device)   # one uint64 slot per peer
        self.waitSignalVal = [1] * N_RANKS                                           # host counters
        self.signalVal = [1] * N_RANKS
        self.pending = torch.zeros(N_RANKS, dtype=torch.int64, device=device)        # transport bookkeeping
        self.remWinInfo = {}

    def ctranNextWaitSignalVal(self, peer):
        v = self.waitSignalVal[peer]
        self.waitSignalVal[peer] += 1                                                # fetch_add(1)
        return v

    def ctranNextSignalVal(self, peer):
        v = self.signalVal[peer]
        self.signalVal[peer] += 1
        return v


def exchange(wins):
    for w in wins:
        w.remWinInfo = {p.rank: dict(dataAddr=p.winBase, signalAddr=p.winSignalPtr, pending=p.pending)
                        for p in wins if p is not w}


# --- comms/ctran/algos/RMA/PutSignal.cc --------------------------------------------------------------------------------

def ctranPutSignal(originBuff, count, peer, targetDisp, win: CtranWin, transport: Transport, signal=True):
    signalVal = win.ctranNextSignalVal(peer) if signal else 0
    remote = win.remWinInfo[peer]
    dstPtr = remote["dataAddr"][targetDisp:targetDisp + count]
    signalAddr = remote["signalAddr"][win.rank:win.rank + 1]            # remWinInfo[peer].signalAddr + rank
    # NVL path: cudaMemcpyAsync(dstPtr, originBuff) then the kernel's atomic store of signalVal; both in flight
    transport.issue(dstPtr, originBuff, signalAddr, signalVal, remote["pending"][win.rank:win.rank + 1])


def cuStreamWaitValue64(signalAddr, cmpVal, transport: Transport):
    """CU_STREAM_WAIT_VALUE_GEQ: the stream proceeds at once if the slot already holds >= cmpVal; otherwise it
    blocks until the peer's put lands."""
    transport.land(signalAddr, signalAddr < cmpVal)


def waitSignalDriverApi(peer, win: CtranWin, transport: Transport):
    signalAddr = win.winSignalPtr[peer:peer + 1]
    cmpVal = win.ctranNextWaitSignalVal(peer)
    if _variant == "bug":
        cuStreamWaitValue64(signalAddr, cmpVal, transport)
        return
    if is_capturing():
        # cuStreamBatchMemOp: WAIT_VALUE_64 (GEQ cmpVal), then WRITE_VALUE_64 (0) to prepare the slot for the next replay
        cuStreamWaitValue64(signalAddr, cmpVal, transport)
        signalAddr.zero_()
    else:
        cuStreamWaitValue64(signalAddr, cmpVal, transport)


def ctranWaitSignal(peer, win, transport):
    waitSignalDriverApi(peer, win, transport)


# --- the test's ring, one step -------------------------------------------------------------------------------------

def make_step(wins, putBufs, weight, transport):
    def step():
        for rank, win in enumerate(wins):                    # put stream: chunk to the next peer
            nextPeer = (rank + 1) % N_RANKS
            ctranPutSignal(putBufs[rank], COUNT, nextPeer, COUNT * rank, win, transport)
        outs = []
        for rank, win in enumerate(wins):                    # wait stream: previous peer's chunk, then consume it
            prevPeer = (rank + N_RANKS - 1) % N_RANKS
            ctranWaitSignal(prevPeer, win, transport)
            recv = win.winBase[COUNT * prevPeer:COUNT * (prevPeer + 1)]
            outs.append(recv @ weight)
        transport.drain()
        return torch.stack(outs)
    return step


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1177)
    weight = randn(COUNT, OUT, gen=gen, device=device).to(DTYPE)
    chunks = [[randn(COUNT, gen=gen, device=device, scale=2.0).to(DTYPE) for _ in range(N_RANKS)]
              for _ in range(N_STEPS)]

    def setup():
        wins = [CtranWin(r, device) for r in range(N_RANKS)]
        exchange(wins)
        putBufs = [torch.zeros(COUNT, dtype=DTYPE, device=device) for _ in range(N_RANKS)]
        return wins, putBufs, Transport()

    def eager():
        wins, putBufs, transport = setup()
        step = make_step(wins, putBufs, weight, transport)
        outs = []
        for s in range(N_STEPS):
            for r in range(N_RANKS):
                putBufs[r].copy_(chunks[s][r])
            outs.append(step().clone())
        return outs

    def served():
        wins, putBufs, transport = setup()
        step = make_step(wins, putBufs, weight, transport)
        static = {f"putBuf[{r}]": b for r, b in enumerate(putBufs)}
        state = {}
        for w in wins:
            state[f"win[{w.rank}].winBase"] = w.winBase
            state[f"win[{w.rank}].winSignalPtr"] = w.winSignalPtr
            state[f"win[{w.rank}].pending"] = w.pending
        g = out = None
        outs = []
        for s in range(N_STEPS):
            for r in range(N_RANKS):
                putBufs[r].copy_(chunks[s][r])
            if g is None:                                    # the test captures without a warm-up run
                g, out = capture(step, device=device, warmups=0, static=static, state=state,
                                 owner="CtranWinDistTest", name="put+wait ring")
            outs.append(replay(g, out).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
