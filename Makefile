# capt: every target runs from a fresh clone; `make setup` first (or .ci/run, which does it).
VENV_PYTHON := .venv/bin/python
PYTHON ?= $(VENV_PYTHON)
# The venv is made only when the venv's python runs: `make bench PYTHON=python3` uses the machine's own.
NEEDS_VENV = $(if $(filter $(VENV_PYTHON),$(PYTHON)),setup)
DATA ?= $(if $(CAPT_DATA),$(CAPT_DATA),data/superglue)
WEIGHTS ?= weights/smollm2-135m-instruct

.PHONY: setup test demo weights data bench gpu clean

# torch first, pinned, so the extras cannot pull another build; then capt with its test, weights and plots extras.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU-only wheel where pip would fetch a CUDA one.
setup: .venv/.done
.venv/.done: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	.venv/bin/pip install -q -e ".[test,weights,plots]"
	touch $@

test: setup
	$(PYTHON) -m pytest tests -q

weights: setup
	$(PYTHON) weights/convert_gguf.py --out $(WEIGHTS)

demo: weights
	$(PYTHON) -m capt.cli.demo --model $(WEIGHTS) --data $(DATA)

data: setup
	$(PYTHON) -m capt.cli.data --out data/superglue

# BENCH_ARGS: bench.py options, e.g. "--budget 480" or "--budget 480 --dry-run"
bench: $(NEEDS_VENV)
	$(PYTHON) bench/bench.py $(BENCH_ARGS)

# The GPU evidence in one command that stops by itself (bench/gpu.sh; GPU_ARGS: its options)
OUT ?= bench/results/gpu
GPU_SECONDS ?= 480
gpu: $(NEEDS_VENV)
	PYTHON=$(PYTHON) bench/gpu.sh $(OUT) $(GPU_SECONDS) $(GPU_ARGS)

clean:
	rm -rf .venv runs .pytest_cache
