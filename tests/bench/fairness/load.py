#!/usr/bin/env python3
"""Per-tenant load for the fairness bench (standard library only).

Each `--tenant NAME:KEY:MODE:ISL:OSL:PRIORITY` sends streaming
`/v1/completions` requests as the tenant whose API key is KEY:

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
import http.client
import json
import random
import sys
import threading
import time
from urllib.parse import urlparse


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


def one_request(url, tenant, rng_seed, vocab):
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(10, vocab) for _ in range(tenant.isl)]
    body = json.dumps({
        "model": "sluice-tiny", "prompt": prompt, "max_tokens": tenant.osl,
        "min_tokens": tenant.osl, "ignore_eos": True, "temperature": 0,
        "stream": True, "nvext": {"agent_hints": {"priority": tenant.priority}},
    })
    headers = {"content-type": "application/json"}
    if tenant.key:
        headers["authorization"] = f"Bearer {tenant.key}"
    start = time.monotonic()
    first, tokens, status = None, [], 0
    try:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        status = resp.status
        if status != 200:
            resp.read()
        else:
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                choices = msg.get("choices") or []
                if choices and choices[0].get("finish_reason") is None:
                    now = time.monotonic()
                    if first is None:
                        first = now
                    tokens.append(now)
        conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        print(f"{tenant.name}: {e}", file=sys.stderr)
        status = -1
    with tenant.lock:
        tenant.records.append((start, first, tokens, status))
    return status


def drive(url, tenant, t0, duration, seed, vocab, threads):
    rng = random.Random(seed)
    end = t0 + duration

    def spawn(i):
        t = threading.Thread(target=one_request, args=(url, tenant, seed * 1_000_003 + i, vocab), daemon=True)
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
                if one_request(url, tenant, seed * 1_000_003 + n, vocab) != 200:
                    time.sleep(0.1)  # a refusal is not a reason to spin

        for slot in range(k):
            t = threading.Thread(target=loop, args=(slot,), daemon=True)
            t.start()
            threads.append(t)


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
    url = urlparse(args.url)
    tenants = [Tenant(s) for s in args.tenant]
    threads = []
    t0 = time.monotonic()
    drivers = [
        threading.Thread(target=drive, args=(url, t, t0, args.duration, args.seed + n, args.vocab, threads), daemon=True)
        for n, t in enumerate(tenants)
    ]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join()
    deadline = t0 + args.duration + args.drain
    for t in list(threads):
        t.join(max(0.0, deadline - time.monotonic()))
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
