# fedcli: make demo | make test | make bench | make matrix | make reproduce | make lint  (each creates .venv if missing)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The extras installed into .venv: EXTRAS=dev,ray adds Ray (the Ray sweep backend's tests run then; .ci/run).
EXTRAS ?= dev
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),+,$(EXTRAS))

.PHONY: install demo test test-fast test-wide bench matrix reproduce lint clean

# setuptools prints an "Editable installation." notice (its InformationOnly warning, not a problem:
# the installed names differ from the folders, pyproject.toml) for every editable install of this
# layout; PYTHONWARNINGS drops that one message and nothing else.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedcli demo   # = fedcli train --config demo: the config shipped in fedcli/configs/demo.yaml
	@echo
	@echo "Results: ./fedcli-runs (SQL store fedcli.db, MLflow store mlflow.db, models and checkpoints under runs/)"
	@echo "  $(BIN)/fedcli list runs"
	@echo "  $(BIN)/fedcli report --experiment demo --output report.md"
	@echo "  $(BIN)/fedcli ui        # MLflow UI on http://127.0.0.1:5000"
	@echo "(.venv/bin is not on your PATH: 'source .venv/bin/activate' lets you type plain 'fedcli')"

# on every core, at most 4 workers (pytest-xdist); groups that must share a worker: tests/conftest.py
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup

# the cross products left out of `make test` (marker `wide`; docs/testing.md)
test-wide: $(STAMP)
	$(BIN)/python -m pytest -m wide

# Flower pins older typer/rich/protobuf than fedcli: it gets its own environment, which also
# sees .venv's packages (fedcli, torch) through a .pth file. Best effort: without it (no
# package index), the bench runs and reports the Flower column as "not measured".
FLOWER := .venv-flower
$(FLOWER)/.installed: $(STAMP)
	test -d $(FLOWER) || $(PYTHON) -m venv $(FLOWER)
	$(BIN)/python -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_paths()['purelib'])" \
		> "$$($(FLOWER)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_fedcli.pth"
	$(FLOWER)/bin/pip install --quiet "flwr[simulation]>=1.8"
	touch $@

bench: $(STAMP)
	-$(MAKE) $(FLOWER)/.installed
	$(BIN)/python -m tests.benchmarks.run --out bench-results
	$(BIN)/python tests/benchmarks/bench_report.py --out bench-results/bench_report.json
	$(BIN)/python -m tests.benchmarks.bench_user_models --out bench-results
	$(BIN)/python -m tests.benchmarks.scaleout --out bench-results

# Issue 32's paper-scale figures (tests/benchmarks/bench_scale.py): 342,477- vs 3,400-client StackOverflow-format
# federations, client state on disk (SCAFFOLD, BayesADMM, CNN), disk vs memory round time; bench-results/bench_scale.md.
# Hours on 2 cores (generated data under /tmp/bench-scale); PARTS=so,state,ratio picks parts. Runs under quiet-run if present.
.PHONY: bench-scale
bench-scale: $(STAMP)
	OMP_NUM_THREADS=1 $$(command -v quiet-run) $(BIN)/python -m tests.benchmarks.bench_scale --out bench-results $(if $(PARTS),--parts $(PARTS))

# Every algorithm with its defaults on every bundled task, 25 rounds, seeds 0 and 1, one thread per run; writes
# the table into docs/out-of-the-box.md (tests/benchmarks/matrix.py; several hours on 2 cores: har and vehicle
# run where their data is in ~/.cache/fedcli, shakespeare only with --tasks shakespeare). Exits 1 when a target
# is missed without a reason on record or a run fails. `make test` runs a few-round version (tests/algorithms/test_out_of_the_box.py).
matrix: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.benchmarks.matrix --rounds 25 --seeds 2 --root matrix-runs --out docs/out-of-the-box.md

# Every paper recipe (fedcli sweep --recipe NAME), reports into reproductions/ (docs/reproductions.md).
# RECIPES="fedpa-toy fola-toy" runs only those.
reproduce: $(STAMP)
	$(BIN)/python -m fedcli.recipes.reproduce --out reproductions $(if $(RECIPES),--only $(RECIPES))

# The gates CI runs before the tests (.ci/run); each fails the build. mypy checks the installed layout
# (fedcli.algorithms is algorithms/, fedcli.datasets datasets/, fedcli.tracking tracking/: pyproject.toml's
# package-dir), which it cannot read from the folders themselves: build/typecheck/fedcli links them under one
# package, so every module is checked with its imports resolved (docs/testing.md "Tiers and gates").
TYPECHECK := build/typecheck
lint: $(STAMP)
	$(BIN)/ruff format --check fedcli algorithms datasets tracking tests
	$(BIN)/ruff check fedcli algorithms datasets tracking tests
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/fedcli
	for f in fedcli/*; do case "$$f" in */__pycache__) ;; *) ln -s "$(CURDIR)/$$f" $(TYPECHECK)/fedcli/ ;; esac; done
	for p in algorithms datasets tracking; do ln -s "$(CURDIR)/$$p" $(TYPECHECK)/fedcli/$$p; done
	cd $(TYPECHECK) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/build/mypy-cache -p fedcli

# The fast tier: what a contributor runs before committing (under 2 minutes on 2 cores; docs/testing.md).
# `slow` marks every test of a module that starts processes (tests/conftest.py) and the in-process tests
# that take seconds; `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not soak and not wide"

clean:
	rm -rf $(VENV) $(FLOWER) fedcli-runs matrix-runs .pytest_cache
