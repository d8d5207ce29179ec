#!/usr/bin/env python3
"""Per-tenant load for the fairness bench, through the `openai` package.

Each `--tenant NAME:KEY:MODE:ISL:OSL:PRIORITY` sends streaming
`/v1/completions` requests with the `openai` client as the tenant whose API
key is KEY, from a process of its own (so one tenant's chunk parsing never
delays another's clock readings):

  MODE = `rate=R`    open loop, Poisson arrivals at R requests/s
  MODE = `closed=K`  closed loop, K requests in flight at all times

Prompts are ISL random token ids (no two share a prefix, so nothing is
cached), OSL output tokens each (`ignore_eos`). For `--duration` seconds;
requests still running then are awaited (up to `--drain` seconds) and
counted.

Prints, and writes to `--out` as JSON, per tenant: requests, errors (by
status), TTFT p50/p90 of requests that *started* in the measurement window
(`--warmup` s after the start to the end of the duration), and the tokens
served in that window: a request's prompt tokens at its first token, each
output token when its chunk arrives (one chunk per token).
"""

import argparse
import json
import multiprocessing
import random
import sys
import threading
import time

import httpx
import openai


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


class Tenant:
    def __init__(self, spec):
        parts = spec.split(":")
        if len(parts) != 6:
            raise SystemExit(f"--tenant {spec!r}: want NAME:KEY:MODE:ISL:OSL:PRIORITY")
        self.name, self.key, mode, isl, osl, prio = parts
        kind, _, value = mode.partition("=")
        if kind not in ("rate", "closed"):
            raise SystemExit(f"--tenant {spec!r}: MODE is rate=R or closed=K")
        self.mode = kind
        self.value = float(value)
        self.isl, self.osl, self.priority = int(isl), int(osl), int(prio)
        self.lock = threading.Lock()
        self.records = []  # (start, first_token or None, [token times], status)


def one_request(client, tenant, rng_seed, vocab):
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(10, vocab) for _ in range(tenant.isl)]
    start = time.monotonic()
    first, tokens, status = None, [], 200
    try:
        stream = client.completions.create(
            model="sluice-tiny", prompt=prompt, max_tokens=tenant.osl, temperature=0,
            stream=True,
            extra_body={"min_tokens": tenant.osl, "ignore_eos": True,
                        "nvext": {"agent_hints": {"priority": tenant.priority}}},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                now = time.monotonic()
                if first is None:
                    first = now
                tokens.append(now)
    except openai.APIStatusError as e:
        status = e.status_code
    except openai.APIError as e:
        print(f"{tenant.name}: {e}", file=sys.stderr)
        status = -1
    with tenant.lock:
        tenant.records.append((start, first, tokens, status))
    return status


def drive(client, tenant, t0, duration, seed, vocab, threads):
    rng = random.Random(seed)
    end = t0 + duration

    def spawn(i):
        t = threading.Thread(target=one_request, args=(client, tenant, seed * 1_000_003 + i, vocab), daemon=True)
        t.start()
        threads.append(t)
        return t

    if tenant.mode == "rate":
        at, i = t0, 0
        while True:
            at += rng.expovariate(tenant.value)
            if at >= end:
                return
            time.sleep(max(0.0, at - time.monotonic()))
            spawn(i)
            i += 1
    else:
        k = int(tenant.value)
        i = 0

        def loop(slot):
            nonlocal i
            while time.monotonic() < end:
                with tenant.lock:
                    n = i
                    i += 1
                if one_request(client, tenant, seed * 1_000_003 + n, vocab) != 200:
                    time.sleep(0.1)  # a refusal is not a reason to spin

        for slot in range(k):
            t = threading.Thread(target=loop, args=(slot,), daemon=True)
            t.start()
            threads.append(t)


def tenant_process(url, spec, t0, args, n, results):
    """One tenant's load, in a process of its own; its records go back on
    `results`."""
    tenant = Tenant(spec)
    # Enough connections that no request waits for one (httpx's default
    # pool of 100 would hold requests back under the heaviest cases).
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=tenant.key or "none",
                           max_retries=0, timeout=600.0,
                           http_client=openai.DefaultHttpxClient(limits=limits))
    threads = []
    time.sleep(max(0.0, t0 - time.monotonic()))
    drive(client, tenant, t0, args.duration, args.seed + n, args.vocab, threads)
    deadline = t0 + args.duration + args.drain
    for t in list(threads):
        t.join(max(0.0, deadline - time.monotonic()))
    with tenant.lock:
        records = list(tenant.records)
    results.put((tenant.name, records))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--tenant", action="append", required=True)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--drain", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--out")
    args = ap.parse_args()
    tenants = [Tenant(s) for s in args.tenant]
    # CLOCK_MONOTONIC is one clock for every process: each tenant's process
    # starts its load at t0 and sends back its records.
    t0 = time.monotonic() + 2.0
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=tenant_process, args=(args.url, spec, t0, args, n, results), daemon=True)
        for n, spec in enumerate(args.tenant)
    ]
    for p in procs:
        p.start()
    by_name = {}
    for _ in procs:
        name, records = results.get(timeout=args.duration + args.drain + 60)
        by_name[name] = records
    for p in procs:
        p.join()
    for t in tenants:
        t.records = by_name.get(t.name, [])
    w0, w1 = t0 + args.warmup, t0 + args.duration
    report = {"window_s": w1 - w0, "tenants": {}}
    total = 0
    for t in tenants:
        with t.lock:
            records = list(t.records)
        ttft = [f - s for s, f, _, st in records if st == 200 and f is not None and w0 <= s < w1]
        served = 0
        for s, f, toks, st in records:
            if f is not None and w0 <= f < w1:
                served += t.isl
            served += sum(1 for x in toks if w0 <= x < w1)
        errors = {}
        for _, _, _, st in records:
            if st != 200:
                errors[str(st)] = errors.get(str(st), 0) + 1
        total += served
        report["tenants"][t.name] = {
            "priority": t.priority, "isl": t.isl, "osl": t.osl,
            "mode": f"{t.mode}={t.value:g}", "requests": len(records), "errors": errors,
            "ttft_p50_ms": None if not ttft else round(percentile(ttft, 0.5) * 1000, 1),
            "ttft_p90_ms": None if not ttft else round(percentile(ttft, 0.9) * 1000, 1),
            "ttft_n": len(ttft), "served_tokens": served,
        }
    for name, r in report["tenants"].items():
        r["share"] = round(r["served_tokens"] / total, 4) if total else None
        print(f"{name:>8}: prio {r['priority']} {r['mode']:>10} isl {r['isl']} osl {r['osl']}: "
              f"{r['requests']} requests, errors {r['errors']}, TTFT p50 {r['ttft_p50_ms']} ms "
              f"p90 {r['ttft_p90_ms']} ms (n={r['ttft_n']}), served {r['served_tokens']} tokens "
              f"(share {r['share']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
