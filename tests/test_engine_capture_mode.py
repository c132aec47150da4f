"""CUDA's capture modes on the CPU engine: which waits for the device another thread may make while
a capture is open (``engine/capture_mode.py``), and what the doctor says of a capture they broke.
The answers asserted here are those an H200 gave (engine probe ``other_thread``, recorded in
``results/gpu/engine_probes.json`` and compared in ``test_engine_fidelity.py``)."""
import threading

import pytest
import torch

from workbench.doctor import diagnose
from workbench.engine import CaptureError, GraphError, graph, new_graph, synchronize
from workbench.thread_probes import probe_other_thread


def test_each_mode_refuses_the_waits_cuda_refuses():
    answers = probe_other_thread("cpu")
    refused = {key for key, seen in answers.items() if not seen["captured"]}
    assert refused == {"global/tolist", "global/synchronize", "thread_local/synchronize", "relaxed/synchronize"}
    for key, seen in answers.items():
        assert seen["other_raised"] == (key in refused), key     # the wait fails on its own thread too
        if key not in refused:
            assert seen["replayed"] == [4.0] * 4, key


def test_an_unknown_mode_is_refused_before_anything_is_captured():
    g = new_graph("cpu")
    with pytest.raises(GraphError, match="capture_error_mode must be one of"):
        with graph(g, capture_error_mode="local"):
            pass
    with graph(g):                    # the graph is still new
        torch.ones(2) * 2


def test_value_reads_are_unwrapped_when_the_last_capture_closes():
    before = dict(vars(torch.Tensor))
    with graph(new_graph("cpu"), capture_error_mode="thread_local"):
        assert torch.Tensor.tolist is not before.get("tolist", torch._C.TensorBase.tolist)
    assert dict(vars(torch.Tensor)) == before
    assert torch.ones(2).tolist() == [1.0, 1.0]


def test_the_capturing_threads_own_read_is_refused_in_every_mode():
    with pytest.raises(CaptureError, match="cudaErrorStreamCaptureUnsupported"):
        with graph(new_graph("cpu"), capture_error_mode="relaxed"):
            torch.ones(2).sum().item()


def _lazy_vocoder_capture(mode: str, wait: str = "read"):
    """A vocoder captured on first use while the decode loop, on its own thread, reads its tokens
    (or, ``wait="synchronize"``, waits for the whole device: a synchronous copy's wait)."""
    tokens, audio, errors = torch.arange(4.0), torch.zeros(4), []

    def decode_loop():
        try:
            tokens.tolist() if wait == "read" else synchronize("cpu")
        except CaptureError as e:
            errors.append(e)

    def capture_vocoder():
        with graph(new_graph("cpu"), capture_error_mode=mode, name="vocoder"):
            audio.copy_(tokens * 2)
            loop = threading.Thread(target=decode_loop)
            loop.start()
            loop.join()
    try:
        capture_vocoder()
    except CaptureError as e:
        errors.append(e)
    return errors


def test_the_doctor_names_the_capture_whose_global_mode_broke_on_another_threads_read():
    report = diagnose(lambda: _lazy_vocoder_capture("global"))
    [finding] = report.findings
    assert finding.kind == "sync-in-capture" and finding.op == "Tensor.tolist()"
    assert "in capture_vocoder" in finding.source
    assert "in decode_loop" in finding.evidence and "on another thread" in finding.evidence
    assert "thread_local" in finding.cause


def test_a_device_wide_wait_on_another_thread_is_named_where_it_waited_whatever_the_mode():
    """thread_local mode lets other threads read values, but not wait for the whole device: the
    capture did what it could, and the finding names the wait, not the capture's mode."""
    report = diagnose(lambda: _lazy_vocoder_capture("thread_local", wait="synchronize"))
    [finding] = report.findings
    assert finding.kind == "sync-in-capture" and "in decode_loop" in finding.source, finding
    assert "capture_error_mode" not in finding.cause and "'thread_local' included" in finding.cause


def test_a_thread_local_capture_lets_the_other_thread_read():
    assert _lazy_vocoder_capture("thread_local") == []
    assert diagnose(lambda: _lazy_vocoder_capture("thread_local")).findings == []
