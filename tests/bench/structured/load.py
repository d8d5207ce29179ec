"""Load and summary for tests/bench/structured/run.sh (see there)."""

import argparse
import asyncio
import datetime
import json
import os
import time

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "n"],
        "additionalProperties": False,
    },
}


async def batch(client, b, osl, constrained, seed):
    extra = {"ignore_eos": True}
    kwargs = {}
    if constrained:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA}}

    async def one(i):
        r = await client.chat.completions.create(
            model="sluice-tiny", messages=[{"role": "user", "content": f"List rows {i}."}],
            max_tokens=osl, temperature=1.0, seed=seed + i, extra_body=extra, **kwargs,
        )
        return r.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(b))))
    return tokens / (time.perf_counter() - start)


async def run(args):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=600)
    await batch(client, 2, 8, True, 0)  # warm-up (and the first grammar compile)
    rows = []
    for b in [int(x) for x in args.batches.split()]:
        for r in range(args.rounds):
            free = await batch(client, b, args.osl, False, 100 * r)
            constrained = await batch(client, b, args.osl, True, 100 * r)
            rows.append({"batch": b, "round": r, "free": free, "constrained": constrained})
    json.dump({"engine": args.engine, "osl": args.osl, "rows": rows}, open(args.out, "w"))


def summary(args):
    lines = [
        "# Structured outputs: the cost of a grammar while decoding",
        "",
        "Written by `tests/bench/structured/run.sh`; do not edit by hand.",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on a shared 2-core machine.",
        "",
        "B concurrent chat requests through `sluice up` (the `openai` package, `ignore_eos`, same token count",
        "both ways): free text, then under a JSON schema (an array of bounded objects), interleaved per round.",
        "Masks are computed on the rayon pool beside the forward pass (llguidance).",
        "",
        "Commands:",
        "",
        *[f"- `{l.strip()}`" for l in open(os.path.join(args.summary, "commands"))],
        "",
        "| engine | batch | free tok/s (mean) | constrained tok/s (mean) | constrained / free | per round |",
        "|---|---:|---:|---:|---:|---|",
    ]
    goals = []
    for engine in args.engines.split():
        data = json.load(open(os.path.join(args.summary, f"{engine}.json")))
        for b in sorted({r["batch"] for r in data["rows"]}):
            rs = [r for r in data["rows"] if r["batch"] == b]
            free = sum(r["free"] for r in rs) / len(rs)
            con = sum(r["constrained"] for r in rs) / len(rs)
            per = " ".join(f"{r['constrained'] / r['free']:.2f}" for r in rs)
            lines.append(f"| {engine} | {b} | {free:.1f} | {con:.1f} | {con / free:.1%} | {per} |")
            if engine == "cpu":
                goals.append((b, con / free))
    lines += ["", *[f"- cpu, batch {b}: constrained at {r:.1%} of free -> goal (>= 90%) {'met' if r >= 0.9 else '**missed**'}" for b, r in goals]]
    open(args.result, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url")
    p.add_argument("--engine")
    p.add_argument("--batches", default="1 32")
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--summary")
    p.add_argument("--result")
    p.add_argument("--engines", default="cpu mocker")
    a = p.parse_args()
    summary(a) if a.summary else asyncio.run(run(a))
