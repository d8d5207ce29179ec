#!/usr/bin/env bash
# Frontend overhead: requests/s and added latency through
# frontend -> queue -> router -> mocker worker at near-zero compute.
#
# `sluice up --engine mocker --speedup-ratio 1e6` makes every modelled engine
# step cost ~nothing, so what is left is the mesh itself: HTTP parsing,
# templating/tokenizing, the queue's Admit lease, the router's pick, the
# worker's Generate stream, detokenization and SSE. For each router mode
# (round-robin, kv) one server is started, warmed up, and driven by
# `sluice bench` (streaming /v1/completions, 8-token outputs with
# ignore_eos) as a closed loop of C clients for each C in CONCURRENCIES.
# "Added latency" is the e2e latency at C=1.
#
# The load generator runs on the same machine as the server and takes its
# share of the CPUs; the script reports the CPU seconds of both (from
# /proc/PID/stat and /usr/bin/time) so the split is visible.
#
# Writes tests/bench/results/frontend.md (unless RESULT= is set to another
# path) and raw results under OUT.
#
# Environment (defaults in brackets):
#   SLUICE_BIN      a built release `sluice` binary [builds target/release/sluice]
#   MODES ["round-robin kv"]  router modes
#   CONCURRENCIES ["1 16 64"]
#   REQUESTS [10000]  requests per case at C>1; C=1 runs REQUESTS_C1 [2000]
#   WARMUP [1000]   requests at C=16 before measuring, per server
#   ISL [32] OSL [8] WORKERS [2] SPEEDUP [1e6]
#   PORT [18493]    HTTP port for `sluice up`
#   SERVER_LOG [info]  RUST_LOG of the server (what a default `sluice up` logs)
#   OUT             raw results [target/bench/frontend]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
MODES=${MODES:-"round-robin kv"}
CONCURRENCIES=${CONCURRENCIES:-"1 16 64"}
REQUESTS=${REQUESTS:-10000}
REQUESTS_C1=${REQUESTS_C1:-2000}
WARMUP=${WARMUP:-1000}
ISL=${ISL:-32}
OSL=${OSL:-8}
WORKERS=${WORKERS:-2}
SPEEDUP=${SPEEDUP:-1e6}
PORT=${PORT:-18493}
SERVER_LOG=${SERVER_LOG:-info}
OUT=${OUT:-$ROOT/target/bench/frontend}
RESULT=${RESULT:-$ROOT/tests/bench/results/frontend.md}
TCK=$(getconf CLK_TCK)

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
mkdir -p "$OUT"
rm -f "$OUT/cases.tsv"

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

cpu_ticks() { # utime+stime of a process, in clock ticks
  awk '{ print $14 + $15 }' "/proc/$1/stat"
}

bench() { # out-dir, concurrency, requests; prints "user sys wall" of the client
  local dir=$1 c=$2 n=$3
  mkdir -p "$dir"
  /usr/bin/time -f "%U %S %e" -o "$dir/client_time" \
    "$SLUICE_BIN" bench --url "http://127.0.0.1:$PORT" --model sluice-tiny \
    --requests "$n" --burst --concurrency "$c" --isl-mean "$ISL" --osl-mean "$OSL" \
    --seed 1 --timeout-secs 300 --request-timeout-secs 30 --no-progress \
    --out "$dir" >"$dir/table.md"
}

