"""Which MLX backend is installed, read from package metadata and files without importing MLX.

On Linux the `mlx` wheel holds no library of its own: a backend package installs `mlx/lib/libmlx.so`. Without
one, `import mlx.core` fails with only "libmlx.so: cannot open shared object file"; with two, the one installed
last has overwritten the other's library. MTPLX's extras choose exactly one (pyproject.toml, README).
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional, Sequence

# Backend distribution -> the MTPLX extra that installs it.
BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-13": "cuda", "mlx-cuda-12": "cuda12"}
CUDA_BACKENDS = ("mlx-cuda-13", "mlx-cuda-12")
HOW_TO_INSTALL = (
    "install one backend: pip install 'mtplx[cpu]' (the CPU), 'mtplx[cuda]' (an NVIDIA GPU, CUDA 13) or "
    "'mtplx[cuda12]' (CUDA 12); from a checkout: make install (CPU) or make install GPU=cuda"
)


def installed_backends() -> List[str]:
    """The MLX backend distributions installed (names as in BACKENDS)."""
    found = []
    for dist in BACKENDS:
        try:
            version(dist)
        except PackageNotFoundError:
            continue
        found.append(dist)
    return found


def uses_cuda(backends: Optional[Sequence[str]] = None) -> bool:
    """Whether MLX runs on CUDA here: then nothing CPU-specific (OpenBLAS, jemalloc) is preloaded."""
    backends = installed_backends() if backends is None else backends
    return any(b in CUDA_BACKENDS for b in backends)


def _libmlx_present() -> Optional[bool]:
    """A libmlx.so in MLX's package (a backend wheel's, or a source build's); None: no MLX at all."""
    spec = importlib.util.find_spec("mlx")
    if spec is None:
        return None
    return any((Path(p) / "lib" / "libmlx.so").exists() for p in spec.submodule_search_locations or [])


def backend_problem(
    platform: str = sys.platform, backends: Optional[Sequence[str]] = None, libmlx: Optional[bool] = None
) -> Optional[str]:
    """What is wrong with the MLX install on Linux (None: nothing); the arguments default to this machine."""
    if not platform.startswith("linux"):
        return None  # macOS: `mlx` brings its Metal backend
    backends = installed_backends() if backends is None else list(backends)
    if len(backends) > 1:
        return (
            f"two MLX backends are installed ({', '.join(backends)}), and each overwrote the other's "
            f"mlx/lib/libmlx.so: uninstall them (pip uninstall {' '.join(backends)}), then {HOW_TO_INSTALL}"
        )
    if backends:
        return None
    present = _libmlx_present() if libmlx is None else libmlx
    if present is None:
        return f"MLX is not installed: {HOW_TO_INSTALL}"
    if not present:
        return f"MLX is installed without a backend (no mlx/lib/libmlx.so): {HOW_TO_INSTALL}"
    return None


class MLXBackendMissing(ImportError):
    pass


def check_mlx_backend() -> None:
    """Raise MLXBackendMissing, naming the extras, unless exactly one MLX backend is installed (Linux)."""
    problem = backend_problem()
    if problem:
        raise MLXBackendMissing(problem)
