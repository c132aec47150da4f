"""``pytest --graph-doctor``: watch every test with the graph doctor and fail it on a finding.

Registered as the ``graph_doctor`` entry point of ``pytest11``, so installing the package makes the
option available; without the option nothing is watched and nothing changes. Each test's call phase
runs inside ``watch(differential=N)`` (``--graph-doctor-differential N``, default 1: every replay
that announces an eager step is compared with it). A test with findings fails with the report; a
test marked ``@pytest.mark.graph_doctor(expect=["persistent-mutation"])`` must give exactly those
kinds (a test of a known bug), and ``@pytest.mark.graph_doctor(skip=True)`` is not watched.
"""
from __future__ import annotations

import pytest

from .report import KINDS
from .session import watch


def pytest_addoption(parser) -> None:
    group = parser.getgroup("graph-doctor", "CUDA-graph hazards (workbench.doctor)")
    group.addoption("--graph-doctor", action="store_true", default=False,
                    help="watch each test with the graph doctor and fail it on a finding")
    group.addoption("--graph-doctor-differential", type=int, default=1, metavar="N",
                    help="compare every Nth replay that announces an eager step with an eager run (0: off)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "graph_doctor(expect=(), skip=False): the kinds this test's graphs must "
                                       "give under --graph-doctor (default: none), or skip=True not to watch it")
    if config.getoption("--graph-doctor-differential") < 0:
        raise pytest.UsageError("--graph-doctor-differential must be >= 0 (0: off, N: every Nth replay), got "
                                f"{config.getoption('--graph-doctor-differential')}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    marker = item.get_closest_marker("graph_doctor")
    options = dict(marker.kwargs) if marker else {}
    if not item.config.getoption("--graph-doctor") or options.get("skip"):
        return (yield)
    expect = set(options.get("expect", ()))
    unknown = expect - set(KINDS)
    if unknown:
        raise pytest.UsageError(f"graph_doctor(expect=...) names unknown kinds {sorted(unknown)}; kinds are {KINDS}")
    with watch(differential=item.config.getoption("--graph-doctor-differential")) as report:
        result = yield
    item.graph_doctor_report = report
    if report.kinds != expect:
        want = f"expected {sorted(expect)}" if expect else "expected none"
        pytest.fail(f"graph doctor: findings {sorted(report.kinds)}, {want}\n{report}", pytrace=False)
    return result
