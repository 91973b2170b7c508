#!/usr/bin/env bash
# `make gpu-check OUT=DIR` on the GPU machine (no network; docs/gpu.md has the device-tool recipe):
#   1. names the GPU, the driver and the NVIDIA libraries there, against mlx-cuda-13's pins (pins.txt);
#   2. joins mlx-cuda-13's wheel from the parts `make gpu-wheels` split over .gpu/a and .gpu/b and installs
#      the `cuda` extra from them (`pip install -e .[cuda]`, no index); if that cannot resolve, the MLX wheels
#      alone with --no-deps, the checkout on PYTHONPATH;
#   3. runs scripts/gpu_check.py: the GPU tests, the widened shapes, greedy against mlx-lm, `mtplx bench`.
# Everything goes to OUT/log.txt too. Usage: gpu_check.sh OUT [--receive] [--dry-run] [--seconds S]
#   --receive: the first call, which carries .gpu/a: checks its part and names the machine, then stops.
#   --dry-run: no install and tiny shapes on this machine's default device (the script's own check).
#   --seconds: for everything after the install (default 270, so that the whole fits in 5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT [--receive] [--dry-run] [--seconds S]}
shift
MODE=check
SECONDS_FOR_CHECK=270
while [ $# -gt 0 ]; do
  case $1 in
    --receive) MODE=receive ;;
    --dry-run) MODE=dry-run ;;
    --seconds) SECONDS_FOR_CHECK=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, whether or not the install below works
unset LD_PRELOAD  # nothing CPU-specific under the CUDA backend (pipeline/preload.py)
WHEELS=.gpu/wheels
started=$(date +%s)
echo "gpu_check $MODE: $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') in $PWD"

name_the_machine() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  else
    echo "no nvidia-smi"
  fi
  "$PY" --version
  local pins
  pins=$(ls .gpu/b/pins.txt .gpu/a/pins.txt 2>/dev/null | head -1)
  [ -n "$pins" ] || { echo "no pins.txt: run make gpu-wheels here first"; return 0; }
  "$PY" - "$pins" <<'PYEOF' | tee "$OUT/pins.txt"
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
print("mlx-cuda-13's pins against what is installed here:")
for line in open(sys.argv[1]).read().split("\n"):
    if not line.strip():
        continue
    req = Requirement(line)
    try:
        have = version(req.name)
        verdict = "ok" if req.specifier.contains(have, prereleases=True) else "MISMATCH"
    except PackageNotFoundError:
        have, verdict = "-", "MISSING"
    print(f"  {verdict:8} {req.name}{req.specifier or ''}: {have}")
PYEOF
}

join_wheels() {
  [ -d .gpu/b ] || { echo "no .gpu/b: carry it (make gpu-wheels first, here)"; return 1; }
  local first
  first=$(ls .gpu/a/*.part-00 2>/dev/null | head -1)
  [ -n "$first" ] || { echo "no .gpu/a part on this machine: it was given back since the --receive call; run that call again, then this one at once"; return 1; }
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  local whl
  whl=$(basename "$first" .part-00)
  cat .gpu/a/"$whl".part-* .gpu/b/"$whl".part-* > "$WHEELS/$whl"
  cp .gpu/b/*.whl "$WHEELS/"
  (cd "$WHEELS" && sha256sum --quiet -c ../b/SHA256SUMS) || { echo "the joined wheels do not match SHA256SUMS"; return 1; }
  echo "wheels joined: $(ls "$WHEELS" | tr '\n' ' ')"
}

install_cuda() {
  local t0=$(date +%s)
  # The whole extra, resolved against what is installed here: this is what a user's install does.
  if "$PY" -m pip install -q --no-index --find-links "$WHEELS" -e '.[cuda]'; then
    echo "installed .[cuda] in $(( $(date +%s) - t0 )) s"
  else
    echo "pip could not install .[cuda] from the wheels alone (above: which requirement); MLX's wheels with --no-deps instead"
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/mlx-*.whl "$WHEELS"/mlx_cuda_13-*.whl "$WHEELS"/mlx_lm-*.whl \
      || return 1
    echo "installed mlx, mlx-cuda-13, mlx-lm (--no-deps) in $(( $(date +%s) - t0 )) s; mtplx runs from the checkout"
  fi
  # libmlx.so finds NVIDIA's libraries by its run path, in the site-packages it was installed into
  local lib
  lib=$("$PY" -c "import importlib.util as u; print(next(iter(u.find_spec('mlx').submodule_search_locations)))")/lib/libmlx.so
  echo "libmlx.so's libraries:"
  ldd "$lib" | grep -E 'cublas|cufft|cusolver|nvrtc|cudnn|nccl|libcuda|not found' | sed 's/ (0x[0-9a-f]*)//'

  "$PY" - <<'PYEOF'
import os
import mlx.core as mx
import mtplx  # the install check: exactly one MLX backend
from mtplx.install_check import installed_backends
from mtplx import backends
print(f"MLX {mx.__version__}: backends {installed_backends()}, default device {mx.default_device()}, "
      f"GPU available {mx.is_available(mx.gpu)}, {mx.device_info().get('device_name')}")
print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD')!r}; forms on this device: {backends.forms()}")
print(f"a GPU op: {(mx.arange(4) * 2).tolist()}")
PYEOF
}

case $MODE in
  receive)
    name_the_machine
    ls -l .gpu/a/ || echo "no .gpu/a: carry it"
    echo "part a is on the machine: make the second call now (the machine goes back about 30 s after this one)"
    exit 0 ;;
  check)
    name_the_machine
    join_wheels || exit 1
    install_cuda || { echo "the install failed: nothing measured"; exit 1; }
    "$PY" scripts/gpu_check.py "$OUT" --seconds "$SECONDS_FOR_CHECK"
    rc=$? ;;
  dry-run)
    "$PY" scripts/gpu_check.py "$OUT" --seconds "$SECONDS_FOR_CHECK" --dry-run
    rc=$? ;;
esac
echo "gpu_check $MODE: exit $rc after $(( $(date +%s) - started )) s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
