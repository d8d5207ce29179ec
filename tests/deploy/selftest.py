"""Proves check_deploy.py catches broken manifests: copies deploy/ into a
temporary directory, breaks one thing at a time, and expects the checker
to fail naming it; the untouched copy must pass.

Usage: selftest.py [--root REPO] [--sluice PATH]  (same environment as
validate.sh: run it with the venv's python). Ends with "N passed, N failed".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (what is broken, file under deploy/, old text, new text, expected output,
#  needs the sluice binary)
MUTATIONS = [
    (
        "a port given as a string",
        "k8s/base/router.yaml",
        "containerPort: 7001",
        'containerPort: "7001"',
        "FAIL deploy/k8s/base: kubernetes-validate",
        False,
    ),
    (
        "an unknown Deployment field",
        "k8s/base/queue.yaml",
        "  replicas: 2\n",
        "  replicas: 2\n  replica: 1\n",
        "Additional properties are not allowed",
        False,
    ),
    (
        "invalid YAML in an overlay",
        "k8s/overlays/cpu/kustomization.yaml",
        "resources:\n",
        "resources: [\n",
        "FAIL parse every YAML/JSON file",
        False,
    ),
    (
        "compose ports that are not a list",
        "compose.yaml",
        '    ports:\n      - "8000:8000"     # OpenAI HTTP API and gRPC Inference\n',
        "    ports: 8000\n",
        "FAIL deploy/compose.yaml: compose-spec schema",
        False,
    ),
    (
        "two compose workers advertising one address",
        "compose.yaml",
        "--advertise=decode-2:7003",
        "--advertise=decode-1:7003",
        "advertise the same decode-1:7003",
        False,
    ),
    (
        "a frontend readiness probe on the wrong path",
        "k8s/base/frontend.yaml",
        "path: /ready",
        "path: /readyz",
        "readiness is not HTTP /ready",
        False,
    ),
    (
        "GPU workers without their GPU",
        "k8s/overlays/gpu/kustomization.yaml",
        "        path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu\n        value: 1",
        "        path: /spec/template/spec/containers/0/resources/requests/cpu\n        value: 1",
        "workers must request nvidia.com/gpu",
        False,
    ),
    (
        "SLUICE_ADVERTISE not from the pod IP",
        "k8s/base/prefill.yaml",
        "value: $(POD_IP):7004",
        "value: prefill:7004",
        "SLUICE_ADVERTISE is 'prefill:7004'",
        False,
    ),
    (
        "a Dockerfile running as root",
        "Dockerfile",
        "USER 10001:10001",
        "USER root",
        "non-root USER",
        False,
    ),
    (
        "a single queue replica in Kubernetes",
        "k8s/base/queue.yaml",
        "  replicas: 2\n",
        "  replicas: 1\n",
        "1 queue replica(s); at least 2 must run",
        False,
    ),
    (
        "a router scaled down to one by an overlay",
        "k8s/overlays/mocker/kustomization.yaml",
        "replicas:\n",
        "replicas:\n  - name: router\n    count: 1\n",
        "1 router replica(s); at least 2 must run",
        False,
    ),
    (
        "a single router service in compose",
        "compose.yaml",
        "  router-2:\n"
        "    <<: *router\n"
        "    command:\n"
        "      - router\n"
        "      - --etcd=http://etcd:2379\n"
        "      - --listen=0.0.0.0:7001\n"
        "      - --advertise=router-2:7001\n"
        "      - --router-mode=latency\n\n",
        "",
        "1 service(s) run router; at least 2 must",
        False,
    ),
    (
        "an invented compose flag",
        "compose.yaml",
        "      - --advertise=queue-1:7002\n      - --queue-policy=strict\n",
        "      - --advertise=queue-1:7002\n      - --queue-policy=strict\n      - --no-such-flag=1\n",
        "has no flag --no-such-flag",
        True,
    ),
    (
        "a misspelt SLUICE_ variable in a ConfigMap",
        "k8s/base/kustomization.yaml",
        "SLUICE_ROUTER_MODE=latency",
        "SLUICE_ROUTER_MOOD=latency",
        "reads no SLUICE_ROUTER_MOOD",
        True,
    ),
]


def run_checker(root: Path, sluice: str | None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(HERE / "check_deploy.py"), "--root", str(root)]
    env = dict(os.environ)
    env.pop("SLUICE_BIN", None)
    if sluice:
        cmd += ["--sluice", sluice]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", type=Path, default=HERE.parents[1])
    ap.add_argument("--sluice", default=os.environ.get("SLUICE_BIN"))
    opts = ap.parse_args()
    root = opts.root.resolve()
    sluice = opts.sluice
    if sluice is None:
        built = root / "target" / "debug" / "sluice"
        sluice = str(built) if built.is_file() else None

    passed = failed = skipped = 0
    with tempfile.TemporaryDirectory(prefix="sluice-deploy-selftest-") as tmp:
        pristine = Path(tmp) / "pristine"
        shutil.copytree(root / "deploy", pristine / "deploy")
        res = run_checker(pristine, sluice)
        if res.returncode == 0:
            passed += 1
            print("ok   the untouched copy passes")
        else:
            failed += 1
            print("FAIL the untouched copy fails:\n" + res.stdout + res.stderr)

        for i, (what, rel, old, new, expect, needs_bin) in enumerate(MUTATIONS):
            if needs_bin and not sluice:
                skipped += 1
                print(f"skip {what}: no sluice binary")
                continue
            case = Path(tmp) / f"case{i}"
            shutil.copytree(root / "deploy", case / "deploy")
            path = case / "deploy" / rel
            text = path.read_text()
            if text.count(old) != 1:
                failed += 1
                print(f"FAIL {what}: {rel} does not contain the text to break exactly once")
                continue
            path.write_text(text.replace(old, new))
            res = run_checker(case, sluice)
            out = res.stdout + res.stderr
            if res.returncode != 0 and expect in out:
                passed += 1
                print(f"ok   caught: {what}")
            else:
                failed += 1
                print(f"FAIL not caught: {what} (exit {res.returncode}, expected {expect!r})\n{out}")

    summary = f"{passed} passed, {failed} failed"
    if skipped:
        summary += f", {skipped} skipped"
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
