"""How many threads OpenBLAS may use for the decode cycles' GEMMs.

OpenBLAS splits a GEMM across its threads once M x N x K passes a threshold
fixed when it is built (262,144 in Debian's). At decode sizes on a small
model that split costs more than it saves: the second thread has to be woken
and joined for a product of a few microseconds, and on a 2-core machine it
competes with the host thread building the next cycle's graph. On the
built-in model (hidden 96) at batch 4 on this 2-core VM, with one thread
rather than two, interleaved in one process:
- a verify over 3 tokens (12 GEMM rows, up to 590k M x N x K) took 5.7-6.6 ms
  against 7.5-7.6 ms, and one over 4 tokens 6.5-7.5 against 7.5-7.8;
- a one-token step (4 rows, below the threshold) took the same;
- whole runs of 32 prompts ran 1.08-1.17x faster at depth 2 (four A/B
  runs), 1.04-1.06x at depth 3 and 0.96-1.04x at depth 1.
Larger products do gain from the split: at batch 64 (up to 12.6M) the step
took 24.1 ms with two threads against 25.3 with one, and a prefill of 64
prompts 0.94 s against 1.05.

So a decode cycle runs single-threaded when OpenBLAS would split the largest
GEMM of its widest pass (batch x (depth + 1) rows, or the head catch-up's
after a deeper cycle) but that stays under `SINGLE_THREAD_MNK` (2M: at batch
16, up to 1.6M, one thread was as fast or faster; at 3.1M two were ~5%
faster). Prefill runs at the caller's count, and the caller gets it back
before every completion the runtime yields and when the stream ends, so
code between completions is not affected. A larger model's GEMMs (hidden
1024 and up) pass 2M at any batch size.

The thread count changes how OpenBLAS partitions a product, and so its float32
rounding (by ~1e-5 here). So the count is switched only between passes: the
host waits for the work in flight first, and a pass's count depends only on
what it is (decode at a batch size and depth, or prefill) and on the
caller's count, never on timing. Only the runtime holding the count gives
it back: a stream another runtime left unfinished, finalized later by the
garbage collector, does not switch it under the holder.

Without OpenBLAS in the process (macOS's Accelerate, MLX's bundled
reference BLAS, a GPU) nothing changes.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import mlx.core as mx

# Largest decode GEMM (rows x in x out) that runs single-threaded (see above).
SINGLE_THREAD_MNK = 2**21
# Above this Debian's OpenBLAS splits a GEMM (GEMM_MULTITHREAD_THRESHOLD 4 x
# 65536): a pass whose GEMMs are all at or below it is single-threaded
# anyway, and switching the count for it would only cost a wait.
OPENBLAS_SPLITS_ABOVE = 4 * 65536


def gemm_row_cost(model) -> Optional[int]:
    """in x out of the model's largest float32 weight matrix (trunk and
    head): what one row of its largest GEMM costs. None where its weights do
    not go through BLAS (half precision, quantized, not on the CPU)."""
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
    """The thread count for a decode pass over `rows` GEMM rows (batch x
    positions per row): 1 when OpenBLAS would split its largest GEMM but that
    is under SINGLE_THREAD_MNK; None (the caller's count) otherwise."""
    if row_cost is None:
        return None
    return 1 if OPENBLAS_SPLITS_ABOVE < rows * row_cost < SINGLE_THREAD_MNK else None


class _Hold:
    """Who holds OpenBLAS's thread count, and the caller's count to give back."""

    owner: object = None
    callers: Optional[int] = None


_HOLD = _Hold()


def use_threads(n: Optional[int], owner) -> None:
    """Run the GEMMs launched from now on with n OpenBLAS threads (None: the
    caller's count, as it was when MTPLX took the count), on behalf of
    `owner` (a runtime, a cost sampler), which gives it back with
    `release_threads`. Waits for the work in flight before a switch, so that
    no pass straddles two counts."""
    lib = _openblas()
    if lib is None:
        return
    if _HOLD.callers is None:
        _HOLD.callers = int(lib.openblas_get_num_threads())
    _HOLD.owner = owner
    _set(lib, _HOLD.callers if n is None else int(n))


def release_threads(owner) -> None:
    """Give the caller's count back, if `owner` holds it. (An owner that lost
    the count to another, or a stream finalized late by the garbage collector,
    must not switch it under the holder's passes.)"""
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
    """The kernel set OpenBLAS chose (OPENBLAS_CORETYPE can force it), or
    None without OpenBLAS."""
    lib = _openblas()
    fn = getattr(lib, "openblas_get_corename", None) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace")


_LIB = []


def _openblas():
    """The process's OpenBLAS (found by symbol, wherever it was loaded
    from), or None."""
    if not _LIB:
        try:
            lib = ctypes.CDLL(None)
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
            lib.openblas_get_num_threads.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIB.append(lib)
    return _LIB[0]
