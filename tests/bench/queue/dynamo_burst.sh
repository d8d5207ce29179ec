#!/usr/bin/env bash
# Issue 34's side by side: Dynamo's priority burst, replayed by aiperf (a client
# someone else wrote), against NVIDIA Dynamo 1.6.1 and against `sluice up`, each
# with its defaults, in one sitting.
#
# The burst: N requests at t=0 in four priority tiers (`nvext.agent_hints.priority`
# 0..3, shuffled), ISL 512, OSL 64 (`ignore_eos`), 2 mocker workers x 16 seqs;
# aiperf `mooncake_trace --fixed-schedule` (the anchors' `gen_burst_trace.py`).
# Runs, in order:
#   dynamo       Dynamo's defaults (`bench_burst.sh noqueue`: kv router, no router
#                queue; its mocker)
#   sluice       `sluice up --engine mocker --workers 2 --max-num-seqs 16` and the
#                mocker's shape Dynamo's start.sh gives its own (block size 64,
#                8,192 batched tokens, 16,384 blocks); no other flag
#   sluice-one   the same, every request at one priority (`--field none`): the
#                throughput the priority run is held to
#                (sluice and sluice-one run REPEATS times, interleaved: one pair
#                moves by about 2% on this machine; the goals use the means)
#   sluice-two-queues  (when TWO_QUEUES=1) the priority run through two queue
#                replicas, as separate processes with etcd (what deploy/ runs)
# and writes tests/bench/results/burst_vs_dynamo.md with every command line.
# Goals (issue 34): sluice 0 refused; tier-3 / tier-0 mean TTFT <= 0.15;
# throughput >= 98% of sluice-one.
#
# Needs ANCHORS: the directory of the Dynamo anchor scripts (setup.sh,
# bench_burst.sh, gen_burst_trace.py, analyze_by_tier.py), with its setup.sh
# run once (a venv with Dynamo and aiperf under ANCHOR_DIR). They are not
# part of this repository. Environment: SLUICE_BIN [target/release/sluice],
# N [400], REPEATS [3], PORT [18461], ANCHOR_DIR [/tmp/anchors], OUT [target/bench/burst_vs_dynamo],
# SUMMARY_ONLY [0] (1: write the results file from an earlier run's OUT).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
ANCHORS=${ANCHORS:?set ANCHORS to the directory of the Dynamo anchor scripts}
ANCHOR_DIR=${ANCHOR_DIR:-/tmp/anchors}
PY=$ANCHOR_DIR/venv/bin/python
AIPERF=$ANCHOR_DIR/venv/bin/aiperf
N=${N:-400}
REPEATS=${REPEATS:-3}
PORT=${PORT:-18461}
TWO_QUEUES=${TWO_QUEUES:-1}
OUT=${OUT:-$ROOT/target/bench/burst_vs_dynamo}
RESULT=$ROOT/tests/bench/results/burst_vs_dynamo.md
[ -x "$AIPERF" ] || { echo "no aiperf in $ANCHOR_DIR: run $ANCHORS/setup.sh first"; exit 1; }

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
SUMMARY_ONLY=${SUMMARY_ONLY:-0}   # 1: only write the results file from $OUT
if [ "$SUMMARY_ONLY" != 1 ]; then
rm -rf "$OUT"; mkdir -p "$OUT"
: >"$OUT/commands"
fi
SHAPE=(--block-size 64 --max-num-batched-tokens 8192 --num-gpu-blocks 16384)

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap cleanup EXIT

if [ "$SUMMARY_ONLY" != 1 ]; then
# 1. Dynamo with its defaults (the anchors' own script, its own summary).
echo "== dynamo"
echo "dynamo: N=$N \$ANCHORS/bench_burst.sh noqueue" >>"$OUT/commands"
N=$N OUT="$OUT/dynamo" SUMMARY_DIR="$OUT/dynamo-summary" "$ANCHORS/bench_burst.sh" noqueue | tail -12

