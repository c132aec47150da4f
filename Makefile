# The two commands of the README:
#   make run    execute every notebook headless (papermill); figures land in figures/
#   make test   unit tests + every notebook under nbval + papermill parameterised runs
# Both create or reuse .venv (scripts/setup_env.sh) first.
PY := .venv/bin/python
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: setup run test fast-run benchmark data clean

setup:
	@bash scripts/setup_env.sh

run: setup
	$(PY) scripts/run_notebooks.py $(ARGS)

test: setup
	WORKBENCH_FAST=1 WORKBENCH_HEADLESS=1 $(PY) -m pytest tests notebooks --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider $(ARGS)

benchmark: setup
	$(PY) benchmarks/bench_replay.py

data: setup
	$(PY) -m workbench.data

clean:
	rm -rf build
