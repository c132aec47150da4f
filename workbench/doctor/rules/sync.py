"""sync-in-capture: a host synchronisation attempted while a graph is captured."""
from __future__ import annotations

from ...engine.cpu_graph import host_sync_error, is_host_sync
from ...engine.opinfo import tensors
from .. import explain
from ..report import Finding
from ..tensors import device_to_host, host_only


def check(doctor, info, func, args, kwargs, source: str) -> None:
    """A captured op that needs the device's values on the host. On CUDA the doctor stops it
    before CUDA invalidates the capture, as the CPU engine does. An op whose tensors all live in
    host memory (host tensors; beside a CUDA graph, the CPU's) reads no device: no sync."""
    if host_only(list(tensors(args)), info.cuda):
        return
    if is_host_sync(func, args) or device_to_host(func, args, kwargs):
        finding(doctor, info.name, str(func), source)
        if info.cuda:
            raise host_sync_error(str(func), source)


def finding(doctor, graph: str, op: str, source: str) -> None:
    doctor.add(Finding("sync-in-capture", graph, op, "-", source,
                       f"{op} was called while {graph} was being captured", explain.sync(op)),
               ("sync-in-capture", op, source))
