# The two commands: `make run` (whole stack + a demo request) and `make test` (full suite).
# Both create .venv on first use; nothing needs installing by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel of torch; GPU users install their own torch build before `pip install -e .`.
TORCH_PIN ?= torch==2.13.0

.PHONY: run test lint bench venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $@

run: venv
	$(BIN)/pdserve up --demo

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check services tests

bench: venv
	$(BIN)/pdserve bench engine --model tiny

clean:
	rm -rf $(VENV) .pytest_cache
