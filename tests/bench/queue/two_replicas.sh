#!/usr/bin/env bash
# Co-location through two queue replicas (issue 34): the queue bench's
# co-location experiment, but with the services as separate processes and
# etcd, as deploy/ runs them, and two `sluice queue` replicas behind the one
# frontend (it spreads leases over them round robin).
#
# One mocker decode worker with `--max-num-seqs 4`, every other flag at its
# default. Interactive priority-3 requests (INTERACTIVE of them, ISL 512,
# OSL 16) back to back, first on the idle mesh, then while BATCH_CONCURRENCY
# clients keep the worker busy with priority-0 work (ISL 512, OSL 256).
# Run with one queue, then two, in one sitting. Goal: loaded median TTFT
# <= 2x idle with two. Writes
# tests/bench/results/two_replicas.md with every command line; exits 1 when
# the goal is missed (the table is still written).
#
# Environment: SLUICE_BIN [builds target/release/sluice], INTERACTIVE [10],
# BATCH_CONCURRENCY [8], PORT [18451], OUT [target/bench/two_replicas].
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
INTERACTIVE=${INTERACTIVE:-10}
BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-8}
PORT=${PORT:-18451}
OUT=${OUT:-$ROOT/target/bench/two_replicas}
RESULT=$ROOT/tests/bench/results/two_replicas.md
URL=http://127.0.0.1:$PORT

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"

pids=()
etcd_dir=""
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
  [ -n "$etcd_dir" ] && rm -rf "$etcd_dir"
  return 0
}
trap cleanup EXIT

model=$OUT/sluice-tiny
"$SLUICE_BIN" model init --out "$model" >/dev/null
: >"$OUT/commands"

mesh() { # number of queue replicas: starts etcd and the services
  local queues=$1 client peer
  etcd_dir=$(mktemp -d)
  # etcd on two free loopback ports (it cannot report a port bound to :0).
  read -r client peer < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')
  etcd --data-dir "$etcd_dir" --listen-client-urls "http://127.0.0.1:$client" \
    --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
    >"$OUT/q$queues.etcd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$client/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  common=(--etcd "http://127.0.0.1:$client" --namespace colo)
  start() { # log name, then the role and its flags
    local log=$1; shift
    echo "$queues queue(s): sluice $*" >>"$OUT/commands"
    RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" "$@" "${common[@]}" >"$OUT/q$queues.$log.log" 2>&1 &
    pids+=($!)
  }
  start router router --listen 127.0.0.1:0
  for i in $(seq 1 "$queues"); do start "queue-$i" queue --listen 127.0.0.1:0; done
  start decode decode --listen 127.0.0.1:0 --engine mocker --model "$model" --max-num-seqs 4
  start frontend frontend --listen "127.0.0.1:$PORT" --model "$model"
  wait_ready "$URL" "${pids[-1]}" "$OUT/q$queues.frontend.log"
}

interactive() { # out dir, seed (a seed of its own per phase: no prompt is cached)
  echo "sluice bench --url URL --model sluice-tiny --requests $INTERACTIVE --burst --concurrency 1 --isl-mean 512 --osl-mean 16 --priority-tiers 3:1 --seed $2" >>"$OUT/commands"
  "$SLUICE_BIN" bench --url "$URL" --model sluice-tiny --requests "$INTERACTIVE" --burst \
    --concurrency 1 --isl-mean 512 --osl-mean 16 --priority-tiers "3:1" --seed "$2" \
    --timeout-secs 300 --no-progress --out "$1" >"$1.txt"
}

for queues in 1 2; do
  mesh "$queues"
  mkdir -p "$OUT/q$queues"
  # Warm-up: the first requests teach the queues the workers' lease times.
  interactive "$OUT/q$queues/warmup" 5
  interactive "$OUT/q$queues/idle" 1
  echo "sluice bench --url URL --model sluice-tiny --requests 100000 --burst --concurrency $BATCH_CONCURRENCY --isl-mean 512 --osl-mean 256 --priority-tiers 0:1 --seed 2 (stopped after the interactive run)" >>"$OUT/commands"
  "$SLUICE_BIN" bench --url "$URL" --model sluice-tiny --requests 100000 --burst \
    --concurrency "$BATCH_CONCURRENCY" --isl-mean 512 --osl-mean 256 --priority-tiers "0:1" \
    --seed 2 --timeout-secs 300 --no-progress >"$OUT/q$queues.batch.log" 2>&1 &
  pids+=($!)
  # The batch load fills the worker's slots: wait on its running sequences,
  # not on a clock.
  for _ in $(seq 1 100); do
    running=$(curl -s "$URL/metrics" 2>/dev/null | awk '/^sluice_worker_running_sequences/ {s += $2} END {print s + 0}')
    [ "${running:-0}" -ge 4 ] && break
    sleep 0.1
  done
  interactive "$OUT/q$queues/loaded" 3
  cleanup
done

python3 - "$OUT" "$RESULT" <<'PY'
import json, sys, datetime
out, result = sys.argv[1], sys.argv[2]
def ttft(case):
    recs = [json.loads(l) for l in open(f"{out}/{case}/requests.jsonl")]
    return sorted(r["ttft_ms"] for r in recs if r["error"] is None), sum(r["error"] is not None for r in recs)
p50 = lambda v: v[len(v) // 2]
commands = [l.strip().replace("URL", "http://127.0.0.1:PORT") for l in open(f"{out}/commands")]
lines = [
    "# Co-location through two queue replicas (separate processes)", "",
    "Written by `tests/bench/queue/two_replicas.sh`; do not edit by hand.",
    f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on a shared 2-core machine.", "",
    "etcd, one router, one or two queue replicas, one mocker decode worker (`--max-num-seqs 4`) and a",
    "frontend, each its own process on loopback, every flag not listed at its default. With two, the",
    "frontend spreads leases over both queues, so batch and interactive requests land on both, and each",
    "queue counts the other's placements against the worker's slots. Interactive priority-3 requests",
    "back to back, idle and then beside 8 closed-loop priority-0 clients; each phase its own prompts.", "",
    "Commands, in order:", "", *[f"- `{c}`" for c in commands], "",
    "| queues | load | TTFT ms p50 | mean | max | x idle (p50) | failed |",
    "|---:|---|---:|---:|---:|---:|---:|",
]
ratio = {}
failed = 0
for q in (1, 2):
    idle, fi = ttft(f"q{q}/idle")
    loaded, fl = ttft(f"q{q}/loaded")
    failed += fi + fl
    ratio[q] = p50(loaded) / p50(idle)
    for name, v, f in (("idle", idle, fi), ("8 batch clients (priority 0)", loaded, fl)):
        lines.append(f"| {q} | {name} | {p50(v):.0f} | {sum(v) / len(v):.0f} | {max(v):.0f} | {p50(v) / p50(idle):.2f}x | {f} |")
met = ratio[2] <= 2.0 and failed == 0
lines += ["", f"Goal (issue 34): loaded median TTFT <= 2x idle through two queue replicas: "
          f"{ratio[2]:.2f}x (one queue, same sitting: {ratio[1]:.2f}x), {'met' if met else '**missed**'}."]
open(result, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if met else 1)
PY
