"""Case 04: stale ``is_prefilling`` in padded rows (vLLM #41873, #42947)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from workbench import cases
from workbench.cases import mamba_stale_is_prefilling as case
from workbench.cases.mamba_stale_is_prefilling.mamba import NULL_BLOCK_ID, MambaConfig, StateTable, tiny_mamba
from workbench.cases.mamba_stale_is_prefilling.upstream import (CachedRequestState, CommonAttentionMetadata,
                                                                InputBatch, MambaMetadataBuilder, check_variant,
                                                                padded_is_prefilling,
                                                                reorder_batch_to_split_decodes_and_prefills)
from workbench.engine import graph, new_graph

CASE = cases.get("mamba_stale_is_prefilling")


@pytest.fixture(scope="module")
def runs():
    return case.serve_all("cpu")


# ------------------------------------------------------------------------------ model
@pytest.fixture(scope="module")
def hf_pair():
    transformers = pytest.importorskip("transformers")
    config = MambaConfig()
    ours = tiny_mamba(3, config, dtype=torch.float32)
    hf = transformers.MambaForCausalLM(config.to_transformers()).eval()
    hf.load_state_dict(ours.state_dict(), strict=True)
    return ours, hf


@torch.no_grad()
def test_prefill_matches_transformers(hf_pair):
    ours, hf = hf_pair
    ids = torch.randint(1, 64, (2, 9))
    torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_chunked_prefill_and_decode_match_transformers_step_by_step(hf_pair):
    """Our chunked prefill + slot-indexed decode against transformers' cache, logits at every step."""
    ours, hf = hf_pair
    prompt = torch.randint(1, 64, (7,))
    table = StateTable.empty(ours.config, 4, dtype=torch.float32)
    ours.prefill(torch.randint(1, 64, (5,)), table, 1, has_initial_state=False)      # another request
    mine = [ours.prefill(prompt[:4], table, 3, False)[-1], ours.prefill(prompt[4:], table, 3, True)[-1]]
    out = hf(prompt[None], use_cache=True)
    theirs, cache = [out.logits[0, 3], out.logits[0, -1]], out.cache_params
    token = int(theirs[-1].argmax())
    for _ in range(5):
        mine.append(ours.decode(torch.tensor([token]), table, torch.tensor([3], dtype=torch.int32))[0])
        out = hf(torch.tensor([[token]]), cache_params=cache, use_cache=True)
        theirs.append(out.logits[0, -1])
        token = int(out.logits[0, -1].argmax())
    torch.testing.assert_close(torch.stack(mine), torch.stack(theirs), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_decode_reads_the_slot_it_is_given_and_null_rows_write_nothing():
    model = tiny_mamba(0)
    table = StateTable.empty(model.config, 4)
    model.prefill(torch.tensor([5, 6, 7]), table, 1, False)
    model.prefill(torch.tensor([9, 8]), table, 2, False)
    before = table.ssm.clone()
    a = model.decode(torch.tensor([3, 3]), table, torch.tensor([1, NULL_BLOCK_ID], dtype=torch.int32))
    assert torch.equal(table.ssm[:, NULL_BLOCK_ID], before[:, NULL_BLOCK_ID])
    assert torch.equal(table.ssm[:, 2], before[:, 2]) and not torch.equal(table.ssm[:, 1], before[:, 1])
    table.ssm.copy_(before)
    b = model.decode(torch.tensor([3]), table, torch.tensor([2], dtype=torch.int32))
    assert (a[0] - b[0]).abs().max() > 1.0, "another request's state must change the logits"


def test_model_input_errors():
    model = tiny_mamba(0)
    with pytest.raises(ValueError, match="slot must be in"):
        model.prefill(torch.tensor([1]), StateTable.empty(model.config, 3), NULL_BLOCK_ID, False)
    with pytest.raises(ValueError, match="null block"):
        StateTable.empty(model.config, 1)


def test_weights_are_the_same_on_every_call():
    a, b = tiny_mamba(0), tiny_mamba(0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, tiny_mamba(1).lm_head.weight)


# ------------------------------------------------------------------------------ input batch and metadata
def _req(rid: str, block: int, prompt: int, computed: int) -> CachedRequestState:
    return CachedRequestState(rid, list(range(1, prompt + 1)), block, computed)


def test_condense_moves_the_last_request_and_leaves_its_old_row_stale():
    ib = InputBatch(4, 32)
    for rid, block, prompt, computed in [("a", 1, 4, 4), ("b", 2, 4, 4), ("c", 3, 20, 5)]:
        ib.add_request(_req(rid, block, prompt, computed))
    assert ib.remove_request("a") == 0 and ib.remove_request("zz") is None
    ib.condense()
    assert ib.req_ids == ["c", "b"] and ib.req_id_to_index == {"c": 0, "b": 1}
    assert (ib.num_computed_tokens_cpu[0], ib.num_prompt_tokens[0], ib.block_table[0]) == (5, 20, 3)
    # The vacated row 2 still holds c's counters: a padded row there reads is_prefilling=True.
    assert (ib.num_computed_tokens_cpu[2], ib.num_prompt_tokens[2], ib.block_table[2]) == (5, 20, 3)
    assert padded_is_prefilling(ib.num_computed_tokens_cpu_tensor, torch.from_numpy(ib.num_prompt_tokens),
                                2, 3, "bug").tolist() == [True, False, True]


def test_add_request_fills_the_smallest_hole_first():
    ib = InputBatch(4, 32)
    for i in range(4):
        ib.add_request(_req(f"r{i}", i + 1, 3, 3))
    ib.remove_request("r2")
    ib.remove_request("r1")
    assert ib.add_request(_req("new", 7, 3, 0)) == 1
    ib.condense()                                   # moves r3 into hole 2
    assert ib.req_ids == ["r0", "new", "r3"]
    with pytest.raises(ValueError, match="already in the batch"):
        ib.add_request(_req("new", 7, 3, 0))


def test_input_batch_errors():
    ib = InputBatch(1, 8)
    ib.add_request(_req("a", 1, 3, 0))
    with pytest.raises(ValueError, match="batch is full"):
        ib.add_request(_req("b", 2, 3, 0))
    with pytest.raises(ValueError, match="max_model_len"):
        InputBatch(2, 8).add_request(_req("long", 1, 9, 0))
    with pytest.raises(ValueError, match="two occupied rows"):
        InputBatch(2, 8).swap_states(0, 1)


def test_reorder_puts_decodes_first():
    ib = InputBatch(4, 32)
    ib.add_request(_req("prefill", 1, 20, 5))
    ib.add_request(_req("d1", 2, 4, 4))
    ib.add_request(_req("d2", 3, 4, 4))
    assert reorder_batch_to_split_decodes_and_prefills(ib, {"prefill": 6, "d1": 1, "d2": 1})
    assert ib.req_ids == ["d2", "d1", "prefill"]
    assert ib.block_table[:3].tolist() == [3, 2, 1] and ib.num_computed_tokens_cpu[:3].tolist() == [4, 4, 5]
    assert not reorder_batch_to_split_decodes_and_prefills(ib, {"prefill": 6, "d1": 1, "d2": 1})


def test_upstream_unit_case_is_prefilling():
    """#41873's case: 3 real rows padded to 5; padded rows 3 and 4 are stale True before, False after."""
    assert case.unit_is_prefilling("bug") == [False, True, False, True, True]
    assert case.unit_is_prefilling("guard") == [False, True, False, True, True]   # guard acts in the split
    assert case.unit_is_prefilling("fix") == [False, True, False, False, False]


def test_upstream_split_case():
    """2 real decodes padded to 4 with a stale True in row 2: (2, 2, 2, 2) before, (4, 0, 4, 0) after."""
    assert case.unit_split("bug") == (2, 2, 2, 2)
    assert case.unit_split("fix") == (4, 0, 4, 0)
    assert case.unit_split("guard") == (4, 0, 4, 0)
    # Backends that treat short extends as decodes never look at is_prefilling.
    assert case.unit_split("bug", treat_short_extends_as_decodes=True) == (4, 0, 4, 0)


def _decode_metadata(block_table, is_prefilling, num_real):
    n = len(block_table)
    qsl = list(range(num_real + 1)) + [num_real] * (n - num_real)
    return CommonAttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.ones(n, dtype=torch.int32), n, n, 1,
                                   torch.tensor(block_table, dtype=torch.int32), torch.tensor(is_prefilling))


