"""Decode speed of an OpenAI-compatible server, measured with the `openai`
client: batch-1 tokens/s (one stream at a time; time from the first token
to the last, over the tokens after the first) and the aggregate tokens/s of
N concurrent streams (all completion tokens over the wall time from the
first request sent to the last stream ended).

    python decode.py --base-url http://127.0.0.1:8000/v1 --model NAME \
        [--tokens 128] [--reps 3] [--parallel 8] [--json out.json]

Every request is greedy (temperature 0) with ignore_eos where the server
accepts it, so each generates exactly --tokens tokens.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time

import openai

PROMPT = "Write a long story about a river that flows through a city."


async def one(client, model, tokens, extra):
    t0 = time.perf_counter()
    first = None
    count = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            count += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    n = usage if usage is not None else count
    return {"start": t0, "first": first or end, "end": end, "tokens": n}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=a.base_url, api_key="none", timeout=600, max_retries=0)
    extra = {"ignore_eos": True} if a.ignore_eos else {}
    await one(client, a.model, 8, extra)  # warm-up
    single = []
    for _ in range(a.reps):
        r = await one(client, a.model, a.tokens, extra)
        if r["tokens"] > 1:
            single.append((r["tokens"] - 1) / (r["end"] - r["first"]))
    batch = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one(client, a.model, a.tokens, extra) for _ in range(a.parallel)))
        wall = time.perf_counter() - t0
        batch.append(sum(r["tokens"] for r in rs) / wall)
    out = {
        "command": " ".join(sys.argv),
        "tokens": a.tokens,
        "batch1_tok_s": statistics.median(single),
        "batch1_runs": single,
        f"batch{a.parallel}_aggregate_tok_s": statistics.median(batch),
        "batch_runs": batch,
    }
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


asyncio.run(main())
