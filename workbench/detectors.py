"""The detectors users have for CUDA-graph bugs today, as baselines for the graph doctor.

Each detector runs a zoo program's variant and answers as the tool it models would: whether it
found something and, where that tool can say, the kind and the site (the user function). None of
them knows the program; each watches only what its tool watches.

* ``eager_diff``: replay outputs against eager outputs on a few batches (vLLM's
  ``test_full_cudagraph``): it sees that numbers differ or that the run crashed, not why.
* ``poison_fill``: TensorRT-LLM's poison-fill tests (PR #18207): the static input buffers are filled
  with a sentinel (-12345) before each step is prepared; a replay whose buffers still hold the
  sentinel in the rows the graph reads fails the test, and so do outputs that differ from eager. It
  says "stale padding" when the sentinel survived or the poison alone changed the outputs. The
  buffers poisoned are those the runner names as per-step inputs (at ``serve``).
* ``address_check``: vLLM's debug mode asserts that a graph's inputs have the addresses they had at
  capture. The inputs of a captured callable are taken to be the tensors it closes over and their
  tensor attributes, checked before every replay.
* ``input_liveness``: PyTorch's ``CUDAGraph(check_input_liveness=True)`` (torch >= 2.13, CUDA only;
  pytorch/pytorch#174649), as its documentation describes it: external tensors read during capture
  are tracked (tensors created inside the capture are internal and are not), and a replay raises if
  any was deallocated. The GPU machines run torch 2.11, which lacks it, hence this emulation.
* ``doctor``: ``workbench.doctor.diagnose`` on the program, its public API only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from . import doctor
from .engine import events
from .engine.opinfo import tensors
from .zoo import kit

DETECTORS = ("eager_diff", "poison_fill", "address_check", "input_liveness", "doctor")


@dataclasses.dataclass
class Detection:
    """What one detector said about one run: found, and the kind and site when it can say."""

    detector: str
    found: bool
    kind: str | None = None
    site: str | None = None          # ``file:line in function`` where the tool points, if it does
    detail: str = ""


class _Observer:
    """No-op handlers for every engine event (the engine calls each by name)."""

    def capture_begin(self, graph, name): pass
    def capture_end(self, graph): pass
    def capture_abort(self, graph, error): pass
    def replay_begin(self, graph): pass
    def replay_end(self, graph): pass
    def static_buffers(self, owner, buffers): pass
    def warmup_begin(self, real=False): pass
    def warmup_end(self): pass
    def serve(self, graph, real, size, padded, outputs, **announced): pass
    def handed_out(self, graph, tensors): pass


class _Attached:
    """Subscribe an observer to engine events (and, if it has the methods, to the zoo runner's hooks)."""

    def __init__(self, observer) -> None:
        self.observer = observer

    def __enter__(self):
        events.subscribe(self.observer)
        if hasattr(self.observer, "captured"):
            kit.hooks.append(self.observer)
        return self.observer

    def __exit__(self, *exc) -> None:
        events.unsubscribe(self.observer)
        if self.observer in kit.hooks:
            kit.hooks.remove(self.observer)


# ----------------------------------------------------------------------------- (a) eager diff
def eager_diff(prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    outcome = prog.run(variant, device)
    if outcome.error is not None:
        return Detection("eager_diff", True, detail=f"the graph run raised {outcome.error[0]}: {outcome.error[1]}")
    return Detection("eager_diff", outcome.verdict == kit.MISBEHAVES,
                     detail=f"max |graph - eager| = {outcome.max_abs_error:.3g}")


# ----------------------------------------------------------------------------- (b) poison fill
SENTINEL = -12345


class _Poisoner(_Observer):
    """After each replay, fill the per-step input buffers (those the runner names at ``serve``) with
    the sentinel; at the next ``serve``, note those whose rows ``[0, size)`` still hold it."""

    def __init__(self) -> None:
        self.inputs: dict[int, tuple[str, torch.Tensor]] = {}
        self.poisoned = False
        self.survived: list[str] = []

    def serve(self, graph, real, size, padded, outputs, **announced):
        if self.poisoned:
            for name, t in padded.items():
                if isinstance(t, torch.Tensor) and (t[:size] == SENTINEL).any() and name not in self.survived:
                    self.survived.append(name)
        for name, t in padded.items():
            if isinstance(t, torch.Tensor) and t.dtype != torch.bool:
                self.inputs[id(t)] = (name, t)

    def replay_end(self, graph):
        with torch.no_grad():
            for _, t in self.inputs.values():
                t.fill_(SENTINEL)
        self.poisoned = bool(self.inputs)


def poison_fill(prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    plain = prog.run(variant, device)
    with _Attached(_Poisoner()) as poisoner:
        poisoned = prog.run(variant, device)
    if not poisoner.inputs:
        return Detection("poison_fill", plain.verdict == kit.MISBEHAVES, detail="no per-step buffers to poison")
    changed = (poisoned.error != plain.error or len(poisoned.graph) != len(plain.graph)
               or any(not torch.equal(a.nan_to_num(1e9), b.nan_to_num(1e9))
                      for a, b in zip(poisoned.graph, plain.graph)))
    found = poisoned.verdict == kit.MISBEHAVES or bool(poisoner.survived)
    stale = bool(poisoner.survived) or (found and changed)
    detail = f"sentinel left in: {', '.join(poisoner.survived)}; " if poisoner.survived else ""
    return Detection("poison_fill", found, kind="stale-padding" if stale else None, detail=detail + poisoned.summary())


# ----------------------------------------------------------------------------- (c) address check
def _inputs_of(fn: Callable) -> dict[str, torch.Tensor]:
    """The tensors a captured callable would be given: those it closes over, and their tensor
    attributes (``model.w``), named by their path."""
    found: dict[str, torch.Tensor] = {}
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        items = [(var, value)]
        if isinstance(value, dict):
            items += [(f"{var}[{k!r}]", v) for k, v in value.items()]
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, ModuleType)):
            items += [(f"{var}.{k}", v) for k, v in vars(value).items()]
        found.update({name: v for name, v in items if isinstance(v, torch.Tensor)})
    return found


class _AddressCheck(_Observer):
    def __init__(self) -> None:
        self.graphs: dict[int, tuple[Callable, dict[str, int]]] = {}
        self.changed: list[str] = []

    def captured(self, graph, fn):
        self.graphs[id(graph)] = (fn, {k: t.data_ptr() for k, t in _inputs_of(fn).items()})

    def replaying(self, graph):
        entry = self.graphs.get(id(graph))
        if entry is None:
            return
        fn, addresses = entry
        now = {k: t.data_ptr() for k, t in _inputs_of(fn).items()}
        self.changed += [k for k, a in addresses.items() if now.get(k, a) != a and k not in self.changed]


def address_check(prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    with _Attached(_AddressCheck()) as check:
        prog.run(variant, device)
    if not check.graphs:
        return Detection("address_check", False, detail="no captured callable seen: nothing to check")
    return Detection("address_check", bool(check.changed), kind="dangling-reference" if check.changed else None,
                     detail=f"input addresses changed: {', '.join(check.changed)}" if check.changed else "stable")


# ----------------------------------------------------------------------------- (d) input liveness
class _Liveness(_Observer, TorchDispatchMode):
    """Tracks, per capture, the external storages its ops read; a replay with a dead one is an error."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        self.capturing = None
        self.internal: set[int] = set()
        self.external: dict[int, dict[int, tuple[StorageWeakRef, str]]] = {}
        self.dead: list[str] = []

    def capture_begin(self, graph, name):
        self.capturing, self.internal = id(graph), set()
        self.external[id(graph)] = {}
        self.__enter__()

    def capture_end(self, graph):
        self.__exit__(None, None, None)
        self.capturing = None

    def capture_abort(self, graph, error):
        self.capture_end(graph)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracked = self.external.get(self.capturing)
        if tracked is not None:
            for t in tensors((args, kwargs)):
                key = t.untyped_storage()._cdata
                if key not in self.internal and key not in tracked:
                    tracked[key] = (StorageWeakRef(t.untyped_storage()), f"{t.dtype}{list(t.shape)}")
            for t in tensors(out):
                key = t.untyped_storage()._cdata
                if key not in tracked:
                    self.internal.add(key)
        return out

    def replay_begin(self, graph):
        for ref, what in self.external.get(id(graph), {}).values():
            if ref.expired() and what not in self.dead:
                self.dead.append(what)


def input_liveness(prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    with _Attached(_Liveness()) as check:
        prog.run(variant, device)
    return Detection("input_liveness", bool(check.dead), kind="dangling-reference" if check.dead else None,
                     detail=f"deallocated before replay: {', '.join(check.dead)}" if check.dead else "all inputs alive")


# ----------------------------------------------------------------------------- (e) the doctor
def doctor_detector(prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    """``doctor.diagnose`` on the program; the finding reported is the one of the expected kind if
    there is one (else the first), its site the ``file:line in function`` it names."""
    report = doctor.diagnose(lambda: prog.run(variant, device))
    if not report.findings:
        return Detection("doctor", False, detail=report.headline())
    best = next((f for f in report.findings if f.kind == prog.KIND), report.findings[0])
    kinds = sorted(report.kinds)
    return Detection("doctor", True, kind=best.kind, site=best.location,
                     detail=f"kinds: {', '.join(kinds)}; {best.op} at {best.location}")


FUNCTIONS: dict[str, Callable[[ModuleType, str, str], Detection]] = {
    "eager_diff": eager_diff, "poison_fill": poison_fill, "address_check": address_check,
    "input_liveness": input_liveness, "doctor": doctor_detector,
}


def detect(detector: str, prog: ModuleType, variant: str, device: str = "cpu") -> Detection:
    if detector not in FUNCTIONS:
        raise ValueError(f"detector must be one of {DETECTORS}, got {detector!r}")
    kit.check_variant(variant)
    return FUNCTIONS[detector](prog, variant, device)
