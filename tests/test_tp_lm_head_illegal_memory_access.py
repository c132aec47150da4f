"""Case 03: the TP>1 lm_head gather the centroid graphs do not own. Model, launcher, bug and fix."""
import json
import math
import os
import re
import time

import matplotlib.pyplot as plt
import pytest
import torch

from workbench.cases import get
from workbench.cases import tp_lm_head_illegal_memory_access as case
from workbench.cases.tp_lm_head_illegal_memory_access.scenario import _failed_launch
from workbench.cases.tp_lm_head_illegal_memory_access.upstream import (
    CentroidsProposer, MTPDraftHead, MTPHeadConfig, make_checkpoint, transformers_masked_embedder,
    weights_from_transformers)
from workbench.dist import RankError, launch, tensor_model_parallel_all_gather
from workbench.engine import IllegalMemoryAccess

# written by scripts/gpu_session.py: {"name", "device", "torch", ..., "results": gpu_record("cuda")}
CASE = get("tp_lm_head_illegal_memory_access")
SMALL = MTPHeadConfig(vocab_size=3000, hidden_size=32, num_centroids=60, centroid_intermediate_top_k=4)
QUICK = case.FAST


def _model(variant, config=SMALL, seed=0):
    model = MTPDraftHead(config, variant)
    model.load_weights(make_checkpoint(config, seed).items())
    return model


# --------------------------------------------------------------------------- model, in this process
def test_config_and_inputs_are_validated():
    with pytest.raises(ValueError, match="multiple of num_centroids"):
        MTPHeadConfig(vocab_size=1000, num_centroids=7)
    with pytest.raises(ValueError, match="cannot exceed"):
        MTPHeadConfig(vocab_size=100, num_centroids=10, centroid_intermediate_top_k=11)
    with pytest.raises(ValueError, match="hidden_size"):
        MTPHeadConfig(hidden_size=0)
    with pytest.raises(ValueError, match="variant"):
        MTPDraftHead(SMALL, "patched")
    with pytest.raises(ValueError, match="sizes"):
        CentroidsProposer(_model("bug"), "cpu", sizes=[0, 2])
    with pytest.raises(ValueError, match="timing_batch"):
        case.Settings(sizes=(1, 2), timing_batch=4)
    with pytest.raises(ValueError, match="unique"):
        case.Settings(sizes=(2, 2))
    model = _model("bug")
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("lm_head.bias", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("lm_head.weight", torch.zeros(10, SMALL.hidden_size))])


def test_lm_head_storage_is_vllm_padded():
    """Vocabulary padded to a multiple of 64; rows past the vocabulary are zero; the full weight
    the masked embedder gets is the first ``vocab_size`` rows."""
    model = _model("bug")
    assert model.lm_head.weight.shape == (3008, SMALL.hidden_size)
    assert torch.equal(model.lm_head.weight[3000:], torch.zeros(8, SMALL.hidden_size))
    assert torch.equal(model._get_full_lm_head_weight(), make_checkpoint(SMALL)["lm_head.weight"])


