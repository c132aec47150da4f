"""Probes of host data meeting device memory inside a capture: a boolean mask filled or read, a copy
from host memory (pinned or pageable, blocking or not), and Python data made into a tensor or
copied to the device. Part of the engine's semantic probes (``workbench.probes``), run the same way
on a real ``torch.cuda.CUDAGraph`` and on ``CPUGraph``; on CUDA in child processes, since a refused
copy or sync ends the capture.
"""
from __future__ import annotations

import torch

from .childproc import run_in_child
from .engine import graph, host, new_graph, synchronize
from .pool_probes import _values


MASK_ASSIGN = ("python_number", "host_tensor", "device_value", "masked_read", "tensor_made_on_device",
               "number_made_on_device")


def probe_mask_assign(device: str) -> dict:
    """Boolean-mask indexing inside a capture: ``x[mask] = 0`` with one value held on the host
    fills through ``masked_fill_`` (no count of the mask's elements: recorded), a device value or a
    masked read needs ``nonzero`` (a sync: refused); and a tensor made from Python data (a list, one
    number) on the device inside the capture. Whether each raises (on CUDA, each in a child: a refused sync ends the
    capture)."""
    if device == "cuda":
        return {s: run_in_child(_mask_assign, device, s, timeout=300).raise_if_failed()
                for s in MASK_ASSIGN}
    return {s: _mask_assign(device, s) for s in MASK_ASSIGN}


def _mask_assign(device: str, scenario: str) -> bool:
    x = torch.arange(8.0, device=device).reshape(4, 2)
    mask = torch.tensor([True, False, True, False], device=device)
    g = new_graph(device)
    try:
        with graph(g):
            y = x * 1
            if scenario == "python_number":
                y[mask] = 0
            elif scenario == "host_tensor":
                y[mask] = torch.tensor(0.0)
            elif scenario == "device_value":
                y[mask] = y.max()
            elif scenario == "masked_read":
                y = y[mask] * 1
            elif scenario == "tensor_made_on_device":
                y = y + torch.tensor([1.0, 2.0], device=device)
            else:
                y = y + torch.tensor(1.0, device=device)
        return False
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError, the CPU a CaptureError
        return True


HOST_COPY = ("pinned", "pinned_blocking", "pinned_view", "clone_of_pinned", "pinned_in_capture")


def probe_host_copy(device: str) -> dict:
    """A copy from host memory into device memory inside a capture: from pinned memory with
    ``non_blocking=True`` (recorded: the graph's copy node reads it by address), the same copy
    blocking (torch synchronises the stream after it), from a view of pinned memory, from a clone
    of it (pageable: torch refuses it), and from memory pinned inside the capture. Whether each
    raises (on CUDA, each in a child: a refused copy ends the capture)."""
    if device == "cuda":
        return {s: run_in_child(_host_copy, device, s, timeout=300).raise_if_failed() for s in HOST_COPY}
    return {s: _host_copy(device, s) for s in HOST_COPY}


def _host_copy(device: str, scenario: str) -> bool:
    dev = torch.zeros(2, device=device)
    pinned = host(torch.arange(4.0), device)
    try:
        with graph(new_graph(device)):
            if scenario == "pinned_in_capture":
                dev.copy_(host(torch.arange(2.0), device), non_blocking=True)
            else:
                source = {"pinned": pinned[:2], "pinned_blocking": pinned[:2], "pinned_view": pinned[2:],
                          "clone_of_pinned": pinned.clone()[:2]}[scenario]
                dev.copy_(source, non_blocking=scenario != "pinned_blocking")
        return False
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError or an AcceleratorError, the CPU a CaptureError
        return True


PYTHON_DATA = ("element", "element_2d", "slice", "column", "indexed", "listed", "element_host_tensor",
               "copy_host_tensor", "copy_numpy", "add_host_tensor", "where_host_tensor", "fill", "new_tensor",
               "new_tensor_number", "host_tensor_to_device", "read_listed")


def probe_python_data(device: str) -> dict:
    """Python data (a number, a list, an array, or a tensor made from one on the host) meeting device
    memory inside a capture: written into one element (``t[0] = 0``: torch copies the number from a
    pageable CPU tensor) or indexed elements (``index_put_``), copied in, made on the device
    (``new_tensor``, ``.to(device)``), used as an index (``t[[0, 2]]``); or written into a slice or
    a column (``fill_``, by value), or given as a host number to an op. Whether each raises (on CUDA,
    all in one child: torch refuses each copy before it reaches CUDA, and the capture ends cleanly)."""
    if device == "cuda":
        return run_in_child(_python_data_all, device, timeout=300).raise_if_failed()
    return _python_data_all(device)


def _python_data_all(device: str) -> dict:
    return {s: _python_data(device, s) for s in PYTHON_DATA}


def _python_data(device: str, scenario: str) -> bool:
    import numpy as np
    t = torch.zeros(3, 4, device=device)
    index = torch.tensor([0, 2], device=device)
    use = {"element": lambda: t.__setitem__((0, 1), 1.0), "element_2d": lambda: t[1].__setitem__(2, 1.0),
           "slice": lambda: t.__setitem__(slice(1, 3), 5.0), "column": lambda: t.__setitem__((slice(None), 0), 2),
           "indexed": lambda: t.__setitem__(index, 1.0), "listed": lambda: t.__setitem__([0, 2], 1.0),
           "element_host_tensor": lambda: t.__setitem__((0, 0), torch.tensor(2.0)),
           "copy_host_tensor": lambda: t.copy_(torch.tensor(2.0)),
           "copy_numpy": lambda: t[0].copy_(torch.from_numpy(np.ones(4, dtype=np.float32))),
           "add_host_tensor": lambda: t.add_(torch.tensor(2.0)),
           "where_host_tensor": lambda: torch.where(t > 0, t, torch.tensor(0.5)),
           "fill": lambda: t[0, 0].fill_(3), "new_tensor": lambda: t[0] + t.new_tensor([1.0, 2.0, 3.0, 4.0]),
           "new_tensor_number": lambda: t + t.new_tensor(2.0),
           "host_tensor_to_device": lambda: t[0] + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(device),
           "read_listed": lambda: t[[0, 2]] * 1}[scenario]
    try:
        with graph(new_graph(device)):
            use()
        return False
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError, the CPU a CaptureError
        return True


def probe_python_into_host(device: str) -> dict:
    """Host metadata written with Python numbers inside a capture, as a runner's attention-metadata
    builder stages it: one element (``pinned[1] = n``: torch copies the number from a CPU scalar),
    a slice (``fill_``), listed elements (``index_put_``) and a store through numpy, then a captured
    copy to the device. Every host write runs once, at capture, and stays; the graph records only
    the copy, so a replay copies what the host holds then, not what the capture wrote."""
    import numpy as np
    pinned = host(torch.zeros(6), device)
    dev = torch.zeros(6, device=device)
    g = new_graph(device)
    with graph(g):
        pinned[1] = 5
        pinned[2:4] = 7.0
        pinned[[4, 5]] = torch.tensor([8.0, 9.0])
        np.asarray(pinned.numpy())[0] = 3.0
        dev.copy_(pinned, non_blocking=True)
    synchronize(device)
    after_capture = {"host": _values(pinned), "device": _values(dev)}
    pinned.zero_()
    pinned[0] = 1.0
    g.replay()
    synchronize(device)
    return {"after_capture": after_capture, "after_replay": {"host": _values(pinned), "device": _values(dev)}}
