"""Make sure MLX on Linux runs with OpenBLAS and jemalloc preloaded.

- mlx[cpu] ships a reference BLAS that is about 15x slower than OpenBLAS.
- MLX's CPU backend takes every array buffer from malloc and frees it
  after use, thousands of times per decode step; with glibc's malloc that
  was about 13% of a step's time in `perf` (malloc_consolidate, _int_malloc);
  with jemalloc whole runs of mlx-lm and MTPLX were about 1.4x faster here
  (1.03-2.33x over 18 paired settings).

- OpenBLAS's idle worker threads spin on sched_yield for 2^28 TSC cycles
  (about 0.1 s here) after each threaded GEMM before they sleep. After a
  prefill that took a whole core from a decode whose tiny GEMMs use no
  second thread (batch 1-4): the main thread was preempted ~12,000 times
  a second. OPENBLAS_THREAD_TIMEOUT=20 (2^20 cycles, about 0.4 ms) still
  spans the gaps between one step's GEMMs at batch 16.

All of this is read when the process starts, so the CLI re-executes itself
once with LD_PRELOAD set to those libraries that exist and are not preloaded
yet, and with the OpenBLAS setting unless the user set it. Any of it missing
only costs speed. With MLX's CUDA backend none of it applies (the model runs
on the GPU, not on the CPU's BLAS and malloc), so nothing is preloaded or set.
"""

import os
import sys
from typing import Optional

from mtplx.install_check import uses_cuda

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
_GUARD = "MTPLX_PRELOAD_REEXEC_DONE"
# The re-executed CLI, with the current directory off sys.path: `-m` would put it first, so a folder
# holding its own `mtplx/` or `pipeline/` would be imported instead of the installed packages.
REEXEC_ENTRY = "import sys; del sys.path[0]; from pipeline.cli import main; main()"
# Native-library settings the user has not chosen otherwise (see above).
NATIVE_SETTINGS = {"OPENBLAS_THREAD_TIMEOUT": "20"}


# A library counts as preloaded when LD_PRELOAD names it or, for the
# allocator, any other malloc the user chose.
_ALREADY = {OPENBLAS: ("libopenblas",), JEMALLOC: ("jemalloc", "tcmalloc", "mimalloc")}


def missing_preloads(preload: str) -> list:
    """The libraries that exist here and are not in `preload` (LD_PRELOAD)."""
    if not sys.platform.startswith("linux"):
        return []
    return [lib for lib, names in _ALREADY.items() if os.path.exists(lib) and not any(n in preload for n in names)]


def with_preloads(env: dict, cuda: Optional[bool] = None) -> dict:
    """`env` with the missing libraries put first in LD_PRELOAD and the
    native settings it lacks added (the user's own values stay); unchanged
    when MLX runs on CUDA (`cuda`: default, whether its backend is installed)."""
    if uses_cuda() if cuda is None else cuda:
        return env
    preload = env.get("LD_PRELOAD", "")
    missing = missing_preloads(preload)
    if missing:
        env = {**env, "LD_PRELOAD": " ".join(missing + ([preload] if preload else []))}
    if sys.platform.startswith("linux"):
        env = {**NATIVE_SETTINGS, **env}
    return env


def reexec_with_preloads() -> None:
    env = with_preloads(dict(os.environ))
    if os.environ.get(_GUARD) or env == dict(os.environ):
        return
    try:
        os.execve(sys.executable, [sys.executable, "-c", REEXEC_ENTRY, *sys.argv[1:]], {**env, _GUARD: "1"})
    except OSError:
        return  # run on, slower, rather than fail
