#!/usr/bin/env bash
# Sustained overload with default flags: is it shed, by priority?
#
# Starts `sluice up --engine mocker` (loopback, default queue flags), then
#   1. idle:     REQUESTS_IDLE requests one at a time -> idle TTFT, idle RSS
#   2. capacity: a closed loop of MAX_NUM_SEQS clients -> requests/s served
#   3. overload: Poisson arrivals at FACTOR x capacity for DURATION s,
#                priorities 0..3 in equal shares
# and writes tests/bench/results/overload.md: served TTFT p50 against idle
# TTFT (goal within 5x), every refusal a 429 with Retry-After, served
# fraction per priority (goal p3 >= p2 >= p1 >= p0), peak RSS of the server
# during the overload against idle RSS (goal within 2x). Exits 1 when a goal
# is missed (the table is still written).
#
# Environment (defaults in brackets):
#   SLUICE_BIN   a built `sluice` [builds target/release/sluice]
#   ISL [128] OSL [64] ISL_STD [ISL/4] OSL_STD [OSL/4]
#   MAX_NUM_SEQS [64, the worker default]
#   FACTOR [5] DURATION [30] PORT [18441] OUT [target/bench/overload]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
ISL=${ISL:-128}
OSL=${OSL:-64}
# Lengths vary as they do in real traffic (std a quarter of the mean); with
# every output the same length, sequences that start together end together
# and the engine frees its slots in waves.
ISL_STD=${ISL_STD:-$((ISL / 4))}
OSL_STD=${OSL_STD:-$((OSL / 4))}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
FACTOR=${FACTOR:-5}
DURATION=${DURATION:-30}
PORT=${PORT:-18441}
REQUESTS_IDLE=${REQUESTS_IDLE:-20}
OUT=${OUT:-$ROOT/target/bench/overload}
RESULT=$ROOT/tests/bench/results/overload.md

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"
URL=http://127.0.0.1:$PORT

