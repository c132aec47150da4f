"""cuOpt's batch LP solve (``call_batch_solve``) runs several PDLP solves at once, one per OpenMP host thread, each on
its own non-blocking stream. Every solve starts with ``setup_device_symbols()``, which writes PDLP's hyper-parameters
into ``__constant__`` device symbols (``pdlp_hyper_params::default_reduction_exponent``, ...) with the synchronous
``cudaMemcpyToSymbol``: a copy on the legacy default stream that the host waits for. PDLP itself captures its steps
into CUDA graphs (``ping_pong_graph_t``, ``cudaStreamCaptureModeThreadLocal``) the first time each iteration parity
is seen. When one thread's solve starts while another thread is capturing its first PDHG step, the synchronous
symbol copy waits for the device in the middle of that capture: CUDA invalidates the capture, and the batch solve
fails (an intermittent CI failure, as upstream saw it). The fix (PR #34) switches every symbol write to
``cudaMemcpyToSymbolAsync`` on the solve's own stream, which does not wait, so the other thread's capture survives.

Upstream: https://github.com/NVIDIA/cuopt/pull/34 ("Fix graph bug seen when using batch", repository NVIDIA/cuopt,
author Nicolas Blin (Kh4ster), merged 2025-05-23 as commit 82de1e401760892ce3e0d92e00382222ee96da46, parent 88b8f0a).
Read, in a mirror of the repository: the whole diff of 82de1e4 (``set_adaptive_step_size_hyper_parameters``,
``set_restart_hyper_parameters``, ``set_pdlp_hyper_parameters`` moved from ``cudaMemcpyToSymbol`` to
``cudaMemcpyToSymbolAsync(..., stream_view)``; ``setup_device_symbols`` in ``linear_programming/solve.cu`` and
``mip/solve.cu`` passing the problem's stream; the CI, dependency and README changes it also carries); at its parent:
``utilities/ping_pong_graph.cuh`` (whole), ``pdhg.cu`` (``compute_At_y``, ``compute_primal_projection_with_gradient``,
``compute_next_dual_solution``, ``compute_next_primal_dual_solution`` with ``graph_all`` and
``graph_prim_proj_gradient_dual``, ``take_step``, ``update_solution``), ``adaptive_step_size_strategy.cu``
(``compute_step_sizes``, ``compute_interaction_and_movement``, the kernel
``compute_step_sizes_from_movement_and_interaction``), ``pdlp.cu`` (``take_step``, ``compute_initial_step_size``,
the initial primal weight kernel, the start of ``run_solver``), ``solve.cu`` (``solve_lp``, ``setup_device_symbols``),
``utilities/cython_solve.cu`` (``call_solve``, ``compute_max_thread``, ``call_batch_solve``), ``utils.cuh``
(``primal_projection``, ``dual_projection``), ``pdlp_hyper_params.cuh``/``.cu`` (the ``__constant__`` symbols and
their host defaults), ``pdlp_constants.hpp`` (``divergent_movement``). Also the two later fixes of the same
intermittent failure and the first one's diff: #68 (batch solves on blocking streams, "preventing any
cudaMalloc/Free while another stream might be doing a CUDA Graph capture") and #110 (a thrust pinned allocator
launching work on the default stream during a capture).
Not read: any issue, review thread or CI log (the PR links none, and I found none); the restart, termination,
scaling, warm-start and averaging code; the cuSPARSE/cuBLAS wrappers; the Python batch API and its test. Which
symbol copy met which capture in CI is not recorded anywhere I read: the interleaving here is the one the PR
describes ("another CPU thread ... call cudaMemcpyToSymbol while another was trying to capture on its stream").
Symptom: PR #34: "Should fix the interment CI issue we were seeing in batch mode"; #68 calls it "the invalid
operation while there is a graph capture we sometimes see when using batch solve". The batch solve aborts with a
CUDA error; a solve alone, or any solve without graphs, is fine.
Mechanism: thread 0's first ``take_step`` captures ``graph_all`` (even parity) in thread-local mode. Thread 1 starts
its solve meanwhile; ``solve_lp`` calls ``setup_device_symbols()``, whose first ``cudaMemcpyToSymbol`` (in
``set_adaptive_step_size_hyper_parameters``) waits for the device while thread 0's capture is open. CUDA refuses the
wait on thread 1 and invalidates the capture, so thread 0's ``cudaStreamEndCapture`` fails ("operation failed due
to a previous error during capture"). Without graphs the same copy waits and returns.
Doctor: sync-in-capture, at ``set_adaptive_step_size_hyper_parameters``: a host wait for the device (the synchronous
symbol copy) is made while a capture is open (on another thread; a device-wide wait breaks a capture in any mode),
and this function is where the synchronous API is chosen: the first of the three ``set_*_hyper_parameters`` that
``setup_device_symbols`` calls, all of which the fix changes.
Fix (upstream): the three ``set_*_hyper_parameters`` take a ``rmm::cuda_stream_view`` and call
``cudaMemcpyToSymbolAsync(symbol, &host_value, sizeof(double), 0, cudaMemcpyHostToDevice, stream_view)``;
``setup_device_symbols`` passes ``op_problem.get_handle_ptr()->get_stream()``. The values written are unchanged.
Modelled: ``pdlp_hyper_params`` (the ``__constant__`` symbols, one set per device shared by all threads, and their
``host_*`` defaults), ``set_adaptive_step_size_hyper_parameters``, ``set_restart_hyper_parameters``,
``set_pdlp_hyper_parameters``, ``setup_device_symbols``, ``ping_pong_graph_t``, ``pdhg_solver_t`` (``compute_At_y``,
``compute_primal_projection_with_gradient``, ``compute_next_dual_solution``, ``compute_next_primal_dual_solution``,
``take_step``, ``update_solution``), ``adaptive_step_size_strategy_t`` (``compute_step_sizes``,
``compute_interaction_and_movement``, ``get_primal_and_dual_stepsizes``),
``compute_step_sizes_from_movement_and_interaction``, ``pdlp_solver_t`` (``compute_initial_step_size``,
``compute_initial_primal_weight``, ``run_solver``, ``take_step``), ``solve_lp``, ``call_solve``, ``call_batch_solve``.
Stand-ins: the OpenMP threads are ``threading.Thread``s whose timing is fixed by ``threading.Event`` hand-offs
(``_BatchTimeline``): thread 1 starts ``setup_device_symbols`` while thread 0 captures its first PDHG step, and
otherwise the two solves do not overlap (the engine's CUDA captures share torch's capture stream). The synchronous
``cudaMemcpyToSymbol`` is the engine's device-wide ``synchronize`` followed by a fill; ``cudaMemcpyToSymbolAsync``
is the fill alone on the solve's stream. ``ping_pong_graph_t.run`` does ``is_initialized`` / ``start_capture`` /
body / ``end_capture`` / ``launch`` in one call, with ``kit.capture`` (no warmup, as cuOpt's) and ``kit.replay``.
Dense ``A`` for the cuSPARSE CSR matrix; one stream for the two side streams of ``compute_interaction_and_movement``;
``valid_step_size`` (a host-mapped variable upstream) read with ``.item()`` after the launch, where cuOpt
synchronizes its stream. No scaling, restarts, averaging or termination checks: each solve runs ``ITERATIONS``
PDLP iterations; the combined bounds for the primal weight are each constraint's largest finite bound magnitude.
``use_graphs=False`` (the run without graphs) runs every captured body directly. A failed solve fails the batch
(its first error is raised): ``solve_lp`` catches only ``cuopt::logic_error`` and ``std::bad_alloc``, so a
``raft::cuda_error`` leaves the OpenMP loop (my reading). That a synchronous legacy-stream copy on one thread breaks
a thread-local capture on another thread's non-blocking stream is the PR's statement, modelled by the engine's rule
that a device-wide wait breaks a capture in any mode; #68 and #110 show other sources of the same failure remained.
Workload: a batch of two random feasible LPs (6 variables in [0, 5], 4 two-sided constraints, float64), 12 PDLP
iterations each. Outputs: each solve's primal and dual solution, step size and PDHG iteration count.
Measured: the check printed (the bug's message wrapped here)
  cuopt_34_batch_pdlp_symbol_copy_syncs_during_other_threads_capture [bug] on cpu: misbehaves (raised
  WaitedElsewhereError: operation failed due to a previous error during capture: synchronize() at
  workbench/zoo/trials/round147/cuopt_34_batch_pdlp_symbol_copy_syncs_during_other_threads_capture.py:141 in
  set_adaptive_step_size_hyper_parameters: synchronize(device), on another thread, waited for the device while pdhg
  graph_all (even, problem 0) was being captured in 'thread_local' mode, and CUDA invalidated the capture.)
  cuopt_34_batch_pdlp_symbol_copy_syncs_during_other_threads_capture [fix] on cpu: equals eager
  (max |graph - eager| = 0)
Without graphs both solves finish (problem 1 needs 14 PDHG steps for its 12 PDLP iterations: two step sizes are
retried, so both ping-pong graph sets replay); with the fix the graph run equals that bit for bit. The whole check
took about 4 s on the CPU.
"""
from __future__ import annotations

