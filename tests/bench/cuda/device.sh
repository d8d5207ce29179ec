#!/usr/bin/env bash
# Issue 40's device run: on a GPU host with no Rust toolchain and no network,
# in one go, building nothing there. `make device-build` (build.sh) builds
# here what travels: target/device/ (the `sluice` binary and the engine's
# `cuda_gpu` test binary with the cuda feature, stripped and xz-compressed,
# their commit in BUILD_INFO, the `openai` client as wheels). Then, on the
# GPU host, from the repository root:
#
#   tests/bench/cuda/device.sh OUT
#
# Steps, each with its own time limit, all within BUDGET (540 s):
#   info        the device, driver, CUDA and PyTorch versions
#   reference   random Llama and Qwen2 models by transformers on this GPU, and
#               their bf16 logits and 32 greedy tokens (hf_reference.py)
#   parity      the cuda_gpu tests: built-in models against the CPU backend,
#               the parity fixtures and the models above against transformers,
#               KV round trip, graphs = eager, a prefix-cache hit and a
#               preemption giving the same tokens, sluice-small and the 1.1B
#               shape's decode tokens/s
#   serve       `sluice up --engine cuda` through the openai client (e2e.py)
#   speed_8b    the Llama-3-8B shape: decode at batch 1/8/32/128, prefill of
#               512 and 2,048 tokens, beside the measured copy bandwidth
#   peer        PyTorch's copy bandwidth and bf16 peak, transformers' generate
#               and prefill on the same shape (torch_baseline.py)
#   report      report.py: OUT/cuda_section.md (a dated section for
#               tests/bench/results/cuda.md) and OUT/cuda_raw.json
# OUT also gets device.log and logs.tar.gz (every step's output): four files,
# within what the device tool brings back. A failed step is recorded and the
# run goes on.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
BIN=${DEVICE_BIN:-$ROOT/target/device}
PY=${PYTHON:-python3}
PORT=${PORT:-18490}
BUDGET=${BUDGET:-540}   # seconds for the whole run (the device tool allows 600 a call)

# step NAME LIMIT_SECS COMMAND...: runs it with its output in $W/NAME.log,
# within LIMIT_SECS and what is left of the run's BUDGET (less 20 s kept for
# the report); a step with no time left is skipped (rc -1).
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 20))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    echo "{\"step\": \"$name\", \"rc\": -1, \"secs\": 0}" >>"$STEPS"
    echo "-- $name: skipped, no time left"
    return
  fi
  echo "== $name (limit ${limit}s)"
  local start=$EPOCHREALTIME
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  local secs
  secs=$("$PY" -c "print(round($EPOCHREALTIME - $start, 1))")
  echo "{\"step\": \"$name\", \"rc\": $rc, \"secs\": $secs}" >>"$STEPS"
  tail -n 8 "$W/$name.log"
  echo "-- $name: rc $rc in ${secs}s"
}

info() {
  "$PY" - "$W/info.json" "$BIN/BUILD_INFO" <<'PY'
import json, subprocess, sys, torch
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
name, driver, memory = [s.strip() for s in smi.splitlines()[0].split(",")]
build = dict(line.split("=", 1) for line in open(sys.argv[2]).read().splitlines() if "=" in line)
info = {"device": name, "driver": driver, "memory": memory, "cuda": torch.version.cuda,
        "torch": torch.__version__, "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        **{f"build_{k}": v for k, v in build.items()}}
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[1], "w"))
PY
}

serve() {
  "$W/sluice" model init --out "$W/tiny" || return 1
  RUST_LOG=info "$W/sluice" up --engine cuda --model "$W/tiny" --http-port "$PORT" >"$W/serve.server.log" 2>&1 &
  local pid=$!
  "$PY" - "$PORT" "$pid" <<'PY' || { kill "$pid"; cat "$W/serve.server.log"; return 1; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("sluice up exited")
        time.sleep(0.25)
sys.exit("sluice up not ready after 60 s")
PY
  local site=$W/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$BIN"/wheels/*.whl
  PYTHONPATH=$site "$PY" "$ROOT/tests/bench/cuda/e2e.py" "http://127.0.0.1:$PORT" "$W/e2e.json"
  local rc=$?
  kill "$pid"; wait "$pid" 2>/dev/null
  tail -n 20 "$W/serve.server.log"
  return $rc
}

# The steps that are shell functions run as `device.sh --info` / `--serve`
# (under `timeout`), with W, the work folder, from the run that calls them.
case "${1:-}" in
  --info) info; exit ;;
  --serve) serve; exit ;;
esac

OUT=${1:?usage: device.sh OUT}
mkdir -p "$OUT"
W=$(mktemp -d)
export W
STEPS=$W/steps.jsonl
: >"$STEPS"
exec > >(tee -a "$OUT/device.log") 2>&1

[ -f "$BIN/BUILD_INFO" ] || { echo "no $BIN/BUILD_INFO: run 'make device-build' where Rust is"; exit 1; }
for f in sluice cuda_gpu; do
  xz -dc "$BIN/$f.xz" >"$W/$f" && chmod +x "$W/$f" || { echo "cannot unpack $BIN/$f.xz"; exit 1; }
done

# NVRTC and cuBLAS 13 from the CUDA wheels PyTorch brings.
LIBS=$("$PY" - <<'PY'
import pathlib, site
dirs = set()
for root in map(pathlib.Path, site.getsitepackages()):
    for pattern in ("libcublas.so.13*", "libcublasLt.so.13*", "libnvrtc.so.13*"):
        dirs.update(str(f.parent) for f in root.glob("nvidia/**/" + pattern))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "CUDA libraries from: ${LIBS:-none found}"

export SLUICE_TEST_CUDA=1 SLUICE_ENGINE_DIR=$ROOT/engine SLUICE_CUDA_BENCH_JSON=$W/bench.jsonl
export SLUICE_CUDA_HF_REFERENCE=$W/hf
step info 30 "$0" --info
step reference 90 "$PY" "$ROOT/tests/bench/cuda/hf_reference.py" "$W/hf"
step parity 150 "$W/cuda_gpu" --ignored --test-threads=1 --nocapture --skip llama_8b_shape
step serve 75 "$0" --serve
step speed_8b 200 "$W/cuda_gpu" --ignored --exact llama_8b_shape_decode_and_prefill --nocapture
step peer 120 "$PY" "$ROOT/tests/bench/cuda/torch_baseline.py" "$W/torch.json"
"$PY" "$ROOT/tests/bench/cuda/report.py" "$W" "$OUT"
tar -czf "$OUT/logs.tar.gz" -C "$W" --exclude hf --exclude tiny --exclude site --exclude sluice --exclude cuda_gpu .
echo "results: $OUT/cuda_section.md, $OUT/cuda_raw.json"
