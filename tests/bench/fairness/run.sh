#!/usr/bin/env bash
# Fair share by tenant (issue 18), measured on `sluice up --engine mocker`
# with one worker; the queue holds what the worker cannot take
# (`--queue-threshold`) and releases it under `--queue-policy fair`.
# Tenants are API keys (`--api-key-file`); the load comes from
# tests/bench/fairness/load.py (the `openai` package from the venv `make
# deps` creates, one process per tenant, streaming /v1/completions, random
# prompts so nothing is cached).
#
# Cases (each its own `sluice up`):
#   alone       the light tenant alone: LIGHT_RATE req/s, ISL/OSL
#   contended   light as above + heavy at 10x light's token rate (same
#               shapes, 10x the requests), more than the worker serves
#   fcfs        `contended` under `--queue-policy fcfs` (the baseline)
#   shares-1:1  both tenants backlogged (closed loop, CONC requests each);
#               heavy's requests are HEAVY_ISL/HEAVY_OSL, light's
#               LIGHT_ISL/LIGHT_OSL: token shares should be 1:1
#   shares-3:1  the same with heavy's key at weight 3: 3:1
#   priority    shares-1:1's load at priority 0 + a `vip` tenant at
#               priority 1 (LIGHT_RATE req/s): vip still goes first
#
# Writes tests/bench/results/fairness.md (the numbers load.py printed, then
# tests/bench/fairness/conclusions.md, the hand-written reading) and
# exits 1 when a goal is missed (the file is still written):
#   light TTFT p50 in `contended` <= 1.5x `alone`; shares within +-10% of
#   the weights; vip's TTFT p50 below every priority-0 tenant's.
#
# Environment (defaults in brackets):
#   SLUICE_BIN   a built `sluice` binary [builds target/release/sluice]
#   PYTHON [.venv/bin/python]  DURATION [30] WARMUP [5] seconds per case
#   SPEEDUP [0.5]     mocker --speedup-ratio (below 1: a slower worker, so
#                     the load generator needs fewer requests per second)
#   THRESHOLD [0.1]   --queue-threshold (fraction of max_num_batched_tokens
#                     in prefill above which the queue holds)
#   LIGHT_RATE [1.5]  ISL [256] OSL [64]
#   CONC [64] HEAVY_ISL [1024] HEAVY_OSL [128] LIGHT_ISL [128] LIGHT_OSL [16]
#   PORT [18451]      OUT [target/bench/fairness]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
"$PYTHON" -c 'import openai' 2>/dev/null || { echo "$PYTHON has no openai package: run 'make deps' (or set PYTHON)" >&2; exit 1; }
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
SPEEDUP=${SPEEDUP:-0.5}
THRESHOLD=${THRESHOLD:-0.1}
LIGHT_RATE=${LIGHT_RATE:-1.5}
ISL=${ISL:-256}
OSL=${OSL:-64}
CONC=${CONC:-64}
HEAVY_ISL=${HEAVY_ISL:-1024}
HEAVY_OSL=${HEAVY_OSL:-128}
LIGHT_ISL=${LIGHT_ISL:-128}
LIGHT_OSL=${LIGHT_OSL:-16}
PORT=${PORT:-18451}
OUT=${OUT:-$ROOT/target/bench/fairness}
RESULT=$ROOT/tests/bench/results/fairness.md
LOAD=$ROOT/tests/bench/fairness/load.py
HEAVY_RATE=$($PYTHON -c "print($LIGHT_RATE * 10)")

# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
mkdir -p "$OUT"

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

keys() { # heavy's weight
  printf '# key tenant weight\nsk-light light 1\nsk-heavy heavy %s\nsk-vip vip 1\n' "$1" >"$OUT/keys"
}

run_case() { # name, policy, then load.py --tenant specs
  local name=$1 policy=$2; shift 2
  local dir=$OUT/$name
  rm -rf "$dir"; mkdir -p "$dir"
  RUST_LOG=${RUST_LOG:-warn} "$SLUICE_BIN" up --engine mocker --http-port "$PORT" \
    --max-num-seqs 128 --num-gpu-blocks 65536 --speedup-ratio "$SPEEDUP" \
    --queue-threshold "$THRESHOLD" --queue-policy "$policy" \
    --max-pending 100000 --max-pending-per-tenant 100000 \
    --api-key-file "$OUT/keys" >"$dir/server.log" 2>&1 &
  server_pid=$!
  wait_ready "http://127.0.0.1:$PORT" "$server_pid" "$dir/server.log"
  echo "== $name ($policy)"
  local args=()
  for t in "$@"; do args+=(--tenant "$t"); done
  $PYTHON "$LOAD" --url "http://127.0.0.1:$PORT" --duration "$DURATION" --warmup "$WARMUP" \
    --out "$dir/results.json" "${args[@]}" | tee "$dir/table.txt"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice_queue_tenant_served_tokens_total' >"$dir/queue_tokens.txt" || true
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
}

