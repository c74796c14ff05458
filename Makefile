# The README's quick start: `make demo` (set up + decode a story) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

# pip byte-compiles what it installs one file at a time (half of a fresh set-up); compileall does it on every core
# (a file that cannot compile, such as one of torch's tests written for a newer Python, is skipped, as pip skips it).
INSTALL = $(PY) -m pip install -q --no-compile
COMPILE = $(PY) -m compileall -q -q -j 0 $(VENV)/lib || true

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(PY)
	$(INSTALL) -e .
	$(COMPILE)
	touch $@

# the test extras hold the base install: a fresh machine installs once
# (and z-lab's DFlash reference, for tests/test_dflash_reference.py, without its dependencies: its model needs only
# torch and transformers; its pinned requests/tqdm and datasets serve its benchmark; and vLLM's speculators library,
# for tests/test_speculators_format.py, without its dependencies: it pins transformers<=5.19 and asks for torchvision,
# torchaudio and a data-generation stack; the test extras hold the modules it imports)
$(VENV)/.test: pyproject.toml | $(PY)
	$(INSTALL) -e '.[test]'
	$(INSTALL) --no-deps dflash==0.1.0 speculators==0.9.0
	$(COMPILE)
	touch $(VENV)/.base $@

$(VENV)/.tables: $(VENV)/.base
	$(INSTALL) -e '.[tables]'
	$(COMPILE)
	touch $@

# specjax's CPU kernels for passes of several rows (products, attention; specjax/kernels), built for this machine:
# asked every time, the module rebuilds them only where they are missing or stale, from other sources or for another
# CPU (a checkout moved to another host, whose -march=native may lack the build's instructions); without a C++
# compiler they are not built and XLA's stay in use
.PHONY: demo test bench heads tables kernels
kernels: | $(VENV)/.base
	$(PY) -m specjax.kernels

demo: $(VENV)/.base kernels
	$(PY) run_decode.py

# The tests run with jemalloc where the machine has it (Debian's libjemalloc2, which CI's .ci/run installs), keeping
# freed pages for reuse instead of handing them back to the system: XLA allocates and frees heavily, and three
# test modules took 15% less CPU and 17% less time than with glibc's malloc (jemalloc's default decay: 5% less).
JEMALLOC := $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2))
ifneq ($(JEMALLOC),)
TEST_ENV := LD_PRELOAD=$(JEMALLOC) MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1
endif

test: $(VENV)/.test kernels
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(TEST_ENV) $(PY) -m pytest -q -n 3 --dist loadscope --no-loadscope-reorder --durations=30 tests

bench: $(VENV)/.test kernels
	$(PY) -m experiments.bench_ar

# The paper-style tables and plots (Leviathan's Theorem 3.8, every drafter by prompt category, heads, sweeps) into
# results/, each file stamped with commit, date, device and command.
tables: $(VENV)/.tables kernels
	$(PY) -m experiments.tables

# Speculative decoding on stories260K expanded to a memory-bound 372 MB target (synthetic cost, real distribution):
# verify-cost curve, bandwidth and FLOP/s, every drafter at T=0/1 and batch 1/4 (about an hour on 2 busy cores).
.PHONY: bench-memory
bench-memory: $(VENV)/.base kernels
	$(PY) -m experiments.bench_memory_bound

# Trains the default Medusa, EAGLE, EAGLE-3 and DFlash heads, DFlash's one-layer ablation, its greedy head and TVD
# fine-tune (from heads/stories260K_dflash), each then on blocks of 8, the parallel EAGLE-3 head and the distilled
# draft model on stories260K into heads/.
heads: $(VENV)/.base
	test -d checkpoints/stories260K || $(PY) -m specjax.convert stories260K checkpoints/stories260K
	for m in medusa eagle eagle3 dflash; do \
	  echo "== heads: training $$m (then the one-layer, greedy and TVD DFlash, parallel EAGLE-3, the distilled draft)" && \
	  $(PY) train_heads.py --config=configs/$$m.py --workdir=checkpoints/$${m}_stories260K && \
	  $(PY) -c "from specjax import heads; heads.export('checkpoints/$${m}_stories260K', 'heads/stories260K_$$m')" || exit 1; \
	done
	$(PY) train_heads.py --config=configs/dflash.py --config.heads.n_layers=1 --workdir=checkpoints/dflash_l1_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/dflash_l1_stories260K', 'heads/stories260K_dflash_l1')"
	$(PY) train_heads.py --config=configs/dflash_greedy.py --workdir=checkpoints/dflash_greedy_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/dflash_greedy_stories260K', \
	  'heads/stories260K_dflash_greedy')"
	$(PY) train_heads.py --config=configs/dflash_greedy_b8.py --workdir=checkpoints/dflash_greedy_b8_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/dflash_greedy_b8_stories260K', \
	  'heads/stories260K_dflash_greedy_b8')"
	$(PY) train_heads.py --config=configs/dflash_tvd.py --workdir=checkpoints/dflash_tvd_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/dflash_tvd_stories260K', \
	  'heads/stories260K_dflash_tvd')"
	$(PY) train_heads.py --config=configs/dflash_tvd_b8.py --workdir=checkpoints/dflash_tvd_b8_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/dflash_tvd_b8_stories260K', \
	  'heads/stories260K_dflash_tvd_b8')"
	$(PY) train_heads.py --config=configs/eagle3_parallel.py --workdir=checkpoints/eagle3_parallel_stories260K
	$(PY) -c "from specjax import heads; heads.export('checkpoints/eagle3_parallel_stories260K', \
	  'heads/stories260K_eagle3_parallel')"
	$(PY) train_heads.py --config=configs/draft.py --workdir=checkpoints/distill_stories260K
	$(PY) -c "from specjax.drafters import distill; distill.export_model('checkpoints/distill_stories260K', \
	  'heads/stories260K_distill', 'checkpoints/stories260K')"

# On a machine with an accelerator (JAX with CUDA or TPU, torch, transformers installed; no venv is made): the test
# suite there, then AR against transformers (bfloat16, 110M and 1B) and the memory-bound benchmark sized from the
# device (float32 and bfloat16, T=0 and 1) into results/device_*.{md,csv}, stamped with the device.
#   make device-check PYTHON=/path/to/python
.PHONY: device-check
device-check:
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(PYTHON) -m experiments.device_check
