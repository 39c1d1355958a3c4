# The two commands of the README: `make run` (set up + answer a question with the default model)
# and `make test` (set up + the test suite). Everything lives in .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; on this project's machines pip finds it locally. Override for other builds.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test test-fast bench clean

$(BIN)/hetero: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,hub,serve]"
	touch $@

setup: $(BIN)/hetero

run: setup
	$(BIN)/hetero run "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The committed speed benchmarks of prefill and decode (~25 min on 2 cores; a quiet machine): bench/results/.
bench: setup
	$(BIN)/pip install --quiet -e ".[test,hub,serve,bench]"
	$(BIN)/python bench/prefill.py
	$(BIN)/python bench/prefill_parts.py --out bench/results
	$(BIN)/python bench/decode.py
	$(BIN)/python bench/decode_step.py --out bench/results
	$(BIN)/python bench/fused_step.py --out bench/results

clean:
	rm -rf $(VENV) build *.egg-info
