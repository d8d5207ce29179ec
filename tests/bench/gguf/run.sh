#!/usr/bin/env bash
# Sluice's GGUF path beside llama.cpp on the same file, in one sitting
# (issue 37): SmolLM2-135M-Instruct Q4_1, 2 threads.
#
# 1. llama.cpp (llama-cpp-python, built with AMX off): batch-1 decode
#    tokens/s and the aggregate of 8 sequences decoding together, in
#    process (tests/bench/gguf/llamacpp.py; no HTTP, so an upper bound for
#    llama-server).
# 2. llama.cpp's llama-server (8 slots, continuous batching) through its
#    OpenAI API with the same client as Sluice, when it is built
#    (tests/bench/gguf/build_llama_server.sh: the same llama.cpp as 1).
# 3. Sluice: `sluice up --model FILE.gguf` on defaults, measured through the
#    OpenAI API with the `openai` package (tests/bench/gguf/decode.py): the
#    batch-1 stream's tokens/s after its first token, and the aggregate of 8
#    concurrent streams.
#
# Writes tests/bench/results/gguf.md with the exact commands.
# Environment: SLUICE_BIN [builds target/release/sluice], GGUF
# [models/SmolLM2-135M-Instruct.Q4_1.gguf, `make model-smollm2`],
# LLAMACPP_PY [/tmp/llamacpp-venv/bin/python; see llamacpp.py for its
# build], LLAMA_SERVER [/tmp/llama-server-0.3.36/llama-server; skipped when
# absent], PY [.venv/bin/python], REPS [3].
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"
GGUF=${GGUF:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMACPP_PY=${LLAMACPP_PY:-/tmp/llamacpp-venv/bin/python}
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/llama-server-0.3.36/llama-server}
PY=${PY:-$ROOT/.venv/bin/python}
REPS=${REPS:-3}
OUT=${OUT:-$ROOT/target/bench/gguf}
RESULT=$ROOT/tests/bench/results/gguf.md
# shellcheck source=../lib.sh
. "$ROOT/tests/bench/lib.sh"
[ -f "$GGUF" ] || make -s model-smollm2
ensure_sluice_bin
rm -rf "$OUT"; mkdir -p "$OUT"
server_pid=""
cleanup() { [ -n "$server_pid" ] && { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }; }
trap cleanup EXIT

llama_cmd="$LLAMACPP_PY tests/bench/gguf/llamacpp.py --model $GGUF --threads 2 --gen 128 --reps $REPS --parallel 8 --json $OUT/llamacpp.json"
echo "+ $llama_cmd"
$llama_cmd >"$OUT/llamacpp.log" 2>&1 || { cat "$OUT/llamacpp.log"; exit 1; }

server_cmd=""
llama_server_cmd=""
if [ -x "$LLAMA_SERVER" ]; then
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # 8 slots of 512 tokens (prompt ~40 + 128 generated).
  server_cmd="$LLAMA_SERVER --model $GGUF --threads 2 --threads-batch 2 --parallel 8 --ctx-size 4096 --host 127.0.0.1 --port $port"
  echo "+ $server_cmd"
  $server_cmd >"$OUT/llama-server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 120); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$OUT/llama-server.log"; exit 1; }
    sleep 0.5
  done
  llama_server_cmd="$PY tests/bench/gguf/decode.py --base-url http://127.0.0.1:$port/v1 --model $(basename "$GGUF" .gguf) --tokens 128 --reps $REPS --parallel 8 --ignore-eos --json $OUT/llama-server.json"
  echo "+ $llama_server_cmd"
  $llama_server_cmd >"$OUT/llama-server.client.log"
  cleanup; server_pid=""
fi

log=$OUT/sluice.server.log
up_cmd="$SLUICE_BIN up --model $GGUF --http-port 0"
echo "+ $up_cmd"
start_sluice_up "$log" --model "$GGUF"
model=$(basename "$GGUF" .gguf)
sluice_cmd="$PY tests/bench/gguf/decode.py --base-url http://$addr/v1 --model $model --tokens 128 --reps $REPS --parallel 8 --ignore-eos --json $OUT/sluice.json"
echo "+ $sluice_cmd"
$sluice_cmd >"$OUT/sluice.log"
cleanup; server_pid=""

"$PY" - "$OUT" "$RESULT" "$llama_cmd" "$server_cmd" "$llama_server_cmd" "$up_cmd" "$sluice_cmd" <<'PYEOF'
import datetime, json, os, sys
out, result, llama_cmd, server_cmd, llama_server_cmd, up_cmd, sluice_cmd = sys.argv[1:]
l = json.load(open(f"{out}/llamacpp.json"))
s = json.load(open(f"{out}/sluice.json"))
l1 = l["single"]["decode_tok_s_median"]
l8 = l["parallel"]["aggregate_tok_s_median"]
s1, s8 = s["batch1_tok_s"], s["batch8_aggregate_tok_s"]
rows = [
    f"| llama.cpp (in process) | {l1:.1f} | {l8:.1f} |",
]
server_rows, commands = [], [llama_cmd]
if server_cmd and os.path.exists(f"{out}/llama-server.json"):
    v = json.load(open(f"{out}/llama-server.json"))
    v1, v8 = v["batch1_tok_s"], v["batch8_aggregate_tok_s"]
    rows.append(f"| llama-server (`--parallel 8`, OpenAI API) | {v1:.1f} | {v8:.1f} |")
    server_rows.append(f"| Sluice / llama-server | {s1 / v1:.2f} | {s8 / v8:.2f} |")
    commands += [server_cmd, llama_server_cmd]
commands += [up_cmd, sluice_cmd]
rows.append(f"| Sluice (`sluice up`, OpenAI API) | {s1:.1f} | {s8:.1f} |")
rows.append(f"| Sluice / llama.cpp in process | {s1 / l1:.2f} | {s8 / l8:.2f} |")
rows += server_rows
table = "\n".join(rows)
cmds = "\n".join(f"    {c}" for c in commands)
section = f"""
## {datetime.date.today()}: SmolLM2-135M-Instruct Q4_1, 2 threads

| | batch 1 decode tok/s | 8 streams, aggregate tok/s |
|---|---|---|
{table}

Goals (issue 37): batch 1 >= 1.0, 8 streams >= 1.5 against llama.cpp's
server (its in-process batch is an upper bound for it).

Commands:

{cmds}
"""
try:
    old = open(result).read()
except FileNotFoundError:
    old = "# Sluice's GGUF path beside llama.cpp\n\nWritten by tests/bench/gguf/run.sh; newest first.\n"
# The new section goes after the file's preamble, before the newest one.
cut = old.find("\n## ")
head, body = (old, "") if cut < 0 else (old[:cut + 1], old[cut + 1:])
open(result, "w").write(head + section.lstrip("\n") + "\n" + body)
print(section)
PYEOF
