"""Quick all-reduce rotates its round colour on the host, so a captured all-reduce replays one colour forever and the waiting rank takes the previous replay's flag for this round's.

Upstream: https://github.com/vllm-project/vllm/pull/46913 ("[communication] [bugfix] fix quickreduce acc error
in cudagraph mode"); the same defect was fixed in AITER's copy, https://github.com/ROCm/aiter/pull/3928.
Symptom: with ROCm quick all-reduce (``VLLM_ROCM_QUICK_REDUCE_QUANTIZATION``, tensor parallel) and CUDA
graphs, the all-reduce result is silently wrong ("quickreduce acc error in cudagraph mode"): a rank reads the
previous round's data of its peer (June 2026).
Mechanism: ``DeviceComms::allreduce`` (``csrc/quickreduce/quick_reduce.h``) launches the two-shot kernel
with ``flag_color`` as a scalar kernel argument and afterwards rotates it on the host
(``flag_color += divceil(N, grid)``). The kernel writes its data into the peer's IPC comm buffer, then
publishes ``flag_color`` in the peer's flags buffer; the peer waits (``wait_sync_flag``, exact equality)
until its flag slot holds the colour of this round and only then reads the data. Under capture the argument
is baked into the graph and the host rotation runs once, at capture: every replay publishes and waits for
the same colour, and the flags buffer is never reset. From the second replay on, the waiter finds its slot
already holding that colour -- left there by the previous replay -- so its wait returns before the late peer
has written this round's data, and it sums the peer's data of the previous round.
Doctor: host-work-frozen, at ``allreduce`` (the host-side ``self.flag_color`` rotation and the scalar colour
handed to the kernel, run once at capture).
Fix (upstream): the colour moves to device memory (a per-block ``flag_color`` counter the kernel reads and
advances); the host rotation is removed ("Color rotation happens inside the kernel now").
(Read: the pre-fix ``quick_reduce.h``, the PR description and the review thread showing the removed host
rotation; the kernel-side counter is taken from the PR's summary and AITER's identical fix. Emulation: two
ranks in one process, rank 0's view of one round in which rank 1 is late. "Wait until the flag equals the
colour" is written as ``where(flag == colour, buffer_now, data_the_late_peer_will_write)``: a flag that
already matches lets rank 0 read the buffer at once, otherwise it spins until rank 1 writes its data.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/46913"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "allreduce"
SYMPTOM = "TP all-reduce under CUDA graphs sums the peer's previous-round data (silent accuracy loss)"

WORLD, TOKENS, HIDDEN, INTER = 2, 4, 8, 6       # TP-2, a decode batch of 4 tokens
STEPS = 5


class DeviceComms:
    """``quickreduce::DeviceComms``: the IPC comm buffers (peer data) and flags buffer of the two ranks."""

    def __init__(self, device, variant):
        self.variant = variant
        self.data = torch.zeros(WORLD, TOKENS, HIDDEN, device=device)     # dbuffer: data area
        self.flags = torch.zeros(WORLD, dtype=torch.long, device=device)  # dbuffer: flags area (memset 0)
        self.flag_color = 1                                               # host colour (bug)
        self.d_flag_color = torch.ones(1, dtype=torch.long, device=device)  # device colour (fix)

    def _two_shot_kernel(self, partials, color):
        """``allreduce_prototype_twoshot`` seen from rank 0, with rank 1 late this round.

        Rank 0 waits for rank 1's flag to equal ``color``; a slot that already holds it is taken as
        "rank 1 has written", so rank 0 reads rank 1's comm data as it is now. Otherwise rank 0 spins
        until rank 1 writes, i.e. it reads rank 1's data of this round. Then rank 1 writes data + flag."""
        peer_ready = (self.flags[1:2] == color).view(1, 1, 1)
        peer = torch.where(peer_ready, self.data[1], partials[1])
        self.data[1].copy_(partials[1])          # rank 1: data into the IPC buffer...
        self.flags[1:2].copy_(color)             # ...then publish this round's colour
        return partials[0] + peer

    def allreduce(self, partials):
        if self.variant == "bug":
            color = torch.full((1,), self.flag_color, dtype=torch.long, device=partials.device)
            out = self._two_shot_kernel(partials, color)
            # Rotate the flag color (host side, after the launch).
            self.flag_color += 1
            return out
        # Fix: the colour lives in device memory and the kernel advances it.
        out = self._two_shot_kernel(partials, self.d_flag_color)
        self.d_flag_color.add_(1)
        return out


class RowParallelMLP:
    """A TP-2 MLP: each rank holds a column slice of ``up`` and the matching row slice of ``down``."""

    def __init__(self, device):
        gen = generator(46913)
        self.up = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(WORLD)]
        self.down = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(WORLD)]

    def forward(self, comms, hidden):
        partials = torch.stack([F.silu(hidden @ self.up[r]) @ self.down[r] for r in range(WORLD)])
        return hidden + comms.allreduce(partials)


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.graphed = model, graphed
        self.comms = DeviceComms(device, variant)
        self.hidden = torch.zeros(TOKENS, HIDDEN, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: model.forward(self.comms, self.hidden), device=device,
                owner="GPUModelRunner (FULL decode graph, quick all-reduce)",
                static={"hidden": self.hidden},
                state={"quickreduce_data": self.comms.data, "quickreduce_flags": self.comms.flags,
                       "quickreduce_flag_color": self.comms.d_flag_color})

    def execute_model(self, hidden):
        if not self.graphed:
            return self.model.forward(self.comms, hidden).clone()
        self.hidden.copy_(hidden)
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = RowParallelMLP(device)
    gen = generator(4691300)
    inputs = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        return [runner.execute_model(x) for x in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
