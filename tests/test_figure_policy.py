"""Figures stay put: only a declared default run rewrites committed figures, no text is under 8 pt, and
rounding differences draw alike on every machine."""
import matplotlib
import matplotlib.pyplot as plt
import matplotlib.text
import pytest

from workbench import plots


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    committed, build = tmp_path / "figures", tmp_path / "build" / "figures"
    monkeypatch.setattr(plots, "FIGURES", committed)
    monkeypatch.setattr(plots, "BUILD_FIGURES", build)
    monkeypatch.setattr(plots, "_POLICIES", {})
    monkeypatch.delenv("WORKBENCH_FAST", raising=False)
    monkeypatch.delenv(plots.SAVE_MEASURED_ENV, raising=False)
    return committed, build


def _save(case, name):
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    try:
        return plots.save(fig, case, name)
    finally:
        plt.close(fig)


def test_only_a_declared_default_run_writes_committed_figures(dirs, monkeypatch):
    committed, build = dirs
    assert _save("nb", "a") == build / "nb" / "a.png"                 # undeclared: never committed
    plots.figure_policy("nb", default_run=False)
    assert _save("nb", "a") == build / "nb" / "a.png"                 # FAST or other parameters
    plots.figure_policy("nb", default_run=True, measured=("timing",))
    assert _save("nb", "a") == committed / "nb" / "a.png"
    assert _save("nb", "timing") == build / "nb" / "timing.png"       # measured: differs every run
    assert _save("other", "a") == build / "other" / "a.png"           # the policy is per notebook
    monkeypatch.setenv(plots.SAVE_MEASURED_ENV, "1")
    assert _save("nb", "timing") == committed / "nb" / "timing.png"   # refreshed on purpose
    monkeypatch.setenv("WORKBENCH_FAST", "1")
    assert _save("nb", "a") == build / "nb" / "a.png"                 # CI sizes never committed
    assert sorted(p.name for p in (committed / "nb").iterdir()) == ["a.png", "timing.png"]
    assert plots.save(plt.figure(), "nb", "off", enabled=False) is None
    plt.close("all")


def test_no_text_is_drawn_smaller_than_the_minimum():
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2])
    ax.text(0.5, 0.5, "tiny", fontsize=5)
    ax.annotate("note", (1, 1), fontsize="xx-small")
    ax.tick_params(labelsize=4)
    ax.set_xticks([0, 1, 2], ["a", "b", "c"], fontsize="x-small")
    ax.legend(["line"], fontsize=6)
    ax.set_title("big", fontsize=14)
    fig.canvas.draw()
    sizes = {t.get_text(): t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text()}
    plt.close(fig)
    assert min(sizes.values()) == plots.MIN_FONT_PT and sizes["big"] == 14
    assert {"tiny", "note", "a", "line"} <= set(sizes)


def test_rounding_differences_draw_alike_on_every_machine():
    """Two CPUs whose kernels round differently give the same figure; a real difference shows."""
    one, other = [0.0, 7.2e-7, 2.4e-7], [0.0, 9.5e-7, 1.2e-8]
    assert (plots.rounded(one) == plots.rounded(other)).all() and plots.rounded(one)[0] == plots.ROUNDING
    assert plots.worst(one) == plots.worst(other) == f"< {plots.ROUNDING:g} (rounding)"
    assert plots.worst([1e-7, 3.4e-3]) == "3.4e-03" and plots.rounded([3.4e-3])[0] == 3.4e-3