def test_builder_refreshes_the_persistent_buffer_only_without_prefills():
    builder = MambaMetadataBuilder(4, "cpu", full_cudagraphs=True)
    md = builder.build(_decode_metadata([1, 2, 3, 0], [False] * 4, 3))
    assert md.refreshed and md.state_indices_tensor_d.data_ptr() == builder.state_indices_tensor_d.data_ptr()
    assert builder.state_indices_tensor_d.tolist() == [1, 2, 3, 0]
    md = builder.build(_decode_metadata([3, 2, 4, 0], [False, False, False, True], 3))
    assert (md.num_decodes, md.num_prefills, md.refreshed) == (3, 1, False)
    assert builder.state_indices_tensor_d.tolist() == [1, 2, 3, 0], "the graph's buffer keeps last step's slots"
    assert md.state_indices_tensor_d.tolist() == [3, 2, 4], "only the (unused) metadata copy is right"
    guarded = MambaMetadataBuilder(4, "cpu", full_cudagraphs=True, ignore_zero_query_rows=True)
    assert guarded.build(_decode_metadata([3, 2, 4, 0], [False, False, False, True], 3)).refreshed
    assert guarded.state_indices_tensor_d.tolist() == [3, 2, 4, 0]


def test_variant_and_size_errors():
    with pytest.raises(ValueError, match="variant must be one of"):
        check_variant("fixed")
    with pytest.raises(ValueError, match="num_reqs_padded"):
        padded_is_prefilling(torch.zeros(4), torch.zeros(4), 3, 2, "bug")
    with pytest.raises(ValueError, match="exceed max_num_reqs"):
        case.MambaServer(tiny_mamba(0), capture_sizes=(1, 8))
    with pytest.raises(ValueError, match="max_tokens must be >= 8"):
        case.default_workload(max_tokens=4)
    with pytest.raises(ValueError, match="unique"):
        case.Scheduler([case.Request("a", (1,), 1, 0)] * 2, max_num_seqs=2, max_num_batched_tokens=4, num_slots=4)


