"""Case 05: lazily planned split-KV schedule skipped by CUDA-graph capture (vLLM #42444)."""
import dataclasses
import pathlib
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import cases
from workbench.cases import VARIANTS
from workbench.cases import lazy_attention_state_capture as case
from workbench.cases.lazy_attention_state_capture.split_kv import (LMConfig, empty_schedule, plan_splits,
                                                                   reference_attention, split_kv_attention,
                                                                   to_transformers)
from workbench.engine import CUDAGraphMode, events, graph, new_graph

CASE = cases.get("lazy_attention_state_capture")


@pytest.fixture(scope="module")
def model():
    return case.load_model()


# ------------------------------------------------------------------------------------------ planner
def test_plan_splits_known_partitions():
    bounds, num_splits = plan_splits(torch.tensor([0, 1, 4, 5, 10, 16, 30]), block_size=4, max_splits=4)
    assert bounds.tolist() == [[0, 0, 0, 0, 0],        # empty request: one empty split
                               [0, 1, 1, 1, 1],
                               [0, 4, 4, 4, 4],
                               [0, 4, 5, 5, 5],        # a partial last tile
                               [0, 4, 8, 10, 10],
                               [0, 4, 8, 12, 16],
                               [0, 8, 16, 24, 30]]     # 8 tiles over 4 splits: 2 tiles each
    assert num_splits.tolist() == [1, 1, 1, 2, 3, 4, 4]


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 64), min_size=1, max_size=6), block=st.integers(1, 8), splits=st.integers(1, 6))
def test_plan_splits_covers_each_range_exactly(lens, block, splits):
    bounds, num_splits = plan_splits(torch.tensor(lens), block_size=block, max_splits=splits)
    for length, b, ns in zip(lens, bounds.tolist(), num_splits.tolist()):
        assert b[0] == 0 and b[-1] == length and b == sorted(b)
        sizes = np.diff(b)
        assert (sizes[ns:] == 0).all()                           # splits past num_splits are empty
        if length:
            assert (sizes[:ns] > 0).all()                        # the used ones are not
            assert all(x % block == 0 for x in b[1:ns])          # cuts fall on tile boundaries


def test_planner_is_capturable_and_replans_on_replay():
    """No host sync: a graph can record the planner, and its replay plans from the current lengths."""
    lens = torch.tensor([3, 9])
    g = new_graph("cpu")
    with graph(g):
        bounds, _ = plan_splits(lens, block_size=4, max_splits=4)
    lens.copy_(torch.tensor([13, 2]))
    g.replay()
    assert bounds.tolist() == [[0, 4, 8, 12, 13], [0, 2, 2, 2, 2]]


# ---------------------------------------------------------------------------------------- attention
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 16), min_size=1, max_size=5), block=st.integers(1, 6),
       splits=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_split_kv_attention_matches_plain_softmax(lens, block, splits, seed):
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    q, k, v = (torch.randn(b, *shape, generator=g) for shape in ((2, 8), (16, 2, 8), (16, 2, 8)))
    seq_lens = torch.tensor(lens)
    out = split_kv_attention(q, k, v, seq_lens, empty_schedule(), block_size=block, max_splits=splits)
    torch.testing.assert_close(out, reference_attention(q, k, v, seq_lens), atol=1e-5, rtol=1e-5)


def test_zero_length_request_attends_to_nothing():
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    out = split_kv_attention(q, k, v, torch.tensor([0, 5]), empty_schedule(), block_size=4, max_splits=4)
    assert torch.equal(out[0], torch.zeros(2, 8)) and torch.isfinite(out).all()


def test_schedule_is_planned_once_and_then_reused_stale():
    """FlashMLA's contract: the first call plans, later calls with the same object reuse the plan."""
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    schedule = empty_schedule()
    split_kv_attention(q, k, v, torch.tensor([4, 4]), schedule, block_size=4, max_splits=4)
    assert schedule.have_initialized and schedule.split_bounds.tolist() == [[0, 4, 4, 4, 4]] * 2
    stale = split_kv_attention(q, k, v, torch.tensor([12, 7]), schedule, block_size=4, max_splits=4)
    torch.testing.assert_close(stale, reference_attention(q, k, v, torch.tensor([4, 4])))
    with pytest.raises(ValueError, match="reused with"):
        split_kv_attention(q[:1], k[:1], v[:1], torch.tensor([4]), schedule, block_size=4, max_splits=4)


# -------------------------------------------------------------------------------------------- model
def test_lm_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        LMConfig(vocab_size=14, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="max_splits"):
        LMConfig(vocab_size=14, max_splits=0)


