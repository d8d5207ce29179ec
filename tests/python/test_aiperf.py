"""NVIDIA's aiperf, unmodified, against `sluice up`: its synthetic profile
and a small mooncake-format trace run to completion and their results parse.
aiperf loads the tokenizer from the model directory Sluice serves (no hub)."""

import json
import pathlib
import subprocess
import sys

import pytest

AIPERF = str(pathlib.Path(sys.executable).parent / "aiperf")


def run_aiperf(addr, model_dir, out, *args):
    cmd = [
        AIPERF, "profile",
        "--model", "sluice-tiny",
        "--url", f"http://{addr}",
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", model_dir,
        "--artifact-dir", str(out),
        "--ui-type", "none",
        "--use-server-token-count",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"aiperf failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads((out / "profile_export_aiperf.json").read_text())
    assert results["is_complete"], results.get("error_summary")
    return results


def test_aiperf_synthetic_profile(sluice_up, tmp_path):
    r = run_aiperf(
        sluice_up["addr"], sluice_up["model_dir"], tmp_path / "synthetic",
        "--synthetic-input-tokens-mean", "64",
        "--output-tokens-mean", "16",
        "--extra-inputs", "ignore_eos:true",
        "--request-count", "16",
        "--concurrency", "4",
    )
    assert r["request_count"]["avg"] == 16
    assert r["time_to_first_token"]["avg"] > 0
    assert r["output_sequence_length"]["avg"] == pytest.approx(16, abs=1)
    assert not r.get("error_summary"), r["error_summary"]


def test_aiperf_mooncake_trace(sluice_up, tmp_path):
    # Mooncake format: 512-token blocks; rows 2 and 3 share row 1's prefix.
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]},
        {"timestamp": 50, "input_length": 700, "output_length": 8, "hash_ids": [1, 3]},
        {"timestamp": 100, "input_length": 1000, "output_length": 8, "hash_ids": [1, 4]},
        {"timestamp": 150, "input_length": 300, "output_length": 8, "hash_ids": [5]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_aiperf(
        sluice_up["addr"], sluice_up["model_dir"], tmp_path / "mooncake",
        "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace",
        "--fixed-schedule",
        "--extra-inputs", "ignore_eos:true",
    )
    assert r["request_count"]["avg"] == len(rows)
    assert r["time_to_first_token"]["count"] == len(rows)
