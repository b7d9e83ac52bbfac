# Every target sets up what it needs: the first run creates .venv (torch pinned by constraints.txt)
# with the project and all its extras (`.[repro,test]`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1

.PHONY: help venv test test-core test-host-data lint throughput-table throughput-reproducibility memory-table validate-sim validate-unseen bench-overhead bench-runtime \
        bench-replicas bench-schedules versus-torch bench-zero-bubble bench-latency replicas-plan-table deep-vs-wide train-amoebanet corpus baseline \
        gpu-check check-speedups check-regression-detector results device-results bench-compile clean

help:
	@echo "make throughput-table  the paper's Table 2/3 (K x M speedups), results/throughput/"
	@echo "make test              lint (ruff + mypy), then the test suite"
	@echo "make test-core         the engine installed alone (torch, numpy) trains in both runtimes"
	@echo "make test-host-data    checks of this host's installed data (the full gettext corpus)"
	@echo "make memory-table      the paper's Table 1 (max model size), results/memory/"
	@echo "make throughput-reproducibility  two consecutive simulated tables, each calibrated afresh: same cuts, cells within 2%?"
	@echo "make validate-sim      simulator vs real stage processes, results/throughput/validation.*"
	@echo "make validate-unseen   simulator vs real runs on three models it was never tuned on (K=2, 30 configs)"
	@echo "make bench-overhead    engine (K=1,M=1) vs plain PyTorch step time"
	@echo "make bench-runtime     distributed runtime vs K=1 and vs torch.distributed.pipelining"
	@echo "make bench-replicas    K=1 x R=2 data parallel vs one process; K=2 x R=2 Gantt, results/replicas/"
	@echo "make replicas-plan-table  K x R x M for Transformer-L / AmoebaNet-D on 8-2048 devices (simulated)"
	@echo "make bench-schedules   every schedule of ours vs every torch.distributed.pipelining schedule, K=2"
	@echo "make versus-torch      ours vs torch.distributed.pipelining, each used its default way, K=2, results/schedules/versus_torch.*"
	@echo "make bench-zero-bubble zb-h1 and zb-v vs 1f1b on the validations' models, K=2, results/schedules/zero_bubble.*"
	@echo "make bench-compile     torch.compile vs eager (GPipe and plain), launch-bound M=32, host sync, results/compile/ (DEVICE=cuda on a GPU)"
	@echo "make bench-latency     seconds of fit (80B Transformer) and of an offline W&B run vs targets, host load"
	@echo "make train-amoebanet   AmoebaNet-B on the offline MNIST sample (CPU preset)"
	@echo "make deep-vs-wide      deep vs wide multilingual translation, results/translation/"
	@echo "make baseline          regenerate the CI speedup baseline on purpose (prints the diff)"
	@echo "make check-speedups    benchmark: K=2 speedups vs the committed baseline: pass / fail / inconclusive (RUNS=N rounds, BUDGET=s)"
	@echo "make check-regression-detector  the CI regression vs 4 breakages (RUNS=10; RENDER_ONLY=1: the page again from its JSON), results/ci/"
	@echo "make results           every table and validation page of record from a clean commit (<= 45 min; DRY_RUN=1: the plan)"
	@echo "make device-results    a lent GPU host: host speed, gpu-check, validate-sim K=2/4/8, schedules K=4, replicas R=2/4, compile (<= 8 min; ONLY=part,... reruns some) -> \$$OUT or results/hosts/<host>/ (TINY=1: toy sizes on a CPU)"
	@echo "make gpu-check         engine, memory planner and cost model on one GPU, results/gpu/<device>/"

# The venv's packages come from uv (installed into the venv by its own pip): one resolve and parallel
# downloads take the install from ~10 min to ~2 min on a 2-core CI host. uv does not read pip's
# configuration, so the wheel folders pip is configured with (PIP_FIND_LINKS or pip.conf's
# find-links: where this host keeps the CPU build of torch) are passed on; torch is named so that
# constraints.txt picks that wheel before anything else is resolved. Bytecode is compiled at install
# on purpose: with PYTHONDONTWRITEBYTECODE set, every process would otherwise recompile torch's
# modules on each import. UV=no installs with pip alone, as before; so does a failed uv install.
UV ?= yes
FIND_LINKS := $(strip $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(UV),yes)
	( $(PY) -m pip install -q uv && \
	  $(VENV)/bin/uv pip install --python $(PY) -q --compile-bytecode \
	      $(addprefix --find-links ,$(sort $(FIND_LINKS))) -c constraints.txt torch -e ".[repro,test]" ) || \
	{ echo "uv could not install the venv: installing with pip"; \
	  $(PY) -m pip install -q -c constraints.txt torch -e ".[repro,test]"; }
else
	$(PY) -m pip install -q -c constraints.txt torch -e ".[repro,test]"
endif
	touch $(STAMP)

venv: $(STAMP)

