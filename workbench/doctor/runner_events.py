"""What the runners announce (``workbench.engine.events``): the meaning of their tensors, the pools
they make and give captures (and the graphs reset, whose memory goes back to them), warmups, dummy
runs, the workload's reference run, each served step and the outputs handed out; and the check
before a CUDA launch, which runs the eager form a served step announced. The ``Doctor`` takes these
handlers from this class; the engine's other events and the dispatch mode's work are in ``intake.py``."""
from __future__ import annotations

import torch

from ..engine.opinfo import storage_key
from ..engine.source import user_frame
from . import raised
from .failures import contained
from .probes import differential, padding as padding_probe
from .probes.compare import verdict
from .probes.reference import Reference
from .records import Pending, announced
from .rules import dangling, mutation, overwritten, undersized
from .rules.pool import block
from . import tensors


class RunnerEvents:
    """The runner events' handlers of ``intake.Doctor`` (whose state they read and write)."""

    def _announce(self, owner: str, buffers: dict, role: str) -> None:
        source = user_frame()
        for name, t in buffers.items():
            key = storage_key(t)
            # (another window of one allocation, sharing no byte with the old one, is another buffer)
            if (old := self.buffer(key)) is not None and role == old.role == "input" and name != old.name \
                    and tensors.overlap(tensors.span(old.ref()), tensors.span(t)):
                dangling.handed_on(self, key, old, name, owner, source)
            if old is not None and (name, role) == (old.name, old.role) == (old.name, "input") \
                    and _within(t, old.ref()):
                continue            # (a graph's slice of an input announced whole: one per capture size)
            self.buffers[key] = announced(name, owner, t, role, source)
        undersized.announced(self, owner, buffers)

    @contained
    def pool_made(self, pool) -> None:
        self.pools[dangling.pool_key(pool)] = (user_frame(), [])

    @contained
    def pool_used(self, graph, pool) -> None:
        info = self.info(graph)
        if info is not None and (made := self.pools.get(dangling.pool_key(pool))) is not None:
            made[1].append(info.name)

    @contained
    def graph_reset(self, graph) -> None:
        """Its memory goes back to the pool: a graph that reads it is named here (``dangling``)."""
        if (info := self.info(graph)) is not None:
            info.let_go("reset")

    @contained
    def capture_refused(self, graph, pool, name: str | None, error: BaseException) -> None:
        dangling.refused(self, pool, name or f"graph #{len(self.graphs) + 1}", error)

    @contained
    def static_buffers(self, owner: str, buffers: dict) -> None:
        self._announce(owner, buffers, "input")

    @contained
    def persistent_state(self, owner: str, buffers: dict) -> None:
        self._announce(owner, buffers, "state")
        mutation.state_announced(self, buffers)

    @contained
    def shared_outputs(self, owner: str, buffers: dict) -> None:
        self._announce(owner, buffers, "output")

    @contained
    def written_metadata(self, owner: str, buffers: dict) -> None:
        self._announce(owner, buffers, "metadata")

    @contained
    def reference_begin(self) -> None:
        """Recorded under ``diagnose`` (whose tracer numbers the calls), with differential replay on,
        before any capture, and not again in its padded-row runs."""
        if self.every and self.pattern is None and not self.graphs and raised.tracing():
            self.reference = Reference()

    @contained
    def reference_end(self) -> None:
        if self.reference is not None:
            self.reference.recording = False

    def results_agree(self) -> bool:
        """Whether the workload said its results equal its run without graphs' (``results``) and
        nothing it ran raised: what a hazard the doctor holds could change reached none of them."""
        return self.reference is not None and self.reference.verdict == () and not self.report.errors

    @contained
    def results(self, reference: list, served: list) -> None:
        if self.reference is not None and not self.reference.recording:
            self.reference.results(reference, served)
        elif self.pattern is not None and self.plan is not None:    # a padded-row run: did its fill give them
            self.plan.agrees = verdict(reference, served)[0] == ()

    @contained
    def warmup_begin(self, real: bool = False) -> None:
        self.threads.enter(self.mode)
        self.warm.warmup_begin()
        self.phase, self.real_warmup, self.trained = "warmup", real, False
        self.report.warmups += 1

    @contained
    def dummy_run_begin(self) -> None:
        self.dummy_run = True

    @contained
    def dummy_run_end(self) -> None:
        self.dummy_run = False
        mutation.warmup_wrote_state(self)
        self.startup.warmup_end()

    @contained
    def warmup_end(self) -> None:
        """A warmup that ran a backward pass, or an optimizer step (an update of a tensor that holds a
        gradient, however the gradient got there), was a training step (PyTorch's whole-network
        capture warms up with real optimizer steps): its writes are real data, as
        ``warmup(real=True)``'s."""
        self.threads.leave(self.mode)
        self.phase = "eager"
        self.warm.warmup_end()
        if self.trained:
            self.warm_saved = {}
            self.startup.trained()
        elif not self.real_warmup:
            mutation.warmup_wrote_state(self)
        self.startup.warmup_end()

    @contained
    def serve(self, graph, real: int, size: int, padded: dict, outputs, eager=None, padded_columns=None,
              pieces=(), unpadded=None) -> None:
        if self.capturing is not None:
            return              # a step served inside a capture: its replay is refused (``replay_begin``)
        info = self.info(graph)
        columns = padded_columns or {}
        undersized.serve_contract(self, info.name if info else "a graph", real, size, padded, columns)
        undersized.served_data(self, info, real)
        for name, t in padded.items():
            self._padded(name, t)
        for name, (t, _) in columns.items():
            self._padded(name, t)
        if (padded and real < size) or (columns and any(w < c.shape[1] for c, w in columns.values())):
            self.padded_steps += 1
            if self.pattern is not None and real <= size:
                padding_probe.fill(self, padded, columns, real, size)
        if self.plan is not None and self.plan.inputs is not None and info is not None and real < size:
            padding_probe.fill_inputs(self, info, real, size)
        padding_probe.served(self, real, size, padded, columns)
        self.served += 1
        self.no_eager += eager is None
        sampled = eager is not None and self.every > 0 and (self.served - 1) % self.every == 0
        if info is not None:
            info.size = size
            span = tuple(i for g in pieces if (i := self.info(g)) is not None)
            info.pending = Pending(real, size, outputs, padded, eager, columns, sampled, grad=torch.is_grad_enabled(),
                                   span=span if len(span) == len(pieces) else (), unpadded=unpadded)
            if sampled and info.pending.span:       # the state before the whole step, eager regions included
                differential.begin(self, info)

    def _padded(self, name: str, t) -> None:
        if isinstance(t, torch.Tensor) and (key := storage_key(t)) not in self.buffers:
            self.buffers[key] = announced(name, "serve", t, "padded")

    def launching(self, graph) -> None:
        """(``events.launching``, CUDA) A sampled step whose eager form indexes out of range raises the
        CPU's error instead of launching (``differential.before_launch``): the same failure as on the
        CPU, where the rules explain it, and a CUDA context that lives on."""
        info = self.info(graph)
        if self.failure is not None or self.phase != "replay" or info is None or not info.cuda or info.pending is None:
            return                      # (a replay the doctor's own runs make, or one of a step's eager form)
        try:
            error = differential.before_launch(self, info)
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            self.fail(e, "launching")
            return
        finally:
            self.phase = "replay"
        if error is not None:
            raise error

    @contained
    def handed_out(self, graph, tensors_out) -> None:
        info = self.info(graph)
        if info is None:
            return
        self.handed_any = True
        for t in (tensors_out if isinstance(tensors_out, (tuple, list)) else (tensors_out,)):
            overwritten.tag(self, t, info)
            info.handed_blocks.add(block(t))
        padding_probe.carry(self)


def _within(t, whole) -> bool:
    """Whether view ``t`` covers only bytes that ``whole`` (of the same storage, same layout) covers."""
    inner, outer = tensors.span(t), tensors.span(whole) if whole is not None else None
    return inner is not None and outer is not None and outer[0] <= inner[0] and inner[1] <= outer[1] \
        and t.stride() == whole.stride()[len(whole.stride()) - t.dim():]
