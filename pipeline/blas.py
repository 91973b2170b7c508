"""Make sure MLX on Linux runs with OpenBLAS instead of its reference BLAS.

mlx[cpu] ships a reference BLAS that is about 15x slower than OpenBLAS. The
library has to be preloaded before the process starts, so the CLI re-executes
itself once with LD_PRELOAD set when the library exists and is not loaded yet.
"""

import os
import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
_GUARD = "MTPLX_BLAS_REEXEC_DONE"


def reexec_with_openblas() -> None:
    if not sys.platform.startswith("linux") or not os.path.exists(OPENBLAS):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "libopenblas" in preload or os.environ.get(_GUARD):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{OPENBLAS} {preload}".strip()
    env[_GUARD] = "1"
    try:
        os.execve(sys.executable, [sys.executable, "-m", "pipeline.cli", *sys.argv[1:]], env)
    except OSError:
        return  # run on, slower, rather than fail