aiperf_run() { # name, trace field, url
  local name=$1 field=$2 url=$3
  "$PY" "$ANCHORS/gen_burst_trace.py" --out "$OUT/$name.trace.jsonl" --n "$N" --tiers 4 \
    --isl 512 --osl 64 --field "$field"
  local cmd=("$AIPERF" profile --model sluice-tiny --url "$url" --endpoint-type chat --streaming
    --tokenizer "$ANCHOR_DIR/tiny-model" --input-file "$OUT/$name.trace.jsonl"
    --custom-dataset-type mooncake_trace --fixed-schedule --use-server-token-count
    --random-seed 42 --request-timeout-seconds 600 --ui-type none --no-server-metrics
    --no-gpu-telemetry --artifact-dir "$OUT/$name")
  echo "$name: gen_burst_trace.py --n $N --tiers 4 --isl 512 --osl 64 --field $field; ${cmd[*]##*/}" >>"$OUT/commands"
  ( cd "$OUT" && timeout 900 "${cmd[@]}" >"$OUT/$name.aiperf.log" 2>&1 ) \
    || { echo "aiperf failed: see $OUT/$name.aiperf.log"; tail -20 "$OUT/$name.aiperf.log"; }
  "$PY" "$ANCHORS/analyze_by_tier.py" "$OUT/$name" --label "$name" --json "$OUT/$name.tiers.json"
}

sluice_case() { # name, trace field
  local name=$1 field=$2
  local up=(up --engine mocker --http-port "$PORT" --workers 2 --max-num-seqs 16 "${SHAPE[@]}")
  echo "$name: sluice ${up[*]}" >>"$OUT/commands"
  RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" "${up[@]}" >"$OUT/$name.server.log" 2>&1 &
  pids+=($!)
  wait_ready "http://127.0.0.1:$PORT" "${pids[-1]}" "$OUT/$name.server.log"
  echo "== $name"
  aiperf_run "$name" "$field" "http://127.0.0.1:$PORT"
  cleanup
}

for r in $(seq 1 "$REPEATS"); do
  sluice_case "sluice-$r" priority
  sluice_case "sluice-one-$r" none
done

