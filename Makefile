# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REPO ?= build/demo/triton_repo

.PHONY: setup demo test lint serve clean gpu-check

setup: $(STAMP)

# torch first and pinned: the CPU wheel on these machines; anything looser pulls CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m medusa_trt.cli.demo --workdir build/demo

# Two workers, whole files per worker; the workers share the tiny checkpoints and engines they build,
# and the slowest files start first (tests/conftest.py). 17 min on an idle 2-core Xeon (2026-11-28); 11-13 min
# on a 2-core AMD EPYC AVX2 (2026-11-29, pytest; docs/benchmarks/issue-35-amphista.md (ai)).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Everything that needs an NVIDIA GPU (kernel vs reference and SDPA, TensorRT plugin/native and ONNX
# Runtime CUDA engines with medusa-check, Medusa vs plain timing); one line and exit 0 without a GPU.
# On a machine without a package index (the lent device: no .venv travels, and TensorRT is not
# installed there) run the kernel part with its own python instead:
#   python3 scripts/gpu_check.py --no-install --skip-engines --out $OUT/gpu_check.json
gpu-check: setup
	$(PY) scripts/gpu_check.py --out build/gpu_check/report.json

serve: setup
	$(PY) -m medusa_trt.cli.serve --repo $(REPO)

lint: setup
	$(PY) -m ruff check medusa_trt tests benchmarks

clean:
	rm -rf build .pytest_cache
