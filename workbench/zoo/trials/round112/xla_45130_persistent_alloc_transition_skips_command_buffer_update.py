"""XLA:GPU command buffers with a profiled persistent-allocation policy: the command buffer is recorded while
``persistent_alloc_indices`` is still absent (profiling), and when the policy becomes present the temp allocation moves
to its VMM reservation address, but the thunk now checks only non-persistent allocations for address changes, so the
command buffer is never updated and keeps launching against the temp buffer that was released at the transition.

Upstream: https://github.com/openxla/xla/pull/45130 ("[XLA:GPU] Trigger command buffers update when persistent
allocations set changed.", openxla/xla, by shawnwang18, opened 2026-07-01; closed through the Copybara flow, merge
commit not seen here).
Read: the PR description only (summary of changes: "Track only whether persistent-allocation information was valid
when each executor's command buffer was recorded", "Force a full command-buffer update in
``CommandBufferThunk::Initialize`` when persistent allocation information first becomes valid", "In ``ExecuteOnStream``,
recover from a recorded/current information-validity mismatch by fully updating the command buffer"), and the
descriptions of the PRs it builds on and that build on it: #44296 (``AllocationAddressInfo``: once ready,
``persistent_alloc_indices`` is the source of truth and ``CommandBufferThunk`` limits address-change checks to dynamic
allocations), #44290, #45062 (``SKIP_TEMP``: temp buffers get stable VMM reservation addresses), #45483 / #45568
(``SKIP_PROFILED``: the first executions pass ``std::nullopt``, then a single absent-to-present transition; temp
buffers are then allocated with ``return_reservation_address=true``) and #46343 (later replaced the transition by
falling back to the thunk sequence until the policy is ready). The diff itself could not be read here (the XLA
snapshot was too large to bring in), so the code below follows the descriptions, not the C++.
Symptom: with a profiled command-buffer update mode, the first execution after the profiling window replays a command
buffer whose recorded addresses predate the VMM remapping: it reads and writes a temp buffer the executable no longer
owns (an illegal address once that memory is unmapped or reused), and the step's results are wrong.
Mechanism: during profiling ``persistent_alloc_indices`` is absent, so ``ExecuteOnStream`` compares every allocation
address with the recorded one and the command buffer is recorded against the temp buffer's physical address. At the
transition the allocator releases that temp buffer and hands out the reservation-backed one, and the temp index is now
listed as persistent. ``ExecuteOnStream`` checks only the dynamic (non-persistent) allocations, none of which moved, so
it skips the update and submits the command buffer recorded with the released temp buffer.
Doctor: dangling-reference, at ExecuteOnStream. The executed command buffer still holds the address of the temp
allocation the executable released at the policy transition; the skipped update in ``ExecuteOnStream`` is what leaves
it there.
Fix (upstream): remember whether persistent-allocation information was valid when the command buffer was recorded;
on a recorded/current mismatch (``Initialize`` and ``ExecuteOnStream``) do a full command-buffer update.
Modelled: ``GpuExecutableBufferAllocator`` (profiling window of three executions with ``persistent_alloc_indices``
None, then the temp allocation remapped to a fresh reservation-backed buffer and the old one released),
``CommandBufferThunk.Initialize`` / ``ExecuteOnStream`` with per-executor state (command buffer, recorded allocation
addresses, and in the fix the recorded validity flag; recorded commands resolve their allocation slices in the
execution's ``BufferAllocations`` at record time), record = capture, update = re-record (a CUDA graph's pointers
cannot be patched from torch). Stand-ins: the fused computation (two GEMMs with a ReLU through the temp buffer), the
parameter and output allocations are the caller's stable buffers; float64.
Workload: five executions with new parameters each (three profiling, the transition, one more). Bug: the fourth
execution's replay raises IllegalMemoryAccess (the command buffer reads the released temp buffer; on a GPU the
replay faults or reads reused memory). Fix: the five outputs equal eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/openxla/xla/pull/45130"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "ExecuteOnStream"
SYMPTOM = ("after the profiling window the temp allocation moves to its persistent VMM address, but the command "
           "buffer update is skipped because persistent allocations are no longer checked, so it replays against "
           "the released temp buffer")

ROWS, HIDDEN, INTER = 8, 16, 64
PROFILE_STEPS_LIMIT = 3
PARAM, TEMP, OUTPUT = 0, 1, 2          # buffer allocation indices
DTYPE = torch.float64

_variant = "bug"


class BufferAllocations:
    """The execution's allocation table: index -> device buffer (its address)."""

    def __init__(self, buffers):
        self.buffers = list(buffers)

    def GetDeviceAddress(self, index):
        return self.buffers[index]