if [ "$TWO_QUEUES" = 1 ]; then
  # Separate processes with etcd, as deploy/ runs them: two queue replicas.
  name=sluice-two-queues
  etcd_dir=$(mktemp -d)
  etcd --data-dir "$etcd_dir" --listen-client-urls http://127.0.0.1:12479 \
    --advertise-client-urls http://127.0.0.1:12479 --listen-peer-urls http://127.0.0.1:12480 \
    >"$OUT/$name.etcd.log" 2>&1 &
  pids+=($!)
  common=(--etcd http://127.0.0.1:12479 --namespace burst)
  model=$OUT/sluice-tiny
  "$SLUICE_BIN" model init --out "$model" >/dev/null
  start() { # log name, then the role and its flags
    local log=$1; shift
    echo "$name: sluice $*" >>"$OUT/commands"
    RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" "$@" "${common[@]}" >"$OUT/$name.$log.log" 2>&1 &
    pids+=($!)
  }
  start router router --listen 127.0.0.1:0
  start queue-a queue --listen 127.0.0.1:0
  start queue-b queue --listen 127.0.0.1:0
  for i in 0 1; do
    start "decode-$i" decode --listen 127.0.0.1:0 --engine mocker --model "$model" \
      --max-num-seqs 16 "${SHAPE[@]}"
  done
  start frontend frontend --listen "127.0.0.1:$PORT" --model "$model"
  wait_ready "http://127.0.0.1:$PORT" "${pids[-1]}" "$OUT/$name.frontend.log"
  echo "== $name"
  aiperf_run "$name" priority "http://127.0.0.1:$PORT"
  cleanup
  rm -rf "$etcd_dir"
fi
fi

"$PY" - "$OUT" "$RESULT" "$N" "$REPEATS" <<'PY'
import glob, json, os, sys, datetime
out, result, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def tiers(name):
    path = f"{out}/{name}.tiers.json"
    if name == "dynamo":
        found = glob.glob(f"{out}/**/burst_noqueue.tiers.json", recursive=True)
        path = found[0] if found else path
    return {str(r["tier"]): r for r in json.load(open(path))["rows"]}
def summary(name):
    path = f"{out}/{name}/profile_export_aiperf.json"
    if name == "dynamo":
        found = glob.glob(f"{out}/**/burst_noqueue.aiperf_summary.json", recursive=True)
        path = found[0] if found else path
    try:
        s = json.load(open(path))
    except OSError:
        return float("nan")
    m = s.get("output_token_throughput") or {}
    return m.get("avg", float("nan")) if isinstance(m, dict) else float(m)
runs = [r for r in range(1, repeats + 1) if os.path.exists(f"{out}/sluice-{r}.tiers.json")]
pairs = [(f"sluice-{r}", f"sluice-one-{r}") for r in runs]
two = os.path.exists(f"{out}/sluice-two-queues.tiers.json")
cases = ["dynamo"] + [c for p in pairs for c in p] + (["sluice-two-queues"] if two else [])
rows = {c: tiers(c) for c in cases}
thr = {c: summary(c) for c in cases}
mean = lambda xs: sum(xs) / len(xs)
ttft = lambda c, t: rows[c].get(str(t), {}).get("ttft_mean", float("nan"))
one = mean([thr[o] for _, o in pairs])
lines = ["# The priority burst beside Dynamo (aiperf)", "",
         "Written by `tests/bench/queue/dynamo_burst.sh`; do not edit by hand.",
         f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on a shared 2-core machine, one case after the other.",
         f"{n} requests at t=0, tiers 0..3 in `nvext.agent_hints.priority` (shuffled), ISL 512, OSL 64 (`ignore_eos`),",
         "2 mocker workers x 16 seqs, replayed by aiperf 0.13 (`mooncake_trace --fixed-schedule`). Each system runs with its",
         "defaults; the mocker's shape is Dynamo's start.sh's (block size 64, 8,192 batched tokens, 16,384 blocks).",
         f"Sluice's priority run (`sluice-N`) and its one-priority twin (`sluice-one-N`) ran {len(pairs)} times, interleaved",
         "(one pair moves by about 2% here); the summary rows are their means, each ratio to one priority within its pair.", "",
         "Commands:", ""]
lines += [f"- `{l.strip()}`" for l in open(f"{out}/commands")]
head = ["", "| case | refused/failed | TTFT mean ms tier 3 | 2 | 1 | 0 | tier-3 / tier-0 | out tok/s | vs one priority |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
def row(name, cs, vs):
    err = sum(rows[c]["all"]["errors"] for c in cs)
    m = [mean([ttft(c, t) for c in cs]) for t in (3, 2, 1, 0)]
    ratio = mean([ttft(c, 3) / ttft(c, 0) for c in cs])
    return (f"| {name} | {err} | " + " | ".join(f"{x:.0f}" for x in m)
            + f" | {ratio:.3f} | {mean([thr[c] for c in cs]):.0f} | {vs:.1%} |"), err, ratio
summary_rows = {}
summary_rows["dynamo"] = row("dynamo", ["dynamo"], thr["dynamo"] / one)
kept = mean([thr[p] / thr[o] for p, o in pairs])
summary_rows["sluice"] = row(f"sluice (mean of {len(pairs)})", [p for p, _ in pairs], kept)
lines += head + [summary_rows["dynamo"][0], summary_rows["sluice"][0],
                 f"| sluice-one (mean of {len(pairs)}) | {sum(rows[o]['all']['errors'] for _, o in pairs)} | – | – | – | – | – | {one:.0f} | 100% |"]
if two:
    summary_rows["two"] = row("sluice-two-queues", ["sluice-two-queues"], thr["sluice-two-queues"] / one)
    lines.append(summary_rows["two"][0])
lines += ["", "Each pair:", "", "| run | tier-3 / tier-0 | out tok/s | one priority out tok/s | ratio |", "|---|---:|---:|---:|---:|"]
lines += [f"| {p} | {ttft(p, 3) / ttft(p, 0):.3f} | {thr[p]:.0f} | {thr[o]:.0f} | {thr[p] / thr[o]:.1%} |" for p, o in pairs]
_, err, ratio = summary_rows["sluice"]
goals = {"sluice: 0 refused": err == 0,
         "sluice: tier-3 / tier-0 mean TTFT <= 0.15": ratio <= 0.15,
         "sluice: throughput >= 98% of one priority": kept >= 0.98}
if two:
    _, err2, ratio2 = summary_rows["two"]
    goals["two queue replicas: 0 refused"] = err2 == 0
    goals["two queue replicas: tier-3 / tier-0 mean TTFT <= 0.15"] = ratio2 <= 0.15
lines += ["", "| goal | met |", "|---|---|"] + [f"| {k} | {'yes' if v else '**no**'} |" for k, v in goals.items()]
lines += ["", "Per-tier tables (aiperf's records through the anchors' `analyze_by_tier.py`) and aiperf's logs are under",
          "`target/bench/burst_vs_dynamo/`, not committed."]
open(result, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if all(goals.values()) else 1)
PY
