"""Case 01: RoBERTa positions accumulate in padded slots. Model fidelity, prediction, bug and fix."""
import json

import matplotlib.pyplot as plt
import pytest
import torch

from workbench.cases import get
from workbench.cases import roberta_position_accumulation as case
from workbench.cases.roberta_position_accumulation import RobertaEmbeddingModel, from_transformers
from workbench import doctor
from workbench.engine import CUDAGraphMode, GraphError, GraphManager
from workbench.models.hf import tiny_model

# written by scripts/gpu_session.py: {"name", "device", "torch", "cuda", "date", "results": gpu_record("cuda")}
CASE = get("roberta_position_accumulation")
# Cheap to start: two graphs, but 100 warmups each push the padded slots near the limit.
QUICK = case.Settings(capture_sizes=(8, 16), max_num_reqs=16, num_warmups=100)




@pytest.fixture(scope="module")
def hf():
    return tiny_model("roberta", positions=case.MAX_POSITIONS - case.OFFSET, seed=0)


@pytest.fixture(scope="module")
def record():
    """``gpu_record("cpu")`` with vLLM's default capture sizes: the headline numbers."""
    return case.gpu_record("cpu")


def _flat(requests):
    ids = torch.cat(requests).int()
    positions = torch.cat([torch.arange(len(r)) for r in requests])
    request_ids = torch.cat([torch.full((len(r),), i) for i, r in enumerate(requests)])
    return ids, positions, request_ids


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_eager_outputs_match_transformers_per_request(hf, variant):
    gen = torch.Generator().manual_seed(1)
    requests = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen) for n in (6, 1, 11)]
    model = from_transformers(hf, variant)
    ids, positions, request_ids = _flat(requests)
    with torch.no_grad():
        out = model(ids, positions.clone(), request_ids)
        start = 0
        for r in requests:
            ref = hf(input_ids=r[None]).last_hidden_state[0]
            assert (out[start:start + len(r)] - ref).abs().max().item() <= case.TOLERANCE
            start += len(r)


def test_the_comparison_sees_a_wrong_position_offset(hf):
    """Skipping the +2 (positions from 0, as the runner writes them) is far outside tolerance."""
    requests = [torch.tensor([0, 5, 9, 17, 2])]
    model = from_transformers(hf, "bug")
    ids, positions, request_ids = _flat(requests)
    with torch.no_grad():
        wrong = model.model(ids, positions, request_ids)       # BertModel without pre_model
        ref = hf(input_ids=requests[0][None]).last_hidden_state[0]
    assert (wrong - ref).abs().max().item() > 1e-2


def test_bug_shifts_the_buffer_in_place_and_fix_leaves_it(hf):
    requests = [torch.tensor([0, 5, 9, 2])]
    ids, positions, request_ids = _flat(requests)
    for variant, expected in (("bug", [2, 3, 4, 5]), ("fix", [0, 1, 2, 3])):
        buf = positions.clone()
        with torch.no_grad():
            from_transformers(hf, variant)(ids, buf, request_ids)
        assert buf.tolist() == expected, variant


def test_requests_do_not_attend_to_each_other(hf):
    """A request's output does not depend on what else is in the batch (or in padded tokens)."""
    model = from_transformers(hf, "fix")
    a, b = torch.tensor([0, 7, 8, 2]), torch.tensor([0, 30, 31, 32, 2])
    with torch.no_grad():
        alone = model(*_flat([a]))
        ids, positions, request_ids = _flat([a, b])
        request_ids[len(a):] = -1                                # b's tokens as padded tokens
        together = model(ids, positions, request_ids)[:len(a)]
    assert (alone - together).abs().max().item() <= case.TOLERANCE