def test_masked_embedder_matches_transformers():
    """Same weights as transformers' Gemma4AssistantMaskedEmbedder: same logits on the selected
    tokens, the same argmax, and get_top_tokens is that argmax."""
    hf = transformers_masked_embedder(SMALL, seed=3)
    lm_head = torch.randn(SMALL.vocab_size, SMALL.hidden_size, generator=torch.Generator().manual_seed(4))
    model = MTPDraftHead(SMALL, "fix")
    model.load_weights(weights_from_transformers(hf, lm_head).items())
    h = torch.randn(6, SMALL.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(h[None], lm_head)[0]
        ours = model.compute_logits(h)
    selected = ours > torch.finfo(ours.dtype).min
    assert selected.sum(-1).tolist() == [model.masked_embedding.num_selected] * 6
    torch.testing.assert_close(ours[selected], expected[selected], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert torch.equal(model.get_top_tokens(h), expected.argmax(-1))


def test_checkpoint_clusters_hold_the_best_tokens():
    """The seeded checkpoint behaves like a trained one: the sparse argmax over the top-k clusters
    is the full-vocabulary argmax for most rows (it is not for random clusters)."""
    ck = make_checkpoint(case.Settings().head)
    model = MTPDraftHead(case.Settings().head, "bug")
    model.load_weights(ck.items())
    h = torch.randn(400, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    full = (h @ ck["lm_head.weight"].T).argmax(-1)
    assert (model.get_top_tokens(h) == full).float().mean() > 0.8


def test_tp1_weight_is_a_view_of_the_parameter_and_the_fix_does_not_cache():
    for variant in ("bug", "fix"):
        model = _model(variant)
        w = model._get_full_lm_head_weight()
        assert w.untyped_storage().data_ptr() == model.lm_head.weight.untyped_storage().data_ptr()
        assert model._stable_full_lm_head_weight is None      # upstream caches at TP>1 only


def test_tp1_bug_replays_match_eager():
    """TP=1: the graphs read the parameter, so the bug code is fine even when the engine allocates
    same-size tensors and empties its cache after load."""
    res = case.run_tp1(QUICK, "cpu")
    assert res.failure is None
    assert len(res.graph_tokens) == QUICK.steps
    assert res.agreement == 1.0
    assert res.timeline["return"][0] == "alive"


def test_a_failed_separate_launch_is_recorded_not_lost():
    """On CUDA the release and gather-in-capture scenarios run in launches of their own; if one
    fails (a rank dies right after the illegal access, an NCCL capture hangs) it becomes that
    scenario's outcome, and the other results stand."""
    died = RankError("2 of 2 ranks failed (nccl):\n  rank 0: AcceleratorError: CUDA error: an illegal "
                     "memory access was encountered", {0: "..."})
    release = _failed_launch("release", QUICK, "cuda", died)["bug_release"]
    assert (release.failure, release.scenario) == (case.ILLEGAL_MEMORY_ACCESS, case.BUG_RELEASE)
    hung = RankError("2 of 2 ranks failed (nccl):\n  rank 0: did not report within 240 s", {0: "..."})
    capture = _failed_launch("gather_in_capture", QUICK, "cuda", hung)["gather_in_capture"]
    assert capture.failure == "capture_error" and math.isnan(capture.agreement)
    assert _failed_launch("release", QUICK, "cuda", hung)["bug_release"].failure == "rank_failed"


def test_proposer_needs_load_model():
    with pytest.raises(RuntimeError, match="load_model"):
        CentroidsProposer(_model("bug"), "cpu")._greedy_sample(torch.zeros(1, SMALL.hidden_size))


# --------------------------------------------------------------------------- the launcher
def _rank_facts(config):
    """Facts about TP=2 that need two ranks (module level: spawned ranks import it by name)."""
    rank = torch.distributed.get_rank()
    x = torch.full((2, 3), float(rank))
    gathered = tensor_model_parallel_all_gather(x, dim=0)
    gathered_cols = tensor_model_parallel_all_gather(x, dim=1)
    native = torch.distributed.all_gather_into_tensor

    def unsupported(*args, **kwargs):        # what gloo builds without _allgather_base raise
        raise RuntimeError("Backend gloo does not support _allgather_base")

    torch.distributed.all_gather_into_tensor = unsupported
    try:
        fallback = tensor_model_parallel_all_gather(x + 10, dim=0)
    finally:
        torch.distributed.all_gather_into_tensor = native
    bug, fix = _model("bug", config), _model("fix", config)
    b1, b2 = bug._get_full_lm_head_weight(), bug._get_full_lm_head_weight()
    f1, f2 = fix._get_full_lm_head_weight(), fix._get_full_lm_head_weight()
    alt = CentroidsProposer(_model("bug", config), "cpu", sizes=[1, 2], gather_in_capture=True)
    alt.load_model()
    outside = CentroidsProposer(_model("fix", config), "cpu", sizes=[1, 2])
    outside.load_model()
    return {
        "rank": rank, "world": torch.distributed.get_world_size(),
        "shard_rows": bug.lm_head.weight.shape[0],
        "gathered": gathered[:, 0].tolist(), "gathered_cols": gathered_cols[0].tolist(),
        "fallback": fallback[:, 0].tolist(),
        "bug_new_storage_each_call": b1.untyped_storage().data_ptr() != b2.untyped_storage().data_ptr(),
        "bug_not_parameter": b1.untyped_storage().data_ptr() != bug.lm_head.weight.untyped_storage().data_ptr(),
        "bug_equals_checkpoint": torch.equal(b1, make_checkpoint(config)["lm_head.weight"]),
        "fix_same_tensor": f1 is f2 and f1.is_contiguous(),
        "fix_equals_checkpoint": torch.equal(f1, make_checkpoint(config)["lm_head.weight"]),
        "allgather_in_alt_graphs": [sum("all_gather" in op.name for op in g.ops)
                                    for g in alt.centroid_graphs],
        "allgather_in_fix_graphs": [sum("all_gather" in op.name for op in g.ops)
                                    for g in outside.centroid_graphs],
    }


def _rank_fails():
    rank = torch.distributed.get_rank()
    if rank == 0:
        raise ValueError("rank zero gives up")
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()          # rank 2 waits for peers that never come


def _rank_hangs():
    time.sleep(600)


@pytest.mark.multiproc
def test_launcher_returns_rank_values_and_tp2_facts():
    r0, r1 = launch(_rank_facts, 2, SMALL, timeout=120)
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["shard_rows"] == 3008 // 2
    assert r0["gathered"] == r1["gathered"] == [0.0, 0.0, 1.0, 1.0]
    assert r0["gathered_cols"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert r0["fallback"] == r1["fallback"] == [10.0, 10.0, 11.0, 11.0]   # gloo without all_gather_into_tensor
    for r in (r0, r1):
        assert r["bug_new_storage_each_call"] and r["bug_not_parameter"] and r["bug_equals_checkpoint"]
        assert r["fix_same_tensor"] and r["fix_equals_checkpoint"]
        assert r["allgather_in_alt_graphs"] == [1, 1]     # the alternative fix: a collective per replay
        assert r["allgather_in_fix_graphs"] == [0, 0]


@pytest.mark.multiproc
def test_launcher_reports_raising_dead_and_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        launch(_rank_fails, 3, timeout=60)
    assert "ValueError: rank zero gives up" in caught.value.failures[0]
    assert "exit code 3" in caught.value.failures[1]
    assert 2 in caught.value.failures     # gloo saw its peers vanish, or the launcher killed it
    assert time.monotonic() - start < 45          # well before the 60 s timeout


@pytest.mark.multiproc
def test_launcher_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match="did not report within 8 s"):
        launch(_rank_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_hangs, 0)
    with pytest.raises(ValueError, match="device"):
        launch(_rank_hangs, 2, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="need 2 GPUs"):
            launch(_rank_hangs, 2, device="cuda")


# --------------------------------------------------------------------------- the case at TP=2
@pytest.fixture(scope="module")
def results():
    """The run ``gpu_record`` makes (upstream's seven graph sizes), once for all tests below."""
    return case.run_case(case.GPU_RECORD, "cpu")


@pytest.mark.multiproc
def test_bug_release_is_an_illegal_memory_access_naming_the_gather(results):
    r = results.bug_release
    assert (r.failure, r.failed_step, r.graph_tokens) == (case.ILLEGAL_MEMORY_ACCESS, 0, [])
    assert r.error_type == "IllegalMemoryAccess"
    assert r.error.startswith("graph replay read freed memory")
    assert re.search(case.expected_release_error("cpu"), r.error)
    assert f"float32[{results.settings.head.vocab_size}, {results.settings.head.hidden_size}]" in r.error
    with pytest.raises(IllegalMemoryAccess, match="_select_and_score"):
        r.raise_failure()
    assert r.timeline["return"][0] == "freed" and r.timeline["release"][0] == "released"


@pytest.mark.multiproc
def test_bug_reuse_gives_wrong_but_valid_tokens_silently(results):
    r = results.bug_reuse
    assert r.failure is None and len(r.graph_tokens) == results.settings.steps
    assert r.reused_blocks == len(results.settings.sizes)   # every graph reads the later tensor
    assert r.agreement < 0.2                            # chance level: the graphs score noise
    vocab = results.settings.head.vocab_size
    assert all(0 <= t < vocab for step in r.graph_tokens for t in step)


@pytest.mark.multiproc
def test_fixes_match_eager_every_step(results):
    for r in (results.fix, results.gather_in_capture):
        assert r.failure is None
        assert r.agreement_per_step == [1.0] * results.settings.steps
    assert results.fix.timeline["return"][0] == "alive"
    assert results.gather_in_capture.timeline["gather"][0] == "pool"
    assert results.ranks_agree
    # TP=2 computes the same draft tokens as TP=1 (same checkpoint, sharded and gathered back).
    assert results.fix.eager_tokens == results.tp1_bug.eager_tokens


@pytest.mark.multiproc
def test_reload_invalidates_the_cache_and_needs_a_recapture(results):
    reload = results.reload
    assert reload["cache_invalidated"] and reload["old_weight_freed"] and reload["new_cache_matches_checkpoint"]
    assert reload["stale_vs_old_eager"] == 1.0           # graphs captured before still read the old weight
    assert reload["stale_vs_new_eager"] < 0.2
    assert reload["recaptured_vs_new_eager"] == 1.0


@pytest.mark.multiproc
def test_step_times_and_figures(results):
    t = results.step_time_ms
    assert tuple(t) == case.STEP_WAYS
    assert all(v > 0 for v in t.values())
    assert t["eager, all-gather every step"] > 2 * t["eager, cached weight"]
    for fig in (case.plot_agreement(results), case.plot_token_match(results),
                case.plot_memory_timeline(results), case.plot_step_time(results),
                case.plot_step_tokens(results, 0)):
        assert fig.axes
        plt.close(fig)
    with pytest.raises(ValueError, match="step"):
        case.plot_step_tokens(results, results.settings.steps)
    assert len(case.summary_lines(results)) == 5


@pytest.mark.multiproc
def test_record_is_json_ready(results):
    rec = case.record(results)
    json.dumps(rec)
    assert rec["release_outcome"] == case.ILLEGAL_MEMORY_ACCESS
    assert rec["tp1_bug_agreement"] == rec["fix_agreement"] == rec["gather_in_capture_agreement"] == 1.0
    assert rec["reuse_agreement"] < 1.0


# --------------------------------------------------------------------------- against the GPU
@pytest.mark.multiproc
def test_gpu_record_matches_cpu(results):
    gpu = CASE.gpu_results()
    if gpu is None:
        pytest.skip(f"{CASE.record.name} not recorded on a GPU yet: a GPU session writes it with gpu_record()")
    cpu = case.record(results)      # = gpu_record("cpu"): same settings, same run
    assert gpu["settings"] == cpu["settings"]
    assert gpu["tp1_bug_agreement"] == cpu["tp1_bug_agreement"] == 1.0
    assert gpu["release_outcome"] == cpu["release_outcome"] == case.ILLEGAL_MEMORY_ACCESS
    assert gpu["release_failed_step"] == cpu["release_failed_step"] == 0
    assert gpu["reuse_failure"] is None and cpu["reuse_failure"] is None
    assert gpu["reuse_agreement"] < 1.0 and cpu["reuse_agreement"] < 1.0   # exact values depend on the allocator
    assert gpu["fix_agreement"] == cpu["fix_agreement"] == 1.0
    assert gpu["gather_in_capture_agreement"] == cpu["gather_in_capture_agreement"] == 1.0
    for key in ("cache_invalidated", "old_weight_freed", "new_cache_matches_checkpoint"):
        assert gpu["reload"][key] and cpu["reload"][key]
    assert gpu["reload"]["stale_vs_old_eager"] == cpu["reload"]["stale_vs_old_eager"] == 1.0
    assert gpu["reload"]["recaptured_vs_new_eager"] == cpu["reload"]["recaptured_vs_new_eager"] == 1.0
    pairs = [(a, b) for ga, gb in zip(gpu["eager_tokens"], cpu["eager_tokens"]) for a, b in zip(ga, gb)]
    assert len(pairs) == sum(len(step) for step in cpu["eager_tokens"])
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.98   # fp32 sums in another order may flip a near-tie
    assert not math.isnan(gpu["step_time_ms"]["graph, cached weight (fix)"])
