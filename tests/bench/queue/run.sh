#!/usr/bin/env bash
# The queue's two `make bench` experiments (issue 10), with the mocker engine,
# each printed beside the same run's priority-off baseline.
#
# 1. Burst: REQUESTS streaming requests at t=0, prompts of ISL token ids, OSL
#    output tokens each (ignore_eos), four priority tiers (0..3, equal weights,
#    shuffled), 2 mocker workers with max_num_seqs 16. The headline case runs
#    on defaults (no flag); every other case is an A/B of the flags it names.
#    Reported: tier-3/tier-0 mean-TTFT ratio, requests refused, and output
#    throughput against the priority-off baseline (run first and again last,
#    to show the noise) and against the same burst at one priority on
#    defaults. Goal: 0 refused, ratio <= 0.15, throughput >= 98% of one
#    priority.
# 2. Co-location: 1 mocker worker with max_num_seqs 4. A background `sluice
#    bench` keeps BATCH_CONCURRENCY low-priority (0) batch requests with long
#    outputs in flight (closed loop), so every slot is full and more wait;
#    once they run, a foreground `sluice bench --concurrency 1` sends
#    INTERACTIVE high-priority (3) requests one after another. Their median
#    TTFT is compared with the same requests (same seed) on an idle worker,
#    on defaults and with priority off (`--scheduling-policy fcfs`).
#    Goal: <= 2x idle on defaults.
#
# Writes tests/bench/results/queue.md (with the before/after section of
# preempt.sh kept from the file it replaces, and tests/bench/queue/conclusions.md,
# the hand-written reading of the committed run, appended); exits 1 when a request failed or the
# priority cases show no gradient (the tables are still written). Goals that
# are missed are reported in the tables, not turned into a failure.
#
# Environment (defaults in brackets):
#   SLUICE_BIN      a built `sluice` binary [builds target/release/sluice]
#   REQUESTS [400] ISL [512] OSL [64] WORKERS [2] MAX_NUM_SEQS [16]
#   SPEEDUP [2]     mocker --speedup-ratio of the burst runs
#   REPEATS [2]     rounds of the burst cases (each round runs every case once,
#                   the baseline first and last); the table shows the mean
#   COLO_SPEEDUP [1] mocker --speedup-ratio of the co-location runs
#   BATCH_CONCURRENCY [8] BATCH_ISL [512] BATCH_OSL [256]
#   INTERACTIVE [10] INTERACTIVE_ISL [512] INTERACTIVE_OSL [16]
#   PORT [18441]    HTTP port for `sluice up`
#   OUT             raw results per case [target/bench/queue]
#   ONLY            `burst` or `colo` to run one experiment (the other's
#                   section is then left out of the results file)
#   BURST_CASES     burst cases to run, by name (e.g. "engine"); the
#                   priority-off baseline (off, off-again) always runs, and
#                   the table lists only the cases that ran [all]
#   RESULT          where the results file goes [tests/bench/results/queue.md];
#                   a trimmed run (BURST_CASES, ONLY) can write elsewhere
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
REQUESTS=${REQUESTS:-400}
ISL=${ISL:-512}
OSL=${OSL:-64}
WORKERS=${WORKERS:-2}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-16}
SPEEDUP=${SPEEDUP:-2}
REPEATS=${REPEATS:-2}
COLO_SPEEDUP=${COLO_SPEEDUP:-1}
BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-8}
BATCH_ISL=${BATCH_ISL:-512}
BATCH_OSL=${BATCH_OSL:-256}
INTERACTIVE=${INTERACTIVE:-10}
INTERACTIVE_ISL=${INTERACTIVE_ISL:-512}
INTERACTIVE_OSL=${INTERACTIVE_OSL:-16}
PORT=${PORT:-18441}
ONLY=${ONLY:-}
TIERS="0:1,1:1,2:1,3:1"
URL="http://127.0.0.1:$PORT"
OUT=${OUT:-$ROOT/target/bench/queue}
RESULT=${RESULT:-$ROOT/tests/bench/results/queue.md}

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
mkdir -p "$OUT"
started=$(date +%s)

