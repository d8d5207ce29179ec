#!/usr/bin/env bash
# What enforcing a JSON schema while decoding costs (issue 36): decode
# tokens/s with and without a grammar, through `sluice up`, with the `openai`
# package as the client, in one sitting.
#
# On the cpu engine (the built-in model's real compute; the mocker samples
# nothing, so it gets no grammar), for each batch B in BATCHES, B concurrent chat requests of OSL
# tokens each (`ignore_eos`, so both runs decode the same count), first free
# text, then under a JSON schema (an array of bounded objects; once the
# schema completes, the grammar allows only EOS, still masked every step).
# Interleaved ROUNDS times; the ratio is constrained / free output tokens/s.
# Goal: >= 90% at batch 1 and 32 on the cpu engine.
#
# Writes tests/bench/results/structured_outputs.md with the commands.
# Environment: SLUICE_BIN [builds target/release/sluice], ENGINES ["cpu"],
# BATCHES ["1 32"], OSL [128], ROUNDS [3], PY [.venv/bin/python].
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
ENGINES=${ENGINES:-cpu}
BATCHES=${BATCHES:-1 32}
OSL=${OSL:-128}
ROUNDS=${ROUNDS:-3}
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/target/bench/structured}
RESULT=$ROOT/tests/bench/results/structured_outputs.md
# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"
server_pid=""
cleanup() { [ -n "$server_pid" ] && { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }; }
trap cleanup EXIT
: >"$OUT/commands"
for engine in $ENGINES; do
  log=$OUT/$engine.server.log
  echo "sluice up --engine $engine --http-port 0" >>"$OUT/commands"
  start_sluice_up "$log" --engine "$engine"
  echo "python tests/bench/structured/load.py --url http://ADDR/v1 --engine $engine --batches \"$BATCHES\" --osl $OSL --rounds $ROUNDS" >>"$OUT/commands"
  "$PY" tests/bench/structured/load.py --url "http://$addr/v1" --engine "$engine" \
    --batches "$BATCHES" --osl "$OSL" --rounds "$ROUNDS" --out "$OUT/$engine.json"
  cleanup; server_pid=""
done
"$PY" tests/bench/structured/load.py --summary "$OUT" --result "$RESULT" --engines "$ENGINES"
