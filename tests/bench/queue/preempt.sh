#!/usr/bin/env bash
# Issue 17, preemption that keeps the victim's work: the priority cases of
# run.sh measured with two builds in one sitting, RUNS times, and the
# worker's own preemption counters read from its metrics port.
#
# Cases (the same workloads and flags as run.sh):
#   colo-idle, colo-loaded: 1 mocker worker, --max-num-seqs 4, engine
#     priority; INTERACTIVE priority-3 requests back to back, alone and
#     beside a closed loop of BATCH_CONCURRENCY priority-0 batch clients.
#     Goal: loaded median TTFT <= 2x idle.
#   burst-off, burst-engine, burst-nopreempt: REQUESTS requests at t=0 in
#     four priority tiers on 2 mocker workers (--max-num-seqs 16); priority
#     off, engine --scheduling-policy priority, and the same with
#     --no-preempt-on-seq-limit (for comparison).
#     Goal: tier-3/tier-0 mean-TTFT ratio <= 0.15 and output throughput no
#     lower than the same build's priority-off run of the same round.
# Every run runs every case with both builds; which build goes first
# alternates from run to run.
#
# From each worker's /metrics (its gRPC port, found in the server log):
# sluice_worker_preemptions_total and sluice_worker_recomputed_tokens_total,
# read once the measured requests are done (for colo, while the batch load
# still runs).
#
# Writes the section between the `preempt.sh` markers of
# tests/bench/results/queue.md (appending it when absent; run.sh keeps it).
#
# Environment (defaults in brackets):
#   BEFORE_BIN      the baseline `sluice` (required)
#   AFTER_BIN       the build under test [builds target/release/sluice]
#   BEFORE_LABEL, AFTER_LABEL  how the table names them [before, after]
#   RUNS [3]  REQUESTS [400] ISL [512] OSL [64] SPEEDUP [2]
#   BATCH_CONCURRENCY [8] BATCH_ISL [512] BATCH_OSL [256]
#   INTERACTIVE [10] INTERACTIVE_ISL [512] INTERACTIVE_OSL [16]
#   PORT [18441]  OUT [target/bench/preempt]
#   UP_FLAGS  flags for every `sluice up` [none: defaults]
set -euo pipefail
UP_FLAGS=${UP_FLAGS-}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
: "${BEFORE_BIN:?set BEFORE_BIN to the baseline sluice binary}"
BEFORE_LABEL=${BEFORE_LABEL:-before}
AFTER_LABEL=${AFTER_LABEL:-after}
RUNS=${RUNS:-3}
REQUESTS=${REQUESTS:-400}
ISL=${ISL:-512}
OSL=${OSL:-64}
SPEEDUP=${SPEEDUP:-2}
BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-8}
BATCH_ISL=${BATCH_ISL:-512}
BATCH_OSL=${BATCH_OSL:-256}
INTERACTIVE=${INTERACTIVE:-10}
INTERACTIVE_ISL=${INTERACTIVE_ISL:-512}
INTERACTIVE_OSL=${INTERACTIVE_OSL:-16}
PORT=${PORT:-18441}
TIERS="0:1,1:1,2:1,3:1"
URL="http://127.0.0.1:$PORT"
OUT=${OUT:-$ROOT/target/bench/preempt}
RESULT=$ROOT/tests/bench/results/queue.md

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
if [ -z "${AFTER_BIN:-}" ]; then
  ensure_sluice_bin
  AFTER_BIN=$SLUICE_BIN
fi
rm -rf "$OUT"; mkdir -p "$OUT"
started=$(date +%s)

