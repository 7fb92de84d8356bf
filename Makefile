# Two entry points (see README): `make run` (the main job on embedded defaults) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS := 1
export PYTHONHASHSEED := 0

.PHONY: install run test lint bench learn chromium image-check

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch first: anything that pulls torch later would fetch a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,dev,verifiers]'
	touch $@

install: $(BIN)/.installed

# one process: both cores for its torch threads (the 1 above is for make test's two workers)
run: install
	OMP_NUM_THREADS=2 $(BIN)/orthojob pipeline --preset tiny-cpu --register

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# headless Chromium for the browser tests (tests/browser.py): Debian's package, installed once; where it
# cannot be installed (no root, no apt) those tests skip and say why
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; } \
		|| echo "make: chromium could not be installed: the browser tests will skip"

test: lint chromium
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench: install
	$(BIN)/python bench/env_throughput.py

# the learning experiment: format stage 0 then GRPO (one process), BC then GRPO (a second), one
# thread each on the two cores; held-out curves, the comparison and the targets in runs/learn/
learn: install
	OMP_NUM_THREADS=1 $(BIN)/python -m experiments.learning --out runs/learn

# build the training image (stand-in base where no registry answers) and check it offline, read-only,
# as UID 10001; not part of `make test`: docker, ~20 GB of disk, ~10 minutes (docs/deploy.md)
image-check:
	$(BIN)/python scripts/image_check.py $(IMAGE_CHECK_ARGS)