import contextlib
import threading
import types

import torch
from torch import Tensor

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/cuopt/pull/34"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "set_adaptive_step_size_hyper_parameters"
SYMPTOM = ("a batch LP solve intermittently fails with a CUDA error: one thread's synchronous cudaMemcpyToSymbol of "
           "PDLP hyper-parameters waits for the device while another thread captures its PDHG step, invalidating "
           "the capture")

N, M, ITERATIONS, DTYPE = 6, 4, 12, torch.float64
MAX_RETRIES, WAIT_S = 50, 30.0
_variant = "bug"

# --- pdlp_hyper_params: host defaults and the __constant__ symbols (one set per device, shared by all threads) ---
host_default_reduction_exponent, host_default_growth_exponent = 0.3, 0.6
host_default_primal_weight_update_smoothing = 0.5
host_default_sufficient_reduction_for_restart, host_default_necessary_reduction_for_restart = 0.2, 0.8
host_primal_importance, host_primal_distance_smoothing, host_dual_distance_smoothing = 1.0, 0.5, 0.5
initial_step_size_scaling = 1.0
divergent_movement = 1.0e100
_SYMBOLS: dict = {}


def pdlp_hyper_params(device) -> types.SimpleNamespace:
    """The device's ``__constant__ double`` symbols (zero until ``setup_device_symbols`` writes them)."""
    key = str(torch.device(device))
    if key not in _SYMBOLS:
        names = ("default_reduction_exponent", "default_growth_exponent", "default_primal_weight_update_smoothing",
                 "default_sufficient_reduction_for_restart", "default_necessary_reduction_for_restart",
                 "primal_importance", "primal_distance_smoothing", "dual_distance_smoothing")
        _SYMBOLS[key] = types.SimpleNamespace(**{n: torch.zeros((), dtype=DTYPE, device=device) for n in names})
    return _SYMBOLS[key]


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def set_adaptive_step_size_hyper_parameters(device, stream_view=None) -> None:
    s = pdlp_hyper_params(device)
    for symbol, host_value in ((s.default_reduction_exponent, host_default_reduction_exponent),
                               (s.default_growth_exponent, host_default_growth_exponent),
                               (s.primal_distance_smoothing, host_primal_distance_smoothing),
                               (s.dual_distance_smoothing, host_dual_distance_smoothing)):
        if stream_view is None:            # cudaMemcpyToSymbol: on the legacy default stream, the host waits
            synchronize(device)
            symbol.fill_(host_value)
        else:                              # cudaMemcpyToSymbolAsync(..., cudaMemcpyHostToDevice, stream_view)
            with _on(stream_view.stream):
                symbol.fill_(host_value)


