import os
import pathlib
import pickle

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

# Every notebook runs once per session: under papermill, with parameters injected as strings the way
# `papermill -p` passes them. What a notebook computes that a test module also checks is kept: after
# the notebook's own cells, one more cell in the same kernel pickles the named globals, so that work
# is done once (`notebook_keeps`). The modules named share the notebook's worker (`worker_group`).
NOTEBOOK_PARAMETERS = {"FAST": "true", "INTERACTIVE": "false", "SEED": 0, "SAVE_FIGURES": "false"}
NOTEBOOK_KEEPS = {"06_graph_doctor": {"globals": ("rows", "piecewise", "clean"), "modules": ("test_doctor.py",)}}


def worker_group(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker runs whole (``make test``): a notebook, with the modules
    that share its kept results, or else a test module, so that module-scoped fixtures are computed
    once, as in a serial run. The notebooks are the longest tests; as groups of their own they
    spread over the workers."""
    path, _, rest = nodeid.partition("::")
    module = pathlib.PurePosixPath(path).name
    if module == "test_notebooks.py" and rest.endswith("]"):
        return rest[rest.index("[") + 1:-1]
    return next((stem for stem, keep in NOTEBOOK_KEEPS.items() if module in keep["modules"]), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with ``worker_group`` as the scope (pytest-xdist's ``loadgroup`` marks
    do not reach the scheduler under pytest 9: it renames a node id that pytest no longer reads)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)
    return WorkerGroups(config, log)


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives JupyterLab in Chromium; runs only when -m names it "
                                       "(make browser-test)")


def pytest_collection_modifyitems(config, items):
    # Browser tests are deselected, not skipped, unless asked for: `make test` stays browser-free.
    if "browser" not in (config.getoption("markexpr") or ""):
        browser = [item for item in items if "browser" in item.keywords]
        if browser:
            config.hook.pytest_deselected(items=browser)
            items[:] = [item for item in items if "browser" not in item.keywords]
    _longest_groups_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _longest_groups_first(items):
    """Groups that hold a notebook first, then modules with slow or multi-process tests, then the
    rest, so that no long group starts last while the other worker idles (``make test`` keeps this
    order: --no-loadscope-reorder). Within a group the collection order is kept; the groups of a
    serial run are the same, so both run the tests in one order."""
    rank = {}
    for item in items:
        group = worker_group(item.nodeid)
        slow = "slow" in item.keywords or "multiproc" in item.keywords
        notebook = group in NOTEBOOK_KEEPS or item.path.name == "test_notebooks.py"
        rank[group] = min(rank.get(group, 2), 0 if notebook else 1 if slow else 2)
    order = {group: i for i, group in enumerate(dict.fromkeys(worker_group(item.nodeid) for item in items))}
    items.sort(key=lambda item: (rank[worker_group(item.nodeid)], order[worker_group(item.nodeid)]))


def _execute_notebook(stem: str, where: pathlib.Path) -> tuple[pathlib.Path, dict]:
    # (imported here: a GPU machine that runs only the CUDA tests need not have the notebook tools)
    import nbformat
    import papermill

    path = ROOT / "notebooks" / f"{stem}.ipynb"
    source, out, kept = where / "input" / path.name, where / path.name, where / "kept.pickle"
    nb = nbformat.read(path, as_version=4)
    names = NOTEBOOK_KEEPS.get(stem, {}).get("globals", ())
    if names:
        nb.cells.append(nbformat.v4.new_code_cell(
            f"import pathlib as _p, pickle as _pk\n"
            f"_p.Path({str(kept)!r}).write_bytes(_pk.dumps({{k: globals()[k] for k in {names!r}}}))"))
    source.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, source)
    papermill.execute_notebook(source, out, parameters=NOTEBOOK_PARAMETERS, kernel_name="python3",
                               cwd=str(path.parent), execution_timeout=600, progress_bar=False)
    return out, pickle.loads(kept.read_bytes()) if names else {}


@pytest.fixture(scope="session")
def notebook_run(tmp_path_factory):
    """``notebook_run(stem)``: notebooks/<stem>.ipynb executed once this session; returns the
    executed copy's path and the globals ``NOTEBOOK_KEEPS`` names for it."""
    done = {}

    def run(stem: str) -> tuple[pathlib.Path, dict]:
        if stem not in done:
            done[stem] = _execute_notebook(stem, tmp_path_factory.mktemp(stem))
        return done[stem]
    return run


@pytest.fixture(scope="module")
def notebook_keeps(request, notebook_run):
    """``notebook_keeps(stem)``: that notebook's kept globals when this session runs the notebook
    anyway (its test is collected, as in `make test`), else None: the module then computes them
    itself, so a module run alone does not pay for the whole notebook."""
    module = request.node.path.name

    def keeps(stem: str) -> dict | None:
        if module not in NOTEBOOK_KEEPS.get(stem, {}).get("modules", ()):
            raise LookupError(f"{module} is not listed under NOTEBOOK_KEEPS[{stem!r}]['modules'] in "
                              "tests/conftest.py: list it there, so that it runs on the notebook's worker")
        collected = any(worker_group(item.nodeid) == stem and item.path.name == "test_notebooks.py"
                        for item in request.session.items)
        return notebook_run(stem)[1] if collected else None
    return keeps


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
