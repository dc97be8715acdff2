# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Each creates ./.venv on first use and installs the project with the CPU torch pinned.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
SPEC := tt:768x3072:modes=12,8,8|12,16,16:rank=30

.PHONY: gpu run inspect test test-all bench experiments lint clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

# the optional integrations the tests cover (HuggingFace, Lightning), installed once next to the
# dev set
$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e '.[dev,hf,lightning]'
	touch $(TEST_STAMP)

# the main job: DLRM dense vs CoMERA on the embedded synthetic Criteo-shaped data (a few minutes)
run: $(STAMP)
	$(VENV)/bin/comera train dlrm --quick --out runs/quick

inspect: $(STAMP)
	$(VENV)/bin/tncomp inspect '$(SPEC)'

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest

test-all: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -m 'not gpu'

# the speed and memory benchmarks, run as modules from the repository root; results go to
# benchmarks/results/ (the smoke test in tests/benchmarks runs each script with --smoke)
bench: $(STAMP)
	$(VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e '.[bench]'
	$(VENV)/bin/python -m benchmarks.speed.bench_tt_linear
	$(VENV)/bin/python -m benchmarks.speed.bench_planning
	$(VENV)/bin/python -m benchmarks.speed.bench_transformer
	$(VENV)/bin/python -m benchmarks.speed.bench_stack
	$(VENV)/bin/python -m benchmarks.speed.bench_growth
	$(VENV)/bin/python -m benchmarks.speed.bench_embedding

# the paper's experiments in quick mode, dense vs CoMERA side by side (comera train per task)
experiments: $(STAMP)
	for task in transformer dlrm mlm; do \
		$(VENV)/bin/comera train $$task --quick --out benchmarks/results/$${task}_quick || exit 1; \
	done

lint: $(STAMP)
	$(VENV)/bin/ruff check tncomp comera tests benchmarks docs

clean:
	rm -rf $(VENV) build *.egg-info

# every GPU claim in one command, at most 9 minutes on one CUDA GPU (docs/gpu.md); exits 2 without
# CUDA or when $(PYTHON) has no torch (set PYTHON=/path/to/python). Wheels carried in .whl/
# (benchmarks/gpu/wheels.sh) are installed first where present.
gpu:
	@if ls .whl/*.whl >/dev/null 2>&1; then $(PYTHON) -m pip install -q --no-index --no-deps \
		--no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl; fi
	@PYTHONPATH=$(CURDIR)/.whl/site:$(CURDIR) $(PYTHON) -m benchmarks.gpu