def set_restart_hyper_parameters(device, stream_view=None) -> None:
    s = pdlp_hyper_params(device)
    for symbol, host_value in ((s.default_primal_weight_update_smoothing, host_default_primal_weight_update_smoothing),
                               (s.default_sufficient_reduction_for_restart,
                                host_default_sufficient_reduction_for_restart),
                               (s.default_necessary_reduction_for_restart,
                                host_default_necessary_reduction_for_restart),
                               (s.primal_distance_smoothing, host_primal_distance_smoothing),
                               (s.dual_distance_smoothing, host_dual_distance_smoothing)):
        if stream_view is None:
            synchronize(device)
            symbol.fill_(host_value)
        else:
            with _on(stream_view.stream):
                symbol.fill_(host_value)


def set_pdlp_hyper_parameters(device, stream_view=None) -> None:
    symbol = pdlp_hyper_params(device).primal_importance
    if stream_view is None:
        synchronize(device)
        symbol.fill_(host_primal_importance)
    else:
        with _on(stream_view.stream):
            symbol.fill_(host_primal_importance)


def setup_device_symbols(device, stream_view) -> None:
    if _variant == "bug":                  # before #34: no stream, synchronous copies
        set_adaptive_step_size_hyper_parameters(device)
        set_restart_hyper_parameters(device)
        set_pdlp_hyper_parameters(device)
    else:                                  # #34: setup_device_symbols(op_problem.get_handle_ptr()->get_stream())
        set_adaptive_step_size_hyper_parameters(device, stream_view)
        set_restart_hyper_parameters(device, stream_view)
        set_pdlp_hyper_parameters(device, stream_view)