started=$(date +%s)
keys 1
run_case alone fair "light:sk-light:rate=$LIGHT_RATE:$ISL:$OSL:0"
run_case contended fair "light:sk-light:rate=$LIGHT_RATE:$ISL:$OSL:0" "heavy:sk-heavy:rate=$HEAVY_RATE:$ISL:$OSL:0"
run_case fcfs fcfs "light:sk-light:rate=$LIGHT_RATE:$ISL:$OSL:0" "heavy:sk-heavy:rate=$HEAVY_RATE:$ISL:$OSL:0"
BACKLOG=("light:sk-light:closed=$CONC:$LIGHT_ISL:$LIGHT_OSL:0" "heavy:sk-heavy:closed=$CONC:$HEAVY_ISL:$HEAVY_OSL:0")
run_case shares-1to1 fair "${BACKLOG[@]}"
run_case priority fair "${BACKLOG[@]}" "vip:sk-vip:rate=$LIGHT_RATE:$ISL:$OSL:1"
keys 3
run_case shares-3to1 fair "${BACKLOG[@]}"
elapsed=$(( $(date +%s) - started ))

$PYTHON - "$OUT" "$RESULT" "$elapsed" <<EOF
import json, sys
out, result, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = ["alone", "contended", "fcfs", "shares-1to1", "shares-3to1", "priority"]
res = {c: json.load(open(f"{out}/{c}/results.json")) for c in cases}
def t(c, name):
    return res[c]["tenants"][name]
ok = True
lines = []
def check(cond, text):
    global ok
    ok &= bool(cond)
    lines.append(f"- {'met' if cond else '**missed**'}: {text}")

alone = t("alone", "light")["ttft_p50_ms"]
cont = t("contended", "light")["ttft_p50_ms"]
fcfs = t("fcfs", "light")["ttft_p50_ms"]
ratio = cont / alone if alone and cont else float("inf")
fcfs_ratio = fcfs / alone if alone and fcfs else float("inf")
check(ratio <= 1.5, f"light TTFT p50 contended / alone = {cont} / {alone} ms = {ratio:.2f} (goal <= 1.5; under fcfs: {fcfs} ms = {fcfs_ratio:.1f}x)")
for case, want in (("shares-1to1", 0.5), ("shares-3to1", 0.75)):
    share = t(case, "heavy")["share"]
    check(share is not None and abs(share - want) <= 0.1 * want,
          f"{case}: heavy's token share {share} (goal {want} +-10%)")
vip = t("priority", "vip")["ttft_p50_ms"]
low = min(t("priority", n)["ttft_p50_ms"] or 1e12 for n in ("light", "heavy"))
check(vip is not None and vip < low, f"priority: vip (priority 1) TTFT p50 {vip} ms < priority-0 tenants' ({low} ms)")
errors = {c: {n: r["errors"] for n, r in res[c]["tenants"].items() if r["errors"]} for c in cases}
errors = {c: e for c, e in errors.items() if e}
check(not errors, f"no request failed {errors if errors else ''}")

with open(result, "w") as f:
    f.write("# Fair share by tenant (issue 18)\n\n")
    f.write("Reproduce: \`tests/bench/fairness/run.sh\` (\`sluice up --engine mocker\`, one worker, "
            f"\`--speedup-ratio $SPEEDUP --queue-threshold $THRESHOLD --max-num-seqs 128\`, API keys "
            "\`sk-light light 1\`, \`sk-heavy heavy W\`, \`sk-vip vip 1\`; load from "
            "\`tests/bench/fairness/load.py\` (the \`openai\` package, one process per tenant), streaming \`/v1/completions\`, random prompts). "
            f"Each case {res['alone']['window_s'] + $WARMUP:.0f} s, measured after a $WARMUP s warm-up; "
            f"whole run {elapsed} s.\n\n")
    f.write("## Goals\n\n" + "\n".join(lines) + "\n\n")
    f.write("## Per case\n\n| case | tenant | priority | load | ISL/OSL | requests | TTFT p50 ms | TTFT p90 ms | served tokens | share |\n|---|---|---:|---|---|---:|---:|---:|---:|---:|\n")
    for c in cases:
        for n, r in res[c]["tenants"].items():
            f.write(f"| {c} | {n} | {r['priority']} | {r['mode']} | {r['isl']}/{r['osl']} | {r['requests']} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | {r['served_tokens']} | {r['share']} |\n")
    f.write("\nServed tokens: prompt tokens at the first token plus each output token as it streamed, "
            "inside the measurement window; share = the tenant's part of the case's total.\n")
import os
notes = os.path.join(os.path.dirname(result), "..", "fairness", "conclusions.md")
if os.path.exists(notes):
    with open(result, "a") as f:
        f.write(open(notes).read())
print(open(result).read())
sys.exit(0 if ok else 1)
EOF
