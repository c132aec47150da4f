"""Root causes the doctor tells apart, each on a tiny bug workload and its fix (which must be clean):
a Python binding frozen at capture, dummy-batch writes a real step reads, pool memory read across
graphs after it was handed on, a reference handed to other code since capture, warmup work that is
only constants or host work (no finding), and a runner rebinding its input instead of copying it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench import doctor
from workbench.engine import graph, graph_pool_handle, host, new_graph
from workbench.engine.source import function_of
from workbench.zoo.kit import capture, replay

from test_doctor_mechanisms import Manager, rows


# ------------------------------------------------------------------ a Python binding frozen at capture
class Keeps:
    """Keeps the step's hidden state as an attribute: rebinding it (the bug) or writing in place."""

    def __init__(self, in_place: bool):
        self.x, self.in_place = torch.zeros(2, 4), in_place
        self.hidden = torch.zeros(2, 4)

    def forward(self, size):
        h = self.x[:size] * 2
        if self.in_place:
            self.hidden[:size].copy_(h)
        else:
            self.hidden = h
        return h + 1


def test_an_attribute_rebound_by_the_step_is_host_work_frozen():
    for in_place in (False, True):
        after = []

        def workload():
            model = Keeps(in_place)
            m = Manager(model.forward, [2], {"x": model.x})
            m.capture()
            model.x.copy_(rows(2))
            if in_place:
                model.hidden.fill_(7.0)                  # the user's own value, before the replay
            else:
                model.hidden = torch.full((2, 4), 7.0)
            m.replay(2)
            after.append(model.hidden.clone())
        report = doctor.diagnose(workload)
        # in place, the replay writes the step's state; rebound, a replay rebinds nothing (nor may the doctor)
        assert all(bool((h == 7.0).all()) != in_place for h in after)
        if in_place:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "host-work-frozen" and finding.numbers["rebound"] == 1
        assert finding.tensor.startswith("Keeps.hidden: float32[2, 4]")
        assert "self.hidden = h" in finding.source             # the line that binds the new value,
        assert "h = self.x[:size] * 2" in str(finding)         # and the op that made it


# ------------------------------------------------------------------ a cursor Python advances each step
class Cursor:
    """A ring-buffer cursor: ``read`` scales the input by it, ``advance`` moves it on. As a host int
    (the bug) a replay keeps the capture's value; as a one-element tensor advanced in place it moves."""

    def __init__(self, on_device: bool):
        self.x, self.on_device = torch.zeros(2, 4), on_device
        self.idx = torch.zeros(1) if on_device else 0

    def read(self, size):
        return self.x[:size] * self.idx                 # the number reaches the op straight from the attribute

    def advance(self):
        if self.on_device:
            self.idx.copy_((self.idx + 1) % 3)
        else:
            self.idx = (self.idx + 1) % 3

    def forward(self, size):
        out = self.read(size)
        self.advance()
        return out


def test_a_number_python_advances_each_step_is_named_where_it_advances():
    """The replay launches the scale with the capture's number and the eager step with this step's;
    no frame of the step holds that number in a variable of its own, and the eager step rebinds a
    number the replay leaves alone: ``host-work-frozen`` at ``advance``, where the cursor moves."""
    for on_device in (False, True):
        def workload():
            model = Cursor(on_device)
            m = Manager(model.forward, [2], {"x": model.x})
            m.capture()
            if on_device:                                # the warmup and the capture moved it: start over
                model.idx.zero_()
            else:
                model.idx = 0
            for step in range(3):
                model.x.copy_(rows(2, seed=step))
                m.replay(2)
        report = doctor.diagnose(workload)
        if on_device:
            assert report.findings == [], report
            continue
        finding = next(f for f in report.findings if f.kind == "host-work-frozen")
        assert function_of(finding.location) == "advance" and "self.idx = (self.idx + 1) % 3" in finding.source, finding


# ------------------------------------------------------------------ dummy batches write what real steps read
class NullBlock:
    """A cache whose slot 0 is a null block read with weight 0; the dummy batch writes its slot."""

    def __init__(self, dummy_slot: int):
        self.cache = torch.zeros(4, 2)
        self.x = torch.zeros(2, 2)
        self.slots = torch.full((2,), dummy_slot)

    def forward(self, size):
        self.cache[self.slots[:size]] = self.x[:size] / self.x[:size].abs().amax(-1, keepdim=True)   # 0/0: NaN
        gathered = self.cache.flip(0)[2:]                        # rows 1 and 0
        return (gathered * torch.tensor([[1.0], [0.0]])).sum(0, keepdim=True) + self.x[:size]