# --- graphs -----------------------------------------------------------------------------------------------------

class ping_pong_graph_t:
    """One graph per parity of ``total_pdlp_iterations``: ``update_solution`` swaps buffers instead of copying, so
    even and odd steps read and write different buffers. ``run``: capture the body the first time this parity is
    seen (``start_capture``/``end_capture``, thread-local mode), then ``launch``."""

    def __init__(self, device, name: str, problem_id: int, use_graphs: bool, state):
        self.device_, self.name_, self.problem_id_, self.use_graphs_, self.state_ = device, name, problem_id, \
            use_graphs, state
        self.instances_: list = [None, None]

    def is_initialized(self, total_pdlp_iterations: int) -> bool:
        return self.instances_[total_pdlp_iterations % 2] is not None

    def run(self, total_pdlp_iterations: int, body) -> None:
        if not self.use_graphs_:
            body()
            return
        parity = total_pdlp_iterations % 2
        if not self.is_initialized(total_pdlp_iterations):
            self.instances_[parity] = capture(
                body, device=self.device_, warmups=0, state=self.state_(), owner="cuOpt ping_pong_graph_t",
                name=f"{self.name_} ({('even', 'odd')[parity]}, problem {self.problem_id_})",
                capture_error_mode="thread_local")
        g, outputs = self.instances_[parity]
        replay(g, outputs)


# --- PDHG and the adaptive step size ----------------------------------------------------------------------------

class pdhg_solver_t:
    def __init__(self, problem: dict, device, problem_id: int, use_graphs: bool, timeline):
        self.problem_, self.timeline_, self.problem_id_ = problem, timeline, problem_id

        def z(k):
            return torch.zeros(k, dtype=DTYPE, device=device)
        self.primal_solution_ = torch.zeros(N, dtype=DTYPE, device=device).clamp(problem["var_lower"],
                                                                                 problem["var_upper"])
        self.dual_solution_ = z(M)
        self.potential_next_primal_solution_, self.potential_next_dual_solution_ = z(N), z(M)
        self.delta_primal_, self.delta_dual_, self.tmp_primal_, self.dual_gradient_ = z(N), z(M), z(N), z(M)
        self.current_AtY_, self.next_AtY_ = z(N), z(N)
        self.total_pdhg_iterations_ = 0
        self.d_total_pdhg_iterations_ = torch.zeros((), dtype=torch.int64, device=device)
        self.graph_all = ping_pong_graph_t(device, "pdhg graph_all", problem_id, use_graphs, self.state)
        self.graph_prim_proj_gradient_dual = ping_pong_graph_t(device, "pdhg graph_prim_proj_gradient_dual",
                                                               problem_id, use_graphs, self.state)

    def state(self) -> dict:
        return {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}

    def compute_At_y(self) -> None:
        self.current_AtY_.copy_(self.problem_["A"].t() @ self.dual_solution_)

    def compute_primal_projection_with_gradient(self, primal_step_size: Tensor) -> None:
        p = self.problem_
        gradient = p["c"] - self.current_AtY_
        nxt = torch.maximum(torch.minimum(self.primal_solution_ - primal_step_size * gradient, p["var_upper"]),
                            p["var_lower"])
        self.potential_next_primal_solution_.copy_(nxt)
        self.delta_primal_.copy_(nxt - self.primal_solution_)
        self.tmp_primal_.copy_(nxt - self.primal_solution_ + nxt)

    def compute_next_dual_solution(self, dual_step_size: Tensor) -> None:
        p = self.problem_
        self.dual_gradient_.copy_(p["A"] @ self.tmp_primal_)
        nxt = self.dual_solution_ - dual_step_size * self.dual_gradient_
        low, up = nxt + dual_step_size * p["con_lower"], nxt + dual_step_size * p["con_upper"]
        nxt = torch.maximum(low, up.clamp(max=0.0))
        self.potential_next_dual_solution_.copy_(nxt)
        self.delta_dual_.copy_(nxt - self.dual_solution_)

    def compute_next_primal_dual_solution(self, primal_step_size, dual_step_size, total_pdlp_iterations) -> None:
        outputs = (self.potential_next_primal_solution_, self.potential_next_dual_solution_)
        if self.total_pdhg_iterations_ == 0:
            def step_all():
                self.timeline_.first_pdhg_step(self.problem_id_)   # (stand-in) the other thread's timing
                self.compute_At_y()
                self.compute_primal_projection_with_gradient(primal_step_size)
                self.compute_next_dual_solution(dual_step_size)
                return outputs
            self.graph_all.run(total_pdlp_iterations, step_all)
        else:
            def step_without_At_y():
                self.compute_primal_projection_with_gradient(primal_step_size)
                self.compute_next_dual_solution(dual_step_size)
                return outputs
            self.graph_prim_proj_gradient_dual.run(total_pdlp_iterations, step_without_At_y)

    def take_step(self, primal_step_size, dual_step_size, total_pdlp_iterations) -> None:
        self.compute_next_primal_dual_solution(primal_step_size, dual_step_size, total_pdlp_iterations)
        self.total_pdhg_iterations_ += 1

    def update_solution(self) -> None:
        """Swap, not copy: the accepted next solution (and next A_t @ y) becomes current."""
        self.primal_solution_, self.potential_next_primal_solution_ = \
            self.potential_next_primal_solution_, self.primal_solution_
        self.dual_solution_, self.potential_next_dual_solution_ = \
            self.potential_next_dual_solution_, self.dual_solution_
        self.current_AtY_, self.next_AtY_ = self.next_AtY_, self.current_AtY_