# ------------------------------------------------------------------------------ the graph
@torch.no_grad()
def test_decode_graph_reads_the_state_index_buffer_at_replay():
    """What makes the bug possible: the graph keeps the buffer's address, not its contents."""
    model = tiny_mamba(0)
    table = StateTable.empty(model.config, 4)
    model.prefill(torch.tensor([5, 6]), table, 1, False)
    model.prefill(torch.tensor([7, 8, 9]), table, 2, False)
    ids, slots = torch.tensor([4]), torch.tensor([1], dtype=torch.int32)
    before = table.ssm.clone()
    g = new_graph("cpu")
    with graph(g):
        logits = model.decode(ids, table, slots)
    assert torch.equal(table.ssm, before), "capture must leave no writes"
    snapshot = (table.conv.clone(), table.ssm.clone())
    expected = model.decode(ids, table, torch.tensor([2], dtype=torch.int32))
    table.conv.copy_(snapshot[0])
    table.ssm.copy_(snapshot[1])
    slots.fill_(2)
    g.replay()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------ the served workload
def test_bug_reads_the_predicted_slots(runs):
    """R0 finishes mid R3's prefill; condense moves R3 from row 3 to 0; the three decodes then run the
    4-row graph with the stale row 3 and the slots of steps 1-2 (R0, R1, R2 = slots 1, 2, 3)."""
    bug = runs["bug"]
    assert bug.slots == {"R0": 1, "R1": 2, "R2": 3, "R3": 4}
    predicted = [(step, rid, read, want, whose) for step in range(7, 12)
                 for rid, read, want, whose in [("R2", 1, 3, "R0"), ("R3", 3, 4, "R2")]]
    assert [(m.step, m.req_id, m.slot_read, m.slot_expected, m.state_of) for m in bug.mismatches] == predicted
    skipped = [r for r in bug.records if r.mode == "full" and not r.refreshed]
    assert [r.step for r in skipped] == [7, 8, 9, 10, 11]
    for rec in skipped:
        assert rec.req_ids == ["R2", "R1", "R3"] and rec.is_prefilling == [False, False, False, True]
        assert rec.counters[3] == (5, 20), "row 3 holds R3's counters from when condense moved it"
        assert rec.split == (3, 1, 3, 1)


