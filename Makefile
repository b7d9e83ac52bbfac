# Every target sets up what it needs: the first run creates .venv (torch pinned by constraints.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1

.PHONY: help venv test throughput-table memory-table validate-sim bench-overhead bench-runtime bench-schedules \
        deep-vs-wide train-amoebanet corpus baseline gpu-check clean

help:
	@echo "make throughput-table  the paper's Table 2/3 (K x M speedups), results/throughput/"
	@echo "make test              the test suite"
	@echo "make memory-table      the paper's Table 1 (max model size), results/memory/"
	@echo "make validate-sim      simulator vs real stage processes, results/throughput/validation.*"
	@echo "make bench-overhead    engine (K=1,M=1) vs plain PyTorch step time"
	@echo "make bench-runtime     distributed runtime vs K=1 and vs torch.distributed.pipelining"
	@echo "make bench-schedules   every schedule of ours vs every torch.distributed.pipelining schedule, K=2"
	@echo "make train-amoebanet   AmoebaNet-B on the offline MNIST sample (CPU preset)"
	@echo "make deep-vs-wide      deep vs wide multilingual translation, results/translation/"
	@echo "make baseline          regenerate the CI speedup baseline on purpose"
	@echo "make gpu-check         engine, memory planner and cost model on one GPU, results/gpu/<device>/"

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

throughput-table: $(STAMP)
	$(PY) -m experiments.throughput_table

memory-table: $(STAMP)
	$(PY) -m experiments.memory_table

validate-sim: $(STAMP)
	$(PY) -m experiments.validate_simulator

bench-overhead: $(STAMP)
	$(PY) -m experiments.bench_overhead

bench-runtime: $(STAMP)
	$(PY) -m experiments.bench_runtime

bench-schedules: $(STAMP)
	$(PY) -m experiments.bench_schedules

train-amoebanet: $(STAMP)
	$(VENV)/bin/gpipe-repro run amoebanet --preset cpu

deep-vs-wide: $(STAMP)
	$(PY) -m experiments.deep_vs_wide

corpus: $(STAMP)
	$(VENV)/bin/gpipe-repro corpus build

baseline: $(STAMP)
	$(PY) -m experiments.speedup_baseline --write

# One NVIDIA GPU, < 10 minutes. GPU=cuda:1 picks another; GPU_CHECK_ARGS="--overwrite" replaces an earlier run.
GPU ?= cuda:0
gpu-check: $(STAMP)
	$(VENV)/bin/gpipe-repro gpu-check --device $(GPU) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
