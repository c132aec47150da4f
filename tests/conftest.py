import os
import pathlib

import pytest
import torch

collect_ignore_glob = ["../build/*"]

# Kernels started by the notebook tests run in notebooks/; make them import this checkout's
# workbench, whatever checkout the virtualenv was installed from.
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

# One intra-op thread, here and in every process the tests start (notebook kernels, ranks, zoo
# children): the tests run tiny ops, where a second thread only adds synchronisation, and on a
# 2-core machine that is also running other work (or a second pytest-xdist worker) two threads per
# process make each op up to ~100x slower. Parallelism comes from running tests side by side.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives JupyterLab in Chromium; runs only when -m names it "
                                       "(make browser-test)")
    # pytest-xdist registers it too; without xdist (a plain `pytest`) the groups are simply unused.
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one worker (see _group_for_workers)")


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # Browser tests are deselected, not skipped, unless asked for: `make test` stays browser-free.
    if "browser" not in (config.getoption("markexpr") or ""):
        browser = [item for item in items if "browser" in item.keywords]
        if browser:
            config.hook.pytest_deselected(items=browser)
            items[:] = [item for item in items if "browser" not in item.keywords]
    _group_for_workers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _group_for_workers(items):
    """Under ``pytest -n N --dist loadgroup`` (``make test``) a group runs whole on one worker, so
    a module's tests share its module-scoped fixtures (each computed once, as in a serial run),
    while each notebook is a group of its own: the notebooks are the longest tests and spread
    over the workers. Groups run longest-first (notebooks, then modules with slow tests) so that
    no long group starts last while the other worker idles; within a group the order is kept."""
    def group(item) -> str:
        module = item.path.stem
        return f"{module}[{item.callspec.id}]" if "notebook" in module and hasattr(item, "callspec") else module

    rank = {}
    for item in items:
        name = group(item)
        item.add_marker(pytest.mark.xdist_group(name))
        slow = "slow" in item.keywords or "multiproc" in item.keywords
        rank[name] = min(rank.get(name, 2), 0 if name != item.path.stem else (1 if slow else 2))
    order = {name: i for i, name in enumerate(dict.fromkeys(group(item) for item in items))}
    items.sort(key=lambda item: (rank[group(item)], order[group(item)]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
