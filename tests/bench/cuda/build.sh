#!/usr/bin/env bash
# Builds what issue 40's device run (device.sh) takes to a GPU host that has
# no Rust toolchain and no network, into target/device/ (`make device-build`):
#   sluice.xz      the release binary with the cuda feature, stripped
#   cuda_gpu.xz    the engine's GPU test binary (release, cuda), stripped
#   wheels/        the `openai` client and what it needs beyond the GPU
#                  host's PyTorch image, as the venv here has them
#   BUILD_INFO     commit and build date
# The device tool carries at most 64 MiB with the working tree; this checks
# the folder's size against what is left of it. Carry it with
# `carry: ["target/device"]` and run `tests/bench/cuda/device.sh $OUT`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
DEST=$ROOT/target/device
PY=${PY:-$ROOT/.venv/bin/python}
rm -rf "$DEST"
mkdir -p "$DEST/wheels"

cargo build --release -p sluice --features cuda
test_bin=$(cargo test --release -p sluice-engine --features cuda --test cuda_gpu --no-run \
  --message-format=json 2>/dev/null | "$PY" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_gpu":
        print(m["executable"])')
[ -x "$test_bin" ] || { echo "no cuda_gpu test binary"; exit 1; }
for pair in "sluice:target/release/sluice" "cuda_gpu:$test_bin"; do
  name=${pair%%:*}
  strip -o "$DEST/$name" "${pair#*:}"
  xz -T0 -9 "$DEST/$name"
done

# The openai client and every package it needs but idna (which the GPU
# host's image has), as CPython 3.12 manylinux wheels of the versions the
# venv holds; device.sh puts them ahead of the image's own.
pkgs=$("$PY" -m pip freeze | grep -iE '^(openai|pydantic|pydantic[-_]core|jiter|distro|sniffio|typing[-_]inspection|annotated[-_]types|httpx2|httpcore2|truststore|h11|anyio|typing[-_]extensions)==')
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/wheels" $pkgs

{
  echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo -dirty)"
  echo "date=$(date -u +%Y-%m-%dT%H:%MZ)"
  echo "rustc=$(rustc --version)"
} >"$DEST/BUILD_INFO"

tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
carried=$(du -sb "$DEST" | cut -f1)
total=$((tree + carried))
ls -l "$DEST" "$DEST/wheels"
echo "working tree $((tree / 1048576)) MiB + target/device $((carried / 1048576)) MiB = $((total / 1048576)) MiB (limit 64)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "too large to carry"; exit 1; }
