"""Case 02: ViT encoder CUDA graphs (vLLM #38040): model, manager config paths, reproduction, fix."""
from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from workbench import expect_failure, plots
from workbench.cases import VARIANTS, get
from workbench.cases import vit_zero_per_image_output as case
from workbench.cases.vit_zero_per_image_output.model import _same_sequence_mask

matplotlib.use("Agg")
# written by scripts/gpu_session.py: {"name", "device", "torch", "cuda", "date", "results": gpu_record("cuda")}
CASE = get("vit_zero_per_image_output")




@pytest.fixture(scope="module")
def record():
    """``gpu_record("cpu")``: the CPU emulator's key numbers, shared by the scenario tests."""
    return case.gpu_record("cpu")


def manager(variant, min_budget=4, max_budget=128, token_budgets=(), max_items=0):
    """A config-only manager over a model that only reports its budget range (upstream ``_make_mgr``)."""
    config = case.EncoderGraphConfig(token_budgets=tuple(token_budgets), max_items_per_batch=max_items)
    return case.EncoderCudaGraphManager(case.budget_range_model(min_budget, max_budget, variant), config)


# ------------------------------------------------------------------- model
def test_encoder_matches_transformers_qwen3_vl():
    visual = case.build_encoder(seed=3)
    hf = case.to_transformers(visual)
    grid = [[1, 4, 6], [1, 2, 2], [2, 8, 4], [1, 10, 14]]
    x = case.make_pixels(grid, visual.config.patch_dim, seed=1, device="cpu")
    with torch.no_grad():
        ours, theirs = visual(x, grid), case.transformers_output(hf, x, grid)
    assert ours.shape == (sum(case.output_tokens(grid, 2)), visual.config.output_width)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().mean() > 0.05          # not a comparison of near-zero tensors


def test_patch_embed_on_zero_patches_raises_upstream_reshape_error():
    visual = case.build_encoder()
    with pytest.raises(RuntimeError, match=r"cannot reshape tensor of 0 elements into shape \[0, -1, 2, 16, 16\]"):
        visual.patch_embed(torch.zeros(0, visual.config.patch_dim))


def test_per_item_output_floor_vs_ceiling():
    assert case.per_item_output(64, 256, "bug") == 0 and case.per_item_output(64, 256, "fix") == 1
    assert case.per_item_output(10000, 156, "bug") * 156 == 9984          # 16 tokens short
    assert case.per_item_output(10000, 156, "fix") * 156 == 10140
    assert case.per_item_output(8192, 64, "bug") == case.per_item_output(8192, 64, "fix") == 128
    with pytest.raises(ValueError, match="variant must be one of"):
        case.per_item_output(64, 8, "patched")


def test_capture_inputs_are_rectangular_images_and_padded_metadata():
    model = case.EncoderModel(case.build_encoder(), variant="fix", min_budget=8)
    inputs = model.prepare_encoder_cudagraph_capture_inputs(50, 6, "cpu", torch.float32)
    assert inputs.per_item_output == 9 and inputs.grid_thw == [[1, 2, 18]] * 6
    assert inputs.pixel_values.shape == (6 * 9 * 4, model.visual.config.patch_dim)
    assert inputs.metadata["cu_seqlens"].tolist() == [36 * i for i in range(7)]
    short = model.visual.prepare_encoder_metadata([[1, 2, 4]], max_batch_size=6)["cu_seqlens"]
    assert short.tolist() == [0, 8, 8, 8, 8, 8, 8]      # padded with its last value: empty sequences


def test_padded_rows_never_attend_to_real_rows():
    mask = _same_sequence_mask(torch.tensor([0, 3, 5, 5], dtype=torch.int32), 7)
    assert mask[:3, :3].all() and mask[3:5, 3:5].all() and mask[5:, 5:].all()
    assert not mask[:5, 5:].any() and not mask[:3, 3:].any()


def test_evs_postprocess_appends_mrope_channels():
    visual = case.build_encoder()
    model = case.EncoderModel(visual, variant="fix", pruning=True)
    grid = [[1, 4, 6]]
    (emb,) = model.embed_images(case.make_pixels(grid, visual.config.patch_dim, 0, "cpu"), grid)
    assert emb.shape == (6, visual.config.output_width + case.MROPE_CHANNELS)
    assert emb[:, -5:].tolist() == [[0, h, w, 3, 0] for h in range(2) for w in range(3)]


def test_graph_modalities_with_pruning():
    visual = case.build_encoder()
    assert case.EncoderModel(visual, variant="bug", pruning=True).encoder_cudagraph_modalities() == ["image"]
    assert case.EncoderModel(visual, variant="fix", pruning=True).encoder_cudagraph_modalities() == []
    assert case.EncoderModel(visual, variant="fix", pruning=False).encoder_cudagraph_modalities() == ["image"]


