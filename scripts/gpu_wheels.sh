#!/usr/bin/env bash
# `make gpu-wheels`, here (pip reaches the registry; the GPU machine reaches nothing): the cp312 manylinux
# x86-64 wheels that the GPU machine lacks for `make gpu-check`, at the versions this checkout's venv tests
# with, into .gpu/ (ignored by git), in two folders that each fit one device-tool call beside the working
# tree (64 MiB a call in all): .gpu/a holds the first part of mlx-cuda-13's wheel (about 90 MB), .gpu/b the
# rest and the other wheels. scripts/gpu_check.sh joins them. docs/gpu.md has the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PART=${PART:-46m}  # a part: with the working tree (about 12 MB) under the 64 MiB a call carries

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
MLX=$(version mlx)
WANT=(
  "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$(version mlx-lm)"
  # mtplx's base dependency `datasets` and its needs that the GPU machine lacks (the check never imports them,
  # but `pip install -e .[cuda]` resolves them)
  "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)"
  # the build backend pyproject.toml names, and what `wheel` needs, for an editable install with no index
  # (pip builds in an environment of its own, which sees none of the packages installed there)
  "setuptools>=77" "wheel" "packaging>=24"
)
PLATFORMS=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
PLATFORMS+=(--platform any)

rm -rf .gpu/wheels .gpu/a .gpu/b
mkdir -p .gpu/wheels .gpu/a .gpu/b
for w in "${WANT[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .gpu/wheels "$w" 2>&1 | grep -v "^WARNING: Location" || true
done
cuda=$(ls .gpu/wheels/mlx_cuda_13-*.whl)
(cd .gpu/wheels && sha256sum ./*.whl) > .gpu/b/SHA256SUMS
# mlx-cuda-13's pins on NVIDIA's libraries, for gpu_check.sh to hold against what the GPU machine has
unzip -p "$cuda" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' > .gpu/b/pins.txt
cp .gpu/b/pins.txt .gpu/b/SHA256SUMS .gpu/a/
split -b "$PART" -d "$cuda" ".gpu/a/$(basename "$cuda").part-"
mv .gpu/a/"$(basename "$cuda")".part-0[1-9] .gpu/b/
for w in .gpu/wheels/*.whl; do [ "$w" = "$cuda" ] || cp "$w" .gpu/b/; done
rm -rf .gpu/wheels

echo "wheels for the GPU machine (mlx $MLX), in two carries:"
for d in .gpu/a .gpu/b; do echo "  $d: $(du -sb $d | cut -f1) bytes"; ls -l $d | tail -n +2 | awk '{print "    " $5 "  " $9}'; done
echo "mlx-cuda-13 $MLX requires:"; sed 's/^/  /' .gpu/b/pins.txt
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for d in .gpu/a .gpu/b; do
  total=$((tree + $(du -sb $d | cut -f1)))
  [ $total -lt $((64 * 1024 * 1024)) ] || { echo "error: $d with the working tree is $total bytes, over 64 MiB"; exit 1; }
done
