# fedcli: make demo | make test | make bench | make lint  (each creates .venv if missing)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedcli train --algo fedpa --config examples/fedpa-femnist-demo.yaml
	@echo
	@echo "Results: ./fedcli-runs (SQL store fedcli.db, MLflow store mlflow.db, models under runs/)"
	@echo "  $(BIN)/fedcli list runs"
	@echo "  $(BIN)/fedcli report --experiment demo --output report.md"
	@echo "  $(BIN)/fedcli ui        # MLflow UI on http://127.0.0.1:5000"

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m tests.benchmarks.run --out bench-results
	$(BIN)/python tests/benchmarks/bench_report.py --out bench-results/bench_report.json

lint: $(STAMP)
	$(BIN)/ruff format --check fedcli algorithms datasets tracking tests || true
	$(BIN)/ruff check fedcli algorithms datasets tracking tests
	$(BIN)/mypy fedcli algorithms tracking

clean:
	rm -rf $(VENV) fedcli-runs .pytest_cache
