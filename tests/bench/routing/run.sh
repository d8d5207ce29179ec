#!/usr/bin/env bash
# Routing on the Mooncake conversation trace, through the mesh a user runs.
#
# The reference slice (issue #14): every conversation of
# tests/bench/traces/mooncake_conversation_trace.jsonl whose hash_ids[1] % 16
# == 0 (719 requests), timestamps / 20, input lengths / 8 with 64-token
# blocks (each 512-token hash id becomes 64 tokens: --trace-scale 8), output
# lengths / 8. Replayed by `sluice bench --trace` through
# `sluice up --engine mocker --workers 4` (1,000 blocks of 64 tokens each,
# mocker speedup 0.125, --max-num-batched-tokens 1024, --max-num-seqs 256,
# --max-model-len 32768 so the trace's longest conversations fit)
# once per router mode, and written to tests/bench/results/routing.md with
# the hit rate (cached_tokens / prompt_tokens), TTFT mean and p90, and the
# requests each worker served, beside the oracle (one shared infinite cache:
# a prompt's leading blocks seen before, in arrival order) of the same slice.
#
# Environment (defaults in brackets):
#   SLUICE_BIN   a built `sluice` [builds target/release/sluice]
#   MODES        ["kv approx round-robin random"]
#   ROUTER_FLAGS extra flags for every `sluice up` (cost weights to try) [""]
#   REPEATS      runs per mode [1]; with more, the table gives each figure's
#                mean over the runs and its range (a single run's hit rate
#                moves by about ±0.03 on this slice)
#   PORT [18471] OUT [target/bench/routing]
#   RESULT       [tests/bench/results/routing.md]; "-" prints only
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
MODES=${MODES:-"kv approx round-robin random"}
REPEATS=${REPEATS:-1}
ROUTER_FLAGS=${ROUTER_FLAGS:-}
PORT=${PORT:-18471}
OUT=${OUT:-$ROOT/target/bench/routing}
RESULT=${RESULT:-$ROOT/tests/bench/results/routing.md}
TRACE=$ROOT/tests/bench/traces/mooncake_conversation_trace.jsonl

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
mkdir -p "$OUT"
SLICE=$OUT/slice.jsonl
python3 - "$TRACE" "$SLICE" <<'EOF'
import json, math, sys
src, dst = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(src) if l.strip()]
rows = [r for r in rows if len(r["hash_ids"]) > 1 and r["hash_ids"][1] % 16 == 0]
rows.sort(key=lambda r: r["timestamp"])
with open(dst, "w") as f:
    for r in rows:
        f.write(json.dumps({
            "timestamp": r["timestamp"] / 20,
            "input_length": r["input_length"],
            "output_length": max(1, math.ceil(r["output_length"] / 8)),
            "hash_ids": r["hash_ids"],
        }) + "\n")
print(f"slice: {len(rows)} requests -> {dst}", file=sys.stderr)
EOF

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

UP_FLAGS="--engine mocker --workers 4 --block-size 64 --num-gpu-blocks 1000 --speedup-ratio 0.125 --max-num-batched-tokens 1024 --max-num-seqs 256 --max-model-len 32768"
BENCH_FLAGS="--trace $SLICE --trace-scale 8 --timeout-secs 900 --no-progress"
started=$(date +%s)
for mode in $MODES; do
  for rep in $(seq 1 "$REPEATS"); do
    dir=$OUT/$mode/run$rep
    rm -rf "$dir"; mkdir -p "$dir"
    # shellcheck disable=SC2086
    RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" up $UP_FLAGS --router-mode "$mode" $ROUTER_FLAGS \
      --http-port "$PORT" >"$dir/server.log" 2>&1 &
    server_pid=$!
    wait_ready "http://127.0.0.1:$PORT" "$server_pid" "$dir/server.log"
    echo "== $mode (run $rep of $REPEATS)"
    # shellcheck disable=SC2086
    "$SLUICE_BIN" bench --url "http://127.0.0.1:$PORT" --model sluice-tiny $BENCH_FLAGS \
      --out "$dir" >"$dir/table.md"
    curl -sf "http://127.0.0.1:$PORT/metrics" >"$dir/metrics.txt" || true
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
  done
done
elapsed=$(( $(date +%s) - started ))

python3 - "$OUT" "$SLICE" "$RESULT" "$elapsed" "$MODES" "$ROUTER_FLAGS" "$UP_FLAGS" "$BENCH_FLAGS" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$REPEATS" <<'EOF'
import json, math, os, statistics, sys, datetime
out, slice_path, result, elapsed, modes, router_flags, up_flags, bench_flags, commit, repeats = sys.argv[1:11]
repeats = int(repeats)
rows = [json.loads(l) for l in open(slice_path)]
# The oracle: one shared infinite cache of 64-token blocks, in arrival order.
seen, cached, total = set(), 0, 0
for r in rows:
    p = math.ceil(r["input_length"] / 8)
    full = p // 64
    k = 0
    for h in r["hash_ids"][:full]:
        if h not in seen:
            break
        k += 1
    cached += k * 64
    total += p
    seen.update(r["hash_ids"][:full])