server_pid=""
batch_pid=""
cleanup() {
  if [ -n "$batch_pid" ]; then kill -9 "$batch_pid" 2>/dev/null || true; wait "$batch_pid" 2>/dev/null || true; fi
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

start_server() { # binary, log file, then the `sluice up` flags
  local bin=$1 log=$2; shift 2
  # sluice_runtime=info logs each service's endpoint ("serving").
  # shellcheck disable=SC2086 # UP_FLAGS is a list of flags
  RUST_LOG=warn,sluice_runtime=info "$bin" up --engine mocker --http-port "$PORT" $UP_FLAGS "$@" >"$log" 2>&1 &
  server_pid=$!
  wait_ready "$URL" "$server_pid" "$log"
}

stop_server() {
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
}

scrape_workers() { # server log, out file: every decode worker's preemption series
  local log=$1 out=$2 ep
  : >"$out"
  # The log may be coloured: strip the escapes before matching.
  for ep in $(sed -E 's/\x1b\[[0-9;]*m//g' "$log" | grep 'serving component=decode' \
      | sed -E 's/.*endpoint=([^ ]+).*/\1/'); do
    ep=${ep#http://}
    curl -sf "http://$ep/metrics" \
      | grep -E '^sluice_worker_(preemptions_total|recomputed_tokens_total)' >>"$out" || true
  done
}

bench() { # binary, out dir, then `sluice bench` flags
  local bin=$1 dir=$2; shift 2
  "$bin" bench --url "$URL" --model sluice-tiny --seed 1 --timeout-secs 300 --no-progress \
    --out "$dir" "$@" >"$dir/table.md"
}

colo_case() { # binary, dir, idle|loaded
  local bin=$1 dir=$2 load=$3
  mkdir -p "$dir/interactive"
  start_server "$bin" "$dir/server.log" --workers 1 --max-num-seqs 4 --speedup-ratio 1 \
    --scheduling-policy priority
  if [ "$load" = loaded ]; then
    "$bin" bench --url "$URL" --model sluice-tiny \
      --requests 100000 --burst --concurrency "$BATCH_CONCURRENCY" --isl-mean "$BATCH_ISL" \
      --osl-mean "$BATCH_OSL" --priority-tiers "0:1" --seed 2 --timeout-secs 300 \
      --no-progress >"$dir/batch.log" 2>&1 &
    batch_pid=$!
    sleep 2
    kill -0 "$batch_pid" 2>/dev/null || { echo "batch load died:"; cat "$dir/batch.log"; exit 1; }
  fi
  bench "$bin" "$dir/interactive" --requests "$INTERACTIVE" --burst --concurrency 1 \
    --isl-mean "$INTERACTIVE_ISL" --osl-mean "$INTERACTIVE_OSL" --priority-tiers "3:1"
  scrape_workers "$dir/server.log" "$dir/metrics.txt"
  if [ -n "$batch_pid" ]; then
    kill -9 "$batch_pid" 2>/dev/null || true; wait "$batch_pid" 2>/dev/null || true; batch_pid=""
  fi
  stop_server
}

burst_case() { # binary, dir, then the extra `sluice up` flags
  local bin=$1 dir=$2; shift 2
  mkdir -p "$dir"
  start_server "$bin" "$dir/server.log" --workers 2 --max-num-seqs 16 --speedup-ratio "$SPEEDUP" "$@"
  bench "$bin" "$dir" --requests "$REQUESTS" --burst --isl-mean "$ISL" --osl-mean "$OSL" \
    --priority-tiers "$TIERS"
  scrape_workers "$dir/server.log" "$dir/metrics.txt"
  stop_server
}

run_build() { # run, label, binary
  local run=$1 label=$2 bin=$3 d=$OUT/$1/$2
  echo "== run $run, $label: colo idle, colo loaded, burst off, burst engine, burst engine-nopreempt"
  colo_case "$bin" "$d/colo-idle" idle
  colo_case "$bin" "$d/colo-loaded" loaded
  burst_case "$bin" "$d/burst-off"
  burst_case "$bin" "$d/burst-engine" --scheduling-policy priority
  burst_case "$bin" "$d/burst-nopreempt" --scheduling-policy priority --no-preempt-on-seq-limit
}

for run in $(seq 1 "$RUNS"); do
  if [ $((run % 2)) = 1 ]; then
    run_build "$run" before "$BEFORE_BIN"; run_build "$run" after "$AFTER_BIN"
  else
    run_build "$run" after "$AFTER_BIN"; run_build "$run" before "$BEFORE_BIN"
  fi
done
elapsed=$(( $(date +%s) - started ))

python3 - "$OUT" "$RESULT" "$elapsed" "$RUNS" "$BEFORE_LABEL" "$AFTER_LABEL" <<EOF
import json, os, re, sys, datetime
out, result, elapsed, runs, labels = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), {"before": sys.argv[5], "after": sys.argv[6]}
def load(run, build, case, sub=""):
    return json.load(open(os.path.join(out, str(run), build, case, sub, "results.json")))
def metrics(run, build, case):
    pre = rec = 0
    for line in open(os.path.join(out, str(run), build, case, "metrics.txt")):
        name, value = line.rsplit(" ", 1)
        if name.startswith("sluice_worker_preemptions_total"):
            pre += float(value)
        elif name.startswith("sluice_worker_recomputed_tokens_total"):
            rec += float(value)
    return int(pre), int(rec)
def per(p, r):
    return f"{r / p:.1f}" if p else "-"
def tier(r, p):
    return next(t for t in r["tiers"] if t["priority"] == p)["ttft_ms"]["mean"]
def thr(r):
    return r["overall"]["output_token_throughput"]
lines = []
w = lines.append
w("<!-- preempt.sh: begin (written by tests/bench/queue/preempt.sh; run.sh keeps it) -->")
w("## 3. Preemption that keeps the victim's work (issue 17): before and after")
w("")
w(f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {elapsed} s in all, by \`tests/bench/queue/preempt.sh\`:")
w(f"{runs} runs; each run runs every case with both builds (which goes first alternates), every case a fresh")
w(f"\`sluice up --engine mocker\`. {labels['before']} = \`$BEFORE_BIN\`, {labels['after']} = \`$AFTER_BIN\`.")
w("Preemptions and recomputed tokens are the workers' own \`sluice_worker_preemptions_total\` and")
w("\`sluice_worker_recomputed_tokens_total\`, read from each worker's metrics port when the measured requests are done.")
w("")
w("### Co-location, interactive requests back to back")
w("")
w("As in section 2 (\`--scheduling-policy priority\`, 1 worker, \`--max-num-seqs 4\`, speed-up 1): $INTERACTIVE priority-3")
w("requests one at a time ($INTERACTIVE_ISL-id prompts, $INTERACTIVE_OSL tokens), idle and beside $BATCH_CONCURRENCY priority-0 batch clients")
w("($BATCH_ISL-id prompts, $BATCH_OSL tokens). Goal: loaded median TTFT <= 2x idle.")
w("")
w("| run | build | idle p50 ms | loaded p50 ms | loaded mean | loaded p90 | x idle (p50) | preemptions | recomputed tokens | per preemption | failed |")
w("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
verdict = {}
for b in ("before", "after"):
    for run in range(1, runs + 1):
        i = load(run, b, "colo-idle", "interactive")["overall"]
        l = load(run, b, "colo-loaded", "interactive")["overall"]
        x = l["ttft_ms"]["p50"] / i["ttft_ms"]["p50"]
        verdict.setdefault(("colo", b), []).append(x)
        p, r = metrics(run, b, "colo-loaded")
        failed = i["failed"] + l["failed"]
        w(f"| {run} | {labels[b]} | {i['ttft_ms']['p50']:.0f} | {l['ttft_ms']['p50']:.0f} | {l['ttft_ms']['mean']:.0f} | {l['ttft_ms']['p90']:.0f} | {x:.2f}x | {p} | {r} | {per(p, r)} | {failed} |")
w("")
for b in ("before", "after"):
    xs = verdict[("colo", b)]
    ok = all(x <= 2.0 for x in xs)
    w(f"- {labels[b]}: {' '.join(f'{x:.2f}x' for x in xs)} -> goal (<= 2x in every run) **{'met' if ok else 'missed'}**")
w("")
w("### Burst")
w("")
w("As in section 1: $REQUESTS requests at t=0, $ISL-id prompts, $OSL tokens, tiers $TIERS, 2 workers, \`--max-num-seqs 16\`,")
w("speed-up $SPEEDUP. Ratio = tier-3 / tier-0 mean TTFT. \"vs off\" = engine-priority throughput against the same build's")
w("priority-off run of the same round. Goal: ratio <= 0.15 and throughput >= off, in every run.")
w("")
w("| run | build | off out tok/s | engine out tok/s | vs off | ratio 3/0 | TTFT ms tier 3 / 0 | preemptions | recomputed tokens | per preemption | failed |")
w("|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
for b in ("before", "after"):
    for run in range(1, runs + 1):
        off = load(run, b, "burst-off")
        eng = load(run, b, "burst-engine")
        d = thr(eng) / thr(off) - 1
        ratio = tier(eng, 3) / tier(eng, 0)
        verdict.setdefault(("burst", b), []).append((ratio, d))
        p, r = metrics(run, b, "burst-engine")
        failed = off["overall"]["failed"] + eng["overall"]["failed"]
        w(f"| {run} | {labels[b]} | {thr(off):.0f} | {thr(eng):.0f} | {d * 100:+.1f}% | {ratio:.3f} | {tier(eng, 3):.0f} / {tier(eng, 0):.0f} | {p} | {r} | {per(p, r)} | {failed} |")
w("")
for b in ("before", "after"):
    vs = verdict[("burst", b)]
    ok = all(ratio <= 0.15 and d >= 0 for ratio, d in vs)
    offs = [thr(load(run, b, "burst-off")) for run in range(1, runs + 1)]
    engs = [thr(load(run, b, "burst-engine")) for run in range(1, runs + 1)]
    mean_off = sum(offs) / len(offs)
    w(f"- {labels[b]}: ratio {' '.join(f'{r:.3f}' for r, _ in vs)}; vs off {' '.join(f'{d * 100:+.1f}%' for _, d in vs)}; "
      f"engine mean {sum(engs) / len(engs):.0f} vs off mean {mean_off:.0f} out tok/s ({(sum(engs) / len(engs) / mean_off - 1) * 100:+.1f}%; "
      f"off runs {min(offs):.0f}..{max(offs):.0f}) -> goal **{'met' if ok else 'missed'}**")
w("")
w("For comparison, engine priority with \`--no-preempt-on-seq-limit\` (a higher-priority request waits for a free slot):")
w("")
w("| run | build | out tok/s | vs off | ratio 3/0 | failed |")
w("|---:|---|---:|---:|---:|---:|")
for b in ("before", "after"):
    for run in range(1, runs + 1):
        off = load(run, b, "burst-off")
        np_ = load(run, b, "burst-nopreempt")
        w(f"| {run} | {labels[b]} | {thr(np_):.0f} | {(thr(np_) / thr(off) - 1) * 100:+.1f}% | {tier(np_, 3) / tier(np_, 0):.3f} | {np_['overall']['failed']} |")
w("")
w("Raw results per run, build and case (results.json, requests.jsonl, metrics.txt, server.log) are under")
w("\`target/bench/preempt/\` and not committed.")
w("<!-- preempt.sh: end -->")
section = "\n".join(lines) + "\n"
text = open(result).read() if os.path.exists(result) else ""
m = re.search(r"<!-- preempt\.sh: begin.*?<!-- preempt\.sh: end -->\n", text, re.S)
if m:
    text = text[:m.start()] + section + text[m.end():]
else:
    marker = "## Reading of the committed run"
    at = text.find(marker)
    text = text + "\n" + section if at < 0 else text[:at] + section + "\n" + text[at:]
open(result, "w").write(text)
print(section)
EOF
