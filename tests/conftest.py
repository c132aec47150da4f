import os
import pathlib

import pytest
import torch

collect_ignore_glob = ["../build/*"]

# Kernels started by the notebook tests run in notebooks/; make them import this checkout's
# workbench, whatever checkout the virtualenv was installed from.
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="module")
def one_cpu_thread():
    """For modules of tiny ops: a second intra-op thread only adds synchronisation (on a busy
    2-core machine it makes each op ~100x slower). Use with ``pytestmark = usefixtures(...)``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