def test_eager_model_matches_transformers_gpt2(model):
    tokens, _ = case.training_batch(case.sample_problems(16, seed=5))
    with torch.no_grad():
        ours = model(tokens)
        theirs = to_transformers(model)(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_split_kv_decode_matches_full_sequence_forward(model):
    """Prefill 5 tokens, then decode the rest one by one through split-KV attention."""
    tokens, _ = case.training_batch(case.sample_problems(3, seed=6))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(3)
        torch.testing.assert_close(model.prefill(tokens[:, :5], torch.tensor([5, 5, 5]), cache), full[:, 4])
        for t in range(5, tokens.shape[1]):
            pos = torch.full((3,), t)
            step = model.decode_step(tokens[:, t], pos, model.cached_attention(cache, pos, pos + 1, empty_schedule()))
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------- task and training
def test_problem_format_and_parsing():
    p = case.Problem(47, 385, 3)
    assert case.render(p.prompt) == "047+385=" and case.render(p.answer) == "2340$"
    assert case.parse_answer(p.answer) == 432
    assert case.parse_answer([2, 3, case.PLUS, case.EOS]) is None and case.parse_answer([2, 3]) is None
    assert case.render_answer(case.Problem(1, 4, 1).answer + [7, 0]) == "50$"


def test_held_out_problems_are_never_trained_on():
    held = set(case.sample_problems(300, seed=0))
    train = set(case.sample_problems(3000, seed=0, held_out=False))
    assert not held & train and all(p.held_out for p in held)
    assert case.sample_problems(5, seed=3) == case.sample_problems(5, seed=3)
    with pytest.raises(ValueError):
        case.sample_problems(0, seed=0)


def test_training_steps_are_deterministic():
    a, info_a = case.train(seed=0, steps=3, progress=False)
    b, info_b = case.train(seed=0, steps=3, progress=False)
    c, _ = case.train(seed=1, steps=3, progress=False)
    assert info_a == info_b
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_checkpoint_is_the_trained_model(model):
    ckpt = torch.load(case.CHECKPOINT, weights_only=True)
    assert ckpt["train"]["seed"] == 0 and ckpt["train"]["steps"] == 1500    # write_checkpoint()'s defaults
    assert ckpt["config"] == dataclasses.asdict(case.CONFIG)
    assert case.CHECKPOINT.stat().st_size < 2_000_000
    assert case.serve(model, case.sample_problems(48, seed=11), mode="NONE").accuracy >= 0.95


def test_missing_checkpoint_names_the_regenerate_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m workbench.data"):
        case.load_model(path=tmp_path / "absent.pt")


# -------------------------------------------------------------------------------- capture manager
def test_bug_capture_records_no_planner_fix_does(model):
    ops = {}
    for variant in VARIANTS:
        m = case.CudaGraphManager(model, [1, 2, 4], variant=variant)
        m.capture()
        ops[variant] = m
        # The kernel log is what CPUGraph records (views aside).
        assert [op.name for op in m.captured_ops[4]] == [op.name for op in m.graphs[4][0].ops if not op.is_view]
    assert ops["bug"].planner_ops(4) == []
    assert ops["fix"].planner_ops(4) == ["aten.add.Tensor", "aten.div.Tensor_mode", "aten.clamp.default",
                                         "aten.arange.default", "aten.mul.Tensor", "aten.div.Tensor_mode",
                                         "aten.minimum.default", "aten.mul.Tensor", "aten.minimum.default"]
    # Everything else is the same graph.
    assert [o for o in ops["fix"].captured_ops[4] if o.function != "plan_splits"] == ops["bug"].captured_ops[4]
    # The bug graph reads the warmup's plan (memory it does not own); the fix graph owns its plan.
    assert not ops["bug"].graphs[4][0].owns(ops["bug"].attn_states[4].schedule.split_bounds)
    assert ops["fix"].graphs[4][0].owns(ops["fix"].attn_states[4].schedule.split_bounds)


def test_one_replay_after_the_lengths_change(model):
    lc = case.length_change(model)
    assert lc.seq_lens == [2, 4, 9, 14]
    assert lc.plan_used["bug"] == [[0, 4, 4, 4, 4]] * 4                       # planned for the dummy length 4
    assert lc.plan_used["fix"] == lc.plan_needed == [[0, 2, 2, 2, 2], [0, 4, 4, 4, 4],
                                                     [0, 4, 8, 9, 9], [0, 4, 8, 12, 14]]
    assert lc.max_abs_error["fix"] == [0.0] * 4
    bug = lc.max_abs_error["bug"]
    assert bug[1] == 0.0 and min(bug[0], bug[2], bug[3]) > 1.0   # right only where the stale plan fits
    with pytest.raises(ValueError, match="captured size"):
        case.length_change(model, seq_lens=(5, 6, 7))


@pytest.mark.parametrize("variant", VARIANTS)
def test_piecewise_is_unaffected(model, variant):
    problems = case.sample_problems(12, seed=2)
    eager = case.serve(model, problems, mode="NONE")
    piecewise = case.serve(model, problems, mode="PIECEWISE", variant=variant)
    assert piecewise.tokens == eager.tokens
    np.testing.assert_array_equal(piecewise.logits, eager.logits)


def test_piecewise_keeps_the_warmup_state(model):
    m = case.CudaGraphManager(model, [1, 2], mode="PIECEWISE", variant="fix")
    m.capture()
    assert m.attn_states[2].schedule.split_bounds.tolist() == [[0, 2, 2, 2, 2]] * 2   # planned by the warmup
    assert len(m.graphs[2]) == model.cfg.n_layers + 1 and m.planner_ops(2) == []


class _ServeLog:
    """An engine observer that keeps the ``serve`` announcements and ignores every other event."""

    def __init__(self) -> None:
        self.served = []

    def serve(self, graph, real, size, padded, outputs, **announced):
        self.served.append((graph, real, size, sorted(padded), announced.get("eager")))

    def engine_op(self, func, args):                    # runs the engine's own ops
        return func(*args)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_every_replayed_graph_is_announced(model, mode):
    """FULL and PIECEWISE alike: each graph replayed for a step is announced with its real and padded
    rows, and the eager step announced with the first gives the logits the step handed out (a
    PIECEWISE step is announced whole on its first piece: its pieces cannot be re-run one by one)."""
    m = case.CudaGraphManager(model, [1, 2, 4], mode=mode)
    m.capture()
    tokens = torch.tensor([[1, 2, 10, 3, 4, 11], [5, 10, 6, 11, 13, 13], [7, 8, 10, 9, 1, 11]])
    lens = torch.tensor([6, 4, 6])
    m.prefill(tokens, lens)
    log = _ServeLog()
    events.subscribe(log)
    try:
        out = m.decode(torch.tensor([2, 3, 4]), lens, lens + 1).clone()
    finally:
        events.unsubscribe(log)
    assert [s[0] for s in log.served] == m.graphs[4]
    assert len(log.served) == (1 if mode == "FULL" else model.cfg.n_layers + 1)
    assert all(s[1:4] == (3, 4, ["input_ids", "positions", "seq_lens"]) for s in log.served)
    torch.testing.assert_close(log.served[0][4]()[:3], out, atol=1e-5, rtol=1e-5)
    assert all(s[4] is None for s in log.served[1:])


def test_the_case_does_not_import_workbench_data():
    """``workbench.data`` calls the case's training; the case must not import it back (no cycle)."""
    code = ("import sys, workbench.cases.lazy_attention_state_capture; "
            "assert 'workbench.data' not in sys.modules, 'the case imports workbench.data'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parent.parent)


def test_manager_rejects_bad_use(model):
    assert case.CudaGraphManager(model, [1], mode="full").mode is CUDAGraphMode.FULL     # names in any case
    with pytest.raises(ValueError, match="mode"):
        case.CudaGraphManager(model, [1], mode="fullgraph")
    with pytest.raises(ValueError, match="variant"):
        case.CudaGraphManager(model, [1], variant="fixed")
    m = case.CudaGraphManager(model, [1, 2])
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="capture"):
        m.decode(ids, ids, ids + 1)
    m.capture()
    with pytest.raises(RuntimeError, match="already"):
        m.capture()
    with pytest.raises(ValueError, match="serves 1..2"):
        m.decode(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))