def test_bad_variant_and_config_are_clear_errors(hf):
    with pytest.raises(ValueError, match="variant must be one of"):
        RobertaEmbeddingModel(hf.config, "patched")
    cfg = hf.config.__class__(**{**hf.config.to_dict(), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act"):
        RobertaEmbeddingModel(cfg, "fix")


# ----------------------------------------------------------------------------- prediction
def test_startup_runs_follow_vllm_order():
    runs = case.startup_runs([1, 4, 8], max_num_tokens=32, max_num_reqs=6, num_warmups=2)
    assert [(r.kind, r.num_tokens) for r in runs] == [
        ("profile", 32), ("warmup", 8), ("warmup", 8), ("capture", 8), ("warmup", 4), ("warmup", 4),
        ("capture", 4), ("warmup", 1), ("warmup", 1), ("capture", 1), ("pooler warmup", 6)]
    eager = case.startup_runs([1, 4, 8], max_num_tokens=32, max_num_reqs=6, enforce_eager=True)
    assert [r.kind for r in eager] == ["profile", "pooler warmup"]


def test_vllm_default_capture_sizes():
    sizes = case.vllm_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512] and len(sizes) == 51
    assert case.vllm_capture_sizes(6) == [1, 2, 4]
    with pytest.raises(ValueError):
        case.vllm_capture_sizes(0)


def test_prediction_reproduces_the_request_count_reported_for_bge_m3():
    """#37873: 6-token requests padded to 8 crash BGE-M3 (8194 positions) after ~3999 requests."""
    runs = case.startup_runs(case.vllm_capture_sizes(512), max_num_tokens=8192, max_num_reqs=256)
    v_init = case.predict_v_init(runs, slot=6, mode="piecewise")
    assert case.v_init_breakdown(runs, 6, "piecewise") == {
        "profile": 2, "warmup": 96, "capture": 96, "pooler warmup": 2}   # 48 capture sizes >= 8
    assert v_init == 196
    assert case.predict_failing_step(v_init, max_positions=8194) == 3999


def test_prediction_arithmetic():
    runs = case.startup_runs([1, 2, 4, 8, 16], max_num_tokens=16, max_num_reqs=16)
    # slot 6 is covered by: profile, warmup+capture of 16 and of 8, pooler warmup
    assert case.predict_v_init(runs, 6, "piecewise") == 2 * 6
    assert case.predict_v_init(runs, 6, "full") == 2 * 4          # captures execute nothing
    assert case.predict_failing_step(12) == 251                   # 12 + 2 * 251 = 514
    assert case.predict_failing_step(513) == 1
    assert case.predict_v_init(runs, 6, "FULL") == case.predict_v_init(runs, 6, CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match="mode"):
        case.predict_v_init(runs, 6, "NONE")
    with pytest.raises(ValueError, match="mode"):
        case.predict_v_init(runs, 6, "partial")
    with pytest.raises(ValueError, match="no padded slots"):
        case.predict(case.Settings(capture_sizes=(1, 2, 4, 8), prompt_len=8))
    with pytest.raises(ValueError, match="overflow during startup"):
        case.predict(case.Settings(capture_sizes=(1, 2, 4, 8, 16), max_num_reqs=16, num_warmups=100))


# ----------------------------------------------------------------------------- runner
@pytest.mark.parametrize("mode", case.MODES)
def test_startup_leaves_the_predicted_value_in_every_slot(hf, mode):
    model = from_transformers(hf, "bug")
    runner = case.RobertaRunner(model, (1, 2, 4, 8, 16), cudagraph_mode=mode, num_warmups=2, max_num_reqs=5)
    runner.capture()
    runs = case.startup_runs((1, 2, 4, 8, 16), max_num_tokens=16, max_num_reqs=5, num_warmups=2)
    expected = [case.predict_v_init(runs, slot, mode) for slot in range(16)]
    assert runner.buffers["positions"].tolist() == expected


def test_runner_rejects_bad_input(hf):
    model = from_transformers(hf, "fix")
    with pytest.raises(ValueError, match="mode"):
        case.RobertaRunner(model, (1, 2), cudagraph_mode="partial")
    with pytest.raises(ValueError, match="max_num_reqs"):
        case.RobertaRunner(model, (1, 2), max_num_reqs=3)
    runner = case.RobertaRunner(model, (1, 2, 4))
    with pytest.raises(GraphError, match="capture"):
        runner([torch.tensor([0, 2])])
    runner.capture()
    with pytest.raises(GraphError, match="capture\\(\\) was already called"):
        runner.capture()
    with pytest.raises(ValueError, match="empty batch"):
        runner([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        runner([torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="exceed"):
        runner([torch.arange(3, 8)])
    with pytest.raises(ValueError, match="prompt_len"):
        case.Settings(prompt_len=1)
    with pytest.raises(ValueError, match="unique"):
        case.Settings(capture_sizes=(8, 8))
    with pytest.raises(ValueError, match="num_requests"):
        case.serve_stream(QUICK, "fix", 0)


def test_a_piecewise_step_that_begins_eagerly_is_compared_with_its_first_real_piece():
    """Case 01's PIECEWISE shape: the eager region comes first, so the capture's first piece is
    empty. The doctor compares the warmup with the piece after the eager region: a lazy step the
    capture skips there is still found, and a faithful one gives no finding."""
    def run(lazy: bool) -> doctor.Report:
        buf, state = torch.ones(4), {}

        def forward(size: int) -> torch.Tensor:
            x = manager.eager(lambda t: t * 2)(buf[:size])
            if lazy and "scale" not in state:          # skipped at capture: the warmup did it
                state["scale"] = x.abs().max() + 1
            return x / state.get("scale", 1.0)

        manager = GraphManager(forward, [2, 4], mode="PIECEWISE")
        with doctor.watch() as report:
            manager.capture()
        return report

    faithful, lazy = run(lazy=False), run(lazy=True)
    assert faithful.warmups == 2 and "warmup-divergence" in faithful.checked and not faithful.findings
    assert lazy.kinds == {"warmup-divergence"}


# ----------------------------------------------------------------------------- the case, quick scenario
@pytest.mark.parametrize("mode", case.MODES)
def test_bug_fails_at_the_predicted_request_with_correct_outputs_until_then(mode):
    prediction, bug = case.reproduce(QUICK, "cpu", mode)
    assert bug.failed and bug.failure == "IndexError" and "index out of range" in bug.error
    assert bug.failing_step == prediction.failing_step
    assert bug.served == prediction.failing_step - 1
    pad = slice(QUICK.prompt_len, prediction.padded_size)
    assert bug.startup_slots[pad] == [prediction.v_init] * 2
    for step, row in enumerate(bug.positions, start=1):
        assert row[pad] == [prediction.padded_value(step)] * 2
        assert row[:QUICK.prompt_len] == list(range(2, QUICK.prompt_len + 2))
    assert max(bug.max_abs_diff) <= case.TOLERANCE


def test_fix_defence_and_eager_serve_ten_times_k():
    prediction = case.predict(QUICK)
    results = case.recoveries(QUICK, 10 * prediction.failing_step)
    for key, res in results.items():
        assert not res.failed and res.served == 10 * prediction.failing_step, key
        assert max(res.max_abs_diff) <= case.TOLERANCE, key
        assert max(res.max_index) == QUICK.prompt_len + 1, key        # last real token: 5 + 2
    pad = slice(QUICK.prompt_len, prediction.padded_size)
    assert all(row[pad] == [0, 0] for row in results["fix"].positions)    # never written
    assert all(row[pad] == [2, 2] for row in results["zero_padding"].positions)
    eager = results["eager"]
    assert all(row == eager.positions[0] for row in eager.positions)        # nothing accumulates


def test_figures(hf):
    prediction, bug = case.reproduce(QUICK, "cpu")
    fix = case.serve_stream(QUICK, "fix", 2 * prediction.failing_step, label="fix")
    figs = [case.plot_positions_heatmaps([bug, fix]), case.plot_index_growth([prediction], [bug, fix]),
            case.plot_correctness([bug, fix]), case.plot_buffer_row([bug, fix], bug.served + 5)]
    assert [len(f.axes) for f in figs] == [4, 1, 2, 2]          # heatmaps carry colorbars
    # Past the crash (the explorer's slider runs to the longest stream) the bug's panel keeps its
    # last buffer and says why it ended, instead of going empty.
    bug_ax, fix_ax = figs[-1].axes
    heights = [bar.get_height() for bar in bug_ax.patches]
    assert heights == bug.buffer()[:, bug.served].tolist() and max(heights) > 0
    assert f"after request {bug.served} (IndexError at request {prediction.failing_step})" in bug_ax.get_title()
    assert f"after request {bug.served + 5}" in fix_ax.get_title()
    for f in figs:
        plt.close(f)


def test_expected_crash_progress_bar_reads_as_predicted(capsys):
    prediction, bug = case.reproduce(QUICK, "cpu", progress=True)
    k = prediction.failing_step
    err = capsys.readouterr().err.split("\r")[-1]             # the bar as it was left
    assert f"crashed as predicted at request {k}" in err and "100%" in err and f"{k - 1}/{k - 1}" in err
    res = case.serve_stream(QUICK, "bug", k + 10, label="bug", progress=True, predicted_failure=k + 1)
    err = capsys.readouterr().err
    assert res.failing_step == k and f"crashed at request {k}, predicted {k + 1}" in err


# ----------------------------------------------------------------------------- headline numbers
def test_headline_scenario_fails_where_predicted_in_both_graph_modes(record):
    for mode, v_init, k in ((CUDAGraphMode.PIECEWISE, 196, 159), (CUDAGraphMode.FULL, 100, 207)):
        bug = record[case.record_key(mode)]
        assert (bug["predicted_v_init"], bug["predicted_failing_step"]) == (v_init, k)
        assert bug["failed"] and bug["failing_step"] == k, mode
        assert bug["padded_slots_first_steps"][0] == [v_init + 2, v_init + 2]
        assert bug["padded_slots_last_step"] == [v_init + 2 * (k - 1)] * 2
    for key in ("fix", "zero_padding", "eager"):
        assert not record[key]["failed"] and record[key]["served"] == 10 * 159, key
        assert record[key]["max_abs_diff"] <= case.TOLERANCE


def _same_key_numbers(gpu: dict, cpu: dict) -> None:
    assert gpu["settings"] == cpu["settings"]
    for mode in case.MODES:
        g, c = gpu[case.record_key(mode)], cpu[case.record_key(mode)]
        for key in ("predicted_v_init", "predicted_failing_step", "failed", "failing_step",
                    "startup_slots", "padded_slots_first_steps", "padded_slots_last_step"):
            assert g[key] == c[key], (mode, key)
        assert g["failure"] in ("device-side assert", "IndexError")
        assert g["max_abs_diff_before_failure"] <= case.TOLERANCE
    for key in ("fix", "zero_padding", "eager"):
        for field in ("failed", "served", "last_slots", "max_index"):
            assert gpu[key][field] == cpu[key][field], (key, field)
        assert gpu[key]["max_abs_diff"] <= case.TOLERANCE


def test_gpu_record_matches_cpu(record):
    gpu = CASE.gpu_results()
    if gpu is None:
        pytest.skip(f"{CASE.record.name} not recorded on a GPU yet: a GPU session writes it with gpu_record()")
    _same_key_numbers(gpu, json.loads(json.dumps(record)))


@pytest.mark.cuda
def test_cuda_device_side_assert_at_the_predicted_request():
    prediction, bug = case.reproduce(QUICK, "cuda")
    assert bug.failed and bug.failure == "device-side assert"
    assert bug.failing_step == prediction.failing_step
