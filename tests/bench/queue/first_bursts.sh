#!/usr/bin/env bash
# Issue 34's first two scenarios, as a new user meets them: a burst into a
# `sluice up --engine mocker` that has served nothing yet, no flag but the
# worker's slots.
#   80 streaming requests at once, priorities 0 and 3, 1 worker x 8 seqs
#   160 streaming requests at once, priorities 0..3, 1 worker x 4 seqs
# Each is run RUNS times on a fresh mesh; writes
# tests/bench/results/first_bursts.md with the command lines. Goal: 0
# refused, priority 3 ahead of priority 0 (mean TTFT), every run.
#
# Environment: SLUICE_BIN [target/release/sluice], RUNS [3], PORT [18471],
# OUT [target/bench/first_bursts].
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
RUNS=${RUNS:-3}
PORT=${PORT:-18471}
OUT=${OUT:-$ROOT/target/bench/first_bursts}
RESULT=$ROOT/tests/bench/results/first_bursts.md

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"
: >"$OUT/commands"

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

burst() { # name, run, seqs, requests, tiers
  local name=$1 run=$2 seqs=$3 requests=$4 tiers=$5
  local dir=$OUT/$name/$run
  mkdir -p "$dir"
  local up=(up --engine mocker --http-port "$PORT" --max-num-seqs "$seqs")
  local bench=(bench --url "http://127.0.0.1:$PORT" --model sluice-tiny --requests "$requests" --burst
    --isl-mean 128 --osl-mean 64 --priority-tiers "$tiers" --seed "$run" --timeout-secs 300 --no-progress)
  [ "$run" = 1 ] && echo "$name: sluice ${up[*]}; sluice ${bench[*]} --out DIR" >>"$OUT/commands"
  RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" "${up[@]}" >"$dir/server.log" 2>&1 &
  server_pid=$!
  wait_ready "http://127.0.0.1:$PORT" "$server_pid" "$dir/server.log"
  "$SLUICE_BIN" "${bench[@]}" --out "$dir" >"$dir/table.md" || true
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
}

for run in $(seq 1 "$RUNS"); do
  burst b80 "$run" 8 80 "0:1,3:1"
  burst b160 "$run" 4 160 "0:1,1:1,2:1,3:1"
done

python3 - "$OUT" "$RESULT" "$RUNS" <<'PY'
import json, sys, datetime
out, result, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = ["# First bursts into a fresh mesh, defaults", "",
         "Written by `tests/bench/queue/first_bursts.sh`; do not edit by hand.",
         f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; each run a fresh `sluice up` that has served nothing.", "",
         "Commands:", ""]
lines += [f"- `{l.strip()}`" for l in open(f"{out}/commands")]
lines += ["", "| burst | run | sent | refused | other failures | mean TTFT ms, priority 3 | priority 0 | 3 / 0 |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
ok = True
for name in ("b80", "b160"):
    for run in range(1, runs + 1):
        r = json.load(open(f"{out}/{name}/{run}/results.json"))
        tiers = {t["priority"]: t["stats"] if "stats" in t else t for t in r["tiers"]}
        o = r["overall"]
        refused = o["errors"].get("429", 0)
        other = o["failed"] - refused
        m3 = tiers[3]["ttft_ms"]["mean"] if tiers[3].get("ttft_ms") else float("nan")
        m0 = tiers[0]["ttft_ms"]["mean"] if tiers[0].get("ttft_ms") else float("nan")
        ok &= o["failed"] == 0 and m3 < m0
        lines.append(f"| {name[1:]} | {run} | {o['requests']} | {refused} | {other} | {m3:.0f} | {m0:.0f} | {m3 / m0:.2f} |")
lines += ["", f"Goal (0 refused, priority 3 ahead of priority 0, every run): **{'met' if ok else 'missed'}**."]
open(result, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
PY
