# Two entry points (see README): `make run` (the main job on embedded defaults) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS := 1
export PYTHONHASHSEED := 0

.PHONY: install run test lint bench learn

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
	OMP_NUM_THREADS=2 $(BIN)/orthojob pipeline --preset tiny-cpu

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/python bench/env_throughput.py

# issue 12's learning experiment: format stage 0 then GRPO (one process), BC and RSFT (a second),
# one thread each on the two cores; held-out curves and the comparison in runs/learn/
learn: install
	OMP_NUM_THREADS=1 $(BIN)/python -m orthojob.learning --out runs/learn