def compute_step_sizes_from_movement_and_interaction(view: dict, primal_step_size, dual_step_size, pdhg_iteration):
    """The one-thread kernel: reads PDLP's ``__constant__`` symbols; device-side branches as ``torch.where``."""
    hp = pdlp_hyper_params(primal_step_size.device)
    w = view["primal_weight"]
    movement = (hp.primal_distance_smoothing * w * view["norm_squared_delta_primal"]
                + (hp.dual_distance_smoothing / w) * view["norm_squared_delta_dual"])
    ok = (movement > 0) & (movement < divergent_movement)
    interaction, step = view["interaction"].abs(), view["step_size"]
    pdhg_iteration.copy_(torch.where(ok, pdhg_iteration + 1, pdhg_iteration))
    k = pdhg_iteration.to(DTYPE)
    limit = torch.where(interaction > 0, movement / torch.where(interaction > 0, interaction, 1.0),
                        torch.full_like(movement, float("inf")))
    valid = view["valid_step_size"]
    valid.copy_(torch.where(~ok, -1, torch.where(step <= limit, 1, valid)))
    candidate_1 = (1.0 - torch.pow(k + 1.0, -hp.default_reduction_exponent)) * limit
    candidate_2 = (1.0 + torch.pow(k + 1.0, -hp.default_growth_exponent)) * step
    new_step = torch.minimum(candidate_1, candidate_2)
    primal_step_size.copy_(torch.where(ok, new_step / w, primal_step_size))
    dual_step_size.copy_(torch.where(ok, new_step * w, dual_step_size))
    step.copy_(torch.where(ok, new_step, step))