# ------------------------------------------- upstream TestInitInvariantValidation
def test_generate_budgets():
    assert case.generate_budgets(64, 8192) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert case.generate_budgets(64, 800) == [64, 128, 256, 512, 800]


def test_auto_inferred_invariant_holds():                      # finding 1
    fix, bug = manager("fix", 64, 16384), manager("bug", 64, 16384)
    assert fix.path == "d" and fix.max_batch_size == 64 == min(fix.token_budgets)
    assert bug.max_batch_size == 256 > min(bug.token_budgets)    # the bug: 64 // 256 == 0
    small = manager("fix", 4, 128)
    assert small.max_batch_size <= min(small.token_budgets)


def test_user_specified_bad_combo_raises():                     # finding 2
    with pytest.raises(ValueError, match=r"must be <= smallest token budget \(64\)") as e:
        manager("fix", token_budgets=[64], max_items=256)
    assert "Lower encoder_cudagraph_max_vision_items_per_batch to <= 64" in str(e.value)
    assert "remove the budgets below 256" in str(e.value)
    assert manager("bug", token_budgets=[64], max_items=256).max_batch_size == 256


def test_user_specified_valid_combo_and_boundary():
    m = manager("fix", token_budgets=[128, 64], max_items=32)
    assert (m.path, m.max_batch_size, m.token_budgets) == ("a", 32, [64, 128])
    assert manager("fix", token_budgets=[64, 128], max_items=64).max_batch_size == 64   # per item 1
    assert manager("fix", token_budgets=[64, 128], max_items=64).capture_plan()[0]["per_item_output"] == 1


def test_user_max_items_only_raises_budget_floor():             # finding 3
    m = manager("fix", 64, 16384, max_items=128)
    assert m.path == "c" and m.max_batch_size == 128 and min(m.token_budgets) == 128
    assert manager("bug", 64, 16384, max_items=128).token_budgets[0] == 64
    small = manager("fix", 4, 128, max_items=2)
    assert small.max_batch_size == 2 and min(small.token_budgets) >= 2
    with pytest.raises(ValueError, match=r"\(200\) must be <= the largest token budget \(128"):
        manager("fix", 4, 128, max_items=200)


def test_user_budgets_only_caps_max_batch_size():               # finding 4
    fix = manager("fix", 64, 16384, token_budgets=[32, 64])
    assert fix.path == "b" and fix.max_batch_size == 32
    assert manager("bug", 64, 16384, token_budgets=[32, 64]).max_batch_size == 256


@pytest.mark.parametrize("lo, hi", [(0, 128), (4, -1)])
def test_non_positive_budget_range_raises(lo, hi):              # findings 5, 6
    with pytest.raises(ValueError, match="Both must be positive"):
        manager("fix", lo, hi)


def test_min_greater_than_max_raises():
    with pytest.raises(ValueError, match="min_budget=200 > max_budget=100"):
        manager("fix", 200, 100)


@pytest.mark.parametrize("budgets", [[0, 128], [-1, 64]])
def test_non_positive_user_budgets_raise(budgets):              # finding 7
    with pytest.raises(ValueError, match="must be positive"):
        case.check_config(case.EncoderGraphConfig(token_budgets=tuple(budgets)))
    with pytest.raises(ValueError, match="must be positive"):
        manager("fix", token_budgets=budgets, max_items=1)


def test_negative_max_items_raises():
    with pytest.raises(ValueError, match="non-negative"):
        case.check_config(case.EncoderGraphConfig(max_items_per_batch=-3))


# ------------------------------------------------------------ property tests
configs = st.builds(
    dict, min_budget=st.integers(1, 512), span=st.integers(1, 4096),
    token_budgets=st.one_of(st.just([]), st.lists(st.integers(1, 20000), min_size=1, max_size=5)),
    max_items=st.one_of(st.just(0), st.integers(1, 2048)))


def plan_of(variant, cfg):
    return case.plan(cfg["min_budget"], cfg["min_budget"] * cfg["span"], variant,
                     token_budgets=cfg["token_budgets"], max_items=cfg["max_items"])


@hypothesis.settings(max_examples=300, deadline=None, database=None, derandomize=True)
@hypothesis.given(configs)
def test_fix_never_zero_per_item_never_underallocates(cfg):
    p = plan_of("fix", cfg)
    if p["error"]:      # only a user-given batch size larger than a budget is refused
        assert cfg["max_items"] > 0 and "must be <=" in p["error"]
        return
    assert p["max_batch_size"] <= min(p["token_budgets"])
    for row in p["rows"]:
        assert row["per_item_output"] >= 1
        assert row["budget"] <= row["allocated_tokens"] < row["budget"] + p["max_batch_size"]