# ------------------------------------------------------------------------------------------ the case
def test_case_end_to_end(model):
    result = case.run(model, seeds=(0,), n_problems=24, progress=False)
    assert result.accuracy["eager"][0] >= 0.95
    assert result.fix_equals_eager and result.max_logit_diff_fix == 0.0
    bug, predicted = result.accuracy["bug"][0], result.predicted_bug[0]
    assert bug < 0.6 and abs(bug - predicted) <= 2 / 24      # a lucky guess or two
    plan = result.example["bug"].plan_used[0]
    assert (plan == np.array([0, 4, 4, 4, 4])).all()                          # every step, every request
    assert (result.example["fix"].plan_used[0] == result.example["eager"].plan_needed[0]).all()
    for fig in (case.plot_plans(result.example), case.plot_accuracy(result), case.plot_generations(result.example),
                case.plot_length_change(case.length_change(model))):
        assert fig.axes
        plt.close(fig)


def test_gpu_record_matches_cpu():
    gpu = CASE.gpu_results()
    if gpu is None:
        pytest.skip(f"{CASE.record.name} not recorded on a GPU yet: a GPU session writes it with gpu_record()")
    cpu = case.gpu_record("cpu")
    for key in ("seq_lens", "plan_needed", "plan_used", "planner_ops", "captured_ops", "n_problems",
                "fix_equals_eager", "piecewise_bug_equals_eager"):
        assert gpu[key] == cpu[key], key
    for name, acc in cpu["accuracy"].items():
        assert abs(gpu["accuracy"][name] - acc) <= 0.02, name
    assert abs(gpu["predicted_bug_accuracy"] - cpu["predicted_bug_accuracy"]) <= 0.02
    for variant, errors in cpu["length_change_max_abs_error"].items():
        for g, c in zip(gpu["length_change_max_abs_error"][variant], errors):
            assert (g < 1e-3) if c == 0.0 else (g > 1.0), (variant, g, c)


@pytest.mark.cuda
def test_cuda_graph_reproduces_the_stale_plan(model):
    cpu = case.length_change(model)
    cuda = case.length_change(case.load_model("cuda"), device="cuda")
    assert cuda.plan_used == cpu.plan_used and cuda.planner_ops == cpu.planner_ops
