#!/usr/bin/env bash
# The mesh's own cost per request at near-zero compute, through the services
# a user runs, with a client someone else wrote (wrk).
#
# Two meshes, each with one mocker worker whose modelled engine steps cost
# ~nothing (`--speedup-ratio 1e6`), so what is left is the mesh itself:
#   up     `sluice up`: frontend, queue, router and worker in one process,
#          calling each other without sockets
#   procs  the same services as separate processes on loopback, found
#          through a real etcd, talking gRPC
# For each router mode and each concurrency C, wrk drives streaming chat
# completions (about 17 prompt tokens, OSL output tokens, ignore_eos) as a
# closed loop of C connections for DUR seconds, after a warm-up; the CPU
# time of every mesh process over the run gives CPU ms per request. At C=1,
# `sluice bench` adds TTFT and e2e p50/p99 (streaming, client-side clocks).
#
# Same sitting: with DYNAMO_BENCH set to NVIDIA Dynamo's overhead script
# (it runs Dynamo 1.6.1's frontend and mocker with the same wrk request),
# it runs first and its summary table is copied in beside ours.
#
# Writes tests/bench/results/frontend.md (RESULT=- prints only) and raw
# results under OUT. Needs `wrk` (apt-get install wrk) and, for procs,
# `etcd` (make deps installs it).
#
# Environment (defaults in brackets):
#   SLUICE_BIN   a built release `sluice` [builds target/release/sluice]
#   MESHES ["up procs"]  MODES ["round-robin kv"]  CONCS ["1 16 64 256"]
#   DUR [10] seconds per point   WARMUP [3] seconds at C=16 per server
#   ROUNDS [2] sweeps of CONCS per server, interleaved (16 64 256 16 64 256 …),
#          so a comparison between concurrencies is not one noisy point each
#   OSL [8]  PORT [18493]  OUT [target/bench/frontend]
#   DYNAMO_BENCH  path of Dynamo's bench_overhead.sh (optional)
#   FLOOR [1]    also run `tests/examples/grpc_floor.rs` (a bare gRPC ping-pong
#                between two processes: what one crossing costs at the least)
#                and write its table beside the meshes'; GRPC_FLOOR_BIN a built one
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
MESHES=${MESHES:-"up procs"}
MODES=${MODES:-"round-robin kv"}
CONCS=${CONCS:-"1 16 64 256"}
DUR=${DUR:-10}
ROUNDS=${ROUNDS:-2}
WARMUP=${WARMUP:-3}
OSL=${OSL:-8}
PORT=${PORT:-18493}
OUT=${OUT:-$ROOT/target/bench/frontend}
RESULT=${RESULT:-$ROOT/tests/bench/results/frontend.md}
HERE=$ROOT/tests/bench/frontend
TCK=$(getconf CLK_TCK)
command -v wrk >/dev/null || { echo "wrk is required: apt-get install wrk" >&2; exit 1; }

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"
MODEL=$OUT/sluice-tiny
"$SLUICE_BIN" model init --out "$MODEL" >/dev/null

if [ -n "${DYNAMO_BENCH:-}" ]; then
  echo "== Dynamo (same sitting): $DYNAMO_BENCH"
  CONCS="$CONCS" DUR=$DUR OSL=$OSL AIPERF_CONCS="" NOSTREAM_CONCS="" MODES="$MODES" SUMMARY_DIR=$OUT/dynamo \
    bash "$DYNAMO_BENCH" >"$OUT/dynamo.log" 2>&1 || echo "Dynamo's bench failed; see $OUT/dynamo.log"
fi

pids=()       # name=pid of every process of the running mesh
cleanup() {
  for np in "${pids[@]}"; do kill "${np#*=}" 2>/dev/null || true; done
  for np in "${pids[@]}"; do wait "${np#*=}" 2>/dev/null || true; done
  pids=()
}
trap cleanup EXIT

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }

start_up() { # mode
  "$SLUICE_BIN" up --model "$MODEL" --engine mocker --speedup-ratio 1e6 --workers 1 \
    --max-num-seqs 4096 --router-mode "$1" --http-port "$PORT" >"$2/up.log" 2>&1 &
  pids=("up=$!")
}