def _bug_zero(cfg):
    p = plan_of("bug", cfg)
    return any(r["per_item_output"] == 0 for r in p["rows"])


def _bug_short(cfg):
    p = plan_of("bug", cfg)
    return any(0 < r["allocated_tokens"] < r["budget"] for r in p["rows"])


def test_hypothesis_finds_bug_counterexamples():
    settings = hypothesis.settings(max_examples=2000, database=None, derandomize=True)
    zero = hypothesis.find(configs, _bug_zero, settings=settings)
    short = hypothesis.find(configs, _bug_short, settings=settings)
    assert _bug_zero(zero) and _bug_short(short)
    assert not any(r["per_item_output"] == 0 for r in plan_of("fix", zero).get("rows", []))
    assert not any(r["allocated_tokens"] < r["budget"] for r in plan_of("fix", short).get("rows", []))


# ------------------------------------------------------------------ packing
def test_pack_greedy_respects_budget_and_batch_size():
    tokens = [50, 4, 30, 30, 8, 100, 1]
    batches = case.pack_greedy(tokens, 64, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(tokens)))
    assert batches == [[6, 1, 4], [2, 3], [0], [5]]       # ascending; 100 alone (eager later)
    for b in batches[:-1]:
        assert len(b) <= 3 and sum(tokens[i] for i in b) <= 64


# ---------------------------------------------------------------- scenarios
def test_defaults_bug_crashes_at_first_capture(record):
    r = record["defaults_bug"]
    assert r["token_budgets"] == [64 * 2 ** k for k in range(9)] and r["max_batch_size"] == 256
    assert (r["failed_budget"], r["per_item_output"], r["captured"]) == (64, 0, [])
    assert r["error"].startswith("cannot reshape tensor of 0 elements into shape [0, -1, 2, 16, 16]")
    fix = record["defaults_fix_plan"]
    assert fix["max_batch_size"] == 64 and len(fix["token_budgets"]) == 9
    assert [row["per_item_output"] for row in fix["rows"]] == [2 ** k for k in range(9)]


def test_defaults_bug_capture_under_expect_failure():
    bug = case.build_manager("bug", case.DEFAULTS)
    with expect_failure(RuntimeError, match=r"cannot reshape tensor of 0 elements", quiet=True):
        bug.capture()
    assert bug.capture_failed_at == 64 and not bug.budget_graphs


def test_scaled_bug_crashes_fix_captures_every_budget(record):
    assert record["scaled_bug"]["max_batch_size"] == 16 and record["scaled_bug"]["failed_budget"] == 8
    assert record["scaled_bug"]["per_item_output"] == 0 and record["scaled_bug"]["captured"] == []
    fix = record["scaled_fix"]
    assert fix["max_batch_size"] == 8 and fix["error"] is None
    assert fix["captured"] == fix["token_budgets"] == [8, 16, 32, 64, 128]


def test_underallocation_bug_fails_at_replay_fix_fits(record):
    bug, fix = record["underallocation"]["bug"], record["underallocation"]["fix"]
    assert bug["token_budgets"] == [8, 16, 32, 50] and bug["max_batch_size"] == 6
    assert bug["allocated_tokens"] == [6, 12, 30, 48] and fix["allocated_tokens"] == [12, 18, 36, 54]
    assert bug["full_batch_tokens"] == 50
    assert bug["full_batch_error"] == ("The size of tensor a (192) must match the size of tensor b (200) "
                                       "at non-singleton dimension 0")
    crashed = [t for t, c in zip(bug["sweep_tokens"], bug["sweep_crashed"]) if c]
    assert crashed == [7, 8, 13, 14, 15, 16, 31, 32, 49, 50]
    assert bug["sweep_crashed"] == bug["predicted_crash"]
    assert all(d < case.TOLERANCE for d in bug["sweep_max_abs_diff"] if d is not None)  # fitting ones are right
    assert fix["full_batch_error"] is None and not any(fix["sweep_crashed"])
    assert fix["full_batch_max_abs_diff"] < case.TOLERANCE
    assert max(fix["sweep_max_abs_diff"]) < case.TOLERANCE


def test_pruning_bug_changes_width_fix_falls_back_to_eager(record):
    w = record["pruning"]
    assert (w["eager"], w["bug"], w["fix"]) == (101, 96, 101)
    assert w["bug_graph_hits"] == 2 and w["fix_graphs"] == 0 and w["fix_graph_hits"] == 0