def test_a_real_step_reading_what_the_warmup_wrote_is_persistent_mutation():
    for dummy_slot, bug in ((0, True), (3, False)):
        def workload():
            model = NullBlock(dummy_slot)
            m = Manager(model.forward, [2], {"x": model.x, "slots": model.slots})
            m.capture()
            model.x.copy_(rows(2, 2) + 1)
            model.slots.copy_(torch.tensor([1, 2]))
            m.replay(2)
        report = doctor.diagnose(workload)
        if not bug:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "persistent-mutation" and finding.graph == "size 2"
        assert finding.op == "aten.index_put_.default" and "self.cache[self.slots[:size]]" in finding.source
        assert "from the state before the warmups" in finding.evidence


# ------------------------------------------------------------------ pool memory read across graphs
def test_a_block_handed_on_while_its_first_graph_still_writes_it_is_dangling():
    """Size 4's temporary is freed at its capture; size 2's capture allocates a counter there and
    keeps it in a cache; size 1 reads the counter across replays, and size 4's replay rewrites it."""
    for keep_out_of_pool in (False, True):
        def workload():
            cache, x = {}, torch.zeros(4, 2)
            if keep_out_of_pool:
                cache["count"] = torch.zeros(8)          # the fix: made before any capture
            pool = graph_pool_handle("cpu")

            def forward(size):
                if size == 4:
                    return (x * 3.0).sum(1, keepdim=True) * 1.0     # an 8-float temporary, freed at capture
                if "count" not in cache:
                    cache["count"] = torch.zeros(8)
                cache["count"].add_(1.0)
                return x[:size] + cache["count"][:2]

            graphs = {}
            with torch.no_grad():
                for size in (4, 2, 1):
                    g = new_graph("cpu")
                    with graph(g, pool=pool, name=f"size {size}"):
                        graphs[size] = (g, forward(size))
            for size in (2, 1, 4, 1):
                graphs[size][0].replay()
        report = doctor.diagnose(workload)
        if keep_out_of_pool:
            assert report.findings == [], report
            continue
        kinds = {f.kind: f for f in report.findings}
        finding = kinds["dangling-reference"]
        assert finding.graph == "size 1" and finding.op == "aten.zeros.default"
        assert "size 4's replay wrote that memory last" in finding.evidence


# ------------------------------------------------------------------ a reference handed to other code since capture
class Windows:
    """Registered buffers handed out from a free list (a pool the doctor cannot see into); the fix
    refuses them while a graph is capturing, so that the graph writes memory of its own."""

    def __init__(self, refuse_while_capturing: bool):
        self.free, self.refuse = [torch.zeros(2, 2)], refuse_while_capturing

    def all_reduce(self, x):
        capturing = torch.cuda.is_current_stream_capturing()
        lent = bool(self.free) and not (self.refuse and capturing)
        out = self.free.pop() if lent else torch.empty(2, 2)
        torch.mul(x, 2.0, out=out)
        result = out * 1.0
        if lent:
            self.free.append(out)                     # released: the next requester gets it
        return result


def test_memory_the_graph_writes_handed_to_other_code_since_capture_is_dangling():
    for refuse in (False, True):
        def workload():
            windows, x = Windows(refuse), torch.zeros(2, 2)
            m = Manager(lambda size: windows.all_reduce(x[:size]), [2], {"x": x})
            m.capture()
            kept = windows.free.pop()                     # another request takes the buffer ...
            kept.copy_(torch.full((2, 2), 5.0))           # ... and writes it
            x.copy_(rows(2, 2))
            m.replay(2)
            windows.free.append(kept)
        report = doctor.diagnose(workload)
        if refuse:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "dangling-reference" and finding.op == "aten.mul.out"
        assert "kept.copy_" in finding.cause


# ------------------------------------------------------------------ warmup work that cannot be a finding
def test_warmup_work_on_constants_or_host_memory_is_no_finding():
    def workload():
        state = {}
        limit = host(torch.tensor(2), "cpu")
        x = torch.zeros(2, 2)

        def forward(size):
            if "table" not in state:                      # lazily built, from no data: the same every step
                state["table"] = torch.arange(2.0) * 2
            n = int(limit.item())                         # host memory: never recorded, never skipped
            return x[:size, :n] * state["table"]

        m = Manager(forward, [2], {"x": x})
        m.capture()
        x.copy_(rows(2, 2))
        m.replay(2)
    report = doctor.diagnose(workload)
    assert report.findings == [], report


