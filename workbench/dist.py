"""Tensor parallelism over ``torch.distributed``, and a launcher that starts the ranks.

Two halves:

* **The collective, as vLLM has it.** ``tensor_model_parallel_all_gather`` follows vLLM's CUDA path
  (v0.22.0): ``GroupCoordinator.all_gather`` calls the custom op ``torch.ops.vllm.all_gather``,
  whose implementation (``DeviceCommunicatorBase.all_gather``) allocates the output with
  ``torch.empty``, fills it with ``dist.all_gather_into_tensor`` and reshapes it. The output is an
  ordinary caching-allocator tensor: nothing keeps it alive but the caller's reference, which is
  what case 03 is about. Like vLLM's, the collective is a dispatcher op here
  (``torch.ops.workbench_dist.all_gather``): the CPU emulation, which records dispatcher ops, then
  records it as one synchronous op, so a graph that captured it re-runs the whole collective at
  every replay, as a CUDA graph re-launches its captured NCCL kernel.
* **The launcher.** ``launch(fn, world_size, ...)`` starts one ``spawn``-ed process per rank on
  loopback (gloo on CPU, NCCL with one GPU per rank), runs ``fn`` in each, and returns every
  rank's return value. It works from pytest and from a notebook kernel (``fn`` must be importable
  by name). A rank that raises, dies, or hangs becomes a ``RankError`` naming the rank and what it
  did; the launcher never waits longer than ``timeout``.

The tensor-parallel group is the whole world (as in a single-node TP deployment). Without an
initialised process group the world size is 1 and the all-gather returns its input, as vLLM's does.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 180.0
TEARDOWN_GRACE_S = 10.0    # finished ranks: time to tear the process group down and exit
FAILURE_GRACE_S = 5.0      # after a rank failed: time for the others to report before they are killed


# ----------------------------------------------------------------------------- the collective
def get_tensor_model_parallel_world_size() -> int:
    """Number of tensor-parallel ranks (1 when no process group is initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_tensor_model_parallel_rank() -> int:
    """This process's tensor-parallel rank (0 when no process group is initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along ``dim`` (vLLM's function of the same name)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    if not -input_.dim() <= dim < input_.dim():
        raise ValueError(f"Invalid dim ({dim}) for input tensor with shape {tuple(input_.shape)}")
    return torch.ops.workbench_dist.all_gather(input_, dim, world_size)


def _all_gather(input_: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """``DeviceCommunicatorBase.all_gather`` (vLLM v0.22.0), line for line."""
    if dim < 0:
        dim += input_.dim()
    input_size = input_.size()
    output_size = (input_size[0] * world_size,) + input_size[1:]
    output_tensor = torch.empty(output_size, dtype=input_.dtype, device=input_.device)
    _all_gather_into_tensor(output_tensor, input_)
    output_tensor = output_tensor.reshape((world_size,) + input_size)
    output_tensor = output_tensor.movedim(0, dim)
    output_tensor = output_tensor.reshape(
        input_size[:dim] + (world_size * input_size[dim],) + input_size[dim + 1:])
    return output_tensor


# Registered with the plain Library API: torch.library.custom_op costs seconds on its first call.
_LIBRARY = torch.library.Library("workbench_dist", "FRAGMENT")
_LIBRARY.define("all_gather(Tensor input, int dim, int world_size) -> Tensor")
_LIBRARY.impl("all_gather", _all_gather, "CompositeExplicitAutograd")


def _all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor) -> None:
    with warnings.catch_warnings():
        # torch 2.13 renames it all_gather_single; the GPU machines run 2.11, which has only this name.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
        try:
            dist.all_gather_into_tensor(output, input_)
            return
        except (RuntimeError, NotImplementedError) as e:
            if dist.get_backend() != "gloo" or "does not support" not in str(e):
                raise
    # Some gloo builds lack all_gather_into_tensor (_allgather_base): gather into a list, then copy
    # into the same torch.empty output, so the caller sees exactly the buffer vLLM would return.
    parts = [torch.empty_like(input_) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, input_)
    torch.cat(parts, dim=0, out=output)


# ----------------------------------------------------------------------------- the launcher
class RankError(RuntimeError):
    """One or more ranks raised, died or timed out. ``failures`` maps rank -> description."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclasses.dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str) -> str:
    """``"nccl"`` for CUDA ranks, ``"gloo"`` for CPU ranks."""
    if torch.device(device).type == "cuda":
        return "nccl"
    if torch.device(device).type == "cpu":
        return "gloo"
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
           timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their values in rank order.

    CPU ranks talk over gloo, CUDA ranks over NCCL with rank ``r`` on GPU ``r``; both only over
    127.0.0.1. ``fn`` must be a module-level function (spawned processes import it by name).
    Raises ``RankError`` if a rank raises or dies, or if not every rank reports within ``timeout``
    seconds; the other ranks are then killed, so a failure never turns into a hang.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    backend = default_backend(device)
    if backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world_size:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs (one per rank); this "
                               f"machine has {have}. Use device='cpu' for gloo ranks on the CPU.")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True, name=f"workbench-rank{rank}",
                         args=(rank, world_size, port, backend, timeout, fn, args, kwargs, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure is not None and now > first_failure + FAILURE_GRACE_S:
                break       # the surviving ranks are probably blocked in a collective with a dead peer
            try:
                outcome = results.get(timeout=0.2)
                outcomes[outcome.rank] = outcome
                if not outcome.ok and first_failure is None:
                    first_failure = time.monotonic()
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if rank not in outcomes and not p.is_alive():
                        try:        # it may have reported just before exiting
                            outcome = results.get(timeout=1.0)
                            outcomes[outcome.rank] = outcome
                            continue
                        except queue_mod.Empty:
                            pass
                        outcomes[rank] = _Outcome(rank, False, error=f"died with exit code {p.exitcode} "
                                                  "before reporting (a crash, or killed for memory)")
                        if first_failure is None:
                            first_failure = time.monotonic()
    finally:
        all_ok = len(outcomes) == world_size and all(o.ok for o in outcomes.values())
        _stop(procs, TEARDOWN_GRACE_S if all_ok else 1.0)
    failures = {r: o.error for r, o in outcomes.items() if not o.ok}
    for rank in range(world_size):
        if rank not in outcomes:
            failures[rank] = (f"did not report within {timeout:.0f} s" if first_failure is None else
                              "did not report; killed after another rank failed")
    if failures:
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(failures.items()))
        raise RankError(f"{len(failures)} of {world_size} ranks failed ({backend}):\n{lines}", failures)
    return [outcomes[r].value for r in range(world_size)]


def _stop(procs: list, grace: float) -> None:
    """Give the ranks ``grace`` seconds to exit, then kill what is left (never wait forever)."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout: float,
               fn: Callable[..., Any], args: tuple, kwargs: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    initialised = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        initialised = True
        outcome = _Outcome(rank, True, value=fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        outcome = _Outcome(rank, False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    results.put(outcome)
    results.close()
    results.join_thread()       # the result is in the pipe before any teardown that might hang
    if backend == "nccl":
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a dead CUDA context (e.g. after an illegal memory access)
            os._exit(0)     # NCCL teardown on a dead context can hang; the result is already sent
    if initialised and outcome.ok:
        dist.destroy_process_group()


def local_device(device: str) -> str:
    """The device of this rank: ``cuda:<rank>`` for CUDA ranks (one GPU each), else ``device``."""
    if torch.device(device).type == "cuda":
        return f"cuda:{get_tensor_model_parallel_rank()}"
    return str(device)
