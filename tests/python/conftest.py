"""Starts a real `sluice up` (built-in model, CPU engine) for the client tests."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sluice_up():
    """A running `sluice up`: {"addr": host:port, "model_dir": its built-in model}."""
    binary = os.environ.get("SLUICE_BIN", "target/debug/sluice")
    port = _free_port()
    cache = tempfile.mkdtemp(prefix="sluice-models-")
    log = tempfile.NamedTemporaryFile(prefix="sluice-up-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [binary, "up", "--http-port", str(port), "--model-cache", cache, "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    addr = f"127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice up exited with {proc.returncode}; log: {open(log.name).read()}")
        try:
            with urllib.request.urlopen(f"http://{addr}/ready", timeout=1) as r:
                if json.load(r).get("ready"):
                    break
        except Exception:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"sluice up not ready in 60 s; log: {open(log.name).read()}")
        time.sleep(0.2)
    yield {"addr": addr, "model_dir": os.path.join(cache, "sluice-tiny")}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    output = open(log.name).read()
    os.unlink(log.name)
    assert proc.returncode == 0, f"sluice up did not shut down cleanly; log: {output}"


@pytest.fixture(scope="session")
def sluice(sluice_up):
    """Base address (host:port) of a running `sluice up`."""
    return sluice_up["addr"]