class adaptive_step_size_strategy_t:
    def __init__(self, device, problem_id: int, use_graphs: bool, step_size: Tensor, primal_weight: Tensor):
        def s(dtype=DTYPE):
            return torch.zeros((), dtype=dtype, device=device)
        self.step_size_, self.primal_weight_ = step_size, primal_weight
        self.interaction_, self.norm_squared_delta_primal_, self.norm_squared_delta_dual_ = s(), s(), s()
        self.valid_step_size_ = s(torch.int64)
        self.graph = ping_pong_graph_t(device, "adaptive step size", problem_id, use_graphs,
                                       lambda: {k: v for k, v in vars(self).items() if isinstance(v, Tensor)})

    def view(self) -> dict:
        return {"primal_weight": self.primal_weight_, "step_size": self.step_size_, "interaction": self.interaction_,
                "norm_squared_delta_primal": self.norm_squared_delta_primal_,
                "norm_squared_delta_dual": self.norm_squared_delta_dual_, "valid_step_size": self.valid_step_size_}

    def get_valid_step_size(self) -> int:
        return int(self.valid_step_size_.item())

    def set_valid_step_size(self, valid: int) -> None:
        self.valid_step_size_.fill_(valid)

    def get_primal_and_dual_stepsizes(self, primal_step_size: Tensor, dual_step_size: Tensor) -> None:
        primal_step_size.copy_(self.step_size_ / self.primal_weight_)
        dual_step_size.copy_(self.step_size_ * self.primal_weight_)

    def compute_interaction_and_movement(self, pdhg: pdhg_solver_t) -> None:
        pdhg.next_AtY_.copy_(pdhg.problem_["A"].t() @ pdhg.potential_next_dual_solution_)
        pdhg.tmp_primal_.copy_(pdhg.next_AtY_ - pdhg.current_AtY_)
        self.interaction_.copy_(torch.dot(pdhg.tmp_primal_, pdhg.delta_primal_))
        self.norm_squared_delta_primal_.copy_(torch.dot(pdhg.delta_primal_, pdhg.delta_primal_))
        self.norm_squared_delta_dual_.copy_(torch.dot(pdhg.delta_dual_, pdhg.delta_dual_))

    def compute_step_sizes(self, pdhg, primal_step_size, dual_step_size, total_pdlp_iterations) -> None:
        def body():
            self.compute_interaction_and_movement(pdhg)
            compute_step_sizes_from_movement_and_interaction(self.view(), primal_step_size, dual_step_size,
                                                             pdhg.d_total_pdhg_iterations_)
            return (primal_step_size, dual_step_size, self.valid_step_size_)
        self.graph.run(total_pdlp_iterations, body)
        # cudaStreamSynchronize(stream_view_): the host then reads valid_step_size


class pdlp_solver_t:
    def __init__(self, problem: dict, device, problem_id: int, use_graphs: bool, timeline):
        def s():
            return torch.zeros((), dtype=DTYPE, device=device)
        self.problem_, self.device_ = problem, device
        self.step_size_, self.primal_weight_, self.primal_step_size_, self.dual_step_size_ = s(), s(), s(), s()
        self.step_size_.fill_(initial_step_size_scaling)
        self.pdhg_solver_ = pdhg_solver_t(problem, device, problem_id, use_graphs, timeline)
        self.step_size_strategy_ = adaptive_step_size_strategy_t(device, problem_id, use_graphs, self.step_size_,
                                                                 self.primal_weight_)
        self.total_pdlp_iterations_ = 0

    def compute_initial_step_size(self) -> None:
        self.step_size_.copy_(self.step_size_ / self.problem_["A"].abs().max())

    def compute_initial_primal_weight(self) -> None:
        p, hp = self.problem_, pdlp_hyper_params(self.device_)
        b_vec_norm = torch.linalg.vector_norm(p["combined_bounds"])
        c_vec_norm = torch.linalg.vector_norm(p["c"])
        ratio = torch.where((b_vec_norm > 0) & (c_vec_norm > 0), c_vec_norm / b_vec_norm, 1.0)
        self.primal_weight_.copy_(hp.primal_importance * ratio)

    def take_step(self, total_pdlp_iterations: int) -> None:
        self.step_size_strategy_.set_valid_step_size(0)
        for _ in range(MAX_RETRIES):
            if self.step_size_strategy_.get_valid_step_size() != 0:
                break
            self.pdhg_solver_.take_step(self.primal_step_size_, self.dual_step_size_, total_pdlp_iterations)
            self.step_size_strategy_.compute_step_sizes(self.pdhg_solver_, self.primal_step_size_,
                                                        self.dual_step_size_, total_pdlp_iterations)
        self.pdhg_solver_.update_solution()

    def run_solver(self) -> list:
        self.compute_initial_step_size()
        self.compute_initial_primal_weight()
        self.step_size_strategy_.get_primal_and_dual_stepsizes(self.primal_step_size_, self.dual_step_size_)
        for _ in range(ITERATIONS):
            self.take_step(self.total_pdlp_iterations_)
            self.total_pdlp_iterations_ += 1
        pdhg = self.pdhg_solver_
        return [pdhg.primal_solution_.clone(), pdhg.dual_solution_.clone(), self.step_size_.clone(),
                pdhg.d_total_pdhg_iterations_.to(DTYPE)]


