"""The host side of issue 40's device run: report.py turns the run's records
into the results section and judges the goals from the measured figures
(no GPU needed: the records are written here as the run writes them)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPORT = ROOT / "tests/bench/cuda/report.py"
EIGHT_B = "Llama-3-8B shape (random weights)"


def decode(batch, tps, ms, roof_ms):
    return {"kind": "decode", "model": EIGHT_B, "batch": batch, "context": 256, "tokens_per_s": tps,
            "ms_per_step": ms, "roofline_ms_per_step": roof_ms, "weight_bytes": 16_060_000_000,
            "copy_bandwidth_bytes_per_s": 4.3e12, "device": "NVIDIA H200"}


def write_run(work, *, b1_ms, greedy_equal=32, e2e_ok=True):
    work.mkdir(parents=True, exist_ok=True)
    (work / "info.json").write_text(json.dumps({
        "device": "NVIDIA H200", "driver": "580.159.04", "memory": "143771 MiB", "cuda": "13.0",
        "torch": "2.11.0", "capability": "9.0", "build_commit": "abc1234", "build_date": "2026-11-29T05:00Z"}))
    (work / "steps.jsonl").write_text("".join(json.dumps({"step": s, "rc": 0, "secs": 10.0}) + "\n"
                                              for s in ("info", "reference", "parity", "serve", "speed_8b", "peer")))
    records = [
        {"kind": "parity", "set": "gpu_transformers", "case": c, "worst_rel_err": 0.012, "tolerance": 0.03,
         "greedy_compared": 32, "greedy_equal": greedy_equal, "greedy_near_ties": 32 - greedy_equal}
        for c in ("llama_gpu", "qwen2_gpu")
    ]
    # Roofline 4.0 ms a step at batch 1.
    records += [decode(1, 1000 / b1_ms, b1_ms, 4.0), decode(8, 1900, 4.2, 4.1),
                decode(32, 6400, 5.0, 4.4), decode(128, 20000, 6.4, 5.6)]
    # 2,048 tokens: 33 TFLOP in 100 ms = 330 TFLOP/s, 42% of a 790 TFLOP/s peak.
    records += [{"kind": "prefill", "model": EIGHT_B, "tokens": 2048, "ms": 100.0, "flops": 33e12,
                 "device": "NVIDIA H200"}]
    (work / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (work / "torch.json").write_text(json.dumps({
        "torch": "2.11.0", "transformers": "5.17.0", "cuda": "13.0", "device": "NVIDIA H200",
        "copy_bandwidth_bytes_per_s": 4.3e12, "bf16_dense_flops_per_s": 790e12,
        "prefill_512_ms": 30.0, "prefill_2048_ms": 120.0,
        "generate": {"batch": 1, "context": 256, "new_tokens": 128, "cache": "static", "total_s": 1.0,
                     "decode_tokens_per_s": 100.0}}))
    (work / "e2e.json").write_text(json.dumps({"model": "sluice-tiny", "ok": e2e_ok,
                                               "checks": {"chat has text": e2e_ok}}))
    (work / "parity.log").write_text("test a ... ok\n\ntest result: ok. 9 passed; 0 failed; 0 ignored\n")


def report(tmp_path, **kw):
    work, out = tmp_path / "work", tmp_path / "out"
    write_run(work, **kw)
    subprocess.run([sys.executable, str(REPORT), str(work), str(out)], check=True, capture_output=True)
    return (out / "cuda_section.md").read_text(), json.loads((out / "cuda_raw.json").read_text())


def goal(md, start):
    rows = [l for l in md.splitlines() if l.startswith(f"| {start}")]
    assert len(rows) == 1, (start, md)
    return rows[0].rsplit("|", 2)[1].strip()


def test_goals_are_judged_from_the_measured_figures(tmp_path):
    # Batch 1 at 4.8 ms against a 4.0 ms roofline: 83%, 208 tokens/s = 2.08x
    # transformers' 100; batch 32 6400 / 208 = 30.7x.
    md, raw = report(tmp_path, b1_ms=4.8)
    assert md.startswith("## GPU run ")
    assert "NVIDIA H200 (compute capability 9.0, 143771 MiB), driver 580.159.04, CUDA 13.0" in md
    assert "Sluice commit abc1234" in md
    assert goal(md, "parity: both") == "yes"
    assert "83%" in md and goal(md, "8B shape batch-1 decode") == "yes"
    assert "2.08x" in md and goal(md, "batch-1 decode >= 2x") == "yes"
    assert goal(md, "batch 32 >= 15x") == "yes"
    assert goal(md, "batch 128 no lower") == "yes"
    assert "42%" in md and goal(md, "prefill of 2,048 tokens") == "yes"
    assert goal(md, "`sluice up --engine cuda`") == "yes"
    assert "test result: ok. 9 passed" in md
    assert len(raw["records"]) == 7 and raw["info"]["build_commit"] == "abc1234"


def test_a_missed_goal_and_a_greedy_mismatch_say_no(tmp_path):
    # 6 ms a step: 67% of the roofline, 167 tokens/s = 1.67x transformers.
    md, _ = report(tmp_path, b1_ms=6.0, greedy_equal=31, e2e_ok=False)
    assert goal(md, "parity: both") == "**no**"
    assert "67%" in md and goal(md, "8B shape batch-1 decode") == "**no**"
    assert goal(md, "batch-1 decode >= 2x") == "**no**"
    assert goal(md, "`sluice up --engine cuda`") == "**no**"


def test_a_step_that_wrote_nothing_is_not_measured(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    write_run(work, b1_ms=4.8)
    (work / "torch.json").unlink()
    (work / "bench.jsonl").write_text("")
    subprocess.run([sys.executable, str(REPORT), str(work), str(out)], check=True, capture_output=True)
    md = (out / "cuda_section.md").read_text()
    assert goal(md, "8B shape batch-1 decode") == "not measured"
    assert goal(md, "batch-1 decode >= 2x") == "not measured"
    assert goal(md, "parity: both") == "not measured"


def test_the_device_runs_openai_check_passes_against_sluice_up(sluice, tmp_path):
    # e2e.py is what the device run points at `sluice up --engine cuda`;
    # here it runs against the CPU engine, with this venv's openai client.
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, str(ROOT / "tests/bench/cuda/e2e.py"), f"http://{sluice}", str(out)],
                   check=True, capture_output=True, timeout=120)
    seen = json.loads(out.read_text())
    assert seen["ok"] and all(seen["checks"].values()), seen
