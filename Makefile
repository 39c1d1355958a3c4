# The two commands of the README: `make run` (set up + answer a question with the default model)
# and `make test` (set up + the test suite). Everything lives in .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; on this project's machines pip finds it locally. Override for other builds.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test test-fast bench ship clean

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

# optimum-intel (OpenVINO's exporter, a build step of the OpenVINO peer) exports Gemma 3 only under transformers
# <= 5.0 (optimum-intel 2.2: "Maximum required is 5.0"; Llama too): its own venv.
OV_EXPORT := .venv-ov-export
$(OV_EXPORT)/bin/optimum-cli:
	$(PY) -m venv $(OV_EXPORT)
	$(OV_EXPORT)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(OV_EXPORT)/bin/pip install --quiet "$(TORCH_SPEC)" "optimum-intel[openvino,nncf]==2.2.0" "transformers==5.0.0"
	# PyPI's torchvision is built for another torch than the CPU one: its import breaks the export; unused
	$(OV_EXPORT)/bin/pip uninstall --quiet -y torchvision

# ONNX Runtime GenAI's builder of Gemma 3 reads transformers 4's Gemma 3 config; builder 0.14+ imports transformers 5:
# builder 0.13.2 under transformers 4.57 in its own venv (its models run on the bench's onnxruntime-genai).
ORT_BUILDER := .venv-ort-genai-builder
$(ORT_BUILDER)/bin/python:
	$(PY) -m venv $(ORT_BUILDER)
	$(ORT_BUILDER)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(ORT_BUILDER)/bin/pip install --quiet "$(TORCH_SPEC)" "onnxruntime-genai==0.13.2" "transformers>=4.57,<5" \
		accelerate gguf onnx onnx-ir sentencepiece

# The committed speed benchmarks of prefill and decode, and each engine's accuracy beside its speed (~30 min on 2
# cores; a quiet machine): bench/results/
# (a benchmark writes there only when --out bench/results asks; by default into ~/.cache/hetero/bench/).
bench: setup $(OV_EXPORT)/bin/optimum-cli $(ORT_BUILDER)/bin/python
	$(BIN)/pip install --quiet -e ".[test,hub,serve,bench]"
	HETERO_OPTIMUM_CLI=$(abspath $(OV_EXPORT))/bin/optimum-cli HETERO_ORT_GENAI_PYTHON=$(abspath $(ORT_BUILDER))/bin/python \
		$(BIN)/python bench/prefill.py --out bench/results
	$(BIN)/python bench/prefill_parts.py --out bench/results
	$(BIN)/python bench/decode.py --out bench/results
	$(BIN)/python bench/decode_step.py --out bench/results
	$(BIN)/python bench/fused_step.py --out bench/results
	$(BIN)/python bench/peer_accuracy.py --out bench/results

# The default model's quantization plans as package data (hetero/data/plans/), after an edit to the code a plan is
# derived with: tests/outliers/test_plancache.py says when.
ship: setup
	$(BIN)/python -c "from hetero.methods import ship_default_plans; print(*ship_default_plans(), sep='\n')"

clean:
	rm -rf $(VENV) build *.egg-info
