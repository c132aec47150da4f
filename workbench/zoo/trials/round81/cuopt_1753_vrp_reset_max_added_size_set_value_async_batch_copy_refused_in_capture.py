"""cuOpt's routing local search sets ``max_added_size`` with ``rmm::device_scalar::set_value_async`` inside the ``find_vrp_moves`` graph capture, and on CUDA 13 RMM sends that copy through ``cudaMemcpyBatchAsync``, which a capturing stream refuses.

Upstream: https://github.com/NVIDIA/cuopt/pull/1753 ("fix: avoid uncapturable RMM copies inside routing CUDA graph
captures", ramakrishnap-nv, NVIDIA/cuopt, merged 2026-08-20). Issue: https://github.com/NVIDIA/cuopt/issues/1748 ("All
CUDA 13 test jobs fail: RMM allocation during CUDA graph capture (cudaErrorStreamCaptureUnsupported)"). The trigger is
in RMM: https://github.com/rapidsai/rmm/pull/2511 ("Use cudaMemcpyBatchAsync for RMM copies", merged 2026-08-18),
reported as https://github.com/rapidsai/rmm/issues/2518. Follow-up: https://github.com/NVIDIA/cuopt/issues/1758
(``cuda_graph_t`` discards CUDA error codes).
Symptom: from the 2026-08-19 nightly on, every CUDA 13 test job failed (C++, Python, server, notebooks), and every
CUDA 12 job passed with the same cuOpt code. Each failure was ``CUDA error at: .../rmm/device_uvector.hpp:220:
cudaErrorStreamCaptureUnsupported operation not permitted when stream is capturing``, followed by a cascade of
``cudaErrorStreamCaptureInvalidated`` errors from unrelated call sites.
Mechanism: ``find_vrp_moves`` (cpp/src/routing/local_search/vrp/vrp_search.cu) opens a capture on the solution
handle's stream (``find_kernel_graph.start_capture``; ``cuda_graph_t`` in cpp/src/routing/cuda_graph.cuh captures
again on every call, updates the instantiated graph with ``cudaGraphExecUpdate`` and launches it once). Inside that
capture it calls ``vrp_move_candidates.reset(sol_handle)``
(cpp/src/routing/local_search/move_candidates/vrp_move_candidates.cuh) and then ``find_vrp_moves_kernel``. ``reset``
fills ``cost_delta``, ``best_cost_delta_per_node`` and ``best_id_per_node`` (``async_fill``, kernels), zeroes
``n_best_route_pair_moves`` (``set_value_to_zero_async``, a memset), and writes ``max_fragment_size`` into
``max_added_size`` with ``set_value_async``. ``device_scalar::set_value_async`` is
``device_uvector::set_element_async``: for a zero value it takes the memset path, and for any other value it calls
``RMM_CUDA_TRY(rmm::detail::memcpy_async(...))``. Since rmm#2511, ``memcpy_async`` (rmm cpp/src/cuda_memcpy.cpp)
dispatches to ``cudaMemcpyBatchAsync`` when ``CUDART_VERSION >= 13000`` and the stream is not the default stream.
The capturing stream refuses that call with 900 (``cudaErrorStreamCaptureUnsupported``), and ``RMM_CUDA_TRY``
throws, so ``find_vrp_moves`` never reaches ``end_capture``. Outside a capture the batched copy works, and on CUDA 12
the dispatch picks ``cudaMemcpyAsync``, which a capture records. ``max_added_size`` matters later: after
extraction, ``find_max_added_size_kernel`` (vrp_execute.cu) ``atomicMax``-es the 2-opt* route growth into it, and
``execute_vrp_moves`` reads it on the host to size the shared-memory route buffers
(``depot_excluded_max_route_size``).
Doctor: sync-in-capture, at reset (the call that the capturing stream refuses, the RMM scalar copy, is issued from
``vrp_move_candidates_t::reset`` while ``find_kernel_graph`` is capturing. The fix changes this line and only this
line of the search: it writes the same value with a copy that a capture can record).
Fix (upstream): in ``reset``, ``max_added_size.set_value_async(max_fragment_size, stream)`` becomes
``raft::copy(max_added_size.data(), &max_fragment_size, 1, stream)`` (``cudaMemcpyAsync``), with the comment "This runs
inside a graph capture. set_value_async routes through rmm::detail::memcpy_async, which is not capturable on CUDA
13; raft::copy is." The PR also wraps ``cudaStreamBeginCapture`` / ``cudaStreamEndCapture`` in ``cuda_graph_t`` with
``RAFT_CUDA_TRY``, so that a failed capture is reported where it happens. That part is not modelled: the engine
reports a refused call in both variants.
Modelled: a VRP with a depot, 10 orders and 4 routes, distances as float64, demand and one vehicle capacity. The
start solution assigns the orders to routes round robin. ``perform_vrp_search`` runs up to 8 times, and each run is
``find_vrp_moves`` plus ``select_and_execute_vrp_move``. Two move types are kept: single-node RELOCATE, inserted
before a neighbour, and 2-opt* (tail swap). Each sampled order is tried against its 4 nearest orders.
``find_vrp_moves_kernel`` is one vectorised routine; its ``record_candidate`` keeps the best move per route pair
(the lowest candidate index wins ties, where upstream's locks let any thread win). Compaction, the shuffled
non-overlapping extraction (with a seeded host generator in place of PCG), ``find_max_added_size_kernel`` and the
move execution run outside the capture, as upstream does. The execution builds each new route in a buffer sized from
``max_added_size``. ``recycle_unused_moves``, CROSS moves, fragments longer than one node, reversed fragments, time
windows and the excess penalties are left out. Stand-ins named after the CUDA runtime (``cudaMemcpyAsync``,
``cudaMemcpyBatchAsync``), RMM (``device_uvector``, ``device_scalar``, ``memcpy_async``, ``RMM_CUDA_TRY``) and RAFT
(``raft_copy``) carry the dispatch. ``cudaMemcpyBatchAsync`` returns 900 while a capture is open on either backend,
as the CUDA 13 runtime does. A host-to-device copy of one scalar is written as a fill: its source,
``max_fragment_size``, is a constexpr, so every replay copies the same 6. The build is CUDA 13
(``CUDART_VERSION = 13000``), and the solution handle's stream is a non-default stream. In the served run
``cuda_graph_t`` captures with ``thread_local`` mode, as at the fix. The eager reference runs the same search with
``find_kernel_graph`` turned off, so the region runs straight on the stream. When ``reset`` raises,
``cuda_graph_t.abandon_capture`` closes the emulated capture. Upstream leaves the stream capturing, which is where
the later 901 errors come from.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.engine import CaptureError, events, graph, is_capturing, new_graph, synchronize
from workbench.engine.source import user_frame
from workbench.zoo.kit import compare, generator, remember_step, replay

UPSTREAM = "https://github.com/NVIDIA/cuopt/pull/1753"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "reset"
SYMPTOM = ("every CUDA 13 routing solve fails with cudaErrorStreamCaptureUnsupported at rmm/device_uvector.hpp: "
           "vrp_move_candidates_t::reset writes max_added_size with device_scalar::set_value_async inside the "
           "find_vrp_moves capture, and RMM now sends that copy through cudaMemcpyBatchAsync")

CUDART_VERSION = 13000                   # the CUDA 13 builds (CUDA 12 builds: 12090, and they passed)
N_ORDERS, N_ROUTES = 10, 4
max_n_neighbors = 4
max_relocate_size, max_cross_size = 6, 3
max_fragment_size = max(max_relocate_size, max_cross_size)
EPSILON = 1e-6
DBL_MAX = torch.finfo(torch.float64).max
N_SEARCH_ITERATIONS = 8

cudaSuccess = 0
cudaErrorStreamCaptureUnsupported = 900
_ERROR_NAMES = {cudaErrorStreamCaptureUnsupported:
                "cudaErrorStreamCaptureUnsupported operation not permitted when stream is capturing"}


class vrp_move_t:
    RELOCATE = 0
    TWO_OPT_STAR = 1
    SIZE = 2


# --- CUDA runtime (stand-ins) ---------------------------------------------------------------------------

class cuda_stream_view:
    """rmm::cuda_stream_view. The solution handle owns its own rmm::cuda_stream, which is never the default stream."""

    def __init__(self, device: str, default: bool = False):
        self.device, self._default = device, default

    def is_default(self) -> bool:
        return self._default


def cudaMemcpyAsync(dst: torch.Tensor, value, count: int, kind, stream: cuda_stream_view) -> int:
    """One H2D copy of a host scalar. A capture records it as a memcpy node that reads the source address on each
    launch. The model records it as a fill by value, which is the same thing for a constant source."""
    dst.fill_(value)
    return cudaSuccess


def cudaMemcpyBatchAsync(dsts, srcs, sizes, count: int, attrs, attrs_idxs, num_attrs: int,
                         stream: cuda_stream_view) -> int:
    """The CUDA 13 batched copy. Eagerly it copies like cudaMemcpyAsync. It cannot be captured: on a capturing
    stream it returns 900 and copies nothing."""
    if is_capturing():
        return cudaErrorStreamCaptureUnsupported
    for dst, value in zip(dsts, srcs):
        dst.fill_(value)
    return cudaSuccess


cudaMemcpyDefault = "cudaMemcpyDefault"
cudaMemcpySrcAccessOrderStream = "cudaMemcpySrcAccessOrderStream"
cudaMemcpyFlagPreferOverlapWithCompute = "cudaMemcpyFlagPreferOverlapWithCompute"


# --- RMM (stand-ins) ---------------------------------------------------------------------------------------

class cuda_error(CaptureError):
    """rmm::cuda_error, thrown by RMM_CUDA_TRY. The only code it carries here is 900, a capture refusal."""


def RMM_CUDA_TRY(status: int, where: str) -> None:
    if status != cudaSuccess:
        source = user_frame()
        raise cuda_error(f"CUDA error at: {where}: {_ERROR_NAMES[status]}\n  at {source}",
                         op="cudaMemcpyBatchAsync", source=source)


def is_default_stream(stream: cuda_stream_view) -> bool:
    return stream.is_default()


def memcpy_async(dst: torch.Tensor, value, count: int, stream: cuda_stream_view) -> int:
    """rmm::detail::memcpy_async (cpp/src/cuda_memcpy.cpp, since rmm#2511)."""
    if count == 0:
        return cudaSuccess
    if CUDART_VERSION >= 13000:
        if not is_default_stream(stream):
            attrs = {"srcAccessOrder": cudaMemcpySrcAccessOrderStream,
                     "flags": cudaMemcpyFlagPreferOverlapWithCompute}
            return cudaMemcpyBatchAsync([dst], [value], [count], 1, [attrs], [0], 1, stream)
    return cudaMemcpyAsync(dst, value, count, cudaMemcpyDefault, stream)


class device_uvector:
    """rmm::device_uvector<T>: uninitialised device memory of ``size`` elements."""

    def __init__(self, size: int, stream: cuda_stream_view, dtype):
        self._data = torch.empty(size, dtype=dtype, device=stream.device)

    def data(self) -> torch.Tensor:
        return self._data

    def size(self) -> int:
        return self._data.numel()

    def element_ptr(self, element_index: int) -> torch.Tensor:
        return self._data[element_index:element_index + 1]

    def set_element_to_zero_async(self, element_index: int, stream: cuda_stream_view) -> None:
        self.element_ptr(element_index).zero_()                     # cudaMemsetAsync: capturable

    def set_element_async(self, element_index: int, value, stream: cuda_stream_view) -> None:
        if value == 0:                                              # std::is_fundamental: the memset path
            self.set_element_to_zero_async(element_index, stream)
            return
        RMM_CUDA_TRY(memcpy_async(self.element_ptr(element_index), value, self._data.element_size(), stream),
                     "rmm/device_uvector.hpp:220")

    def element(self, element_index: int, stream: cuda_stream_view):
        return self._data[element_index].item()                     # D2H copy + stream synchronisation


class device_scalar:
    """rmm::device_scalar<T>: a device_uvector of one element."""

    def __init__(self, stream: cuda_stream_view, dtype=torch.int32):
        self._storage = device_uvector(1, stream, dtype)

    def data(self) -> torch.Tensor:
        return self._storage.data()

    def set_value_async(self, value, stream: cuda_stream_view) -> None:
        self._storage.set_element_async(0, value, stream)

    def set_value_to_zero_async(self, stream: cuda_stream_view) -> None:
        self._storage.set_element_to_zero_async(0, stream)

    def value(self, stream: cuda_stream_view):
        return self._storage.element(0, stream)


# --- RAFT -------------------------------------------------------------------------------------------------

def raft_copy(dst: torch.Tensor, src, len_: int, stream: cuda_stream_view) -> None:
    """raft::copy: RAFT_CUDA_TRY(cudaMemcpyAsync(dst, src, len * sizeof(T), cudaMemcpyDefault, stream))."""
    status = cudaMemcpyAsync(dst[:len_], src, len_ * dst.element_size(), cudaMemcpyDefault, stream)
    assert status == cudaSuccess


def async_fill(vec: device_uvector, value, stream: cuda_stream_view) -> None:
    vec.data().fill_(value)                                          # a fill kernel


# --- cpp/src/routing/cuda_graph.cuh ------------------------------------------------------------------------

class cuda_graph_t:
    """Captures the region on every call, updates the executable graph with it, and launches that once."""

    def __init__(self, device: str, enabled: bool, name: str):
        self.device, self.enabled, self.name = device, enabled, name
        self.graph_created = False
        self.capture_started = False
        self.instance = None
        self._graph, self._capture = None, None
        self.region, self.outputs = None, ()

    def start_capture(self, stream: cuda_stream_view) -> None:
        if not self.enabled:                    # eager reference: the region runs on the stream
            return
        # cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal)
        self._graph = new_graph(self.device)
        self._capture = contextlib.ExitStack()
        self._capture.enter_context(graph(self._graph, name=self.name, capture_error_mode="thread_local"))
        self.capture_started = True

    def end_capture(self, stream: cuda_stream_view) -> None:
        if not self.enabled:
            return
        assert self.capture_started, "start_capture was not called before end_capture!"
        capture, self._capture = self._capture, None
        capture.close()                         # cudaStreamEndCapture(stream, &graph)
        self.capture_started = False
        remember_step(self._graph, self.region)
        # cudaGraphExecUpdate(instance, graph, ...) when graph_created, else cudaGraphInstantiate: either way
        # the executable graph now runs the kernels (and parameters) just captured.
        self.instance, self.graph_created = self._graph, True
        self._graph = None

    def launch_graph(self, stream: cuda_stream_view) -> None:
        if not self.enabled:
            return
        replay(self.instance, self.outputs)     # cudaGraphLaunch(instance, stream)

    def abandon_capture(self, exc: BaseException) -> None:
        """(Model only.) Upstream lets the exception leave with the stream still capturing; the emulation's
        capture is closed here so that the error is reported once."""
        if self._capture is not None:
            capture, self._capture = self._capture, None
            self.capture_started = False
            capture.__exit__(type(exc), exc, exc.__traceback__)


# --- cpp/src/routing/local_search/move_candidates/vrp_move_candidates.cuh ----------------------------------

class vrp_move_candidates_t:
    def __init__(self, n_orders: int, n_routes: int, sol_handle_, variant: str, use_cuda_graph: bool):
        stream = sol_handle_.get_stream()
        self.variant = variant
        n_pairs = n_routes * n_routes
        self.node_id_1 = device_uvector(n_pairs, stream, torch.int64)
        self.node_id_2 = device_uvector(n_pairs, stream, torch.int64)
        self.move_type = device_uvector(n_pairs, stream, torch.int64)
        self.cost_delta = device_uvector(n_pairs, stream, torch.float64)
        self.compacted_move_indices = device_uvector(n_pairs, stream, torch.int64)
        self.n_best_route_pair_moves = device_scalar(stream)
        self.selected_move_indices = device_uvector(n_orders + n_routes, stream, torch.int64)
        self.best_cost_delta_per_node = device_uvector(n_orders + n_routes, stream, torch.float64)
        self.best_id_per_node = device_uvector(n_orders + n_routes, stream, torch.int64)
        self.n_of_selected_moves = device_scalar(stream)
        self.max_added_size = device_scalar(stream)
        for v in (self.node_id_1, self.node_id_2, self.move_type, self.compacted_move_indices,
                  self.selected_move_indices):
            async_fill(v, 0, stream)
        self.find_kernel_graph = cuda_graph_t(stream.device, use_cuda_graph, "find_kernel_graph")
        if use_cuda_graph:
            events.written_metadata("vrp_move_candidates_t", self.written_by_find_kernel())

    def written_by_find_kernel(self) -> dict:
        return {"cost_delta": self.cost_delta.data(), "node_id_1": self.node_id_1.data(),
                "node_id_2": self.node_id_2.data(), "move_type": self.move_type.data(),
                "best_cost_delta_per_node": self.best_cost_delta_per_node.data(),
                "best_id_per_node": self.best_id_per_node.data(),
                "n_best_route_pair_moves": self.n_best_route_pair_moves.data(),
                "max_added_size": self.max_added_size.data()}

    def reset(self, sol_handle) -> None:
        stream = sol_handle.get_stream()
        async_fill(self.cost_delta, DBL_MAX, stream)
        async_fill(self.best_cost_delta_per_node, DBL_MAX, stream)
        async_fill(self.best_id_per_node, -1, stream)
        self.n_best_route_pair_moves.set_value_to_zero_async(stream)
        if self.variant == "bug":
            self.max_added_size.set_value_async(max_fragment_size, stream)
        else:
            # This runs inside a graph capture. set_value_async routes through
            # rmm::detail::memcpy_async, which is not capturable on CUDA 13; raft::copy is.
            raft_copy(self.max_added_size.data(), max_fragment_size, 1, stream)

    @staticmethod
    def get_route_pair_idx(r_1: torch.Tensor, r_2: torch.Tensor, n_routes: int) -> torch.Tensor:
        """Upper-triangular index of the route pair."""
        return torch.minimum(r_1, r_2) * n_routes + torch.maximum(r_1, r_2)

    def record_candidate(self, route_pair_idx, node_id_1_, node_id_2_, move_type_, cost_delta_, recorded):
        """For every candidate in ``recorded``: the best per node (``best_*_per_node``) and the best per route
        pair (``cost_delta``, ``node_id_*``, ``move_type``). Upstream takes a lock per slot; here the lowest
        candidate index wins a tie."""
        n_cand = cost_delta_.numel()
        cand_index = torch.arange(n_cand, device=cost_delta_.device)
        delta = torch.where(recorded, cost_delta_, torch.full_like(cost_delta_, DBL_MAX))

        best_node = self.best_cost_delta_per_node.data()
        best_node.scatter_reduce_(0, node_id_1_, delta, reduce="amin")
        win_node = recorded & (delta == best_node[node_id_1_])
        first = torch.full_like(best_node, n_cand, dtype=torch.int64).scatter_reduce_(
            0, node_id_1_, torch.where(win_node, cand_index, n_cand), reduce="amin")
        has = first < n_cand
        self.best_id_per_node.data().copy_(
            torch.where(has, node_id_2_[first.clamp_max(n_cand - 1)], self.best_id_per_node.data()))

        cost = self.cost_delta.data()
        cost.scatter_reduce_(0, route_pair_idx, delta, reduce="amin")
        win_pair = recorded & (delta == cost[route_pair_idx])
        first = torch.full_like(cost, n_cand, dtype=torch.int64).scatter_reduce_(
            0, route_pair_idx, torch.where(win_pair, cand_index, n_cand), reduce="amin")
        has = first < n_cand
        pick = first.clamp_max(n_cand - 1)
        for buf, values in ((self.node_id_1, node_id_1_), (self.node_id_2, node_id_2_),
                            (self.move_type, move_type_)):
            buf.data().copy_(torch.where(has, values[pick], buf.data()))


class move_candidates_t:
    def __init__(self, problem, sol_handle, variant: str, use_cuda_graph: bool):
        self.vrp_move_candidates = vrp_move_candidates_t(problem.n_orders, problem.n_routes, sol_handle, variant,
                                                         use_cuda_graph)
        device = sol_handle.get_stream().device
        self.sampled_nodes = torch.arange(1, problem.n_orders + 1, device=device)      # nodes_to_search


# --- problem, solution -------------------------------------------------------------------------------------

class problem_t:
    def __init__(self, device: str):
        gen = generator(1753)
        self.n_orders, self.n_routes = N_ORDERS, N_ROUTES
        coords = torch.rand(N_ORDERS + 1, 2, generator=gen, dtype=torch.float64) * 10.0
        self.distance = torch.cdist(coords, coords).to(device)                         # [depot + orders]^2
        demand = torch.randint(1, 4, (N_ORDERS + 1,), generator=gen).to(torch.float64)
        demand[0] = 0.0
        self.demand = demand.to(device)
        self.capacity = math.ceil(float(demand.sum()) / N_ROUTES) + 4.0
        d = torch.cdist(coords, coords)
        d[:, 0] = math.inf
        d.fill_diagonal_(math.inf)
        self.neighbors = torch.topk(d, max_n_neighbors, dim=1, largest=False).indices.to(device)   # viable neighbours


class solution_handle_t:
    def __init__(self, device: str):
        self.stream = cuda_stream_view(device)       # rmm::cuda_stream: a stream of its own

    def get_stream(self) -> cuda_stream_view:
        return self.stream

    def sync_stream(self) -> None:
        synchronize(self.stream.device)


class solution_t:
    """Routes as depot, orders..., depot; ``n_nodes`` counts the start depot and the orders (get_num_nodes)."""

    def __init__(self, problem: problem_t, sol_handle: solution_handle_t):
        self.problem, self.sol_handle = problem, sol_handle
        self.n_routes = problem.n_routes
        device = sol_handle.get_stream().device
        cap = problem.n_orders + 2
        self.route_nodes = torch.zeros(self.n_routes, cap, dtype=torch.int64, device=device)
        self.n_nodes = torch.zeros(self.n_routes, dtype=torch.int64, device=device)
        self.route_id_per_node = torch.full((problem.n_orders + 1,), -1, dtype=torch.int64, device=device)
        self.intra_route_idx_per_node = torch.zeros(problem.n_orders + 1, dtype=torch.int64, device=device)
        self.load_prefix = torch.zeros(self.n_routes, cap, dtype=torch.float64, device=device)
        self.load = torch.zeros(self.n_routes, dtype=torch.float64, device=device)
        routes = [[0] + list(range(r + 1, problem.n_orders + 1, self.n_routes)) for r in range(self.n_routes)]
        self.set_routes(routes)

    def view(self) -> dict:
        return {"route_nodes": self.route_nodes, "n_nodes": self.n_nodes, "route_id_per_node": self.route_id_per_node,
                "intra_route_idx_per_node": self.intra_route_idx_per_node, "load_prefix": self.load_prefix,
                "load": self.load}

    def set_routes(self, routes: list[list[int]]) -> None:
        """Routes copied into the solution, then compute_route_id_per_node and the load prefixes."""
        self.route_nodes.zero_()
        for r, nodes in enumerate(routes):
            self.route_nodes[r, :len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
            self.n_nodes[r] = len(nodes)
        self.compute_route_id_per_node()

    def get_routes(self) -> list[list[int]]:
        n_nodes = self.n_nodes.tolist()
        return [self.route_nodes[r, :n_nodes[r]].tolist() for r in range(self.n_routes)]

    def compute_route_id_per_node(self) -> None:
        for r, nodes in enumerate(self.get_routes()):
            for i, node in enumerate(nodes[1:], start=1):
                self.route_id_per_node[node] = r
                self.intra_route_idx_per_node[node] = i
        self.load_prefix.copy_(torch.cumsum(self.problem.demand[self.route_nodes], dim=1))
        self.load.copy_(self.load_prefix[:, -1])

    def get_max_active_nodes_for_all_routes(self) -> int:
        return int(self.n_nodes.max().item())

    def compute_cost(self) -> torch.Tensor:
        nxt = torch.roll(self.route_nodes, -1, dims=1)
        pos = torch.arange(self.route_nodes.shape[1], device=self.route_nodes.device)
        legs = self.problem.distance[self.route_nodes, nxt] * (pos[None, :] < self.n_nodes[:, None])
        return legs.sum()


# --- cpp/src/routing/local_search/vrp/vrp_search.cu --------------------------------------------------------

def find_vrp_moves_kernel(solution: dict, problem: problem_t, move_candidates: move_candidates_t,
                          recycle: bool) -> None:
    """One block per (sampled node, move type), one thread per neighbour: evaluate, then record_candidate."""
    vc = move_candidates.vrp_move_candidates
    rn, n_nodes = solution["route_nodes"], solution["n_nodes"]
    route_id, intra = solution["route_id_per_node"], solution["intra_route_idx_per_node"]
    load_prefix, load = solution["load_prefix"], solution["load"]
    D, demand, cap = problem.distance, problem.demand, problem.capacity

    n1 = move_candidates.sampled_nodes[:, None].expand(-1, max_n_neighbors).reshape(-1)
    n2 = problem.neighbors[move_candidates.sampled_nodes].reshape(-1)
    r1, r2 = route_id[n1], route_id[n2]
    i1, i2 = intra[n1], intra[n2]
    nn1, nn2 = n_nodes[r1], n_nodes[r2]
    prev1, next1, prev2 = rn[r1, i1 - 1], rn[r1, i1 + 1], rn[r2, i2 - 1]
    different = (r1 != r2) & (r1 >= 0) & (r2 >= 0)

    # RELOCATE: node_id_1 leaves route 1 and goes in front of node_id_2
    relocate = (D[prev1, next1] - D[prev1, n1] - D[n1, next1] + D[prev2, n1] + D[n1, n2] - D[prev2, n2])
    relocate_ok = different & (nn1 > 2) & (load[r2] + demand[n1] <= cap)
    # 2-opt*: route 1 keeps its head up to node_id_1 and takes route 2's tail from node_id_2
    two_opt = D[n1, n2] + D[prev2, next1] - D[n1, next1] - D[prev2, n2]
    head1, head2 = load_prefix[r1, i1], load_prefix[r2, i2 - 1]
    two_opt_ok = (different & (head1 + load[r2] - head2 <= cap) & (head2 + load[r1] - head1 <= cap)
                  & (i2 + nn1 - i1 >= 3))

    cost_delta = torch.cat([relocate, two_opt])
    ok = torch.cat([relocate_ok, two_opt_ok])
    move_type = torch.cat([torch.full_like(n1, vrp_move_t.RELOCATE), torch.full_like(n1, vrp_move_t.TWO_OPT_STAR)])
    node_1, node_2 = torch.cat([n1, n1]), torch.cat([n2, n2])
    pair = vc.get_route_pair_idx(torch.cat([r1, r1]), torch.cat([r2, r2]), problem.n_routes)
    # if (cost_delta > -EPSILON) return;  then record_candidate
    vc.record_candidate(pair, node_1, node_2, move_type, cost_delta, ok & (cost_delta < -EPSILON))


def find_vrp_moves(sol: solution_t, move_candidates: move_candidates_t, recycle: bool = False) -> bool:
    if sol.n_routes < 2:
        return False
    stream = sol.sol_handle.get_stream()
    vc = move_candidates.vrp_move_candidates
    graph_ = vc.find_kernel_graph

    def region():
        vc.reset(sol.sol_handle)
        find_vrp_moves_kernel(sol.view(), sol.problem, move_candidates, recycle)

    graph_.region, graph_.outputs = region, tuple(vc.written_by_find_kernel().values())
    graph_.start_capture(stream)
    try:
        vc.reset(sol.sol_handle)
        find_vrp_moves_kernel(sol.view(), sol.problem, move_candidates, recycle)
    except BaseException as e:
        graph_.abandon_capture(e)
        raise
    graph_.end_capture(stream)
    graph_.launch_graph(stream)
    sol.sol_handle.sync_stream()
    return True


# --- cpp/src/routing/local_search/vrp/vrp_execute.cu -------------------------------------------------------

class seed_generator:
    def __init__(self, seed: int):
        self.seed = seed

    def get_seed(self) -> int:
        self.seed += 1
        return self.seed


def compact_best_route_pair_moves(sol: solution_t, move_candidates: move_candidates_t) -> None:
    vc = move_candidates.vrp_move_candidates
    found = vc.cost_delta.data() != DBL_MAX
    idx = torch.arange(found.numel(), device=found.device)[found]
    vc.compacted_move_indices.data()[:idx.numel()] = idx
    vc.n_best_route_pair_moves.data().add_(idx.numel())              # atomicAdd per found pair


def extract_non_overlapping_moves(sol: solution_t, move_candidates: move_candidates_t, seeds: seed_generator) -> int:
    vc = move_candidates.vrp_move_candidates
    stream = sol.sol_handle.get_stream()
    compact_best_route_pair_moves(sol, move_candidates)
    n_best_route_pair_moves = vc.n_best_route_pair_moves.value(stream)
    if n_best_route_pair_moves == 0:
        return 0
    pairs = vc.compacted_move_indices.data()[:n_best_route_pair_moves].tolist()
    order = torch.randperm(n_best_route_pair_moves, generator=torch.Generator().manual_seed(seeds.get_seed()))
    changed_routes = [0] * sol.n_routes
    n_moves_found = 0
    for random_idx in order.tolist():
        route_pair_idx = pairs[random_idx]
        r_1, r_2 = divmod(route_pair_idx, sol.n_routes)
        if changed_routes[r_1] or changed_routes[r_2]:
            continue
        if n_moves_found >= sol.n_routes // 2:
            break
        changed_routes[r_1] = changed_routes[r_2] = 1
        vc.selected_move_indices.data()[n_moves_found] = route_pair_idx          # record_move
        n_moves_found += 1
    vc.n_of_selected_moves.data().fill_(n_moves_found)
    return vc.n_of_selected_moves.value(stream)


def find_max_added_size(sol: solution_t, move_candidates: move_candidates_t, n_moves_found: int) -> None:
    """find_max_added_size_kernel: atomicMax of the 2-opt* route growth into max_added_size."""
    vc = move_candidates.vrp_move_candidates
    cand = vc.selected_move_indices.data()[:n_moves_found]
    n1, n2, mt = vc.node_id_1.data()[cand], vc.node_id_2.data()[cand], vc.move_type.data()[cand]
    r1, r2 = sol.route_id_per_node[n1], sol.route_id_per_node[n2]
    start_idx_1, start_idx_2 = sol.intra_route_idx_per_node[n1], sol.intra_route_idx_per_node[n2] - 1
    nn1, nn2 = sol.n_nodes[r1], sol.n_nodes[r2]
    diff_1 = (nn2 - start_idx_2 + start_idx_1) - nn1
    diff_2 = (nn1 - start_idx_1 + start_idx_2) - nn2
    diff = torch.where(mt > vrp_move_t.RELOCATE, torch.maximum(diff_1, diff_2), torch.zeros_like(diff_1))
    m = vc.max_added_size.data()
    m.copy_(torch.maximum(m, diff.max().to(m.dtype)))


def execute_vrp_moves(sol: solution_t, move_candidates: move_candidates_t, n_moves_found: int) -> bool:
    vc = move_candidates.vrp_move_candidates
    stream = sol.sol_handle.get_stream()
    find_max_added_size(sol, move_candidates, n_moves_found)
    max_added_size = vc.max_added_size.value(stream)
    # the shared-memory route copies: depot_excluded_max_route_size nodes, plus the two depots
    depot_excluded_max_route_size = sol.get_max_active_nodes_for_all_routes() + max_added_size - 1
    routes = sol.get_routes()
    new_routes = [list(r) for r in routes]
    for cand_idx in vc.selected_move_indices.data()[:n_moves_found].tolist():
        n1, n2 = int(vc.node_id_1.data()[cand_idx]), int(vc.node_id_2.data()[cand_idx])
        move_type = int(vc.move_type.data()[cand_idx])
        r1, r2 = int(sol.route_id_per_node[n1]), int(sol.route_id_per_node[n2])
        i1, i2 = int(sol.intra_route_idx_per_node[n1]), int(sol.intra_route_idx_per_node[n2])
        route_1, route_2 = routes[r1], routes[r2]
        if move_type == vrp_move_t.RELOCATE:
            built_1 = route_1[:i1] + route_1[i1 + 1:]
            built_2 = route_2[:i2] + [n1] + route_2[i2:]
        else:
            built_1 = route_1[:i1 + 1] + route_2[i2:]
            built_2 = route_2[:i2] + route_1[i1 + 1:]
        for r, built in ((r1, built_1), (r2, built_2)):
            s_route = torch.full((depot_excluded_max_route_size + 2,), -1, dtype=torch.int64)
            s_route[:len(built)] = torch.tensor(built, dtype=torch.int64)   # overruns if max_added_size is short
            new_routes[r] = s_route[:len(built)].tolist()
    sol.set_routes(new_routes)
    return True


def select_and_execute_vrp_move(sol: solution_t, move_candidates: move_candidates_t, seeds: seed_generator) -> bool:
    n_moves_found = extract_non_overlapping_moves(sol, move_candidates, seeds)
    if n_moves_found == 0:
        return False
    return execute_vrp_moves(sol, move_candidates, n_moves_found)


def perform_vrp_search(sol: solution_t, move_candidates: move_candidates_t, seeds: seed_generator) -> bool:
    if not find_vrp_moves(sol, move_candidates):
        return False
    return select_and_execute_vrp_move(sol, move_candidates, seeds)


def run(variant: str, device: str = "cpu"):
    def solve(use_cuda_graph: bool):
        problem = problem_t(device)
        sol_handle = solution_handle_t(device)
        sol = solution_t(problem, sol_handle)
        move_candidates = move_candidates_t(problem, sol_handle, variant, use_cuda_graph)
        if use_cuda_graph:
            events.static_buffers("solution_t", sol.view())
        seeds = seed_generator(0)
        costs = [sol.compute_cost().clone()]
        for _ in range(N_SEARCH_ITERATIONS):
            if not perform_vrp_search(sol, move_candidates, seeds):
                break
            costs.append(sol.compute_cost().clone())
        return [torch.stack(costs), sol.route_nodes.clone(), sol.n_nodes.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: solve(True), lambda: solve(False))
