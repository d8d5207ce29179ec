#!/usr/bin/env bash
# The field's priority experiment, reproduced with the mocker engine.
#
# A burst of 1,005 requests at t=0 in four priority tiers (0..3, equal
# weights, shuffled), 310 output tokens each (ignore_eos), against one mocker
# worker with max_num_seqs 64, run four times:
#   engine-fcfs  engine priority off (A/B of --scheduling-policy): the queue
#             on its defaults still releases by priority
#   defaults  no flag: engine priority, default holding
#   queue     priority in the queue only (A/B): --queue-threshold set,
#             --queue-policy strict, --scheduling-policy fcfs
#   both      threshold + strict queue on top of the defaults
# and writes the per-tier TTFT table to tests/bench/results/ttft_by_priority.md.
# Higher priority should mean lower TTFT in every case (priority is on in
# the queue or the engine or both); the script checks it and exits 1 when a
# check fails (the table is still written). No case turns priority off
# everywhere: the queue's default holding orders by priority, and only
# the one flag that turns default holding off (no user sets it) would undo it.
#
# Environment (defaults in brackets):
#   SLUICE_BIN      a built `sluice` binary [builds target/release/sluice]
#   REQUESTS [1005] ISL [128] OSL [310] MAX_NUM_SEQS [64]
#   SPEEDUP [8]     mocker --speedup-ratio; the mocker's timing model divided
#                   by this, so the whole script fits in minutes on 2 cores
#   THRESHOLD [0.5] --queue-threshold for the queue cases
#   PORT [18431]    HTTP port for `sluice up`
#   OUT             raw results per case [target/bench/priority]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
REQUESTS=${REQUESTS:-1005}
ISL=${ISL:-128}
OSL=${OSL:-310}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
SPEEDUP=${SPEEDUP:-8}
THRESHOLD=${THRESHOLD:-0.5}
PORT=${PORT:-18431}
TIERS="0:1,1:1,2:1,3:1"
OUT=${OUT:-$ROOT/target/bench/priority}
RESULT=$ROOT/tests/bench/results/ttft_by_priority.md
# KV blocks (16 tokens) for every running sequence's prompt and output, so
# the experiment measures admission order, not preemption.
BLOCKS=$(( (MAX_NUM_SEQS * (ISL + OSL) / 16) * 2 + 256 ))

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
mkdir -p "$OUT"
started=$(date +%s)

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

run_case() { # name, then the extra `sluice up` flags
  local name=$1; shift
  local dir=$OUT/$name
  rm -rf "$dir"; mkdir -p "$dir"
  RUST_LOG=${RUST_LOG:-warn,h2::proto::connection=debug} "$SLUICE_BIN" up --engine mocker --http-port "$PORT" \
    --max-num-seqs "$MAX_NUM_SEQS" --num-gpu-blocks "$BLOCKS" \
    --speedup-ratio "$SPEEDUP" "$@" >"$dir/server.log" 2>&1 &
  server_pid=$!
  wait_ready "http://127.0.0.1:$PORT" "$server_pid" "$dir/server.log"
  echo "sluice up --engine mocker --http-port $PORT --max-num-seqs $MAX_NUM_SEQS --num-gpu-blocks $BLOCKS --speedup-ratio $SPEEDUP $*" >"$dir/command"
  echo "== $name: sluice up $*"
  "$SLUICE_BIN" bench --url "http://127.0.0.1:$PORT" --model sluice-tiny \
    --requests "$REQUESTS" --burst --isl-mean "$ISL" --osl-mean "$OSL" \
    --priority-tiers "$TIERS" --seed 1 --timeout-secs 300 --out "$dir" | tee "$dir/table.md"
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
}

run_case engine-fcfs --scheduling-policy fcfs
run_case defaults
run_case queue --queue-threshold "$THRESHOLD" --queue-policy strict --scheduling-policy fcfs
run_case both --queue-threshold "$THRESHOLD" --queue-policy strict
elapsed=$(( $(date +%s) - started ))

python3 - "$OUT" "$RESULT" "$elapsed" <<EOF
import json, sys
out, result, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = [("engine-fcfs", "default", "off"), ("defaults", "default", "on"), ("queue", "on", "off"), ("both", "on", "on")]
res = {c: json.load(open(f"{out}/{c}/results.json")) for c, _, _ in cases}
def tier(c, p):
    return next(t for t in res[c]["tiers"] if t["priority"] == p)