start_procs() { # mode, dir
  local mode=$1 dir=$2 cport pport url
  cport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  pport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  url=http://127.0.0.1:$cport
  etcd --name bench --data-dir "$dir/etcd" --listen-client-urls "$url" --advertise-client-urls "$url" \
    --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
    --initial-cluster "bench=http://127.0.0.1:$pport" >"$dir/etcd.log" 2>&1 &
  pids=("etcd=$!")
  for _ in $(seq 50); do curl -sf "$url/health" >/dev/null && break; sleep 0.1; done
  local common=(--etcd "$url" --namespace bench --listen 127.0.0.1:0)
  "$SLUICE_BIN" router "${common[@]}" --router-mode "$mode" >"$dir/router.log" 2>&1 &
  pids+=("router=$!")
  "$SLUICE_BIN" queue "${common[@]}" >"$dir/queue.log" 2>&1 &
  pids+=("queue=$!")
  "$SLUICE_BIN" decode "${common[@]}" --model "$MODEL" --engine mocker --speedup-ratio 1e6 \
    --max-num-seqs 4096 >"$dir/decode.log" 2>&1 &
  pids+=("decode=$!")
  "$SLUICE_BIN" frontend --etcd "$url" --namespace bench --listen "127.0.0.1:$PORT" \
    --model "$MODEL" >"$dir/frontend.log" 2>&1 &
  pids+=("frontend=$!")
}

wait_listed() { # dir
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q sluice-tiny && return 0
    sleep 0.2
  done
  echo "mesh never ready; logs in $1" >&2; exit 1
}

wrk_run() { # conc, seconds
  WRK_MODEL=sluice-tiny WRK_MAX_TOKENS=$OSL wrk -t1 -c"$1" -d"$2s" --latency -s "$HERE/wrk_chat.lua" \
    "http://127.0.0.1:$PORT/v1/chat/completions" | sed -n 's/^WRKJSON //p'
}

: >"$OUT/points.jsonl"
for mesh in $MESHES; do
  for mode in $MODES; do
    dir=$OUT/$mesh-$mode; mkdir -p "$dir"
    "start_$mesh" "$mode" "$dir"
    wait_listed "$dir"
    wrk_run 16 "$WARMUP" >/dev/null
    for round in $(seq "$ROUNDS"); do for c in $CONCS; do
      declare -A before=()
      for np in "${pids[@]}"; do before[${np%%=*}]=$(cpu_ticks "${np#*=}"); done
      line=$(wrk_run "$c" "$DUR")
      cpu="{"
      for np in "${pids[@]}"; do
        name=${np%%=*}; after=$(cpu_ticks "${np#*=}")
        cpu+="\"$name\": $(( after - before[$name] )),"
      done
      cpu="${cpu%,}}"
      echo "{\"mesh\":\"$mesh\",\"mode\":\"$mode\",\"c\":$c,\"round\":$round,\"wrk\":$line,\"ticks\":$cpu}" >>"$OUT/points.jsonl"
      echo "== $mesh $mode C=$c round $round: $line"
    done; done
    # TTFT and e2e at C=1 with a streaming client that reads each chunk.
    "$SLUICE_BIN" bench --url "http://127.0.0.1:$PORT" --model sluice-tiny --endpoint chat \
      --requests 2000 --burst --concurrency 1 --isl-mean 17 --osl-mean "$OSL" --seed 1 \
      --timeout-secs 120 --no-progress --out "$dir/c1" >/dev/null
    cleanup
  done
done

if [ "${FLOOR:-1}" = 1 ]; then
  if [ -z "${GRPC_FLOOR_BIN:-}" ]; then
    cargo build --release -p sluice-tests --example grpc_floor
    GRPC_FLOOR_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/grpc_floor
  fi
  echo "== the floor of one gRPC crossing"
  "$GRPC_FLOOR_BIN" 30000 3 | tee "$OUT/floor.md"
fi