# ------------------------------------------------------------------ a runner rebinding its input instead of copying
class Rebinds:
    """A runner whose ``prepare`` binds each step's input to ``self.x`` (the bug: the graph keeps
    reading the tensor bound at capture) or copies it into the static buffer (the fix)."""

    def __init__(self, copy: bool, keep_old: bool):
        self.x, self.copy, self.old = torch.zeros(2, 4), copy, [] if keep_old else None
        self.w = torch.linspace(-1, 1, 16).reshape(4, 4)

    def prepare(self, x):
        if self.copy:
            self.x.copy_(x)
            return
        if self.old is not None:
            self.old.append(self.x)
        self.x = x.clone()

    def forward(self, size):
        return torch.tanh(self.x[:size] @ self.w)


def test_an_input_rebound_instead_of_copied_is_found_whether_or_not_the_old_one_lives():
    """Released (a runner that holds nothing else), the graph reads memory with no owner:
    dangling-reference. Still alive (the graph manager keeps the announced buffer), the replay reads
    the capture's tensor where the eager step reads the new one, a reference frozen at capture:
    warmup-divergence. Both name the captured read; the copying runner is clean either way."""
    from workbench.zoo import kit

    def through_manager(model):
        m = Manager(model.forward, [2], {"x": model.x})
        m.capture()
        return lambda: m.replay(2)

    def bare(model):                    # warm up, capture, replay: nothing but the graph holds the buffer
        g, out = kit.capture(lambda: model.forward(2), device="cpu", static={"x": model.x})
        return lambda: kit.replay(g, out)

    for serve, keep_old, kind in ((through_manager, False, "warmup-divergence"), (bare, False, "dangling-reference"),
                                  (bare, True, "warmup-divergence")):
        for copy in (False, True):
            def workload():
                model = Rebinds(copy, keep_old)
                step = serve(model)
                for n in range(3):
                    model.prepare(rows(2) + n)
                    step()
            report = doctor.diagnose(workload)
            if copy:
                assert report.findings == [], report
                continue
            assert kind in report.kinds, (serve.__name__, keep_old, report)
            finding = next(f for f in report.findings if f.kind == kind)
            # the rebinding releases the old buffer where nothing else holds it: the finding stands there
            site = "self.x = x.clone()" if kind == "dangling-reference" else "self.x[:size] @ self.w"
            assert site in finding.source and "self.x[:size] @ self.w" in finding.source + finding.evidence, finding


# ------------------------------------------------------------------ a view's offset frozen at capture
class Rotary:
    """Reads a row of a table at a host position (``narrow``, a view: it launches nothing, its
    offset is the kernel's pointer) or, fixed, through an index in a static buffer."""

    def __init__(self, by_index: bool):
        self.x, self.table, self.by_index = torch.zeros(2, 4), torch.arange(32.0).reshape(8, 4), by_index
        self.pos, self.slot = 0, torch.zeros(1, dtype=torch.int64)

    def forward(self, size):
        row = self.table.index_select(0, self.slot) if self.by_index else self.table.narrow(0, self.pos, 1)
        return self.x[:size] * row


def test_a_view_whose_offset_python_took_at_capture_is_host_work_frozen():
    for by_index in (False, True):
        def workload():
            model = Rotary(by_index)
            m = Manager(model.forward, [2], {"x": model.x, "slot": model.slot})
            m.capture()
            for step in range(1, 4):
                model.pos = step
                model.slot.fill_(step)
                model.x.copy_(rows(2, seed=step))
                m.replay(2)
        report = doctor.diagnose(workload)
        if by_index:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "host-work-frozen", report
        assert "return self.x[:size] * row" in finding.source
        assert "at element 4 in the eager step" in finding.cause and "A view Python took at capture" in finding.cause


def test_without_differential_replay_host_work_frozen_is_listed_as_not_checked():
    def workload():
        model = Rotary(False)
        m = Manager(model.forward, [2], {"x": model.x})
        m.capture()
        m.replay(2, eager=False)
    report = doctor.diagnose(workload)
    assert "host-work-frozen" in report.not_checked, report


def test_a_graph_left_in_a_reference_cycle_is_nobody_s_at_the_end_of_watch():
    """A runner in a reference cycle (runner -> manager -> forward -> runner) whose input went with
    the rest of it: the end-of-watch liveness check must not take the uncollected graph for a live
    one. The same graph kept reachable is a finding."""
    import gc

    class Holder:
        pass

    for keep in (False, True):
        gc.disable()                      # the cycle outlives the block unless the doctor collects it
        try:
            with doctor.watch() as report:
                h = Holder()
                h.x = torch.ones(2, 4)
                h.m = Manager(lambda size, h=h: h.x[:size] * 2, [2], {})
                h.m.capture()
                h.m.replay(2, eager=False)
                h.x = None
                kept = h if keep else None
                del h
        finally:
            gc.enable()
        assert [f.kind for f in report.findings] == (["dangling-reference"] if keep else []), report
        del kept


