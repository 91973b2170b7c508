"""How many threads OpenBLAS may use for the decode cycles' GEMMs.

At a small model's decode sizes OpenBLAS's split of a GEMM across threads costs more than it saves (waking a
thread for microseconds, competing with the host thread building the next graph): a decode cycle runs
single-threaded when OpenBLAS would split its largest GEMM but that stays under `SINGLE_THREAD_MNK`; prefill
and the caller keep the caller's count. The count changes float32 rounding, so it switches only between
passes and depends only on the pass and the caller's count, never on timing. No OpenBLAS: nothing changes.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import mlx.core as mx

SINGLE_THREAD_MNK = 2**21  # largest decode GEMM (rows x in x out) run single-threaded; above it two threads gain
# Debian's OpenBLAS splits a GEMM above this (GEMM_MULTITHREAD_THRESHOLD 4 x 65536); below it a switch only waits.
OPENBLAS_SPLITS_ABOVE = 4 * 65536


def gemm_row_cost(model) -> Optional[int]:
    """in x out of the largest float32 weight matrix (one GEMM row's cost); None where BLAS is not used."""
    from mlx.utils import tree_flatten

    if mx.default_device() != mx.cpu:
        return None
    sizes = [
        int(w.shape[0]) * int(w.shape[1])
        for part in (model.trunk, model.head)
        if part is not None
        for name, w in tree_flatten(part.parameters())
        if w.ndim == 2 and w.dtype == mx.float32 and name.endswith("weight")
    ]
    return max(sizes, default=None)


def decode_threads(row_cost: Optional[int], rows: int) -> Optional[int]:
    """Threads for a decode pass over `rows` GEMM rows (batch x positions): 1 when OpenBLAS would split
    its largest GEMM but that is under SINGLE_THREAD_MNK; None (the caller's count) otherwise."""
    if row_cost is None:
        return None
    return 1 if OPENBLAS_SPLITS_ABOVE < rows * row_cost < SINGLE_THREAD_MNK else None


class _Hold:
    """Who holds OpenBLAS's thread count, and the caller's count to give back."""

    owner: object = None
    callers: Optional[int] = None


_HOLD = _Hold()


def use_threads(n: Optional[int], owner) -> None:
    """Run the GEMMs launched from now on with n OpenBLAS threads (None: the caller's count) for `owner`,
    which gives it back with `release_threads`. Waits for work in flight so no pass straddles two counts."""
    lib = _openblas()
    if lib is None:
        return
    if _HOLD.callers is None:
        _HOLD.callers = int(lib.openblas_get_num_threads())
    _HOLD.owner = owner
    _set(lib, _HOLD.callers if n is None else int(n))


def release_threads(owner) -> None:
    """Give the caller's count back if `owner` holds it (not a stream finalized late by the collector)."""
    lib = _openblas()
    if lib is None or _HOLD.owner is not owner or _HOLD.callers is None:
        return
    _set(lib, _HOLD.callers)
    _HOLD.owner, _HOLD.callers = None, None


def _set(lib, n: int) -> None:
    if lib.openblas_get_num_threads() != n:
        mx.synchronize()  # the passes in flight keep the count they were launched under
        lib.openblas_set_num_threads(n)


def openblas_threads() -> Optional[int]:
    """The thread count OpenBLAS uses now, or None without OpenBLAS."""
    lib = _openblas()
    return None if lib is None else int(lib.openblas_get_num_threads())


def openblas_core() -> Optional[str]:
    """The kernel set OpenBLAS chose (OPENBLAS_CORETYPE can force it), or None without OpenBLAS."""
    lib = _openblas()
    fn = getattr(lib, "openblas_get_corename", None) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace")


_LIB = []


def _openblas():
    """The process's OpenBLAS (found by symbol, wherever it was loaded from), or None."""
    if not _LIB:
        try:
            lib = ctypes.CDLL(None)
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
            lib.openblas_get_num_threads.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIB.append(lib)
    return _LIB[0]
