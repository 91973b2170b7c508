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
- whole runs of 32 prompts decoded 1.12-1.17x faster at depth 2,
  1.04-1.08x at depth 3, 0.97-1.04x at depths 0 and 1.
Larger products do gain from the split: at batch 64 (up to 12.6M) the step
took 24.1 ms with two threads against 25.3 with one, and a prefill of 64
prompts 0.94 s against 1.05.

So a decode cycle runs single-threaded when the largest GEMM of its widest
pass (the verify: batch x (depth + 1) rows) stays under `SINGLE_THREAD_MNK`
(2M: at batch 16, up to 1.6M, one thread was as fast or faster; at 3.1M two
were ~5% faster), and everything else (prefill) keeps the threads OpenBLAS
started with. A larger model's GEMMs (hidden 1024 and up) pass it at any
batch size.

The thread count changes how OpenBLAS partitions a product, and so its float32
rounding (by ~1e-5 here). So the count is switched only between passes: the
host waits for the work in flight first, and a pass's count depends only on
what it is (decode or prefill), never on timing.

Without OpenBLAS in the process (macOS's Accelerate, MLX's bundled
reference BLAS, a GPU) nothing changes.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import mlx.core as mx

# Largest decode GEMM (rows x in x out) that runs single-threaded (see above).
SINGLE_THREAD_MNK = 2 ** 21
# Where Debian's OpenBLAS starts to split a GEMM (GEMM_MULTITHREAD_THRESHOLD 4
# x 65536): a pass whose GEMMs are all below it is single-threaded anyway,
# and switching the count for it would only cost a wait.
OPENBLAS_SPLITS_FROM = 4 * 65536


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
    tokens per row): 1 when OpenBLAS would split its largest GEMM but that
    is under SINGLE_THREAD_MNK; None (as OpenBLAS started) otherwise."""
    if row_cost is None:
        return None
    return 1 if OPENBLAS_SPLITS_FROM <= rows * row_cost < SINGLE_THREAD_MNK else None


def use_threads(n: Optional[int]) -> None:
    """Run the GEMMs launched from now on with n OpenBLAS threads (None: as
    many as OpenBLAS started with). Waits for the work in flight before a
    switch, so that no pass straddles two counts."""
    lib = _openblas()
    if lib is None:
        return
    n = _STARTED_WITH[0] if n is None else int(n)
    if lib.openblas_get_num_threads() == n:
        return
    mx.synchronize()
    lib.openblas_set_num_threads(n)


def openblas_threads() -> Optional[int]:
    """The thread count OpenBLAS uses now, or None without OpenBLAS."""
    lib = _openblas()
    return None if lib is None else int(lib.openblas_get_num_threads())


_LIB = []
_STARTED_WITH = []


def _openblas():
    """The process's OpenBLAS (found by symbol, wherever it was loaded
    from), or None; notes the thread count it started with."""
    if not _LIB:
        try:
            lib = ctypes.CDLL(None)
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
            lib.openblas_get_num_threads.restype = ctypes.c_int
            _STARTED_WITH.append(int(lib.openblas_get_num_threads()))
        except (OSError, AttributeError):
            lib = None
        _LIB.append(lib)
    return _LIB[0]
