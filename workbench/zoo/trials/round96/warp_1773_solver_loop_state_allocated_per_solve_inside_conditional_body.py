"""A pre-allocated ``warp.optim.linear`` solver (``check_every=0``) cannot run inside an outer ``wp.capture_while`` body: ``_run_capturable_loop`` allocates its iteration/condition buffer on every solve, and a conditional body admits no memory-allocation node.

Upstream: https://github.com/NVIDIA/warp/issues/1773 ("warp.optim.linear solvers with check_every=0 cannot be nested
inside a conditional graph body (one per-call allocation in _run_capturable_loop)", NVIDIA/warp, filed 2026-08-11
against warp 1.16.0, labelled bug, closed: the maintainer pointed to commit 063c857d43cd423ebca9806002d845a311adce95
"Preallocate iterative solver loop state" (Gilles Daviet, 2026-08-01, GitLab MR omniverse/warp!2722), and the
reporter verified it on 1.17.0.dev20260811). Read: the issue (summary, cause, environment; its reproduction nests
``gmres`` in a ``capture_while`` body), the fix commit's diff (``warp/_src/optim/linear.py``, CHANGELOG "Fix
pre-allocated iterative linear solver states allocating an iteration-condition buffer on every solve", the new test
``test_functor_iteration_buffer_reuse``), and at its parent ``LinearSolverState``, ``CG._allocate``/``CG._run``,
``_initialize_absolute_tolerance``, ``_create_update_condition_kernel``, ``_cg_kernel_1``/``_cg_kernel_2``,
``_run_capturable_loop``, and in ``warp/_src/context.py`` ``capture_while``/``capture_pause``/``capture_resume``
and ``wp_cuda_graph_check_conditional_body`` (``warp/native/warp.cu``).
Symptom: capturing a device-resident outer loop (``wp.capture_while``) whose body calls a ``run=False`` solver
functor with ``check_every=0, use_cuda_graph=True`` fails with ``RuntimeError: Conditional body graph contains an
unsupported operation (memory allocation)``. The same functor captures fine at the top level of a graph.
Mechanism: ``_run_capturable_loop`` did ``cur_iter_and_condition = wp.full((2,), value=-cycle_size, dtype=int,
device=device)`` on every solve, even for a pre-allocated solver state. Under a stream capture the allocation
becomes a graph memory-allocation node: allowed in the top-level graph, but a CUDA conditional body graph only
admits kernel, memset, memcpy, empty, child-graph and conditional nodes, and ``capture_while`` checks the body it
captured (``wp_cuda_graph_check_conditional_body``) and raises.
Doctor: sync-in-capture, at _run_capturable_loop. It performs a device allocation, an operation the capture being
recorded (a conditional body) refuses, on every solve instead of reusing storage allocated with the solver state.
Fix (upstream): ``LinearSolverState.__init__`` allocates ``self._cur_iter_and_condition = wp.empty((2,),
dtype=int, device=self._device)``; ``CG``/``CR``/``BiCGSTAB``/``GMRES`` pass it to ``_run_capturable_loop(do_cycle,
cur_iter_and_condition=..., ...)``, which only resets it: ``cur_iter_and_condition.fill_(-cycle_size)`` (a memset).
Modelled: the CUDA driver (``_Core``): capture into a graph, pause/resume into a conditional body, memory-allocation
nodes for allocations made while a body is being captured, the body check; conditional while nodes are emulated
(the engine has none) by running their body ``WHILE_NODE_UNROLL`` times, each pass predicated on the node's handle,
nested nodes inside their parent's passes; root-level while nodes run when the parent capture resumes. Warp:
``array`` (views, ``fill_``/``zero_``/``assign`` as launches), ``empty``/``full`` (``zeros`` is a fill of 0),
``launch`` (``record_cmd``), the ``Graph`` registered per stream (capture ids and module retention left out), ``capture_begin``/``capture_end``/``capture_pause``/``capture_resume``/``capture_while``
(no-graph host loop included), ``ScopedCapture``/``capture_launch``; ``warp.optim.linear``: ``aslinearoperator`` for
a dense matrix, ``TiledDot`` (one batch), ``LinearSolverState``, ``CG`` (no preconditioner, no restart),
``cg(..., run=False)``, ``_run_capturable_loop`` (host-checked ``check_every > 0`` loop, device callbacks and the
solver's own inner ``ScopedCapture`` when nothing outer captures are left out), the CG and condition kernels as
torch code. The outer loop is a stand-in for the reporter's device-resident solver: Newton iterations on ``K u +
kappa u^3 = f`` (a 6-dof SPD ``K``), each assembling ``J = K + 3 kappa diag(u^2)`` and ``-F``, solving ``J du = -F``
with the pre-allocated CG functor, updating ``u`` and the loop condition on the device. float64; CG here, GMRES in
the issue (the fix covers all four solvers).
Workload: four load steps; each writes a new load ``f`` and runs the Newton solve from the previous ``u`` (at most 6
Newton iterations, CG up to 6). Served: the whole Newton solve captured once (``wp.ScopedCapture``; the CG functor
built with ``use_cuda_graph=True``, so it nests its own ``capture_while``) and replayed per step. Eager: the same
code without graphs (host-read loop conditions, ``use_cuda_graph=False``). The bug raises RuntimeError
("Conditional body graph contains an unsupported operation (memory allocation)") at the capture; the fix captures
and equals eager on every step's ``u`` and Newton iteration count (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/issues/1773"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_run_capturable_loop"
SYMPTOM = ("capturing a wp.capture_while outer loop whose body calls a pre-allocated warp.optim.linear solver "
           "(check_every=0) fails: 'Conditional body graph contains an unsupported operation (memory "
           "allocation)', because _run_capturable_loop allocates its iteration/condition buffer on every solve")

N, KAPPA, LOAD_STEPS = 6, 0.5, 4
NEWTON_MAXITER, NEWTON_TOL, CG_TOL = 6, 1e-9, 1e-12
WHILE_NODE_UNROLL = 6        # emulated while node: body passes (>= NEWTON_MAXITER and CG's maxiter, N)
DTYPE = torch.float64

_variant = "bug"
runtime = None


# ----------------------------------------------------------------------------- the driver (warp.cu)
class CUgraph:
    def __init__(self, while_node=None):
        self.while_node = while_node          # the conditional node whose body this is (None: a root graph)
        self.nodes: list = []                 # a body's nodes, emitted when its root-level node runs
        self.pending: list = []               # a root graph's while nodes, run when its capture resumes


class WhileNode:
    def __init__(self, condition, parent):
        self.condition, self.parent, self.handle, self.body = condition, parent, None, CUgraph(self)


class _Core:
    """A stream capturing into one graph at a time; a body graph keeps its nodes for its while node."""

    def __init__(self):
        self.capture_graph, self.error = None, ""

    def _in_body(self) -> bool:
        return self.capture_graph is not None and self.capture_graph.while_node is not None

    def wp_alloc_device(self, device, shape, dtype):
        if self._in_body():                   # stream-ordered allocation while capturing: a mem-alloc node
            self.capture_graph.nodes.append(("memory allocation",))
        return torch.empty(shape, dtype=dtype, device=device)

    def wp_cuda_launch_kernel(self, node_type, func, params):
        if self._in_body():
            self.capture_graph.nodes.append((node_type, func, params))
        else:
            func(*params)

    def wp_cuda_stream_is_capturing(self, stream) -> bool:
        return self.capture_graph is not None

    def wp_cuda_graph_begin_capture(self, stream):
        self.capture_graph = CUgraph()

    def wp_cuda_graph_end_capture(self, stream):
        graph, self.capture_graph = self.capture_graph, None
        self._run_pending(graph)
        return graph

    def wp_cuda_graph_pause_capture(self, stream):
        graph, self.capture_graph = self.capture_graph, None
        return graph

    def wp_cuda_graph_resume_capture(self, stream, graph):      # cudaStreamBeginCaptureToGraph
        self._run_pending(graph)              # the root's finished while nodes, in order
        self.capture_graph = graph

    def wp_cuda_graph_insert_while(self, stream, condition):
        node = WhileNode(condition, self.capture_graph)
        if self._in_body():
            self.capture_graph.nodes.append(("conditional", node))
        else:
            node.handle = (condition[:1] != 0).to(torch.int32)     # set from ``condition`` before the node
            self.capture_graph.pending.append(node)
        return node

    def wp_cuda_graph_set_condition(self, stream, condition, node):
        self.capture_graph.nodes.append(("set_condition", condition, node))

    def wp_cuda_graph_check_conditional_body(self, body_graph) -> bool:
        allowed = ("kernel", "memset", "memcpy", "graph", "empty", "conditional", "set_condition")
        for entry in body_graph.nodes:
            if entry[0] not in allowed:
                self.error = f"Conditional body graph contains an unsupported operation ({entry[0]})"
                return False
        return True

    def _run_pending(self, graph):
        if graph is not None and graph.while_node is None:
            for node in graph.pending:
                self._emit_while(node, node.condition.new_ones((), dtype=torch.bool))
            graph.pending.clear()

    def _emit_while(self, node, active):
        for _ in range(WHILE_NODE_UNROLL):
            self._emit(node.body.nodes, active & (node.handle[0] != 0))

    def _emit(self, nodes, active):
        for entry in nodes:
            if entry[0] in ("kernel", "memset", "memcpy"):
                _, func, params = entry
                written = [p for p in params if isinstance(p, torch.Tensor)]
                before = [p.clone() for p in written]
                func(*params)
                for p, b in zip(written, before):
                    p.copy_(torch.where(active, p, b))
            elif entry[0] == "set_condition":
                _, condition, node = entry
                node.handle.copy_(torch.where(active, (condition[:1] != 0).to(torch.int32), node.handle))
            elif entry[0] == "conditional":
                node = entry[1]
                node.handle = torch.where(active, (node.condition[:1] != 0).to(torch.int32),
                                          torch.zeros_like(node.condition[:1]))
                self._emit_while(node, active)


# ----------------------------------------------------------------------------- warp/context.py, warp arrays
class Device:
    is_cuda = True                            # the emulated device is the GPU

    def __init__(self, alias):
        self.alias, self.stream, self.captures = alias, "stream", {}

    is_capturing = property(lambda self: runtime.core.wp_cuda_stream_is_capturing(self.stream))


class Runtime:
    def __init__(self, device):
        self.core, self.device = _Core(), Device(device)

    def get_error_string(self):
        return self.core.error


class array:
    def __init__(self, data: torch.Tensor):
        self.data = data

    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: runtime.device)

    def __getitem__(self, idx): return array(self.data[idx])                          # noqa: E704
    def fill_(self, value): launch(_memset, inputs=[self, value], _node_type="memset")  # noqa: E704
    def zero_(self): self.fill_(0)                                                    # noqa: E704
    def assign(self, src): launch(_memcpy, inputs=[self, src], _node_type="memcpy")   # noqa: E704


def _memset(a, value): a.fill_(value)          # noqa: E704
def _memcpy(dst, src): dst.copy_(src)          # noqa: E704


def empty(shape, dtype=DTYPE, device=None) -> array:
    return array(runtime.core.wp_alloc_device(runtime.device.alias, shape, dtype))


def full(shape, value, dtype=DTYPE, device=None) -> array:       # wp.zeros is full(..., 0)
    a = empty(shape, dtype, device)
    a.fill_(value)
    return a


class Launch:
    def __init__(self, node_type, kernel, params):
        self.node_type, self.kernel, self.params = node_type, kernel, params

    def launch(self): runtime.core.wp_cuda_launch_kernel(self.node_type, self.kernel, self.params)   # noqa: E704


def launch(kernel, dim=None, inputs=(), outputs=(), device=None, block_dim=None, record_cmd=False,
           _node_type="kernel"):
    cmd = Launch(_node_type, kernel, [p.data if isinstance(p, array) else p for p in (*inputs, *outputs)])
    if record_cmd:
        return cmd
    cmd.launch()


class Graph:
    def __init__(self, device):
        self.device, self.graph, self.graph_exec, self.outputs = device, None, None, None


def capture_begin():
    device = runtime.device
    runtime.core.wp_cuda_graph_begin_capture(device.stream)
    device.captures[device.stream] = Graph(device)        # _register_capture


def capture_end() -> Graph:
    device = runtime.device
    graph = device.captures.pop(device.stream)             # _unregister_capture
    graph.graph = runtime.core.wp_cuda_graph_end_capture(device.stream)
    return graph


def capture_pause(stream=None) -> Graph:
    device = runtime.device
    graph = device.captures.pop(device.stream, None)       # _unregister_capture
    if graph is None:
        raise RuntimeError("Graph capture is not active on this stream")
    graph.graph = runtime.core.wp_cuda_graph_pause_capture(device.stream)
    return graph


def capture_resume(graph: Graph, stream=None):
    device = runtime.device
    runtime.core.wp_cuda_graph_resume_capture(device.stream, graph.graph)
    device.captures[device.stream] = graph                 # _register_capture (new capture id)


def capture_while(condition: array, while_body, **kwargs):
    device = runtime.device
    stream = device.stream
    graph = device.captures.get(stream)
    if graph is None:
        # since no graph is active, just execute the kernels directly
        while bool(condition.data[0].item()):      # pinned readback + synchronize_stream upstream
            while_body(**kwargs)
        return

    # insert conditional while-node
    node = runtime.core.wp_cuda_graph_insert_while(stream, condition.data)
    body_graph = node.body
    # pause capturing parent graph and start capturing child graph
    main_graph = capture_pause(stream=stream)
    main_graph_ptr = main_graph.graph
    main_graph.graph = body_graph
    body_capture_active = False
    try:
        capture_resume(main_graph, stream=stream)
        body_capture_active = True
        while_body(**kwargs)                       # capture while-body
        runtime.core.wp_cuda_graph_set_condition(stream, condition.data, node)    # update condition
        capture_pause(stream=stream)               # stop capturing while-body
        body_capture_active = False
        # check the while-body graph
        if not runtime.core.wp_cuda_graph_check_conditional_body(body_graph):
            raise RuntimeError(runtime.get_error_string())
    except Exception:
        if body_capture_active:
            capture_pause(stream=stream)
        main_graph.graph = main_graph_ptr
        capture_resume(main_graph, stream=stream)
        raise
    # restore the main graph to its original state
    main_graph.graph = main_graph_ptr
    capture_resume(main_graph, stream=stream)


class ScopedCapture:
    """``with wp.ScopedCapture() as capture``: one CUDA graph of everything launched in the block."""

    def __init__(self, device, static, state):
        self.device, self.static, self.state = device, static, state

    def capture(self, fn) -> Graph:
        made = {}

        def captured():
            capture_begin()
            try:
                return fn()
            finally:
                made["graph"] = capture_end()

        graph_exec, outputs = capture(captured, device=self.device, warmups=0, name="newton solve",
                                      static=self.static, state=self.state, owner="wp.ScopedCapture")
        graph = made["graph"]
        graph.graph_exec, graph.outputs = graph_exec, outputs
        return graph


def capture_launch(graph: Graph):
    return replay(graph.graph_exec, graph.outputs)


# ----------------------------------------------------------------------------- warp/_src/optim/linear.py
class LinearOperator:
    def __init__(self, A: array):
        self.A, self.shape, self.device, self.scalar_type = A, A.shape, A.device, A.dtype
        self.batch_count, self.batch_offsets, self.max_batch_length = 1, None, None

    def matvec(self, x, y, z, alpha, beta):   # z = alpha * A x + beta * y
        launch(_dense_mv, inputs=[self.A, x, y, alpha, beta], outputs=[z])


def aslinearoperator(A):
    return A if A is None or isinstance(A, LinearOperator) else LinearOperator(A)


class TiledDot:
    def __init__(self, max_length, device, scalar_type, max_column_count=1):
        self._result = empty((max_column_count, 1), dtype=scalar_type, device=device)   # one batch

    def compute(self, a, b, col_offset=0):
        launch(_tiled_dot, inputs=[a, b, col_offset], outputs=[self._result])

    def col(self, col=0) -> array:
        return self._result[col]


def _dense_mv(A, x, y, alpha, beta, z): z.copy_(alpha * (A @ x) + beta * y)                 # noqa: E704
def _tiled_dot(a, b, col_offset, result): result[col_offset, 0].copy_((a * b).sum())         # noqa: E704


def _initialize_tolerance(rtol, atol, r_norm_sq, atol_sq):
    atol_sq.copy_(torch.clamp(rtol * r_norm_sq.sqrt(), min=atol) ** 2)


def _initialize_absolute_tolerance(b, tol, atol, tiled_dot, atol_sq):
    tiled_dot.compute(b, b)
    b_norm_sq = tiled_dot.col(0)
    eps = torch.finfo(atol_sq.dtype).eps
    tol = atol = tol if tol is not None else eps ** 0.75                  # _get_tolerances (atol None)
    launch(_initialize_tolerance, inputs=[tol, max(atol, eps ** 2.25), b_norm_sq, atol_sq])


def _update_condition(maxiter, cycle_size, cur_iter, r_norm_sq, atol_sq, condition):
    cur_iter.add_(cycle_size)
    converged = (r_norm_sq - atol_sq).max() <= 0
    condition.copy_(torch.where(converged | (cur_iter >= maxiter), 0, 1).to(torch.int32))


def _create_update_condition_kernel(batch_count):
    return _update_condition, 32


def _cg_kernel_1(tol, resid, rz_old, p_Ap, x, r, p, Ap):
    alpha = torch.where(resid > tol, rz_old / p_Ap, torch.zeros_like(rz_old))
    x.add_(alpha * p)
    r.sub_(alpha * Ap)


def _cg_kernel_2(tol, resid_new, rz_old, rz_new, z, p):
    beta = torch.where(resid_new > tol, rz_new / rz_old, torch.zeros_like(rz_old))
    p.copy_(z + beta * p)


class LinearSolverState:
    """Pre-allocated state for a linear iterative solver (calling it runs the solver)."""

    def __init__(self, A, b, x, tol=None, atol=None, maxiter=0, M=None, callback=None, check_every=10,
                 use_cuda_graph=True):
        self._A, self._M, self._b, self._x = aslinearoperator(A), aslinearoperator(M), b, x
        self._tol, self._atol, self._callback = tol, atol, callback
        self._check_every, self._use_cuda_graph = check_every, use_cuda_graph
        self._device, self._scalar_type = self._A.device, self._A.scalar_type
        self._batch_count = self._A.batch_count
        if maxiter is None or maxiter == 0:
            maxiter = b.shape[0] // self._batch_count
        self._maxiter = int(maxiter)
        if _variant == "fix":
            self._cur_iter_and_condition = empty((2,), dtype=torch.int32, device=self._device)
        self._allocate()

    def __call__(self, A=None, b=None, x=None, M=None):
        return self._run(self._A if A is None else aslinearoperator(A), self._b if b is None else b,
                         self._x if x is None else x, self._M if M is None else aslinearoperator(M))


class CG(LinearSolverState):
    def _allocate(self):
        b, device = self._b, self._device
        self._r_and_z_buf = empty((2, b.shape[0]), dtype=b.dtype, device=device)
        self._p_and_Ap = empty((2, b.shape[0]), dtype=b.dtype, device=device)
        self._residuals = empty((2, self._batch_count), dtype=self._scalar_type, device=device)
        self._tiled_dot = TiledDot(max_length=b.shape[0], device=device, scalar_type=self._scalar_type,
                                   max_column_count=2)
        self._r_repeated = array(self._r_and_z_buf.data[0:1].expand(2, b.shape[0]))   # _repeat_first

    def _run(self, A, b, x, M):
        assert M is None                      # the preconditioned path is left out
        tiled_dot, p_and_Ap = self._tiled_dot, self._p_and_Ap
        r_and_z = self._r_repeated            # without preconditioner r == z
        rz_new = tiled_dot.col(0)
        r, z = r_and_z[0], r_and_z[1]
        r_norm_sq = tiled_dot.col(0)
        p, Ap = p_and_Ap[0], p_and_Ap[1]
        rz_old, atol_sq = self._residuals[0], self._residuals[1]

        Ap.zero_()
        z.zero_()
        _initialize_absolute_tolerance(b, self._tol, self._atol, tiled_dot, atol_sq)
        A.matvec(x, b, r, alpha=-1.0, beta=1.0)

        def update_rr_rz():
            tiled_dot.compute(r, r)

        update_rr_rz()
        p.assign(z)

        def do_iteration():
            rz_old.assign(rz_new)
            A.matvec(p, Ap, Ap, alpha=1, beta=0)
            tiled_dot.compute(p, Ap, col_offset=1)
            p_Ap = tiled_dot.col(1)
            launch(_cg_kernel_1, dim=x.shape[0], inputs=[atol_sq, r_norm_sq, rz_old, p_Ap, x, r, p, Ap])
            update_rr_rz()
            launch(_cg_kernel_2, dim=z.shape[0], inputs=[atol_sq, r_norm_sq, rz_old, rz_new, z, p])

        return _run_capturable_loop(
            do_iteration,
            cur_iter_and_condition=self._cur_iter_and_condition if _variant == "fix" else None,
            r_norm_sq=r_norm_sq, maxiter=self._maxiter, atol_sq=atol_sq, callback=self._callback,
            check_every=self._check_every, use_cuda_graph=self._use_cuda_graph, cycle_size=1)


def cg(A, b, x, tol=None, atol=None, maxiter=0, M=None, callback=None, check_every=10, use_cuda_graph=True,
       run=True):
    state = CG(A, b, x, tol=tol, atol=atol, maxiter=maxiter, M=M, callback=callback, check_every=check_every,
               use_cuda_graph=use_cuda_graph)
    return state() if run else state


def _run_capturable_loop(do_cycle, r_norm_sq, maxiter, atol_sq, callback, check_every, use_cuda_graph,
                         cycle_size=1, cur_iter_and_condition=None):
    device = atol_sq.device
    batch_count = atol_sq.shape[0]
    if check_every > 0:
        raise NotImplementedError("_run_solver_loop (host-side residual checks) is left out")

    if _variant == "bug":
        cur_iter_and_condition = full((2,), value=-cycle_size, dtype=torch.int32, device=device)
    else:
        cur_iter_and_condition.fill_(-cycle_size)
    cur_iter = cur_iter_and_condition[0:1]
    condition = cur_iter_and_condition[1:2]

    update_condition_kernel, update_condition_tile_size = _create_update_condition_kernel(batch_count)
    update_condition_launch = launch(update_condition_kernel, dim=(1, update_condition_tile_size),
                                     block_dim=update_condition_tile_size, device=device,
                                     inputs=[int(maxiter), cycle_size, cur_iter, r_norm_sq, atol_sq, condition],
                                     record_cmd=True)
    update_condition_launch.launch()

    def do_cycle_with_condition():
        do_cycle()
        update_condition_launch.launch()

    if use_cuda_graph and device.is_cuda:
        # (not capturing: the solver's own ScopedCapture of the same loop, left out -- never reached here)
        assert device.is_capturing
        capture_while(condition, do_cycle_with_condition)
    else:
        for _ in range(0, maxiter, cycle_size):
            do_cycle_with_condition()
    return cur_iter, r_norm_sq, atol_sq


# ----------------------------------------------------------------------------- the user's device-resident Newton loop
def _newton_init(iteration, condition):
    iteration.zero_(), condition.fill_(1)


def _assemble(K, kappa, u, f, J, rhs):
    J.copy_(K + torch.diag(3.0 * kappa * u * u))
    rhs.copy_(f - K @ u - kappa * u ** 3)


def _newton_update(maxiter, tol, du, u, iteration, condition):
    u.add_(du)
    iteration.add_(1)
    condition.copy_((((du * du).sum() > tol * tol) & (iteration < maxiter)).to(torch.int32))


class NewtonSolver:
    def __init__(self, K: torch.Tensor, use_cuda_graph: bool):
        self.K = array(K.clone())
        self.f, self.u, self.du, self.rhs = (full(N, 0.0) for _ in range(4))
        self.J = full((N, N), 0.0)
        self.iteration, self.condition = full(1, 0, dtype=torch.int32), full(1, 0, dtype=torch.int32)
        self.linear_solver = cg(self.J, self.rhs, self.du, tol=CG_TOL, check_every=0,
                                use_cuda_graph=use_cuda_graph, run=False)

    def newton_iteration(self):
        launch(_assemble, inputs=[self.K, KAPPA, self.u, self.f], outputs=[self.J, self.rhs])
        self.du.zero_()
        self.linear_solver()
        launch(_newton_update, inputs=[NEWTON_MAXITER, NEWTON_TOL, self.du],
               outputs=[self.u, self.iteration, self.condition])

    def solve(self):
        launch(_newton_init, outputs=[self.iteration, self.condition])
        capture_while(self.condition, self.newton_iteration)
        return self.u.data, self.iteration.data


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1773)
    A = torch.randn(N, N, generator=gen, dtype=DTYPE) * 0.3
    K = (A @ A.T + 2.0 * torch.eye(N, dtype=DTYPE)).to(device)
    loads = [(torch.randn(N, generator=gen, dtype=DTYPE) * 0.8 * (t + 1)).to(device) for t in range(LOAD_STEPS)]

    def serve(use_cuda_graph: bool):
        global runtime
        runtime = Runtime(device)
        solver = NewtonSolver(K, use_cuda_graph)
        graph = None
        if use_cuda_graph:
            graph = ScopedCapture(device, {"f": solver.f.data}, {"u": solver.u.data}).capture(solver.solve)
        outs = []
        for f in loads:
            solver.f.data.copy_(f)
            u, iteration = capture_launch(graph) if graph is not None else solver.solve()
            outs += [u.clone(), iteration.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
