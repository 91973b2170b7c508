# MTPLX: set-up, demo, tests and benchmark.
#
# On Linux, mlx[cpu] ships a reference BLAS that is ~15x slower than OpenBLAS,
# so `install` adds Debian's libopenblas0-pthread (when apt-get is there) and
# every target that runs MLX preloads it when the library exists.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
STAMP := $(VENV)/.installed
# Runs its argument with OpenBLAS preloaded where it exists (Linux), plainly elsewhere.
MLXENV = if [ "$$(uname -s)" = Linux ] && [ -e $(OPENBLAS) ]; then export LD_PRELOAD=$(OPENBLAS); fi;

.PHONY: install run test test-all bench clean openblas

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory openblas
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray]'
	@touch $(STAMP)

openblas:
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	    echo "installing libopenblas0-pthread (mlx-cpu's bundled BLAS is ~15x slower)"; \
	    ($$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	      || echo "warning: could not install libopenblas0-pthread; MLX will use its slow reference BLAS"; \
	  else echo "warning: no apt-get; install OpenBLAS yourself for speed"; fi; \
	fi

# The sample nightly job on the built-in model: rerunning resumes (nothing to
# do once complete); `make run ARGS=--overwrite` starts over.
run: install
	$(MLXENV) $(VENV)/bin/mtplx run jobs/nightly.toml $(ARGS); rc=$$?; \
	  if [ $$rc -le 1 ]; then echo "output: out/nightly/"; $(VENV)/bin/mtplx inspect out/nightly; fi; exit $$rc

test: install
	$(MLXENV) $(PY) -m pytest -q -m "not slow" tests

test-all: install
	$(MLXENV) $(PY) -m pytest -q tests

bench: install
	$(MLXENV) $(VENV)/bin/mtplx bench --output bench.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