# ------------------------------------------------------------------ attributes a program sets on a tensor
class AttachedGrad:
    """The step attaches its gradient to the weight as a Python attribute (``w.grad_ref``), which the
    optimizer reads after the step; ``zero_grad`` runs before every step. ``bug``: ``zero_grad`` drops
    the attribute, and the attachment is host work in the captured step, which a replay never
    repeats: the optimizer finds nothing to apply. ``fix``: ``zero_grad`` zeroes the gradient and
    keeps the binding."""

    def __init__(self, fixed: bool):
        self.fixed = fixed
        self.x, self.w, self.grad = torch.zeros(2, 4), torch.eye(4), torch.zeros(4, 4)

    def forward(self, size):
        x = self.x[:size]
        self.grad.copy_(x.t() @ x)
        self.attach()
        return x @ self.w

    def attach(self):
        """Host work alone: no op runs here, so only the lines a capture ran say it ran there."""
        self.w.grad_ref = self.grad

    def zero_grad(self):
        if self.fixed:
            self.grad.zero_()
        else:
            self.w.grad_ref = None

    def step(self):
        if (g := getattr(self.w, "grad_ref", None)) is not None:
            self.w.sub_(0.01 * g)


def test_an_attribute_set_on_a_tensor_by_the_captured_step_is_host_work_frozen():
    """Attributes a program sets on tensors (a parameter's gradient, as Megatron and TE attach them)
    are host state the eager step changes: watched, and put back after each eager run, or the
    doctor itself would hand the optimizer what the replay never set."""
    for fixed in (False, True):
        weights: list = []

        def workload():
            model = AttachedGrad(fixed)
            m = Manager(model.forward, [2], {"x": model.x}, state={"grad": model.grad})
            m.capture()
            for step in range(3):
                model.zero_grad()
                model.x.copy_(rows(2, seed=step))
                m.replay(2)
                model.step()
            weights.append(model.w.clone())
        workload()
        report = doctor.diagnose(workload)
        assert all(torch.equal(weights[0], w) for w in weights), "the doctor changed what the workload computes"
        assert torch.equal(weights[0], torch.eye(4)) != fixed           # the bug's optimizer never steps
        if fixed:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "host-work-frozen" and finding.tensor == "Tensor.grad_ref", finding
        assert " in attach: self.w.grad_ref = self.grad" in finding.source, finding


# ------------------------------------------------------------------ a tensor reference fetched from a global context
_CONTEXT: dict = {}


def _gather(q, cache, meta):
    slots = meta.slots
    return cache[slots] * q


def _attend(q, cache):
    meta = _CONTEXT["meta"]                  # the step's metadata, read from a global forward context
    return _gather(q, cache, meta)


def test_a_tensor_the_capture_fetched_from_a_context_is_named_where_it_was_fetched():
    """The step reads its slots from a global forward context, not from its arguments: the capture
    binds the tensors the context held then. ``bug`` sets a new metadata record per step, which the
    replays never see; ``fix`` writes the new slots into the captured record's tensor. The finding
    names the line that fetched the record (the reference frozen at capture), not the op that
    indexes with it."""
    from collections import namedtuple
    Meta = namedtuple("Meta", ["slots"])
    for variant in ("bug", "fix"):
        def workload():
            cache = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
            q = torch.zeros(2, 4)
            _CONTEXT["meta"], kept = Meta(torch.tensor([0, 1])), []
            m = Manager(lambda size: _attend(q[:size], cache), [2], {"q": q})
            m.capture()
            for step in range(3):
                slots = torch.tensor([2 * step, 2 * step + 1])
                if variant == "bug":
                    kept.append(_CONTEXT["meta"])       # (kept alive: stale, not freed)
                    _CONTEXT["meta"] = Meta(slots)
                else:
                    _CONTEXT["meta"].slots.copy_(slots)
                q.copy_(rows(2, seed=step))
                m.replay(2)
        report = doctor.diagnose(workload)
        if variant == "fix":
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "warmup-divergence" and " in _attend: return _gather(q, cache, meta)" in finding.source
        assert "The step fetches that tensor at" in finding.evidence + finding.cause, finding


# ------------------------------------------------------------------ a replay that raises where the eager step does not
class Splits:
    """Partial sums into a scratch of ``splits`` columns, at the split each element's static input
    names: a plan Python makes per step. The scratch sized by the plan at capture (the bug), or by the
    largest plan (``fixed``)."""

    def __init__(self, fixed: bool):
        self.x, self.split = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long)
        self.splits, self.fixed = 2, fixed

    def forward(self, size):
        parts = torch.zeros(size, 4 if self.fixed else self.splits)
        parts.scatter_add_(1, self.split[:size], self.x[:size])
        return parts.sum(1, keepdim=True)


