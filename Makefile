# MTPLX: set-up, demo, tests and benchmark.
#
# MLX's backend: the CPU by default; `make install GPU=cuda` (CUDA 13; GPU=cuda12 for CUDA 12) installs
# the CUDA one instead. Later targets keep the venv's backend ($(VENV)/.backend); GPU=cpu goes back.
#
# On Linux, mlx[cpu] ships a reference BLAS that is ~15x slower than OpenBLAS,
# and its CPU backend mallocs and frees every buffer, which glibc's malloc does
# slowly; so installing the CPU backend adds Debian's libopenblas0-pthread and
# libjemalloc2 (when apt-get is there) and every target that runs MLX on it
# preloads those of them that exist. On CUDA neither is installed or preloaded.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
JEMALLOC := /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
GPU ?=
BACKEND := $(if $(GPU),$(GPU),$(shell cat $(VENV)/.backend 2>/dev/null || echo cpu))
BACKENDS := cpu cuda cuda12 cuda13
STAMP := $(VENV)/.installed-$(BACKEND)
LINTED := mtplx pipeline tests jobs scripts
OUT ?= gpu-check
# Runs its argument with OpenBLAS and jemalloc preloaded where they exist (Linux), plainly elsewhere,
# and OpenBLAS's idle threads sleeping after ~0.4 ms instead of spinning ~0.1 s (pipeline/preload.py);
# nothing of it when the venv's MLX runs on CUDA.
MLXENV = if [ "$$(cat $(VENV)/.backend 2>/dev/null || echo cpu)" = cpu ]; then \
  P=""; for l in $(OPENBLAS) $(JEMALLOC); do if [ -e $$l ]; then P="$$P $$l"; fi; done; \
  if [ -n "$$P" ]; then export LD_PRELOAD="$$P"; fi; \
  export OPENBLAS_THREAD_TIMEOUT=$${OPENBLAS_THREAD_TIMEOUT:-20}; fi;

.PHONY: install run lint format test test-all test-gpu gpu-check gpu-receive gpu-check-dry gpu-wheels bench bench-scale clean native-libs

install: $(if $(filter cpu,$(BACKEND)),native-libs) $(STAMP)

# One backend: every backend's wheel ships mlx/lib/libmlx.so, so where another is installed, every one is
# removed (removing one deletes the library file the other may have left there) and the chosen one reinstalled.
$(STAMP): pyproject.toml
	@case " $(BACKENDS) " in *" $(BACKEND) "*) ;; *) echo "GPU=$(GPU): choose cuda, cuda12, cuda13 or cpu"; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@present=$$(for d in mlx-cpu mlx-cuda-12 mlx-cuda-13; do $(PY) -m pip show -q $$d >/dev/null 2>&1 && echo $$d; done); \
	  keep=$$(case $(BACKEND) in cpu) echo mlx-cpu;; cuda12) echo mlx-cuda-12;; *) echo mlx-cuda-13;; esac); \
	  if [ -n "$$(echo $$present | tr ' ' '\n' | grep -vx "$$keep")" ]; then \
	    echo "removing the MLX backends installed ($$(echo $$present)) for $$keep"; $(PY) -m pip uninstall -q -y $$present; fi
	$(PY) -m pip install -q -e '.[$(BACKEND),dev,ray]'
	@rm -f $(VENV)/.installed $(VENV)/.installed-*; echo $(BACKEND) > $(VENV)/.backend; touch $(STAMP)

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

# The exactness tests (marked `gpu`) on the GPU device; each skips, saying why, where MLX has none.
test-gpu: install
	$(MLXENV) $(PY) -m pytest -q -rs -m gpu --gpu tests

# On the GPU machine, with no network and its own python3: install the CUDA backend from the wheels
# `make gpu-wheels` put in .gpu/, run the GPU tests, widen the built-in model to real sizes and run
# `mtplx bench` on them in bfloat16; JSON, tables and a log under OUT. docs/gpu.md has the device-tool recipe
# (two calls: `gpu-receive` carries the first part of the wheels). ARGS: e.g. --seconds 400.
GPU_PY ?= python3
gpu-check:
	PY=$(GPU_PY) bash scripts/gpu_check.sh $(OUT) $(ARGS)

gpu-receive:
	PY=$(GPU_PY) bash scripts/gpu_check.sh $(OUT) --receive

# The same script here, as far as it goes without a GPU: no install, tiny shapes, the default device.
gpu-check-dry: install
	PY=$(PY) bash scripts/gpu_check.sh $(OUT) --dry-run $(ARGS)

# Here, with pip's network: the cp312 manylinux wheels the GPU machine lacks, split for its 64 MiB carry limit.
gpu-wheels: install
	PY=$(PY) bash scripts/gpu_wheels.sh

bench: install
	$(MLXENV) $(VENV)/bin/mtplx bench --output bench.json

# The regime users run in: the built-in model widened to Qwen3.5-0.8B's shape and vocabulary (float32, ~3.7 GB,
# written once under .cache/), against mlx-lm on the same checkpoint, the head drafting over 32,768 ids.
# Sized for two cores: about 20 minutes at batch 1, 4 and 16 (docs/scale.md); batch 64 takes as long alone
# there, so it is its own run: `make bench-scale SCALE_BATCH_SIZES=64`. BENCH_SCALE_ARGS adds or overrides flags.
SCALE_SHAPE ?= qwen3.5-0.8b
SCALE_BATCH_SIZES ?= 1,4,16
BENCH_SCALE_ARGS ?=
bench-scale: install
	$(MLXENV) M=$$($(PY) -m mtplx.bench.scale $(SCALE_SHAPE) --cache .cache) && \
	  $(VENV)/bin/mtplx bench --model $$M --batch-sizes $(SCALE_BATCH_SIZES) \
	    --depths 0,1,2,3,auto --temperatures 0,1 --max-tokens 16 --max-prompt-tokens 32 --prompts $(SCALE_BATCH_SIZES) \
	    --rounds 2 --bare-rounds 2,1 --draft-vocab 32768 --output bench-scale.json $(BENCH_SCALE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
