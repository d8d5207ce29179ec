#!/usr/bin/env bash
# Validates deploy/ offline: YAML/JSON syntax, compose.yaml (compose-spec
# schema and Sluice's wiring), the Dockerfile, and every kustomization under
# deploy/k8s rendered by `kubectl kustomize` and checked with
# kubernetes-validate. With a sluice binary (SLUICE_BIN, or target/debug/sluice)
# it also checks every flag and SLUICE_* variable against `sluice --help`.
#
#   python3 -m venv .venv && .venv/bin/pip install -r tests/deploy/requirements.txt
#   tests/deploy/validate.sh
#
# Environment: PY (python with the requirements; default .venv/bin/python),
# KUBECTL (kubectl to render with; default the venv's, then PATH),
# SLUICE_BIN (sluice binary for the flag checks).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PY:-$root/.venv/bin/python}"
if [ ! -x "$py" ]; then
  echo "validate.sh: no python at $py; run: python3 -m venv .venv && .venv/bin/pip install -r tests/deploy/requirements.txt" >&2
  exit 2
fi
exec "$py" "$here/check_deploy.py" --root "$root" "$@"
