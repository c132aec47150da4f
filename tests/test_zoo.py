"""The zoo: every bug variant misbehaves on the CPU emulation, every fix equals eager, and the CPU
verdicts agree with the GPU record program by program."""
import re
import time

import pytest

from workbench import zoo
from workbench.zoo import readme, record

NAMES = zoo.names()


def _case(name, variant):
    gap = zoo.engine_gap(name, variant)
    marks = [pytest.mark.xfail(strict=True, reason=f"engine gap: {gap}")] if gap else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_case(n, "bug") for n in NAMES])
def test_bug_misbehaves_on_cpu(name):
    outcome = zoo.run(name, "bug")
    assert outcome.verdict == zoo.MISBEHAVES, outcome.summary()
    assert outcome.error is not None or outcome.max_abs_error > zoo.TOLERANCE


@pytest.mark.parametrize("name", [_case(n, "fix") for n in NAMES])
def test_fix_equals_eager_on_cpu(name):
    outcome = zoo.run(name, "fix")
    assert outcome.error is None, outcome.summary()
    assert outcome.max_abs_error <= 1e-5, outcome.summary()
    assert outcome.graph and len(outcome.graph) == len(outcome.eager)


def test_zoo_size_and_families():
    assert len(NAMES) >= 20
    per_family = {f: sum(zoo.program(n).FAMILY == f for n in NAMES) for f in zoo.FAMILIES}
    assert min(per_family.values()) >= 3, per_family


@pytest.mark.parametrize("name", NAMES)
def test_header_names_source_mechanism_kind_and_site(name):
    m = zoo.program(name)
    doc = m.__doc__ or ""
    assert m.UPSTREAM.startswith("https://github.com/") and m.UPSTREAM in doc
    for part in ("Symptom:", "Mechanism:", "Doctor:", "Fix"):
        assert part in doc, f"{name}: header lacks {part!r}"
    assert m.KIND in doc and f"``{m.SITE}``" in doc
    assert re.search(rf"def {m.SITE}\b|class {m.SITE}\b", open(m.__file__).read()), f"{name}: no {m.SITE} in the program"


def test_each_program_runs_in_well_under_a_second():
    zoo.run(NAMES[0], "bug")                          # imports and first-call costs out of the way
    slow = {}
    for name in NAMES:
        for variant in zoo.VARIANTS:
            start = time.perf_counter()
            zoo.run(name, variant)
            if (elapsed := time.perf_counter() - start) > 0.5:
                slow[f"{name}[{variant}]"] = round(elapsed, 2)
    assert not slow, slow


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="variant must be one of"):
        zoo.run(NAMES[0], "guard")
    with pytest.raises(ValueError, match="unknown zoo program 'nope'"):
        zoo.program("nope")


def test_verdicts_are_a_table_of_both_variants():
    v = zoo.verdicts("cpu")
    assert set(v) == set(NAMES)
    assert all(set(row) == set(zoo.VARIANTS) and set(row.values()) <= {zoo.MISBEHAVES, zoo.EQUALS} for row in v.values())


def test_readme_is_current():
    assert readme.README.read_text() == readme.markdown(), "regenerate with: python -m workbench.zoo.readme"


def _gpu_case(name, variant):
    gap = zoo.engine_gap(name, variant)
    marks = [pytest.mark.xfail(strict=True, reason=f"engine gap: {gap}")] if gap else []
    return pytest.param(name, variant, id=f"{name}-{variant}", marks=marks)


@pytest.mark.parametrize("name,variant", [_gpu_case(n, v) for n in NAMES for v in zoo.VARIANTS])
def test_cpu_verdict_agrees_with_gpu_record(name, variant):
    rec = record.load()
    if rec is None:
        pytest.skip("results/gpu/zoo.json does not exist yet: run workbench.zoo.gpu_record() on a GPU")
    assert name in rec["programs"], f"{name} is missing from the GPU record: record it again"
    gpu = rec["programs"][name][variant]
    assert zoo.run(name, variant).verdict == gpu["verdict"], gpu