def test_skipped_refresh_replays_the_last_refreshed_slots(runs):
    """The mechanism as an invariant: after a skipped refresh the graph reads exactly the slots of
    the last refreshed FULL step, whatever the batch now holds."""
    last = None
    for rec in runs["bug"].records:
        if rec.mode != "full":
            continue
        if rec.refreshed:
            assert rec.slots_read == rec.slots_expected
            last = rec.slots_read
        else:
            assert rec.slots_read == last[:rec.num_reqs_padded]
            assert rec.slots_read != rec.slots_expected


def test_bug_diverges_silently_and_fix_and_guard_equal_eager(runs):
    eager = runs["eager"]
    bug = case.agreement(runs["bug"], eager)
    assert bug["R0"] == bug["R1"] == 1.0, "requests whose rows read their own slot are untouched"
    assert bug["R2"] < 1.0 and bug["R3"] < 1.0
    assert runs["bug"].generations["R2"][:7] == eager.generations["R2"][:7], "diverges only from step 7"
    for v in ("fix", "guard"):
        assert runs[v].generations == eager.generations
        assert runs[v].mismatches == []
        assert all(r.refreshed for r in runs[v].records if r.mode == "full")
    assert [r.step for r in runs["fix"].records if r.mode == "full"] == [1, 2, 7, 8, 9, 10, 11, 12, 13]


@torch.no_grad()
def test_served_eager_reference_equals_transformers_greedy_generation(runs):
    """The reference itself (chunked prefill, reused rows, slots) against transformers, one request at a time."""
    transformers = pytest.importorskip("transformers")
    model = tiny_mamba(0)
    hf = transformers.MambaForCausalLM(model.config.to_transformers()).to(torch.float64).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    for req in case.default_workload():
        ids, out = torch.tensor([req.prompt]), []
        for _ in range(req.max_tokens):
            out.append(int(hf(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        assert runs["eager"].generations[req.req_id] == out, req.req_id
    assert runs["eager"].min_margin > 1e-3


def test_requests_finishing_on_an_idle_step_leave_the_batch():
    """A request that finishes before a gap in arrivals is still removed (and its row reused)."""
    workload = [case.Request("A", (5, 6), 1, 0), case.Request("B", (7, 8, 9), 3, 3)]
    result = case.serve("fix", workload=workload)
    assert [r.req_ids for r in result.records] == [["A"], ["B"], ["B"], ["B"]]
    assert result.generations == case.serve("eager", workload=workload).generations


def test_figures_draw_with_no_text_under_8_points(runs):
    import matplotlib.pyplot as plt
    from matplotlib.text import Text
    for fn in (case.plot_is_prefilling, case.plot_state_slots, case.plot_token_agreement):
        fig = fn(runs)
        assert len(fig.axes) >= 2
        fig.canvas.draw()                      # tick labels exist once drawn
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert len(texts) > 20                 # the cell labels are among them
        small = sorted({(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 8})
        assert not small, f"{fn.__name__}: text under 8 pt: {small[:5]}"
        plt.close(fig)


def test_importing_the_case_registers_no_colormap():
    """Colour maps belong to the figures that use them, not to matplotlib's global registry."""
    code = ("import matplotlib; before = set(matplotlib.colormaps); "
            "import workbench.cases.mamba_stale_is_prefilling as case; "
            "assert set(matplotlib.colormaps) == before, set(matplotlib.colormaps) - before")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parent.parent)


# ------------------------------------------------------------------------------ GPU record
def test_gpu_record_matches_cpu(runs):
    gpu = CASE.gpu_results()
    if gpu is None:
        pytest.skip(f"{CASE.record.name} not recorded on a GPU yet: a GPU session writes it with gpu_record()")
    cpu = case.key_numbers(runs)
    assert gpu["min_margin"] > 1e-6, "tokens could flip between devices; exact comparison is not valid"
    for key in ("unit_is_prefilling", "unit_split", "generations", "agreement", "mismatches", "full_steps",
                "skipped_refresh_steps"):
        assert gpu[key] == cpu[key], key
    assert np.isclose(gpu["min_margin"], cpu["min_margin"], rtol=1e-9)


@pytest.mark.cuda
def test_cuda_graphs_reproduce_the_cpu_numbers(runs):
    gpu, cpu = case.gpu_record("cuda"), case.key_numbers(runs)
    assert gpu.pop("min_margin") == pytest.approx(cpu.pop("min_margin"), rel=1e-9)
    assert gpu == cpu
