"""GraphRunner: static buffers, padding, warmup then capture, pool, eager fallback, bad input."""
import pytest
import torch

from workbench.engine import GraphError, GraphRunner, validate_capture_sizes


def make(sizes=(1, 2, 4), **kw):
    calls = []

    def model(x):
        calls.append(x.shape[0])
        return x * 2

    runner = GraphRunner(model, {"x": ((3,), torch.float32)}, sizes, **kw)
    return runner, calls


def test_capture_sizes_are_validated_and_sorted():
    assert validate_capture_sizes([4, 1, 2]) == [1, 2, 4]
    for bad, msg in [([], "empty"), ([0, 2], "positive"), ([-1], "positive"), ([2, 2], "unique"),
                     ([1.5], "integers"), ([True], "integers")]:
        with pytest.raises(ValueError, match=msg):
            validate_capture_sizes(bad)


def test_warmup_then_capture_largest_first_into_one_pool():
    runner, calls = make(num_warmups=2)
    runner.capture()
    assert calls == [4, 4, 4, 2, 2, 2, 1, 1, 1]          # 2 warmups + 1 capture per size
    pools = {id(g.pool()) for g in runner.graphs.values()}
    assert len(pools) == 1


def test_batch_is_padded_to_the_smallest_captured_size_and_padded_rows_are_not_refreshed():
    runner, _ = make()
    runner.capture()
    runner(x=torch.full((4, 3), 7.0))
    out = runner(x=torch.ones(3, 3))
    assert runner.history[-1] == (3, 4)
    assert torch.equal(out, torch.full((3, 3), 2.0))
    assert torch.equal(runner.buffers["x"][3], torch.full((3,), 7.0))   # stale padded row


def test_poison_padding_fills_padded_rows():
    runner, _ = make(poison_padding=True)
    runner.capture()
    runner(x=torch.ones(3, 3))
    assert torch.isnan(runner.buffers["x"][3]).all()
    assert torch.isnan(runner.outputs[4][3]).all()


def test_eager_fallback_above_the_largest_size_and_enforce_eager():
    runner, calls = make()
    runner.capture()
    calls.clear()
    out = runner(x=torch.ones(6, 3))
    assert calls == [6] and runner.history[-1] == (6, None) and out.shape == (6, 3)
    eager, calls = make(enforce_eager=True)
    eager.capture()
    assert eager.graphs == {}
    eager(x=torch.ones(3, 3))
    assert calls == [3]


def test_bad_input_is_refused_with_a_clear_error():
    runner, _ = make()
    with pytest.raises(GraphError, match="capture"):
        runner(x=torch.ones(2, 3))
    runner.capture()
    with pytest.raises(GraphError, match="dtype"):
        runner(x=torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(GraphError, match="row shape"):
        runner(x=torch.ones(2, 5))
    with pytest.raises(GraphError, match="do not match"):
        runner(y=torch.ones(2, 3))
    with pytest.raises(GraphError, match="empty"):
        runner(x=torch.ones(0, 3))
    with pytest.raises(GraphError, match="already"):
        runner.capture()
