# The two commands of the README. Both create .venv and install what they need first.
#   make demo   a short distributed training run on Tiny Shakespeare (it ships: offline), a sample
#   make test   the test suite (CPU, gloo; CUDA paths too when a GPU is present), with the test
#               references of requirements-test.txt (transformers, peft), on TEST_WORKERS workers
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# one process per GPU; two gloo processes on a CPU
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NPROC ?= $(if $(filter-out 0,$(NGPU)),$(NGPU),2)
# pytest-xdist: one test process per core and one more, at most 4: a hang test mostly waits out
# its timeouts and a torchrun test its start, and the extra worker computes meanwhile (on 2
# cores: 3 min 26 s against 4 min 2 s with two); a test's own ranks are processes too
# (not nproc: it answers OMP_NUM_THREADS, which the README's first hour sets to 1)
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, (os.cpu_count() or 1) + 1))")
# --archive: a second `make demo` moves the first one's run into out-demo/archive-N/
DEMO_FLAGS ?= --zero 2 $(if $(filter-out 0,$(NGPU)),--bf16,) --max-iters 1000 --lr-decay-iters 1000 --out-dir out-demo --archive

.PHONY: demo test clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch $@

demo: $(VENV)/.installed
	$(PY) data/prepare.py --dataset shakespeare_char
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) train.py $(DEMO_FLAGS)
	$(PY) sample.py --out-dir out-demo --num-samples 1 --max-new-tokens 300

test: $(VENV)/.installed-test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf out-demo .pytest_cache
