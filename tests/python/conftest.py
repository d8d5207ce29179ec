"""Starts a real `sluice up` (built-in model, CPU engine) for the client tests."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest


def _listening(log_path: str):
    """The address `sluice up --http-port 0` reports once bound, if it has."""
    with open(log_path, errors="replace") as f:
        m = re.search(r"^listening on (\S+)$", f.read(), re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="session")
def sluice_up():
    """A running `sluice up`: {"addr": host:port, "model_dir": its built-in model}."""
    binary = os.environ.get("SLUICE_BIN", "target/debug/sluice")
    cache = tempfile.mkdtemp(prefix="sluice-models-")
    log = tempfile.NamedTemporaryFile(prefix="sluice-up-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        # Port 0: the process binds one itself and reports it (nothing to
        # race with between picking a port here and binding it there).
        [binary, "up", "--http-port", "0", "--model-cache", cache, "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    addr = None
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice up exited with {proc.returncode}; log: {open(log.name).read()}")
        addr = addr or _listening(log.name)
        try:
            if addr is None:
                raise RuntimeError("not listening yet")
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