for mode in $MODES; do
  sdir=$OUT/$mode
  if curl -s -o /dev/null "http://127.0.0.1:$PORT/"; then
    echo "port $PORT is already taken by another server; set PORT" >&2; exit 1
  fi
  rm -rf "$sdir"; mkdir -p "$sdir"
  RUST_LOG=$SERVER_LOG "$SLUICE_BIN" up --engine mocker --http-port "$PORT" \
    --workers "$WORKERS" --router-mode "$mode" --speedup-ratio "$SPEEDUP" \
    >"$sdir/server.log" 2>&1 &
  server_pid=$!
  wait_ready "http://127.0.0.1:$PORT" "$server_pid" "$sdir/server.log"
  echo "== $mode: warm-up ($WARMUP requests at C=16)"
  bench "$sdir/warmup" 16 "$WARMUP"
  for c in $CONCURRENCIES; do
    n=$REQUESTS; [ "$c" = 1 ] && n=$REQUESTS_C1
    dir=$sdir/c$c
    before=$(cpu_ticks "$server_pid")
    bench "$dir" "$c" "$n"
    after=$(cpu_ticks "$server_pid")
    read -r cu cs wall <"$dir/client_time"
    server_cpu=$(awk -v a="$after" -v b="$before" -v t="$TCK" 'BEGIN { printf "%.2f", (a - b) / t }')
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$c" "$n" "$server_cpu" \
      "$(awk -v u="$cu" -v s="$cs" 'BEGIN { printf "%.2f", u + s }')" "$wall" >>"$OUT/cases.tsv"
    echo "== $mode C=$c: server ${server_cpu} CPU-s, client $cu+$cs CPU-s, ${wall} s wall"
    grep -E '^\| (all|tier)' "$dir/table.md" | head -2 || true
  done
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
done

python3 - "$OUT" "$RESULT" <<EOF
import json, sys, datetime, subprocess
out, result = sys.argv[1], sys.argv[2]
rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/cases.tsv")]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
lines = []
w = lines.append
w("# Frontend overhead at near-zero compute")
w("")
w("Tables written by \`tests/bench/frontend/run.sh\`; only the notes after the marker at the end are by hand (the script keeps them).")
w("")
w(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, {cpus} CPUs (shared with the load generator).")
w(f"\`sluice up --engine mocker --workers $WORKERS --speedup-ratio $SPEEDUP --router-mode MODE\` (RUST_LOG=$SERVER_LOG),")
w(f"driven by \`sluice bench --burst --concurrency C --isl-mean $ISL --osl-mean $OSL\`: streaming \`/v1/completions\`,")
w(f"prompts of $ISL token ids, $OSL output tokens each (ignore_eos), a closed loop of C clients;")
w(f"$WARMUP warm-up requests per server first. e2e/TTFT are client-side wall clock (HTTP request to last SSE byte).")
w("CPU columns are CPU-seconds per 1,000 requests of the server process (frontend, queue, router, workers)")
w("and of the load generator; the load generator runs on the same CPUs.")
w("")
w("| router | C | requests | failed | req/s | e2e p50 ms | e2e p99 ms | TTFT p50 ms | TTFT p99 ms | server CPU-s/1k | client CPU-s/1k | client CPU share |")
w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for mode, c, n, scpu, ccpu, wall in rows:
    r = json.load(open(f"{out}/{mode}/c{c}/results.json"))["overall"]
    done = r["completed"]
    k = max(done, 1) / 1000
    e2e, ttft = r["e2e_ms"] or {}, r["ttft_ms"] or {}
    share = float(ccpu) / (float(scpu) + float(ccpu)) if float(scpu) + float(ccpu) > 0 else 0
    w(f"| {mode} | {c} | {n} | {r['failed']} | {r['request_throughput']:.0f} | {e2e.get('p50', float('nan')):.2f} | "
      f"{e2e.get('p99', float('nan')):.2f} | {ttft.get('p50', float('nan')):.2f} | {ttft.get('p99', float('nan')):.2f} | "
      f"{float(scpu) / k:.2f} | {float(ccpu) / k:.2f} | {share:.0%} |")
w("")
w("Raw results (results.json, requests.jsonl, server.log per case) are under \`target/bench/frontend/\`, not committed.")
MARK = "<!-- notes: kept by run.sh -->"
notes = ""
try:
    old = open(result).read()
    if MARK in old:
        notes = old[old.index(MARK) + len(MARK):]
except FileNotFoundError:
    pass
w("")
w(MARK)
open(result, "w").write("\n".join(lines) + (notes if notes else "\n"))
print("\n".join(lines))
EOF