# --- batch solve ------------------------------------------------------------------------------------------------

class _BatchTimeline:
    """(stand-in) The OpenMP threads' timing, fixed: thread 1 starts ``setup_device_symbols`` while thread 0 is in
    its first PDHG step (which a graph run captures); otherwise the two solves do not overlap."""

    def __init__(self):
        self.b_ready, self.a_in_first_step = threading.Event(), threading.Event()
        self.b_setup_done, self.a_done = threading.Event(), threading.Event()
        self._first_step_seen = False

    @staticmethod
    def _wait(event: threading.Event) -> None:
        if not event.wait(WAIT_S):
            raise TimeoutError("batch timeline: the other solve never arrived")

    def before_setup(self, problem_id: int) -> None:
        if problem_id == 1:
            self.b_ready.set()
            self._wait(self.a_in_first_step)

    def after_setup(self, problem_id: int) -> None:
        if problem_id == 0:
            self._wait(self.b_ready)
        else:
            self.b_setup_done.set()
            self._wait(self.a_done)

    def first_pdhg_step(self, problem_id: int) -> None:
        if problem_id == 0 and not self._first_step_seen:
            self._first_step_seen = True
            self.a_in_first_step.set()
            self._wait(self.b_setup_done)

    def release(self, problem_id: int) -> None:
        for event in ((self.a_in_first_step, self.a_done) if problem_id == 0 else (self.b_ready, self.b_setup_done)):
            event.set()


def solve_lp(problem: dict, device, stream_view, problem_id: int, use_graphs: bool, timeline) -> list:
    timeline.before_setup(problem_id)
    setup_device_symbols(device, stream_view)
    timeline.after_setup(problem_id)
    return pdlp_solver_t(problem, device, problem_id, use_graphs, timeline).run_solver()


def call_solve(data_model: dict, device, problem_id: int, use_graphs: bool, timeline) -> list:
    """``cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)``, then the problem on that stream."""
    stream = torch.cuda.Stream() if torch.device(device).type == "cuda" else None
    stream_view = types.SimpleNamespace(stream=stream)
    with _on(stream):
        problem = {k: v.to(device) for k, v in data_model.items()}
        return solve_lp(problem, device, stream_view, problem_id, use_graphs, timeline)


def call_batch_solve(data_models: list, device, use_graphs: bool) -> list:
    """``#pragma omp parallel for num_threads(max_thread)`` over ``call_solve``."""
    pdlp_hyper_params(device)
    timeline = _BatchTimeline()
    results, errors = [None] * len(data_models), [None] * len(data_models)

    def worker(i: int) -> None:
        try:
            results[i] = call_solve(data_models[i], device, i, use_graphs, timeline)
        except BaseException as e:  # noqa: BLE001 - a solve's failure is reported by the batch
            errors[i] = e
        finally:
            timeline.release(i)

    threads = [threading.Thread(target=worker, args=(i,), name=f"batch-solve-{i}") for i in range(len(data_models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return [t for r in results for t in r]


def make_data_model(seed: int) -> dict:
    gen = generator(seed)
    A = torch.randn(M, N, generator=gen, dtype=DTYPE)
    x0 = torch.rand(N, generator=gen, dtype=DTYPE) * 4.0 + 0.5
    r = torch.rand(M, generator=gen, dtype=DTYPE) + 0.1
    lower, upper = A @ x0 - r, A @ x0 + r
    return {"A": A, "c": torch.randn(N, generator=gen, dtype=DTYPE), "var_lower": torch.zeros(N, dtype=DTYPE),
            "var_upper": torch.full((N,), 5.0, dtype=DTYPE), "con_lower": lower, "con_upper": upper,
            "combined_bounds": torch.maximum(lower.abs(), upper.abs())}


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    models = [make_data_model(340 + i) for i in range(2)]
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: call_batch_solve(models, device, use_graphs=True),
                   lambda: call_batch_solve(models, device, use_graphs=False))