class GpuExecutableBufferAllocator:
    """SKIP_PROFILED-like policy: profile addresses for a few executions, then remap the stable temp allocation."""

    def __init__(self, device, param, output, temp_elems):
        self.device, self.param, self.output = device, param, output
        self.temp_elems = temp_elems
        self.temp = torch.empty(temp_elems, dtype=DTYPE, device=device)     # physical temp buffer
        self.num_executions = 0
        self.persistent_alloc_indices = None                                # absent while profiling

    def Allocate(self):
        self.num_executions += 1
        if self.num_executions == PROFILE_STEPS_LIMIT + 1:                  # profile done: temp address was stable
            self.temp = None                                                # physical temp buffer released
            release_to_driver(self.device)
            # Allocate(return_reservation_address=true): reservation-backed temp buffer
            self.temp = torch.empty(self.temp_elems, dtype=DTYPE, device=self.device)
            self.persistent_alloc_indices = (TEMP,)
        return self.Current(), self.persistent_alloc_indices

    def Current(self):
        return BufferAllocations([self.param, self.temp, self.output])


class CommandBufferThunk:
    def __init__(self, commands, device, buffer_allocator):
        self.commands, self.device = commands, device
        self.buffer_allocator = buffer_allocator    # where each execution's BufferAllocations come from
        self.state = {}                 # per executor: command buffer, recorded addresses, recorded info validity

    def _record(self, allocs, persistent_alloc_indices):
        def commands():                 # recorded commands resolve their allocation slices at record time
            return self.commands(self.buffer_allocator.Current().buffers)

        graph, out = capture(commands, device=self.device, warmups=0, name="xla command buffer",
                             owner="CommandBufferThunk",
                             static={"param": allocs.GetDeviceAddress(PARAM)},
                             state={"output": allocs.GetDeviceAddress(OUTPUT)})
        self.state = {"command_buffer": graph, "out": out,
                      "recorded_allocs": [id(b) for b in allocs.buffers],
                      "recorded_with_persistent_info": persistent_alloc_indices is not None}

    def Initialize(self, allocs, persistent_alloc_indices):
        if not self.state:
            self._record(allocs, persistent_alloc_indices)
        elif _variant == "fix" and (persistent_alloc_indices is not None) != self.state["recorded_with_persistent_info"]:
            self._record(allocs, persistent_alloc_indices)                  # full update on first valid policy

    def ExecuteOnStream(self, allocs, persistent_alloc_indices):
        st = self.state
        if _variant == "fix" and (persistent_alloc_indices is not None) != st["recorded_with_persistent_info"]:
            self._record(allocs, persistent_alloc_indices)                  # recorded/current validity mismatch
            st = self.state
        else:
            persistent = set(persistent_alloc_indices or ())
            changed = [i for i, b in enumerate(allocs.buffers)
                       if i not in persistent and id(b) != st["recorded_allocs"][i]]
            if changed:                                                     # update only for moved dynamic allocs
                self._record(allocs, persistent_alloc_indices)
                st = self.state
        return replay(st["command_buffer"], st["out"])


def make_commands(w1, w2):
    def commands(buffers):
        param, temp, output = buffers
        h = temp[: ROWS * INTER].view(ROWS, INTER)
        torch.matmul(param, w1, out=h)                                      # fusion 1 writes the temp buffer
        h.relu_()
        torch.matmul(h, w2, out=output)                                     # fusion 2 reads it
        return output
    return commands


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(45130)
    w1 = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.3).to(DTYPE)
    w2 = randn(INTER, HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE)
    inputs = [randn(ROWS, HIDDEN, gen=gen, device=device).to(DTYPE) for _ in range(PROFILE_STEPS_LIMIT + 2)]
    commands = make_commands(w1, w2)
    temp_elems = max(ROWS * INTER, own_segment_elems(device))

    def execute(use_command_buffer):
        param = torch.zeros(ROWS, HIDDEN, dtype=DTYPE, device=device)      # caller's stable argument buffer
        output = torch.zeros(ROWS, HIDDEN, dtype=DTYPE, device=device)
        allocator = GpuExecutableBufferAllocator(device, param, output, temp_elems)
        thunk = CommandBufferThunk(commands, device, allocator)
        results = []
        for x in inputs:
            param.copy_(x)
            allocs, persistent = allocator.Allocate()
            if use_command_buffer:
                thunk.Initialize(allocs, persistent)
                out = thunk.ExecuteOnStream(allocs, persistent)
            else:                                                           # command buffers disabled: thunks run
                out = commands(allocs.buffers)
            results.append(out.clone())
            del allocs, out
        return results

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: execute(True), lambda: execute(False))