def test_a_replay_that_raises_where_its_eager_step_completes_is_named_where_the_traces_part():
    """The plan grows after capture: the replay scatters past the scratch it captured and raises,
    while the same step run eagerly sizes its scratch anew and completes. A split past even the
    largest plan fails without graphs too: not the graph's doing, no finding."""
    for fixed, split in ((False, 2), (True, 2), (True, 4)):
        raised = []

        def workload():
            model = Splits(fixed)
            m = Manager(model.forward, [2], {"x": model.x, "split": model.split})
            m.capture()
            model.x.copy_(rows(2))
            model.splits = 3
            model.split.copy_(torch.tensor([0, 1, 2, split]).expand(2, 4))
            try:                                     # a serving loop that drops the failed batch
                m.replay(2)
            except (RuntimeError, IndexError) as e:
                raised.append(e)
        report = doctor.diagnose(workload)
        assert bool(raised) == (not fixed or split == 4)
        if fixed:
            assert report.findings == [], report
            continue
        (finding,) = report.findings
        assert finding.kind == "host-work-frozen" and finding.numbers["crashed"] == "RuntimeError", finding
        assert "an eager run of the same step, from the state before the replay, completes" in finding.evidence
        assert "parts = torch.zeros(size, 4 if self.fixed else self.splits)" in finding.source, finding


# ------------------------------------------------------------------ a runner hands out a selection of the step's return
@dataclasses.dataclass
class _Batch:
    """What a TP worker's step returns per rank: its metadata beside its results (fields in this order)."""
    ids: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor


def test_outputs_a_runner_hands_out_in_its_own_order_are_compared_with_the_eager_steps_same_tensors():
    """Each rank's step returns its batch (the static ids, then hidden states, then logits); the runner
    hands out only each rank's logits and hidden states, logits first. The eager step returns the
    whole batches: its tensors are paired with the replay's by where each sat in what the step returned
    at capture, not by the next tensor of the same shape (rank 1's hidden states after rank 0's
    logits), and a correct graph is clean."""
    def workload():
        ids = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
        table = torch.arange(40.0).reshape(10, 4)

        def step():
            out = []
            for rank in range(2):
                hidden = table[ids[rank]] * (rank + 1)
                out.append(_Batch(ids[rank], hidden, hidden[:, :3].sum(-1, keepdim=True) + rank))
            return out

        g, batches = capture(step, device="cpu", static={f"rank{r}.ids": ids[r] for r in range(2)})
        handed = tuple(t for b in batches for t in (b.logits, b.hidden))
        served = []
        for n in range(3):
            for rank in range(2):
                ids[rank].copy_(torch.tensor([n, n + 1, n + 2, 9 - n]))
            served.append([v.clone() for v in replay(g, handed)])
        return served

    report = doctor.diagnose(workload)
    assert report.findings == [] and any("differential replay: 3 replay(s)" in n for n in report.notes), report


def test_a_binding_moved_to_another_device_is_another_value_not_a_comparison():
    """A step that moves host metadata onto the GPU (``info.kv_indices = info.kv_indices.to(device)``)
    rebinds it to a tensor on another device: another value, which cannot be compared elementwise with
    the old one (on CUDA the comparison raised, and the doctor stopped). A meta tensor stands in for
    the GPU's here; a mask of two shapes' difference is made on the first one's device."""
    from workbench.doctor.probes.pystate import _same_values
    from workbench.doctor.tensors import differs
    host_side = torch.arange(4)
    assert not _same_values(host_side, torch.empty(4, dtype=host_side.dtype, device="meta"))
    assert _same_values(host_side, host_side.clone())
    assert differs(torch.zeros(2, device="meta"), torch.zeros(3)).device.type == "meta"


@pytest.mark.cuda
def test_values_the_run_without_graphs_kept_on_the_host_are_compared_with_a_replays_gpu_tensor():
    """The reference run's view of a step (host metadata) against the GPU tensor the replay read:
    compared by value on the GPU, not refused for its device (the doctor stopped on this in
    ``replay_end``, on CUDA only)."""
    from workbench.doctor.tensors import disagrees, max_abs_diff
    host, gpu = torch.arange(4.0), torch.arange(4.0, device="cuda")
    assert not disagrees(gpu, host).any() and max_abs_diff(gpu, host) == 0.0
    assert disagrees(gpu, host + 1).all()
