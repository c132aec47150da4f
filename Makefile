# The two commands of the README:
#   make run    execute every notebook headless (papermill); figures land in figures/
#   make test   unit tests + every notebook once (papermill, parameters injected)
#   make lab    JupyterLab on notebooks/, with this project's .venv as the python3 kernel
#   make browser-test   notebooks 01, 04, 06 in JupyterLab driven in Chromium (not part of make test)
# All create or reuse .venv (scripts/setup_env.sh) first.
PY := .venv/bin/python
export PYDEVD_DISABLE_FILE_VALIDATION := 1
# Jupyter refuses to run as root unless told; containers run as root, users do not.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup run test lab browser-test benchmark data clean

setup:
	@bash scripts/setup_env.sh

run: setup
	$(PY) scripts/run_notebooks.py $(ARGS)

# Tests run side by side on up to 4 workers (pytest-xdist; one per core), each module and each
# notebook whole on one worker (tests/conftest.py groups them, longest first). Serial: ARGS="-n 0".
TEST_WORKERS := -n auto --maxprocesses=4 --dist loadscope --no-loadscope-reorder
test: setup
	WORKBENCH_FAST=1 WORKBENCH_HEADLESS=1 $(PY) -m pytest tests -p no:cacheprovider $(TEST_WORKERS) $(ARGS)

# The python3 kernelspec is written into .venv and preferred over a user-wide one of the same
# name, so the notebooks (kernel "python3") always run on this environment.
lab: setup
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
	JUPYTER_PREFER_ENV_PATH=1 $(PY) -m jupyter lab notebooks/ $(ALLOW_ROOT) $(ARGS)

# Debian's chromium (no browser download) and playwright's Python package, then the browser test.
browser-test: setup
	command -v chromium >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }
	$(PY) -m pip install --quiet playwright
	$(PY) -m pytest tests/test_browser.py -m browser -p no:cacheprovider $(ARGS)

benchmark: setup
	$(PY) benchmarks/bench_replay.py

data: setup
	$(PY) -m workbench.data

clean:
	rm -rf build