def test_fix_stream_equals_eager_per_image(record):
    s = record["stream"]
    assert len(s["max_abs_diff"]) == len(s["tokens"]) >= 10
    assert max(s["max_abs_diff"]) < case.TOLERANCE
    assert len({b["budget"] for b in s["batches"]}) >= 3          # several budgets exercised
    assert all(b["tokens"] <= b["budget"] and b["items"] <= 8 for b in s["batches"])
    assert len(s["graph_ms"]) == len(s["eager_ms"]) == 5 * len(s["batches"])
    assert 0 < s["graph_p50_ms"] <= s["graph_p99_ms"]


def test_batches_of_one_budget_do_not_alias_and_oversize_runs_eager():
    m = case.build_manager("fix", case.PRUNING, min_budget=8)
    m.capture()
    visual = m.model.visual
    small, large = [[1, 4, 4]], [[1, 16, 20]]               # 4 tokens; 80 tokens > max budget 64
    first_px = case.make_pixels(small, visual.config.patch_dim, 1, "cpu")
    first = m.execute(first_px, small)
    m.execute(case.make_pixels(small, visual.config.patch_dim, 2, "cpu"), small)
    with torch.no_grad():
        torch.testing.assert_close(first[0], visual(first_px, small), rtol=1e-5, atol=1e-5)
        px = case.make_pixels(large, visual.config.patch_dim, 3, "cpu")
        torch.testing.assert_close(m.execute(px, large)[0], visual(px, large))
    assert (m.graph_hits, m.graph_misses) == (2, 1)


def test_replay_before_capture_and_bad_inputs_are_clear():
    m = case.build_manager("fix", case.PRUNING, min_budget=8)
    grid = [[1, 4, 4]]
    with pytest.raises(RuntimeError, match="call capture"):
        m.execute(case.make_pixels(grid, m.model.visual.config.patch_dim, 0, "cpu"), grid)
    with pytest.raises(ValueError, match="n_requests"):
        case.mixed_stream(0)
    with pytest.raises(ValueError, match="max_side"):
        case.mixed_stream(2, max_side=7)
    with pytest.raises(ValueError, match="at least 1"):
        case.image_grid(0)
    with pytest.raises(ValueError, match="variant"):
        case.build_manager("after", case.PRUNING)


def test_plots_return_figures(record):
    figs = [case.plot_per_item_heatmap(case.per_item_heatmap(range(4))),
            case.plot_allocation(record["underallocation"]["bug"]),
            case.plot_correctness(record["stream"], record["underallocation"]),
            case.plot_latency(record["stream"], "cpu"), case.plot_pruning(record["pruning"]),
            case.plot_plan(64, 16384), case.plot_plan(64, 1024, max_items=128)]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    for fig in figs:        # as asked for, before the draw hook would raise anything smaller
        assert not plots.small_texts(fig), f"{fig.axes[0].get_title()!r}: {plots.small_texts(fig)[:4]}"
        plt.close(fig)
    heat = case.per_item_heatmap(range(4))
    assert np.array(heat["bug"])[3, 0] == 0 and np.array(heat["fix"]).min() >= 1


# ------------------------------------------------------------------- GPU
def _same_key_numbers(gpu: dict, cpu: dict) -> None:
    for key in ("defaults_bug", "defaults_fix_plan", "scaled_bug", "scaled_fix", "pruning"):
        assert gpu[key] == cpu[key], key
    for v in VARIANTS:
        g, c = gpu["underallocation"][v], cpu["underallocation"][v]
        for key in ("token_budgets", "allocated_tokens", "full_batch_error", "sweep_crashed", "predicted_crash"):
            assert g[key] == c[key], (v, key)
        assert [d is None for d in g["sweep_max_abs_diff"]] == [d is None for d in c["sweep_max_abs_diff"]]
        assert all(d < case.TOLERANCE for d in g["sweep_max_abs_diff"] if d is not None)
    assert gpu["stream"]["tokens"] == cpu["stream"]["tokens"]
    assert gpu["stream"]["batches"] == cpu["stream"]["batches"]
    assert max(gpu["stream"]["max_abs_diff"]) < case.TOLERANCE


def test_gpu_record_matches_cpu(record):
    gpu = CASE.gpu_results()
    if gpu is None:
        pytest.skip(f"{CASE.record.name} not recorded on a GPU yet: a GPU session writes it with gpu_record()")
    _same_key_numbers(gpu, json.loads(json.dumps(record)))


@pytest.mark.cuda
def test_cuda_matches_cpu_emulation(record):
    _same_key_numbers(json.loads(json.dumps(case.gpu_record("cuda"))), json.loads(json.dumps(record)))