server_pid=""
batch_pid=""
cleanup() {
  if [ -n "$batch_pid" ]; then kill -9 "$batch_pid" 2>/dev/null || true; wait "$batch_pid" 2>/dev/null || true; fi
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

start_server() { # log file, then the `sluice up` flags
  local log=$1; shift
  # Defaults unless the case names a flag: what a user runs.
  RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" up --engine mocker --http-port "$PORT" "$@" >"$log" 2>&1 &
  server_pid=$!
  wait_ready "$URL" "$server_pid" "$log"
}

stop_server() {
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
}

burst_case() { # name, repetition, then the extra `sluice up` flags
  local name=$1 rep=$2; shift 2
  local tiers=$TIERS
  [ "$name" = one-priority ] && tiers="0:1"
  case " off off-again ${BURST_CASES:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  local dir=$OUT/burst/$name/$rep
  rm -rf "$dir"; mkdir -p "$dir"
  echo "$*" >"$OUT/burst/$name/flags"
  start_server "$dir/server.log" --workers "$WORKERS" --max-num-seqs "$MAX_NUM_SEQS" \
    --speedup-ratio "$SPEEDUP" "$@"
  echo "== burst $name (run $rep): sluice up $*"
  "$SLUICE_BIN" bench --url "$URL" --model sluice-tiny \
    --requests "$REQUESTS" --burst --isl-mean "$ISL" --osl-mean "$OSL" \
    --priority-tiers "$tiers" --seed 1 --timeout-secs 300 --no-progress --out "$dir" | tee "$dir/table.md"
  stop_server
}

interactive() { # out dir
  "$SLUICE_BIN" bench --url "$URL" --model sluice-tiny \
    --requests "$INTERACTIVE" --burst --concurrency 1 --isl-mean "$INTERACTIVE_ISL" \
    --osl-mean "$INTERACTIVE_OSL" --priority-tiers "3:1" --seed 1 --timeout-secs 300 \
    --no-progress --out "$1"
}

colo_case() { # name, idle|loaded, then the extra `sluice up` flags
  local name=$1 load=$2; shift 2
  local dir=$OUT/colo/$name
  rm -rf "$dir"; mkdir -p "$dir/interactive"
  echo "$*" >"$dir/flags"
  start_server "$dir/server.log" --workers 1 --max-num-seqs 4 --speedup-ratio "$COLO_SPEEDUP" "$@"
  echo "== colo $name ($load): sluice up $*"
  if [ "$load" = loaded ]; then
    # Closed loop: BATCH_CONCURRENCY clients, far more requests than the
    # interactive phase can use; stopped once it is over.
    "$SLUICE_BIN" bench --url "$URL" --model sluice-tiny \
      --requests 100000 --burst --concurrency "$BATCH_CONCURRENCY" --isl-mean "$BATCH_ISL" \
      --osl-mean "$BATCH_OSL" --priority-tiers "0:1" --seed 2 --timeout-secs 300 \
      --no-progress >"$dir/batch.log" 2>&1 &
    batch_pid=$!
    # Every slot running and a backlog waiting: the first four prompts take
    # one 2,048-token prefill step; two seconds of wall clock is plenty.
    sleep 2
    kill -0 "$batch_pid" 2>/dev/null || { echo "batch load died:"; cat "$dir/batch.log"; exit 1; }
  fi
  interactive "$dir/interactive" | tee "$dir/table.md"
  if [ -n "$batch_pid" ]; then
    # The batch load is thrown away, so it is killed outright (SIGTERM
    # would stop it too, but print its table).
    kill -9 "$batch_pid" 2>/dev/null || true; wait "$batch_pid" 2>/dev/null || true; batch_pid=""
  fi
  stop_server
}

if [ "$ONLY" != colo ]; then
  rm -rf "$OUT/burst"
  for rep in $(seq 1 "$REPEATS"); do
    burst_case off "$rep" --scheduling-policy fcfs
    burst_case defaults "$rep"
    burst_case one-priority "$rep"
    burst_case engine-nopreempt "$rep" --no-preempt-on-seq-limit
    burst_case engine-nowait "$rep" --admission-wait-steps 0
    burst_case q025-strict "$rep" --queue-threshold 0.25 --queue-policy strict
    burst_case active32-strict "$rep" --max-active $((WORKERS * MAX_NUM_SEQS)) --queue-policy strict
    burst_case off-again "$rep" --scheduling-policy fcfs
  done
fi
if [ "$ONLY" != burst ]; then
  rm -rf "$OUT/colo"
  colo_case idle-defaults idle
  colo_case loaded-defaults loaded
  colo_case loaded-queue loaded --queue-threshold 0.25 --queue-policy strict
  colo_case idle-fcfs idle --scheduling-policy fcfs
  colo_case loaded-fcfs loaded --scheduling-policy fcfs
fi
elapsed=$(( $(date +%s) - started ))

python3 - "$OUT" "$RESULT" "$elapsed" "$ONLY" "$REPEATS" <<EOF
import json, os, sys, datetime
out, result, elapsed, only, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
def load(path):
    return json.load(open(os.path.join(out, path, "results.json")))
def flags(path):
    return open(os.path.join(out, path, "flags")).read().strip()
lines = []
w = lines.append
ok = True
w("# Queue experiments: burst separation and co-location (mocker)")
w("")
w("Written by \`tests/bench/queue/run.sh\`; do not edit by hand.")
w(f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {elapsed} s in all including start-ups,")
w(f"on a shared 2-core machine. Every case is a fresh \`sluice up --engine mocker\`.")
w("Mocker times are Dynamo's timing model divided by the speed-up ratio; the machine's own")
w("overhead (HTTP, gRPC, hundreds of streams on 2 cores) is not divided.")
w("")
if only != "colo":
    bursts = [
        ("off", "engine priority off (A/B of \`--scheduling-policy\`): engine fcfs, the queue on its defaults"),
        ("defaults", "**defaults** (no flag): default holding with the preemption-aware grant and TTFT-target refusal, engine priority"),
        ("one-priority", "defaults, every request at priority 0: the throughput the priority cases are held to"),
        ("engine-nopreempt", "defaults but no preemption at the seq limit (\`--no-preempt-on-seq-limit\`)"),
        ("engine-nowait", "defaults but no admission wait (\`--admission-wait-steps 0\`)"),
        ("q025-strict", "queue threshold 0.25, strict; engine priority"),
        ("active32-strict", "\`--max-active\` = slots in all, strict; engine priority"),
        ("off-again", "engine priority off again, last: the baseline's run-to-run noise"),
    ]
    # Only the cases that ran (BURST_CASES); the baseline always does.
    bursts = [b for b in bursts if os.path.isdir(os.path.join(out, "burst", b[0]))]
    runs = {c: [load(f"burst/{c}/{i}") for i in range(1, repeats + 1)] for c, _ in bursts}
    def tier(r, p):
        return next(t for t in r["tiers"] if t["priority"] == p)
    def thr(r):
        return r["overall"]["output_token_throughput"]
    offs = [thr(r) for c in ("off", "off-again") for r in runs[c]]
    base = sum(offs) / len(offs)
    w("## 1. Burst")
    w("")
    w(f"$REQUESTS streaming requests at t=0, prompts of $ISL token ids, $OSL output tokens (\`ignore_eos\`),")
    w(f"tiers $TIERS (priority:weight, shuffled, seed 1); $WORKERS mocker workers,")
    w(f"\`--max-num-seqs $MAX_NUM_SEQS --speedup-ratio $SPEEDUP\`. Every case ran {repeats} times (rounds of all cases,")
    w("priority-off first and last in each round); figures are means over the runs.")
    w("Ratio = tier-3 mean TTFT / tier-0 mean TTFT (lower = more separation; four equal tiers")
    w("served strictly in order give about 1/7). Throughput = output tokens/s over the whole run;")
    w(f"\"vs off\" is against the mean of the {len(offs)} priority-off runs, with the case's own min..max.")
    w("Goal (issue 34): on defaults 0 refused, ratio <= 0.15, throughput >= 98% of the same burst at one priority.")
    w("")
    one = runs.get("one-priority")
    one_thr = sum(thr(r) for r in one) / len(one) if one else None
    w("| case | \`sluice up\` flags | TTFT ms tier 3 | 2 | 1 | 0 | ratio 3/0 | ratio per run | out tok/s | vs off (min..max) | vs one priority | failed | goal |")
    w("|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---|")
    for c, _ in bursts:
        rs = runs[c]
        t = sum(thr(r) for r in rs) / len(rs)
        d = t / base - 1
        lo, hi = min(thr(r) for r in rs) / base - 1, max(thr(r) for r in rs) / base - 1
        vs_one = f"{t / one_thr * 100:.1f}%" if one_thr else "–"
        failed = sum(r["overall"]["failed"] for r in rs)
        ok &= failed == 0
        if c == "one-priority":
            ttft = sum(r["overall"]["ttft_ms"]["mean"] for r in rs) / len(rs)
            w(f"| {c} | \`(none)\`, tiers 0:1 | – | – | – | {ttft:.0f} | – | – | {t:.0f} | {d * 100:+.1f}% ({lo * 100:+.1f}..{hi * 100:+.1f}) | 100% | {failed} | baseline |")
            continue
        means = [sum(tier(r, p)["ttft_ms"]["mean"] for r in rs) / len(rs) for p in (3, 2, 1, 0)]
        ratios = [tier(r, 3)["ttft_ms"]["mean"] / tier(r, 0)["ttft_ms"]["mean"] for r in rs]
        ratio = sum(ratios) / len(ratios)
        if not c.startswith("off"):
            kept = one_thr is None or t >= 0.98 * one_thr
            goal = "yes" if ratio <= 0.15 and kept and failed == 0 else f"ratio {'ok' if ratio <= 0.15 else 'NO'}, throughput {'ok' if kept else 'NO'}, refused {failed}"
            for r in rs:
                m = [tier(r, p)["ttft_ms"]["mean"] for p in (3, 2, 1, 0)]
                if not all(a < b for a, b in zip(m, m[1:])):
                    ok = False
                    goal += "; NO GRADIENT in a run"
                    break
        else:
            goal = "baseline"
        w(f"| {c} | \`{flags('burst/' + c) or '(none)'}\` | " + " | ".join(f"{m:.0f}" for m in means)
          + f" | {ratio:.3f} | {' '.join(f'{x:.3f}' for x in ratios)} | {t:.0f} | {d * 100:+.1f}% ({lo * 100:+.1f}..{hi * 100:+.1f}) | {vs_one} | {failed} | {goal} |")
    w("")
    w(f"Priority-off throughput over its {len(offs)} runs: {min(offs):.0f}..{max(offs):.0f} out tok/s "
      f"({(max(offs) / min(offs) - 1) * 100:.1f}% apart): differences of that size are noise of the shared machine.")
    if "defaults" in runs:
        for c in ("off", "off-again", "one-priority"):
            if c in runs:
                per = [thr(a) / thr(b) - 1 for a, b in zip(runs["defaults"], runs[c])]
                w(f"defaults against {c} of the same round: " + ", ".join(f"{x * 100:+.1f}%" for x in per) + ".")
    w("")
    w("Cases:")
    for c, d in bursts:
        w(f"- {c}: {d}")
    w("")
if only != "burst":
    colos = [
        ("defaults", "**defaults** (engine priority, default holding)", "idle-defaults", [("loaded-defaults", "defaults"), ("loaded-queue", "queue 0.25 strict")]),
        ("fcfs", "engine priority off (A/B): engine fcfs", "idle-fcfs", [("loaded-fcfs", "default holding")]),
    ]
    w("## 2. Co-location")
    w("")
    w("One mocker worker, \`--max-num-seqs 4 --speedup-ratio $COLO_SPEEDUP\`. Batch load: a background")
    w(f"\`sluice bench\` closed loop of $BATCH_CONCURRENCY clients, priority 0, prompts of $BATCH_ISL ids, $BATCH_OSL output")
    w("tokens, so all 4 slots run batch work and more waits; it starts 2 s before the interactive")
    w(f"requests and is stopped after them. Interactive: $INTERACTIVE requests, priority 3, one at a time")
    w(f"(\`--concurrency 1\`), prompts of $INTERACTIVE_ISL ids, $INTERACTIVE_OSL output tokens, the same seed (same prompts)")
    w("in every case. Idle = the same interactive requests on the same configuration with no batch load.")
    w("Goal: loaded median TTFT <= 2x idle on defaults.")
    w("")
    w("| engine | load | \`sluice up\` flags | TTFT ms p50 | mean | p90 | max | x idle (p50) | failed |")
    w("|---|---|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for eng, engdesc, idle, loaded in colos:
        ri = load(f"colo/{idle}/interactive")["overall"]
        idle50 = ri["ttft_ms"]["p50"]
        for case, desc in [(idle, "idle")] + loaded:
            r = load(f"colo/{case}/interactive")["overall"]
            t = r["ttft_ms"]
            ok &= r["failed"] == 0
            x = t["p50"] / idle50
            summary[case] = x
            w(f"| {engdesc} | {desc} | \`{flags('colo/' + case) or '(none)'}\` | {t['p50']:.0f} | {t['mean']:.0f} | {t['p90']:.0f} | {t['max']:.0f} | {x:.1f}x | {r['failed']} |")
    w("")
    w(f"Goal (<= 2x idle on defaults): **{'met' if summary['loaded-defaults'] <= 2.0 else 'missed'}** "
      f"({summary['loaded-defaults']:.1f}x; with a 0.25 threshold {summary['loaded-queue']:.1f}x; "
      f"engine priority off {summary['loaded-fcfs']:.1f}x).")
    w("")
w("Raw results (results.json, requests.jsonl, server logs per case) are written under")
w("\`target/bench/queue/\` by the script and not committed.")
text = "\n".join(lines) + "\n"

# The before/after section preempt.sh writes stays (it is its own run).
import re
old = open(result).read() if os.path.exists(result) else ""
kept = re.search(r"<!-- preempt\.sh: begin.*?<!-- preempt\.sh: end -->\n", old, re.S)
if kept:
    text += "\n" + kept.group(0)

notes = "$ROOT/tests/bench/queue/conclusions.md"
if os.path.exists(notes):
    text += "\n" + open(notes).read()
open(result, "w").write(text)
print(text)
sys.exit(0 if ok else 1)
EOF
