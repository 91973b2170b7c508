"""Exactly one MLX backend: the extras choose it, `import mtplx` names them when none (or two) is installed,
and `make install GPU=cuda` installs the CUDA one with nothing CPU-specific."""

import shutil
import subprocess

import pytest
from conftest import REPO

from mtplx.install_check import backend_problem, installed_backends, uses_cuda


def test_without_a_backend_on_linux_the_message_names_the_extras():
    problem = backend_problem("linux", [], libmlx=False)
    assert "without a backend" in problem
    for extra in ("mtplx[cpu]", "mtplx[cuda]", "mtplx[cuda12]", "make install GPU=cuda"):
        assert extra in problem


def test_two_backends_are_named_with_how_to_remove_them():
    problem = backend_problem("linux", ["mlx-cpu", "mlx-cuda-13"])
    assert "pip uninstall mlx-cpu mlx-cuda-13" in problem and "mtplx[cuda]" in problem


def test_one_backend_a_source_build_or_macos_is_no_problem():
    assert backend_problem("linux", ["mlx-cuda-13"]) is None
    assert backend_problem("linux", [], libmlx=True) is None  # MLX built from source: its own libmlx.so
    assert backend_problem("darwin", [], libmlx=False) is None
    assert installed_backends() and backend_problem() is None  # this suite runs on an installed backend


def test_only_the_cuda_backends_count_as_cuda():
    assert uses_cuda(["mlx-cuda-13"]) and uses_cuda(["mlx-cuda-12"])
    assert not uses_cuda(["mlx-cpu"]) and not uses_cuda([])


def _make_n(*args, venv):
    out = subprocess.run(
        ["make", "-n", "install", f"VENV={venv}", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_install_takes_the_cpu_backend_by_default_and_the_cuda_one_with_gpu_cuda(tmp_path):
    cpu = _make_n(venv=tmp_path / "v")
    assert "-e '.[cpu,dev,ray]'" in cpu and "libopenblas0-pthread" in cpu
    cuda = _make_n("GPU=cuda", venv=tmp_path / "v")
    assert "-e '.[cuda,dev,ray]'" in cuda
    assert "openblas" not in cuda.lower() and "jemalloc" not in cuda.lower()  # nothing CPU-specific installed
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / ".backend").write_text("cuda\n")
    assert "-e '.[cuda,dev,ray]'" in _make_n(venv=tmp_path / "v")  # later targets keep the venv's backend
    assert "-e '.[cpu,dev,ray]'" in _make_n("GPU=cpu", venv=tmp_path / "v")