# Two pytest workers, one per core of the CI host; each test file runs whole in one worker (module
# fixtures run once). Distributed tests start their own stage processes on top.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not host_data"

# The engine as `pip install gpipe-repro` gives it: a venv of its own with torch and numpy only (the
# project's core dependencies), then a tiny pipeline trained in both runtimes (.ci/core_only.py).
# Rebuilt when pyproject.toml or constraints.txt change; the project is installed editable.
CORE_VENV := build/venv-core
CORE_PY := $(CORE_VENV)/bin/python
$(CORE_VENV)/.installed: pyproject.toml constraints.txt | $(STAMP)
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	if [ "$(UV)" = yes ] && [ -x $(VENV)/bin/uv ]; then \
	  $(VENV)/bin/uv pip install --python $(CORE_PY) -q \
	      $(addprefix --find-links ,$(sort $(FIND_LINKS))) -c constraints.txt torch -e . ; \
	else $(CORE_PY) -m pip install -q -c constraints.txt torch -e . ; fi
	touch $@

# Bytecode is written as modules are imported (PYTHONDONTWRITEBYTECODE cleared): compiling all of
# torch at install would cost more than the check.
test-core: $(CORE_VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(CORE_PY) .ci/core_only.py

# What this host's installed data gives (the full offline gettext corpus: >= 20 languages, a long tail);
# the corpus-building logic itself is tested by `make test` on small catalog sets.
test-host-data: $(STAMP)
	$(PY) -m pytest -q -m host_data

# ruff (style, imports, likely bugs) and mypy (types), configured in pyproject.toml; part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

throughput-table: $(STAMP)
	$(PY) -m experiments.throughput_table

throughput-reproducibility: $(STAMP)
	$(PY) -m experiments.throughput_reproducibility

memory-table: $(STAMP)
	$(PY) -m experiments.memory_table

validate-sim: $(STAMP)
	$(PY) -m experiments.validate_simulator

validate-unseen: $(STAMP)
	$(PY) -m experiments.validate_unseen

bench-overhead: $(STAMP)
	$(PY) -m experiments.bench_overhead $(if $(BUDGET),--budget $(BUDGET))

bench-runtime: $(STAMP)
	$(PY) -m experiments.bench_runtime $(if $(BUDGET),--budget $(BUDGET))

bench-replicas: $(STAMP)
	$(PY) -m experiments.bench_replicas $(if $(BUDGET),--budget $(BUDGET))

replicas-plan-table: $(STAMP)
	$(PY) -m experiments.replicas_plan_table

bench-schedules: $(STAMP)
	$(PY) -m experiments.bench_schedules $(if $(BUDGET),--budget $(BUDGET))

versus-torch: $(STAMP)
	$(PY) -m experiments.versus_torch $(if $(BUDGET),--budget $(BUDGET))

bench-zero-bubble: $(STAMP)
	$(PY) -m experiments.bench_zero_bubble $(if $(BUDGET),--budget $(BUDGET))

DEVICE ?=
bench-compile: $(STAMP)
	$(PY) -m experiments.bench_compile $(if $(BUDGET),--budget $(BUDGET)) $(if $(DEVICE),--device $(DEVICE))

bench-latency: $(STAMP)
	$(PY) -m experiments.bench_latency

train-amoebanet: $(STAMP)
	$(VENV)/bin/gpipe-repro run amoebanet --preset cpu --record

deep-vs-wide: $(STAMP)
	$(PY) -m experiments.deep_vs_wide

corpus: $(STAMP)
	$(VENV)/bin/gpipe-repro corpus build --overwrite

baseline: $(STAMP)
	$(PY) -m experiments.speedup_baseline --write

# One NVIDIA GPU, < 10 minutes. GPU=cuda:1 picks another; GPU_CHECK_ARGS="--overwrite" replaces an earlier run.
GPU ?= cuda:0
gpu-check: $(STAMP)
	$(VENV)/bin/gpipe-repro gpu-check --device $(GPU) $(GPU_CHECK_ARGS)

RUNS ?=
# BUDGET=s: a benchmark's time budget; rounds stop earlier once every interval is within tolerance
BUDGET ?=
check-speedups: $(STAMP)
	$(PY) -m experiments.check_speedups $(if $(RUNS),--runs $(RUNS)) $(if $(BUDGET),--budget $(BUDGET))

check-regression-detector: $(STAMP)
	$(PY) -m experiments.check_regression_detector $(if $(RUNS),--runs $(RUNS)) $(if $(RENDER_ONLY),--render-only)

# Every page of record, in one run from a clean commit (it refuses a dirty tree before any work).
results: $(STAMP)
	$(PY) -m experiments.results $(if $(DRY_RUN),--dry-run) $(if $(ONLY),--only $(ONLY))

# The lent machine's own python and torch; nothing installed (no $(STAMP)).
DEVICE_PYTHON ?= python3
device-results:
	PYTHONPATH=. $(DEVICE_PYTHON) -m experiments.device_results $(if $(TINY),--tiny) $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) build *.egg-info
