"""Writes the device run's results (device.sh's last step): a dated markdown
section for tests/bench/results/cuda.md and every raw record as JSON, from
the work folder the run filled. Every figure in the section is one the run
measured; a step that failed or wrote nothing is said so.

    python3 report.py WORK OUT

WORK holds info.json, steps.jsonl, bench.jsonl (cuda_gpu's records),
torch.json (torch_baseline.py), e2e.json (e2e.py) and parity.log; OUT gets
cuda_section.md and cuda_raw.json. Exits 0 even when goals are not met (the
section says which); 1 only if WORK has no info.json.
"""

import datetime
import json
import pathlib
import re
import sys

EIGHT_B = "Llama-3-8B shape (random weights)"


def load(path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def lines(path):
    try:
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    except (OSError, ValueError):
        return []


def goals(records, torch, e2e):
    """Issue 40's goals as (text, met or None when not measured)."""
    parity = [r for r in records if r["kind"] == "parity" and r["set"] == "gpu_transformers"]
    decode = {r["batch"]: r for r in records if r["kind"] == "decode" and r["model"] == EIGHT_B}
    prefill = {r["tokens"]: r for r in records if r["kind"] == "prefill" and r["model"] == EIGHT_B}
    out = []
    cases = {r["case"] for r in parity}
    ok = len(cases) >= 2 and all(
        r["worst_rel_err"] < r["tolerance"] and r["greedy_equal"] == r["greedy_compared"] for r in parity)
    out.append(("parity: both architectures within bf16 tolerance, identical greedy tokens, against "
                "transformers on the same GPU", ok if parity else None))
    b1 = decode.get(1)
    if b1:
        share = b1["roofline_ms_per_step"] / b1["ms_per_step"]
        out.append((f"8B shape batch-1 decode >= 80% of the bandwidth roofline: {share:.0%}", share >= 0.8))
    else:
        out.append(("8B shape batch-1 decode >= 80% of the bandwidth roofline", None))
    peer = (torch or {}).get("generate", {}).get("decode_tokens_per_s")
    if b1 and peer:
        x = b1["tokens_per_s"] / peer
        out.append((f"batch-1 decode >= 2x transformers' generate: {x:.2f}x", x >= 2.0))
    else:
        out.append(("batch-1 decode >= 2x transformers' generate", None))
    if 1 in decode and 32 in decode:
        x = decode[32]["tokens_per_s"] / decode[1]["tokens_per_s"]
        out.append((f"batch 32 >= 15x batch 1's tokens/s: {x:.1f}x", x >= 15.0))
    else:
        out.append(("batch 32 >= 15x batch 1's tokens/s", None))
    if 32 in decode and 128 in decode:
        x = decode[128]["tokens_per_s"] / decode[32]["tokens_per_s"]
        out.append((f"batch 128 no lower than batch 32: {x:.2f}x", x >= 1.0))
    else:
        out.append(("batch 128 no lower than batch 32", None))
    peak = (torch or {}).get("bf16_dense_flops_per_s")
    if 2048 in prefill and peak:
        r = prefill[2048]
        share = r["flops"] / (r["ms"] / 1e3) / peak
        out.append((f"prefill of 2,048 tokens >= 40% of bf16 dense peak: {share:.0%}", share >= 0.4))
    else:
        out.append(("prefill of 2,048 tokens >= 40% of bf16 dense peak", None))
    out.append(("`sluice up --engine cuda` serves the openai client", e2e.get("ok") if e2e else None))
    return out


def section(info, steps, records, torch, e2e, tests, now):
    yes = {True: "yes", False: "**no**", None: "not measured"}
    md = [f"## GPU run {now:%Y-%m-%d %H:%M} UTC (issue 40; written by `tests/bench/cuda/device.sh`)", ""]
    md.append(f"{info.get('device')} (compute capability {info.get('capability')}, {info.get('memory')}), "
              f"driver {info.get('driver')}, CUDA {info.get('cuda')} (PyTorch {info.get('torch')}); "
              f"Sluice commit {info.get('build_commit', '?')}, built {info.get('build_date', '?')}.")
    md += ["", "| step | exit | seconds |", "|---|---:|---:|"]
    md += [f"| {s['step']} | {s['rc']} | {s['secs']} |" for s in steps]
    md += ["", f"cuda_gpu tests: {tests}", ""]
    md += ["| goal | met |", "|---|---|"] + [f"| {g} | {yes[m]} |" for g, m in goals(records, torch, e2e)]
    parity = [r for r in records if r["kind"] == "parity"]
    if parity:
        md += ["", "Parity (every prefill and teacher-forced decode row; greedy token after each row):", "",
               "| reference | case | worst row error | tolerance | greedy equal | near-ties |",
               "|---|---|---:|---:|---:|---:|"]
        md += [f"| {r['set']} | {r['case']} | {r['worst_rel_err']:.2e} | {r['tolerance']:.0e} | "
               f"{r['greedy_equal']}/{r['greedy_compared']} | {r['greedy_near_ties']} |" for r in parity]
    models = []
    for r in records:
        if r["kind"] in ("decode", "prefill") and r["model"] not in models:
            models.append(r["model"])
    for m in models:
        dec = [r for r in records if r["kind"] == "decode" and r["model"] == m]
        pre = [r for r in records if r["kind"] == "prefill" and r["model"] == m]
        md += ["", f"{m}:", ""]
        if dec:
            bw = dec[0]["copy_bandwidth_bytes_per_s"]
            md += [f"Weights read per decode step {dec[0]['weight_bytes'] / 1e9:.2f} GB; copy bandwidth "
                   f"{bw / 1e9:.0f} GB/s (measured by the run, read + written); context {dec[0]['context']}.", "",
                   "| batch | tokens/s | ms/step | roofline ms/step | share of roofline |",
                   "|---:|---:|---:|---:|---:|"]
            md += [f"| {r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.3f} | "
                   f"{r['roofline_ms_per_step']:.3f} | {r['roofline_ms_per_step'] / r['ms_per_step']:.0%} |"
                   for r in dec]
        if pre:
            peak = (torch or {}).get("bf16_dense_flops_per_s")
            md += ["", "| prompt tokens | ms | TFLOP/s | share of bf16 peak |", "|---:|---:|---:|---:|"]
            for r in pre:
                rate = r["flops"] / (r["ms"] / 1e3)
                share = f"{rate / peak:.0%}" if peak else "–"
                md.append(f"| {r['tokens']} | {r['ms']:.2f} | {rate / 1e12:.0f} | {share} |")
    if torch:
        g = torch.get("generate", {})
        md += ["", f"PyTorch {torch.get('torch')}, transformers {torch.get('transformers')} on the same GPU: copy "
               f"bandwidth {torch['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, bf16 dense "
               f"{torch['bf16_dense_flops_per_s'] / 1e12:.0f} TFLOP/s (8192^3 products); on the 8B shape, "
               f"`generate` (batch {g.get('batch')}, {g.get('cache')} cache, {g.get('context')}-token prompt) "
               f"{g.get('decode_tokens_per_s', float('nan')):.1f} decode tokens/s, prefill of 512 / 2,048 tokens "
               f"{torch.get('prefill_512_ms', float('nan')):.1f} / {torch.get('prefill_2048_ms', float('nan')):.1f} ms."]
    if e2e:
        md += ["", "Serving: " + ", ".join(f"{k}: {'yes' if v else '**no**'}" for k, v in e2e["checks"].items())
               + f" (model `{e2e.get('model')}`)."]
    return "\n".join(md) + "\n"


def test_summary(log):
    """The libtest summary line of the parity step, and any failed tests."""
    try:
        text = log.read_text()
    except OSError:
        return "no output"
    result = re.findall(r"^test result: .*$", text, re.M)
    failed = re.findall(r"^test (\S+) \.\.\. FAILED$", text, re.M)
    out = result[-1] if result else "no summary (the step did not finish)"
    return out + (f"; failed: {', '.join(failed)}" if failed else "")


def main(work, out):
    work, out = pathlib.Path(work), pathlib.Path(out)
    info = load(work / "info.json")
    if info is None:
        print(f"no {work / 'info.json'}: the info step did not run", file=sys.stderr)
        return 1
    steps = lines(work / "steps.jsonl")
    records = lines(work / "bench.jsonl")
    torch = load(work / "torch.json")
    e2e = load(work / "e2e.json")
    tests = test_summary(work / "parity.log")
    now = datetime.datetime.now(datetime.timezone.utc)
    md = section(info, steps, records, torch, e2e, tests, now)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_section.md").write_text(md)
    raw = {"info": info, "steps": steps, "records": records, "torch": torch, "e2e": e2e, "tests": tests,
           "written": now.isoformat()}
    (out / "cuda_raw.json").write_text(json.dumps(raw, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
