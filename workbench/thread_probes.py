"""Probes of a capture and the threads beside it: which waits for the device on another thread
CUDA refuses while a capture is open, in each capture mode (``engine/capture_mode.py``). On CUDA each
runs in a child process: a refused wait invalidates the capture, and may leave the context unusable.
"""
from __future__ import annotations

import functools
import threading

import torch

from .childproc import on_cuda_in_child
from .engine import graph, new_graph, synchronize


def probe_other_thread(device: str) -> dict:
    """Another thread waits for the device while a capture is open, in each capture mode: a value
    read (``.tolist()``) fails there, and the capture with it, only in ``"global"`` mode; a
    device-wide ``synchronize`` breaks a capture in every mode; a kernel launch breaks none."""
    return {f"{mode}/{wait}": on_cuda_in_child(functools.partial(_other_thread, mode=mode, wait=wait), device)
            for mode in ("global", "thread_local", "relaxed") for wait in ("tolist", "synchronize", "launch")}


def _other_thread(device: str, mode: str, wait: str) -> dict:
    x, y = torch.ones(4, device=device), torch.zeros(4, device=device)
    synchronize(device)
    g, seen = new_graph(device), {}

    def other():
        try:
            if wait == "tolist":
                x.tolist()
            elif wait == "synchronize":
                synchronize(device)
            else:
                (x * 2).sum()
            seen["other_raised"] = False
        except Exception:  # noqa: BLE001 - CUDA raises an AcceleratorError, the CPU a CaptureError
            seen["other_raised"] = True
    try:
        with graph(g, capture_error_mode=mode):
            y.copy_(x * 3)
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            y.add_(1)
        seen["captured"] = True
    except Exception:  # noqa: BLE001
        seen["captured"] = False
    if seen["captured"]:
        y.zero_()
        g.replay()
        seen["replayed"] = y.tolist()
    return seen