python3 - "$OUT" "$RESULT" "$TCK" "$MESHES" "$MODES" "$CONCS" "$DUR" "$OSL" "$ROUNDS" <<'EOF'
import json, sys, datetime, subprocess, os, glob
out, result, tck, meshes, modes, concs, dur, osl, rounds = sys.argv[1:10]
rounds = int(rounds)
tck = int(tck)
points = [json.loads(l) for l in open(f"{out}/points.jsonl")]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
L = []
w = L.append
w("# The mesh's own cost per request (near-zero compute)")
w("")
w(f"Written by `tests/bench/frontend/run.sh` ({now}, commit {commit}, {os.cpu_count()} CPUs shared with the client):")
w(f'`MESHES="{meshes}" MODES="{modes}" CONCS="{concs}" DUR={dur} ROUNDS={rounds} OSL={osl} tests/bench/frontend/run.sh`.')
w("")
w("One mocker worker at `--speedup-ratio 1e6`; `up` = `sluice up` (one process), `procs` = router, queue,")
w("decode worker and frontend as separate processes with etcd on loopback. wrk: streaming chat, ~17 prompt")
w(f"tokens, {osl} output tokens (ignore_eos), a closed loop of C connections for {dur} s after a warm-up;")
w("latency is wrk's (request to last byte). CPU ms per request: the mesh's processes' CPU time over the run")
w("(etcd included for procs) divided by the requests served; the client's own CPU is not counted.")
if rounds > 1:
    w(f"Each server ran {rounds} sweeps of the concurrencies in turn ({concs}, then again); a row gives")
    w("the mean over its sweeps, req/s per sweep in brackets.")
w("")
w("| mesh | router | C | req/s | p50 ms | p99 ms | errors | CPU ms/req | per process |")
w("|---|---|---:|---:|---:|---:|---:|---:|---|")
groups = {}
for p in points:
    groups.setdefault((p["mesh"], p["mode"], p["c"]), []).append(p)
mean = lambda xs: sum(xs) / len(xs)
for (mesh, mode, c), ps in groups.items():
    rps = [p["wrk"]["rps"] for p in ps]
    pers = []
    for p in ps:
        n = max(1, p["wrk"]["requests"])
        pers.append({k: v / tck * 1000 / n for k, v in p["ticks"].items()})
    per = {k: mean([q[k] for q in pers]) for k in pers[0]}
    total = sum(per.values())
    detail = ", ".join(f"{k} {v:.2f}" for k, v in per.items()) if len(per) > 1 else ""
    each = f" ({' / '.join(f'{x:.0f}' for x in rps)})" if len(rps) > 1 else ""
    p50 = mean([p["wrk"]["lat_p50_ms"] for p in ps]); p99 = mean([p["wrk"]["lat_p99_ms"] for p in ps])
    errors = sum(p["wrk"]["errors"] for p in ps)
    w(f"| {mesh} | {mode} | {c} | {mean(rps):.0f}{each} | {p50:.2f} | {p99:.2f} | {errors} | {total:.2f} | {detail} |")
w("")
w("At C=1, `sluice bench --endpoint chat --concurrency 1` (2,000 streaming requests):")
w("")
w("| mesh | router | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |")
w("|---|---|---:|---:|---:|---:|")
for mesh in meshes.split():
    for mode in modes.split():
        f = f"{out}/{mesh}-{mode}/c1/results.json"
        if not os.path.exists(f):
            continue
        o = json.load(open(f))["overall"]
        t, e = o.get("ttft_ms") or {}, o.get("e2e_ms") or {}
        w(f"| {mesh} | {mode} | {t.get('p50', float('nan')):.2f} | {t.get('p99', float('nan')):.2f} | {e.get('p50', float('nan')):.2f} | {e.get('p99', float('nan')):.2f} |")
dyn = sorted(glob.glob(f"{out}/dynamo/overhead_SUMMARY_*.md"))
if dyn:
    w("")
    w("NVIDIA Dynamo 1.6.1 (frontend + mocker, same wrk request), run first in this sitting:")
    w("")
    L.extend(l.rstrip("\n") for l in open(dyn[-1]) if l.startswith("|"))
if os.path.exists(f"{out}/floor.md"):
    w("")
    w("The floor of one gRPC crossing, same sitting (`tests/examples/grpc_floor.rs`: a bidirectional stream")
    w("between two processes on loopback, each message of ~150 bytes echoed straight back, nothing but tonic;")
    w("the runtime flavour is both ends'; `current` = one thread, `1`/`2` = tokio's multi-thread runtime):")
    w("")
    L.extend(l.rstrip("\n") for l in open(f"{out}/floor.md") if l.startswith("|"))
MARK = "<!-- notes: kept by run.sh -->"
notes = ""
if os.path.exists(result):
    old = open(result).read()
    if MARK in old:
        notes = old[old.index(MARK) + len(MARK):]
w("")
w(MARK)
text = "\n".join(L) + (notes if notes else "\n")
print(text)
if result != "-":
    open(result, "w").write(text)
EOF
