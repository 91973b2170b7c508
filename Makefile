# MTPLX: set-up, demo, tests and benchmark.
#
# On Linux, mlx[cpu] ships a reference BLAS that is ~15x slower than OpenBLAS,
# and its CPU backend mallocs and frees every buffer, which glibc's malloc does
# slowly; so `install` adds Debian's libopenblas0-pthread and libjemalloc2
# (when apt-get is there) and every target that runs MLX preloads those of
# them that exist.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
JEMALLOC := /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
STAMP := $(VENV)/.installed
LINTED := mtplx pipeline tests jobs
# Runs its argument with OpenBLAS and jemalloc preloaded where they exist (Linux), plainly elsewhere,
# and OpenBLAS's idle threads sleeping after ~0.4 ms instead of spinning ~0.1 s (pipeline/preload.py).
MLXENV = P=""; for l in $(OPENBLAS) $(JEMALLOC); do if [ -e $$l ]; then P="$$P $$l"; fi; done; \
  if [ -n "$$P" ]; then export LD_PRELOAD="$$P"; fi; \
  export OPENBLAS_THREAD_TIMEOUT=$${OPENBLAS_THREAD_TIMEOUT:-20};

.PHONY: install run lint format test test-all bench bench-scale clean native-libs

install: native-libs $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray]'
	@touch $(STAMP)

native-libs:
	@if [ "$$(uname -s)" = Linux ]; then \
	  for pair in libopenblas0-pthread:$(OPENBLAS) libjemalloc2:$(JEMALLOC); do \
	    pkg=$${pair%%:*}; lib=$${pair#*:}; \
	    [ -e $$lib ] && continue; \
	    if command -v apt-get >/dev/null 2>&1; then \
	      SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	      echo "installing $$pkg (MLX on the CPU is much slower without it; see README)"; \
	      ($$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$pkg) >/dev/null 2>&1 \
	        || echo "warning: could not install $$pkg; MLX will run slower"; \
	    else echo "warning: no apt-get; install $$pkg yourself for speed"; fi; \
	  done; \
	fi

# The sample nightly job on the built-in model: rerunning resumes (nothing to
# do once complete); `make run ARGS=--overwrite` starts over.
run: install
	$(MLXENV) $(VENV)/bin/mtplx run jobs/nightly.toml $(ARGS); rc=$$?; \
	  if [ $$rc -le 1 ]; then echo "output: out/nightly/"; $(VENV)/bin/mtplx inspect out/nightly; fi; exit $$rc

# ruff: the formatter's import order and the linter's checks (pyproject.toml).
lint: install
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)

format: install
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

test: install lint
	$(MLXENV) $(PY) -m pytest -q -m "not slow" tests

test-all: install
	$(MLXENV) $(PY) -m pytest -q tests

bench: install
	$(MLXENV) $(VENV)/bin/mtplx bench --output bench.json

# The regime users run in: the built-in model widened to Qwen3.5-0.8B's shape and vocabulary (float32, ~3.7 GB,
# written once under .cache/), against mlx-lm on the same checkpoint. Settings sized for two cores
# (docs/scale.md); BENCH_SCALE_ARGS adds or overrides flags, e.g. BENCH_SCALE_ARGS="--draft-vocab 0".
SCALE_SHAPE ?= qwen3.5-0.8b
BENCH_SCALE_ARGS ?=
bench-scale: install
	$(MLXENV) M=$$($(PY) -m mtplx.bench.scale $(SCALE_SHAPE) --cache .cache) && \
	  $(VENV)/bin/mtplx bench --model $$M --batch-sizes 1,4,16,64 --depths 0,1,2,3,auto --temperatures 0,1 \
	    --max-tokens 16 --prompts 1,4,16,64 --rounds 2 --bare-rounds 4,1 --draft-vocab 32768 \
	    --output bench-scale.json $(BENCH_SCALE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
