# Every target creates what it needs on first use: a virtual environment in .venv with the kit
# installed in editable mode. PY picks the interpreter that builds it (3.10 or newer).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider

.PHONY: run test test-fast notebooks lab bench soak clean

$(STAMP): pyproject.toml
	$(PY) -c 'import sys; sys.exit("Python 3.10 or newer is needed, this is " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

## The main job: the seed's MNIST exercise on two ranks (gloo on CPU, NCCL on a two-GPU box).
run: $(STAMP)
	$(BIN)/python -m ddp_helpers.mnist --nprocs 2 --epochs 1

## Everything CI checks: ruff, the helper tests, then every notebook under nbval (comparing mode).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests
	$(BIN)/python -m pytest $(NBVAL) notebooks

## The helper tests only, without the notebooks and the browser test.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests -m "not browser"

## Re-execute every notebook in place (what gets committed), one at a time.
notebooks: $(STAMP)
	for nb in notebooks/[0-9]*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	done

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

soak: $(STAMP)
	$(BIN)/python bench/soak.py

clean:
	rm -rf $(VENV) runs