prios = sorted({t["priority"] for t in res["defaults"]["tiers"]}, reverse=True)
lines = []
w = lines.append
w("# TTFT by priority: the field experiment on the mocker")
w("")
w("Written by \`tests/bench/priority/run.sh\`; do not edit by hand.")
w("")
w(f"A burst of $REQUESTS requests at t=0, four priority tiers ($TIERS, priority:weight, shuffled),")
w(f"prompts of $ISL token ids, $OSL output tokens each (\`ignore_eos\`), one mocker worker with")
w(f"\`--max-num-seqs $MAX_NUM_SEQS --num-gpu-blocks $BLOCKS --speedup-ratio $SPEEDUP\` (every modelled duration")
w(f"divided by $SPEEDUP so the four runs fit in minutes on 2 cores). TTFTs below are wall-clock ms at that")
w(f"speed-up; the machine's own overhead (HTTP, gRPC, 1,005 streams on 2 cores) is not divided, so they")
w(f"are not exactly 1/$SPEEDUP of the modelled times. \"defaults\" is \`sluice up\` with no flag: the engine")
w("schedules by priority (admits the highest first, preempts the lowest) and the queue holds by engine slots,")
w(f"counting only equal or higher priorities. \"queue\" is \`--queue-threshold $THRESHOLD --queue-policy strict\` with the")
w("engine at fcfs; \"engine-fcfs\" turns only the engine's priority off (\`--scheduling-policy fcfs\`), the queue on its defaults.")
w("")
w("Command lines (each case a fresh \`sluice up\`, then the same \`sluice bench\`):")
w("")
for c, _, _ in cases:
    w(f"- {c}: \`" + open(f"{out}/{c}/command").read().strip() + "\`")
w(f"- bench: \`sluice bench --url http://127.0.0.1:$PORT --model sluice-tiny --requests $REQUESTS --burst --isl-mean $ISL --osl-mean $OSL --priority-tiers $TIERS --seed 1 --timeout-secs 300\`")
w(f"Four runs took {elapsed} s in all, including start-up.")
w("")
w("## Mean TTFT (ms) per tier")
w("")
w("| priority | " + " | ".join(f"{c} (queue {q}, engine {e})" for c, q, e in cases) + " |")
w("|---:|" + "---:|" * len(cases))
for p in prios:
    w(f"| {p} | " + " | ".join(f"{tier(c, p)['ttft_ms']['mean']:.0f}" for c, _, _ in cases) + " |")
w("")
w("## p90 TTFT (ms) per tier")
w("")
w("| priority | " + " | ".join(c for c, _, _ in cases) + " |")
w("|---:|" + "---:|" * len(cases))
for p in prios:
    w(f"| {p} | " + " | ".join(f"{tier(c, p)['ttft_ms']['p90']:.0f}" for c, _, _ in cases) + " |")
w("")
w("## Checks")
w("")
ok = True
for c, q, e in cases:
    means = [tier(c, p)["ttft_ms"]["mean"] for p in prios]  # highest priority first
    ratio = means[-1] / means[0]
    fails = res[c]["overall"]["failed"]
    done = res[c]["overall"]["completed"]
    if q != "off" or e == "on":
        good = all(a < b for a, b in zip(means, means[1:])) and ratio >= 2.0
        want = "gradient: TTFT rises strictly as priority falls, lowest/highest >= 2"
    else:
        good = 0.67 <= ratio <= 1.5
        want = "no gradient: lowest/highest within 0.67..1.5"
    good = good and fails == 0
    ok &= good
    w(f"- {c}: lowest/highest-priority mean TTFT = {ratio:.2f}; {done} completed, {fails} failed; "
      f"{res[c]['duration_s']:.1f} s, {res[c]['overall']['output_token_throughput']:.0f} output tok/s. "
      f"Expected {want}: **{'yes' if good else 'NO'}**")
w("")
w("Raw results (results.json, requests.jsonl, ttft_by_tier.png per case) are written under")
w("\`target/bench/priority/\` by the script and not committed.")
open(result, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
EOF