oracle = cached / total

def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")

def run_figures(path):
    recs = [json.loads(l) for l in open(path)]
    ok = [r for r in recs if not r.get("error")]
    prompt = sum(r["input_tokens"] for r in ok)
    hit = sum(r.get("cached_tokens") or 0 for r in ok) / max(1, prompt)
    ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    per = {}
    for r in ok:
        per[r.get("worker_id") or "?"] = per.get(r.get("worker_id") or "?", 0) + 1
    counts = sorted(per.values(), reverse=True)
    ratio = counts[0] / counts[-1] if counts and counts[-1] else float("inf")
    return hit, statistics.mean(ttft), pct(ttft, 0.9), counts, ratio, len(recs) - len(ok)

def prediction_error(path):
    """The median |predicted - served| / served time to first token over
    the requests the router predicted: its prediction (`nvext.routed_ttft_ms`,
    from placement) against the client's TTFT less the queue wait
    (`nvext.queue_wait_ms`); None without predictions."""
    errors = []
    for line in open(path):
        r = json.loads(line)
        predicted, ttft, wait = r.get("routed_ttft_ms"), r.get("ttft_ms"), r.get("queue_wait_ms")
        if r.get("error") or predicted is None or ttft is None or wait is None:
            continue
        served = ttft - wait
        if served > 0:
            errors.append(abs(predicted - served) / served)
    return statistics.median(errors) if errors else None

def spread(values, fmt):
    """The mean, and the range when there is more than one run."""
    m = fmt.format(statistics.mean(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt.format(min(values))}–{fmt.format(max(values))})"

lines = []
for mode in modes.split():
    runs = [run_figures(f"{out}/{mode}/run{i}/requests.jsonl") for i in range(1, repeats + 1)]
    hits = [r[0] for r in runs]
    counts = " ; ".join(" / ".join(map(str, r[3])) for r in runs)
    errors = [e for e in (prediction_error(f"{out}/{mode}/run{i}/requests.jsonl") for i in range(1, repeats + 1)) if e is not None]
    error = spread([100 * e for e in errors], '{:.0f}%') if errors else "–"
    lines.append(
        f"| {mode} | {spread(hits, '{:.3f}')} | {statistics.mean(hits) / oracle:.0%} "
        f"| {spread([r[1] for r in runs], '{:.0f}')} | {spread([r[2] for r in runs], '{:.0f}')} "
        f"| {counts} | {spread([r[4] for r in runs], '{:.2f}')} | {error} | {sum(r[5] for r in runs)} |")

table = "\n".join([
    "| router | hit rate | of oracle | TTFT mean ms | TTFT p90 ms | requests per worker | max/min | TTFT prediction error, median | errors |",
    "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    *lines,
    f"| oracle (one shared infinite cache) | {oracle:.3f} | 100% | | | | | | |",
])
print(table)
if result == "-":
    sys.exit(0)
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
# Notes written by hand below this marker survive a rerun.
MARKER = "<!-- notes: kept by run.sh -->"
notes = ""
if os.path.exists(result):
    old = open(result).read()
    if MARKER in old:
        notes = old[old.index(MARKER) + len(MARKER):]
doc = f"""# Routing on the Mooncake conversation trace, live mesh

Written by `tests/bench/routing/run.sh` ({now}, commit {commit}, {elapsed} s):
`MODES="{modes}" ROUTER_FLAGS="{router_flags}" REPEATS={repeats} tests/bench/routing/run.sh`.

The reference slice: every conversation of
`tests/bench/traces/mooncake_conversation_trace.jsonl` whose `hash_ids[1] % 16 == 0`
({len(rows)} requests), timestamps / 20, input lengths / 8 with 64-token blocks,
output lengths / 8. Each mode: `sluice up {up_flags} --router-mode MODE {router_flags}`,
replayed by `sluice bench {bench_flags.replace(slice_path, 'SLICE')}` on the trace's own schedule.
Hit rate = sum(cached_tokens) / sum(prompt_tokens) over the requests answered.
The prediction error is the router's: the median over requests of |predicted − served| / served,
predicted the router's time from placement to first token (`nvext.routed_ttft_ms`), served
the client's TTFT less the queue wait (`nvext.queue_wait_ms`); the router's own
`sluice_router_ttft_prediction_error_ratio` histogram is in each run's `metrics.txt`.

{table}

Reference (issue #14, measured with aiperf through `sluice up` in the same sitting as
NVIDIA Dynamo 1.6.1 on this slice): Dynamo kv 0.243 (TTFT mean 810 ms), round-robin
0.161, random 0.129; Sluice before this change kv 0.224 (1,025 ms), round-robin 0.163.
An ideal per-conversation split with 1,000-block LRU caches reaches 0.325.
With REPEATS > 1 each figure is the mean over the runs, with its range in brackets.

{MARKER}{notes}"""
open(result, "w").write(doc)
print(f"wrote {result}", file=sys.stderr)
EOF