server_pid=""; sampler_pid=""
cleanup() {
  [ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null || true
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" up --engine mocker --http-port "$PORT" \
  --max-num-seqs "$MAX_NUM_SEQS" >"$OUT/server.log" 2>&1 &
server_pid=$!
wait_ready "$URL" "$server_pid" "$OUT/server.log"

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status"; }
common=(--url "$URL" --isl-mean "$ISL" --isl-std "$ISL_STD" --osl-mean "$OSL" --osl-std "$OSL_STD" --no-progress)

"$SLUICE_BIN" bench "${common[@]}" --requests "$REQUESTS_IDLE" --concurrency 1 --burst \
  --out "$OUT/idle" >"$OUT/idle.txt" 2>&1
idle_rss=$(rss_kb)

"$SLUICE_BIN" bench "${common[@]}" --requests $((MAX_NUM_SEQS * 8)) \
  --concurrency "$MAX_NUM_SEQS" --burst --out "$OUT/capacity" >"$OUT/capacity.txt" 2>&1
capacity=$(python3 - "$OUT/capacity/requests.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
ok = [r for r in recs if r["error"] is None]
span = max(r["sent_ms"] + r["e2e_ms"] for r in ok) - min(r["sent_ms"] for r in ok)
print(f"{len(ok) / (span / 1000):.2f}")
PY
)
rate=$(python3 -c "print(round($capacity * $FACTOR, 2))")
requests=$(python3 -c "print(int($capacity * $FACTOR * $DURATION))")

# Peak RSS while overloaded, sampled every 100 ms.
( peak=0; while kill -0 "$server_pid" 2>/dev/null; do
    r=$(rss_kb || echo 0); [ "${r:-0}" -gt "$peak" ] && peak=$r && echo "$peak" >"$OUT/peak_rss"
    sleep 0.1; done ) &
sampler_pid=$!
"$SLUICE_BIN" bench "${common[@]}" --requests "$requests" --rate "$rate" \
  --priority-tiers "0:1,1:1,2:1,3:1" --request-timeout-secs 120 --timeout-secs 600 \
  --out "$OUT/overload" >"$OUT/overload.txt" 2>&1 || true
kill "$sampler_pid" 2>/dev/null || true; sampler_pid=""
peak_rss=$(cat "$OUT/peak_rss" 2>/dev/null || echo 0)

# Milder overload, where capacity falls inside the priority bands: 2x
# capacity, a quarter per priority, so priorities 3 and 2 together are
# about what the worker serves.
sleep 3
"$SLUICE_BIN" bench "${common[@]}" --requests "$(python3 -c "print(int($capacity * 2 * $DURATION))")" \
  --rate "$(python3 -c "print(round($capacity * 2, 2))")" \
  --priority-tiers "0:1,1:1,2:1,3:1" --request-timeout-secs 120 --timeout-secs 600 \
  --out "$OUT/overload2x" >"$OUT/overload2x.txt" 2>&1 || true

python3 - "$OUT" "$RESULT" "$idle_rss" "$peak_rss" "$capacity" "$rate" "$requests" \
  "$ISL" "$OSL" "$MAX_NUM_SEQS" "$FACTOR" "$DURATION" <<'PY'
import json, statistics, sys
out, result, idle_rss, peak_rss, capacity, rate, requests, isl, osl, seqs, factor, duration = sys.argv[1:]
def recs(name):
    return [json.loads(l) for l in open(f"{out}/{name}/requests.jsonl")]
def p50(xs):
    return statistics.median(xs) if xs else float("nan")
idle = [r["ttft_ms"] for r in recs("idle") if r["error"] is None and r["ttft_ms"] is not None]
idle_ttft = p50(idle)
over = recs("overload")
ok = [r for r in over if r["error"] is None]
bad = [r for r in over if r["error"] is not None]
refused = [r for r in bad if r["error"]["kind"] == "429"]
with_ra = [r for r in refused if (r["error"].get("retry_after") or "").isdigit()]
other = [r for r in bad if r["error"]["kind"] != "429"]
served_ttft = p50([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None])
# Steady state: requests sent once the overload has stood for a while. The
# first arrivals into the idle mesh take its free engine slots whatever
# their priority (nothing is held yet to choose from); shedding by priority
# starts once the overload stands (`--backlog-secs`, 2 s by default).
WARMUP_MS = 5000
def by_priority(run):
    """Rows of the per-priority table and the served fractions after the warm-up."""
    t0 = min((r["sent_ms"] for r in run), default=0)
    steady = [r for r in run if r["sent_ms"] - t0 >= WARMUP_MS]
    rows, fractions = [], []
    for p in range(4):
        tier = [r for r in run if r["priority"] == p]
        s = [r for r in tier if r["error"] is None]
        frac = len(s) / len(tier) if tier else 0.0
        st = [r for r in steady if r["priority"] == p]
        st_frac = sum(1 for r in st if r["error"] is None) / len(st) if st else 0.0
        fractions.append(st_frac)
        rows.append(f"| {p} | {len(tier)} | {len(s)} | {frac:.1%} | {st_frac:.1%} | "
                    f"{p50([r['ttft_ms'] for r in s if r['ttft_ms'] is not None]):.0f} | "
                    f"{sum(1 for r in tier if r['error'] and r['error']['kind'] == '429')} |")
    return rows, fractions
def ordered(fractions):
    return all(fractions[i] >= fractions[i - 1] for i in range(1, 4))
rows, fractions = by_priority(over)
mild = recs("overload2x")
rows2, fractions2 = by_priority(mild)
mild_bad = [r for r in mild if r["error"] is not None and r["error"]["kind"] != "429"]
ras = sorted(int(r["error"]["retry_after"]) for r in with_ra)
goals = {
    "served TTFT p50 within 5x idle": served_ttft <= 5 * idle_ttft,
    "every refusal a 429 with Retry-After": not other and len(with_ra) == len(refused),
    "served fraction p3 >= p2 >= p1 >= p0 (after the first 5 s)": ordered(fractions),
    "the same at 2x capacity": ordered(fractions2) and not mild_bad,
    "peak RSS within 2x idle": int(peak_rss) <= 2 * int(idle_rss),
}
lines = [
    "# Sustained overload, default flags",
    "",
    "`tests/bench/overload/run.sh`: `sluice up --engine mocker` (one worker, "
    f"`--max-num-seqs {seqs}`, every queue flag at its default), prompts of {isl} "
    f"tokens, {osl} output tokens (normal, std a quarter of the mean). Capacity measured with a closed loop of {seqs} "
    f"clients: **{capacity} req/s**. Then Poisson arrivals at {factor}x that "
    f"({rate} req/s) for {duration} s: {requests} requests, priorities 0..3 in equal shares.",
    "",
    "| measure | value |",
    "|---|---:|",
    f"| idle TTFT p50 (one at a time) | {idle_ttft:.1f} ms |",
    f"| served TTFT p50 under overload | {served_ttft:.1f} ms ({served_ttft / idle_ttft:.1f}x idle) |",
    f"| served / refused (429) / other failures | {len(ok)} / {len(refused)} / {len(other)} |",
    f"| 429s with a Retry-After | {len(with_ra)} of {len(refused)} (min {ras[0] if ras else '-'} s, median {ras[len(ras)//2] if ras else '-'} s, max {ras[-1] if ras else '-'} s) |",
    f"| server RSS idle / peak during overload | {int(idle_rss)/1024:.1f} MiB / {int(peak_rss)/1024:.1f} MiB ({int(peak_rss)/max(1,int(idle_rss)):.2f}x) |",
    "",
    "| priority | sent | served | served fraction | after the first 5 s | served TTFT p50 ms | 429 |",
    "|---:|---:|---:|---:|---:|---:|---:|",
    *rows,
    "",
    f"At 2x capacity ({len(mild)} requests over {duration} s, a quarter per priority): "
    f"{sum(1 for r in mild if r['error'] is None)} served, "
    f"{sum(1 for r in mild if r['error'] is not None and r['error']['kind'] == '429')} refused (429), "
    f"{len(mild_bad)} other failures.",
    "",
    "| priority | sent | served | served fraction | after the first 5 s | served TTFT p50 ms | 429 |",
    "|---:|---:|---:|---:|---:|---:|---:|",
    *rows2,
    "",
    "The first arrivals into the idle mesh take its free engine slots whatever their "
    "priority; shedding by priority starts once the overload has stood for "
    "`--backlog-secs` (2 s), so the served fractions are compared after the first 5 s.",
    "",
    "| goal | met |",
    "|---|---|",
    *[f"| {k} | {'yes' if v else '**no**'} |" for k, v in goals.items()],
    "",
]
if other:
    kinds = {}
    for r in other:
        kinds[r["error"]["kind"]] = kinds.get(r["error"]["kind"], 0) + 1
    lines.insert(-1, f"Other failures by kind: {kinds}")
open(result, "w").write("\n".join(lines))
print("\n".join(lines))
sys.exit(0 if all(goals.values()) else 1)
PY
