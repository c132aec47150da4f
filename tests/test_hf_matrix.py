"""The architecture matrix on the CPU, and against the GPU's record of the same matrix."""
import json
import pathlib

import pytest

from workbench import hf_matrix

RECORD = pathlib.Path(__file__).resolve().parent.parent / "results" / "gpu" / "hf_matrix.json"


@pytest.fixture(scope="module")
def cpu_results():
    return hf_matrix.run_all("cpu")


def test_matrix_covers_the_required_kinds():
    kinds = {e.kind for e in hf_matrix.ENTRIES}
    assert len(hf_matrix.ENTRIES) >= 12
    assert {"encoder", "decoder", "ssm", "vision", "encoder-decoder encoder"} <= kinds
    gpt2 = {(e.mask, e.cache) for e in hf_matrix.ENTRIES if e.arch == "gpt2"}
    assert gpt2 == {(False, False), (True, False), (False, True), (True, True)}


def test_every_architecture_captures_and_replays_equal_to_eager_on_the_cpu(cpu_results):
    bad = {k: v for k, v in cpu_results.items() if not v["captured"] or v["max_abs_diff"] > 1e-5}
    assert not bad, bad


def test_a_failed_capture_is_recorded_with_its_kind():
    """A model whose forward syncs with the host fails capture; the matrix records the kind."""
    class Syncing(hf_matrix.T.BertModel):
        def forward(self, **kw):
            if kw["input_ids"].sum() > 0:        # a data-dependent Python branch: a host sync
                return super().forward(**kw)
            raise AssertionError("not reached")

    entry = hf_matrix.Entry("syncing", "bert", "encoder")
    original = hf_matrix._BUILDERS["bert"]
    hf_matrix._BUILDERS["bert"] = lambda: Syncing(original().config)
    try:
        result = hf_matrix.run_entry(entry)
    finally:
        hf_matrix._BUILDERS["bert"] = original
    assert result == {"captured": False, "error_kind": "host_sync", "max_abs_diff": None}


@pytest.mark.skipif(not RECORD.exists(), reason="results/gpu/hf_matrix.json not recorded yet: run "
                    "workbench.hf_matrix:gpu_record on a GPU")
def test_cpu_matrix_gives_the_recorded_gpu_answers(cpu_results):
    record = json.loads(RECORD.read_text())
    assert "results" in record, record.get("error")
    assert record["device"].startswith("NVIDIA")
    gpu = hf_matrix.load_record()
    assert set(gpu) == set(cpu_results) == set(record["results"]["entries"])
    for label, answer in gpu.items():
        cpu = cpu_results[label]
        assert cpu["captured"] == answer["captured"], label
        assert cpu["error_kind"] == answer["error_kind"], label
        if answer["captured"]:
            assert answer["max_abs_diff"] <= 1e-5 and cpu["max_abs_diff"] <= 1e-5, label


def test_every_architecture_served_under_the_doctor_gives_an_empty_report():
    """17 clean models, masks padding some steps and not others: no finding, nothing left unchecked
    (a finding here is a false alarm of a general mechanism)."""
    reports = hf_matrix.doctor_reports("cpu")
    assert len(reports) == len(hf_matrix.ENTRIES)
    for label, report in reports.items():
        assert report.findings == [] and report.not_checked == {} and report.clean, f"{label}: {report}"
