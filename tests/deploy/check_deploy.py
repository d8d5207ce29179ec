"""Offline validation of deploy/: the compose file, the container build and
every kustomization (base and overlays).

What it checks, without a cluster or a Docker engine:
- every YAML/JSON file under deploy/ parses;
- compose.yaml against the compose-spec JSON schema (vendored by
  check-jsonschema) and for Sluice's own rules (etcd, advertise, OTLP,
  healthchecks, model volume);
- the Dockerfile's stages, user and entrypoint;
- each kustomization renders with a real kustomize (`kubectl kustomize`),
  every rendered resource passes `kubernetes-validate --strict` against the
  oldest and newest Kubernetes versions below, and the wiring holds together
  (selectors, named ports, ConfigMap references, probes, SLUICE_ADVERTISE
  from the pod IP, GPU requests per overlay);
- with a `sluice` binary at hand, every flag and every SLUICE_* variable the
  manifests set is one that `sluice <role> --help` lists.

Usage: check_deploy.py [--root REPO] [--kubectl PATH] [--sluice PATH]
Exits non-zero when anything fails; ends with "N passed, N failed".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

# Kubernetes versions every manifest must be valid for (gRPC probes are GA
# since 1.27).
K8S_VERSIONS = ["1.29.0", "1.37.0"]
ROLES = ["frontend", "queue", "router", "decode", "prefill"]
MODEL_ROLES = {"frontend", "decode", "prefill"}
WORKER_ROLES = {"decode", "prefill"}
# Roles that must run as several replicas (no single point of failure: the
# frontend fails over between queues, queues between routers), and how many.
REPLICATED_ROLES = {"queue": 2, "router": 2}
# SLUICE_* variables read outside clap (none today: SLUICE_LOG_FORMAT is
# the global --log-format flag).
NON_FLAG_ENV: set[str] = set()
# Whether decode/prefill workers must request nvidia.com/gpu, per
# kustomization directory name; directories not listed are not checked.
EXPECT_GPU = {"base": False, "gpu": True, "cpu": False, "mocker": False}


class Report:
    """Counts checks and prints one line per check."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0
        self.skipped = 0

    def check(self, name: str, errors: list[str]) -> bool:
        if errors:
            self.failed += 1
            print(f"FAIL {name}")
            for e in errors:
                print(f"     - {e}")
            return False
        self.passed += 1
        print(f"ok   {name}")
        return True

    def skip(self, name: str, why: str) -> None:
        self.skipped += 1
        print(f"skip {name}: {why}")


def run_check(report: Report, name: str, fn: Callable[[], list[str]]) -> bool:
    try:
        errors = fn()
    except Exception as e:  # a crash in a check is a failure of that check
        errors = [f"{type(e).__name__}: {e}"]
    return report.check(name, errors)


# ---------------------------------------------------------------- helpers


def load_all(path: Path) -> list[Any]:
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [d for d in yaml.safe_load_all(text) if d is not None]


def host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def url_host_port(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", url)
    if not m:
        raise ValueError(f"not an http://host:port URL: {url!r}")
    return m.group(1), int(m.group(2))


def cli_flags(args: Iterable[str]) -> list[str]:
    return [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]


def cli_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == f"--{flag}" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(f"--{flag}="):
            return a.split("=", 1)[1]
    return None


class SluiceHelp:
    """Flags and environment variables each `sluice` subcommand accepts."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.cache: dict[tuple[str, ...], tuple[set[str], set[str]]] = {}

    def of(self, command: tuple[str, ...]) -> tuple[set[str], set[str]]:
        if command not in self.cache:
            out = subprocess.run(
                [self.binary, *command, "--help"],
                check=True,
                capture_output=True,
                text=True,
                env={"PATH": os.environ.get("PATH", "")},
            ).stdout
            flags = set(re.findall(r"^\s+(?:-\w, )?--([a-z0-9-]+)", out, re.M))
            envs = set(re.findall(r"\[env: ([A-Z0-9_]+)=", out))
            self.cache[command] = (flags, envs)
        return self.cache[command]

    def command_of(self, args: list[str]) -> tuple[str, ...]:
        if args and args[0] == "model":
            return tuple(args[:2])
        return tuple(args[:1])

    def check_args(self, args: list[str]) -> list[str]:
        command = self.command_of(args)
        flags, _ = self.of(command)
        return [
            f"`sluice {' '.join(command)}` has no flag --{f}"
            for f in cli_flags(args)
            if f not in flags
        ]

    def check_env(self, role: str, keys: Iterable[str]) -> list[str]:
        _, envs = self.of((role,))
        return [
            f"`sluice {role}` reads no {k}"
            for k in sorted(keys)
            if k.startswith("SLUICE_") and k not in envs and k not in NON_FLAG_ENV
        ]


# ---------------------------------------------------------------- files


def check_parse(root: Path) -> list[str]:
    errors = []
    files = sorted(
        p for p in (root / "deploy").rglob("*") if p.suffix in (".yaml", ".yml", ".json")
    )
    if not files:
        errors.append("no YAML or JSON files under deploy/")
    for p in files:
        try:
            load_all(p)
        except Exception as e:
            errors.append(f"{p.relative_to(root)}: {e}")
    return errors


def check_dockerfile(root: Path) -> list[str]:
    text = (root / "deploy" / "Dockerfile").read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    # `FROM ${NAME}` resolves to the default of a global `ARG NAME=default`.
    args = dict(
        l.split(None, 1)[1].split("=", 1)
        for l in lines
        if l.upper().startswith("ARG ") and "=" in l
    )
    froms = [
        re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), l.split()[1])
        for l in lines
        if l.upper().startswith("FROM ")
    ]
    errors = []
    if len(froms) < 2:
        errors.append(f"expected a build and a runtime stage, found FROM {froms}")
    else:
        if not re.search(r"(^|/)rust:1\.95-bookworm$", froms[0]):
            errors.append(f"build stage is {froms[0]}, expected rust:1.95-bookworm")
        if not re.search(r"(^|/)debian:bookworm-slim$", froms[-1]):
            errors.append(f"runtime stage is {froms[-1]}, expected debian:bookworm-slim")
    if "protobuf-compiler" not in text:
        errors.append("the build stage does not install protobuf-compiler")
    if "cargo build --release --locked -p sluice" not in text:
        errors.append("the build stage does not build the sluice binary")
    users = [l.split(None, 1)[1] for l in lines if l.upper().startswith("USER ")]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        errors.append("the runtime stage does not switch to a non-root USER")
    entry = [l for l in lines if l.upper().startswith("ENTRYPOINT")]
    if not entry or json.loads(entry[-1].split(None, 1)[1]) != ["sluice"]:
        errors.append('ENTRYPOINT is not ["sluice"]')
    return errors


# ---------------------------------------------------------------- compose


def check_compose_schema(compose: Path) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(compose)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        return [(res.stdout + res.stderr).strip()]
    return []


def sluice_compose_services(doc: dict) -> dict[str, dict]:
    out = {}
    for name, svc in doc["services"].items():
        build = svc.get("build") or {}
        dockerfile = build.get("dockerfile", "") if isinstance(build, dict) else ""
        if dockerfile.endswith("deploy/Dockerfile") or "sluice" in str(svc.get("image", "")):
            out[name] = svc
    return out


def check_compose_wiring(compose: Path) -> list[str]:
    doc = yaml.safe_load(compose.read_text())
    services: dict = doc.get("services") or {}
    volumes = set((doc.get("volumes") or {}).keys())
    errors = []
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        for dep in deps:
            if dep not in services:
                errors.append(f"{name}: depends_on unknown service {dep}")
        for v in svc.get("volumes") or []:
            src = v.split(":", 1)[0] if isinstance(v, str) else v.get("source", "")
            if src and not src.startswith((".", "/", "~")) and src not in volumes:
                errors.append(f"{name}: volume {src} is not declared")
    for required in ("etcd", "jaeger"):
        if required not in services:
            errors.append(f"no {required} service")
    sluice = sluice_compose_services(doc)
    seen_roles = set()
    per_role: dict[str, int] = {}
    advertised: dict[str, str] = {}
    for name, svc in sluice.items():
        cmd = [str(c) for c in svc.get("command") or []]
        if not cmd:
            errors.append(f"{name}: no command")
            continue
        role = cmd[0]
        if role == "model":
            continue
        if role not in ROLES:
            errors.append(f"{name}: unknown role {role}")
            continue
        seen_roles.add(role)
        per_role[role] = per_role.get(role, 0) + 1
        etcd = cli_value(cmd, "etcd")
        if etcd is None or url_host_port(etcd) != ("etcd", 2379):
            errors.append(f"{name}: --etcd is {etcd!r}, expected http://etcd:2379")
        listen, advertise = cli_value(cmd, "listen"), cli_value(cmd, "advertise")
        if listen is None or advertise is None:
            errors.append(f"{name}: needs --listen and --advertise")
            continue
        lhost, lport = host_port(listen)
        ahost, aport = host_port(advertise)
        if lhost != "0.0.0.0":
            errors.append(f"{name}: --listen {listen} is not reachable from other containers")
        if (ahost, aport) != (name, lport):
            errors.append(f"{name}: --advertise {advertise}, expected {name}:{lport}")
        if advertise in advertised:
            errors.append(f"{name} and {advertised[advertise]} advertise the same {advertise}")
        advertised[advertise] = name
        env = svc.get("environment") or {}
        otlp = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") if isinstance(env, dict) else None
        if otlp is None or url_host_port(otlp) != ("jaeger", 4317):
            errors.append(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT is {otlp!r}, expected http://jaeger:4317")
        test = " ".join(str(t) for t in (svc.get("healthcheck") or {}).get("test") or [])
        if f":{lport}/" not in test:
            errors.append(f"{name}: no healthcheck on its port {lport}")
        if role in MODEL_ROLES:
            model = cli_value(cmd, "model")
            mounts = [v.split(":")[1] for v in svc.get("volumes") or [] if isinstance(v, str)]
            if model is None or not any(model.startswith(m.rstrip("/") + "/") for m in mounts):
                errors.append(f"{name}: --model {model!r} is not on a mounted volume")
            if "model-init" in services and "model-init" not in (svc.get("depends_on") or {}):
                errors.append(f"{name}: does not wait for model-init")
    missing = set(ROLES) - seen_roles
    if missing:
        errors.append(f"no service runs {sorted(missing)}")
    for role, want in REPLICATED_ROLES.items():
        if 0 < per_role.get(role, 0) < want:
            errors.append(f"{per_role[role]} service(s) run {role}; at least {want} must (failover)")
    return errors


def check_compose_flags(compose: Path, helper: SluiceHelp) -> list[str]:
    doc = yaml.safe_load(compose.read_text())
    errors = []
    for name, svc in sluice_compose_services(doc).items():
        cmd = [str(c) for c in svc.get("command") or []]
        errors += [f"{name}: {e}" for e in helper.check_args(cmd)]
        env = svc.get("environment") or {}
        if cmd and cmd[0] in ROLES and isinstance(env, dict):
            errors += [f"{name}: {e}" for e in helper.check_env(cmd[0], env.keys())]
    return errors


# ---------------------------------------------------------------- kustomize


def render(kubectl: list[str], directory: Path) -> list[dict]:
    res = subprocess.run([*kubectl, str(directory)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip() or f"exit {res.returncode}")
    docs = [d for d in yaml.safe_load_all(res.stdout) if d is not None]
    if not docs:
        raise RuntimeError("rendered nothing")
    return docs


def check_schemas(docs: list[dict]) -> list[str]:
    import kubernetes_validate

    errors = []
    for version in K8S_VERSIONS:
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                errors.append(f"{version} {d['kind']}/{d['metadata']['name']}: {path}: {e.message}")
            except Exception as e:
                errors.append(f"{version} {d.get('kind')}/{d.get('metadata', {}).get('name')}: {e}")
    return errors


def effective_env(container: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        ref = (src.get("configMapRef") or {}).get("name")
        if ref in configmaps:
            env.update(configmaps[ref].get("data") or {})
    for e in container.get("env") or []:
        env[e["name"]] = e.get("value", "<from>")
    return env


def port_number(container: dict, port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p["containerPort"]
    return None


def check_service_target(host: str, port: int, services: dict[str, dict]) -> str | None:
    svc = services.get(host)
    if svc is None:
        return f"no Service {host}"
    if port not in [p["port"] for p in svc["spec"]["ports"]]:
        return f"Service {host} has no port {port}"
    return None


def sluice_containers(dep: dict) -> list[tuple[dict, bool]]:
    spec = dep["spec"]["template"]["spec"]
    out = [(c, False) for c in spec.get("containers") or []]
    out += [(c, True) for c in spec.get("initContainers") or []]
    return [(c, init) for c, init in out if re.match(r"^(.*/)?sluice(:|@|$)", c.get("image", ""))]


def check_wiring(docs: list[dict], expect_gpu: bool | None) -> list[str]:
    errors: list[str] = []
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind.get("Deployment", {})
    services = by_kind.get("Service", {})
    configmaps = by_kind.get("ConfigMap", {})

    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"].get("labels") or {}
        selector = dep["spec"]["selector"].get("matchLabels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            errors.append(f"Deployment/{name}: selector {selector} does not match its pod labels")
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for src in c.get("envFrom") or []:
                ref = (src.get("configMapRef") or {}).get("name")
                if ref and ref not in configmaps:
                    errors.append(f"Deployment/{name}: envFrom ConfigMap {ref} is not rendered")

    for name, svc in services.items():
        selector = svc["spec"].get("selector") or {}
        pods = [
            d
            for d in deployments.values()
            if selector
            and all((d["spec"]["template"]["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
        ]
        if not pods:
            errors.append(f"Service/{name}: selector {selector} matches no Deployment")
            continue
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            containers = pods[0]["spec"]["template"]["spec"]["containers"]
            if not any(port_number(c, target) is not None for c in containers):
                errors.append(f"Service/{name}: targetPort {target} is no container port")

    roles_seen = set()
    replicas: dict[str, int] = {}
    for name, dep in deployments.items():
        for c, init in sluice_containers(dep):
            args = [str(a) for a in c.get("args") or c.get("command") or []]
            if args[:1] == ["sluice"]:
                args = args[1:]
            where = f"Deployment/{name} container {c['name']}"
            if init:
                continue
            if not args or args[0] not in ROLES:
                errors.append(f"{where}: args {args} name no role")
                continue
            role = args[0]
            roles_seen.add(role)
            count = dep["spec"].get("replicas", 1)
            replicas[role] = replicas.get(role, 0) + (count if isinstance(count, int) else 0)
            env = effective_env(c, configmaps)
            env_list = [e["name"] for e in c.get("env") or []]
            pod_ip = next((e for e in c.get("env") or [] if e["name"] == "POD_IP"), None)
            if (
                pod_ip is None
                or ((pod_ip.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") != "status.podIP"
            ):
                errors.append(f"{where}: POD_IP is not the downward API's status.podIP")
            listen = env.get("SLUICE_LISTEN") or cli_value(args, "listen")
            if listen is None:
                errors.append(f"{where}: no SLUICE_LISTEN")
                continue
            lhost, lport = host_port(listen)
            ports = [p["containerPort"] for p in c.get("ports") or []]
            if lhost != "0.0.0.0" or lport not in ports:
                errors.append(f"{where}: SLUICE_LISTEN {listen} is not 0.0.0.0 on a container port {ports}")
            advertise = env.get("SLUICE_ADVERTISE")
            if advertise != f"$(POD_IP):{lport}":
                errors.append(f"{where}: SLUICE_ADVERTISE is {advertise!r}, expected $(POD_IP):{lport}")
            elif "POD_IP" not in env_list or env_list.index("POD_IP") > env_list.index("SLUICE_ADVERTISE"):
                errors.append(f"{where}: POD_IP must be defined before SLUICE_ADVERTISE")
            for key, want in (("SLUICE_ETCD", "etcd"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "jaeger")):
                url = env.get(key)
                if url is None:
                    errors.append(f"{where}: no {key}")
                    continue
                host, port = url_host_port(url)
                problem = check_service_target(host, port, services)
                if problem:
                    errors.append(f"{where}: {key}={url}: {problem}")
            live = c.get("livenessProbe") or {}
            http = live.get("httpGet") or {}
            if http.get("path") != "/live" or port_number(c, http.get("port")) != lport:
                errors.append(f"{where}: liveness is not HTTP /live on port {lport}")
            ready = c.get("readinessProbe") or {}
            if role == "frontend":
                http = ready.get("httpGet") or {}
                if http.get("path") != "/ready" or port_number(c, http.get("port")) != lport:
                    errors.append(f"{where}: readiness is not HTTP /ready on port {lport}")
            elif (ready.get("grpc") or {}).get("port") != lport:
                errors.append(f"{where}: readiness is not a gRPC health probe on port {lport}")
            if role in MODEL_ROLES:
                model = env.get("SLUICE_MODEL") or cli_value(args, "model")
                mounts = [m["mountPath"] for m in c.get("volumeMounts") or []]
                if model is None or not any(model.startswith(m.rstrip("/") + "/") for m in mounts):
                    errors.append(f"{where}: model {model!r} is not on a mounted volume {mounts}")
            gpu = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
            if role in WORKER_ROLES and expect_gpu is True and str(gpu) != "1":
                errors.append(f"{where}: workers must request nvidia.com/gpu: 1 here (found {gpu})")
            if expect_gpu is False and gpu is not None:
                errors.append(f"{where}: requests nvidia.com/gpu in a CPU overlay")
    missing = set(ROLES) - roles_seen
    if missing:
        errors.append(f"no Deployment runs {sorted(missing)}")
    for role, want in REPLICATED_ROLES.items():
        if role in roles_seen and replicas.get(role, 0) < want:
            errors.append(f"{replicas.get(role, 0)} {role} replica(s); at least {want} must run (failover)")
    for required in ("etcd", "jaeger"):
        if required not in deployments or required not in services:
            errors.append(f"no {required} Deployment and Service")
    return errors


def check_k8s_flags(docs: list[dict], helper: SluiceHelp) -> list[str]:
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    errors = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c, _ in sluice_containers(d):
            args = [str(a) for a in c.get("args") or c.get("command") or []]
            if args[:1] == ["sluice"]:
                args = args[1:]
            where = f"Deployment/{d['metadata']['name']} container {c['name']}"
            errors += [f"{where}: {e}" for e in helper.check_args(args)]
            if args and args[0] in ROLES:
                env = effective_env(c, configmaps)
                errors += [f"{where}: {e}" for e in helper.check_env(args[0], env.keys())]
    return errors


# ---------------------------------------------------------------- main


def find_kubectl(explicit: str | None) -> list[str] | None:
    candidates = [explicit, os.environ.get("KUBECTL"), str(Path(sys.executable).parent / "kubectl"), "kubectl"]
    for c in candidates:
        if c and shutil.which(c):
            return [shutil.which(c) or c, "kustomize"]
    if shutil.which("kustomize"):
        return [shutil.which("kustomize") or "kustomize", "build"]
    return None


def find_sluice(root: Path, explicit: str | None) -> str | None:
    if explicit:
        return explicit
    for p in (root / "target" / "debug" / "sluice", root / "target" / "release" / "sluice"):
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("sluice")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--kubectl", help="kubectl (or kustomize) to render with")
    ap.add_argument("--sluice", default=os.environ.get("SLUICE_BIN"), help="sluice binary for flag checks")
    opts = ap.parse_args()
    root: Path = opts.root.resolve()
    report = Report()

    run_check(report, "parse every YAML/JSON file under deploy/", lambda: check_parse(root))
    run_check(report, "deploy/Dockerfile: stages, non-root user, entrypoint", lambda: check_dockerfile(root))

    compose = root / "deploy" / "compose.yaml"
    run_check(report, "deploy/compose.yaml: compose-spec schema", lambda: check_compose_schema(compose))
    run_check(report, "deploy/compose.yaml: etcd, advertise, OTLP, healthchecks, model, replicas", lambda: check_compose_wiring(compose))

    sluice = find_sluice(root, opts.sluice)
    helper = None
    if sluice is None:
        report.skip("flags against `sluice --help`", "no sluice binary (set SLUICE_BIN or build it)")
    elif not (Path(sluice).is_file() or shutil.which(sluice)):
        report.check("flags against `sluice --help`", [f"SLUICE_BIN={sluice} does not exist"])
    else:
        helper = SluiceHelp(sluice)
        print(f"     (flags checked against {sluice})")
        run_check(report, "deploy/compose.yaml: every flag and SLUICE_* variable exists", lambda: check_compose_flags(compose, helper))

    kubectl = find_kubectl(opts.kubectl)
    k8s = root / "deploy" / "k8s"
    # Components (kind: Component) render only through a kustomization that
    # uses them.
    def is_component(p: Path) -> bool:
        try:
            return (yaml.safe_load(p.read_text()) or {}).get("kind") == "Component"
        except yaml.YAMLError:
            return False  # unparsable: rendering it reports the error

    dirs = sorted(p.parent for p in k8s.rglob("kustomization.yaml") if not is_component(p))
    if kubectl is None:
        report.check("render the kustomizations", ["no kubectl or kustomize (pip install -r tests/deploy/requirements.txt)"])
    elif not dirs:
        report.check("render the kustomizations", [f"no kustomization.yaml under {k8s}"])
    else:
        print(f"     (rendering with {' '.join(kubectl)})")
    for d in dirs if kubectl else []:
        rel = d.relative_to(root)
        docs: list[dict] = []

        def do_render() -> list[str]:
            docs.extend(render(kubectl, d))
            kinds: dict[str, int] = {}
            for doc in docs:
                kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
            print(f"     {rel}: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}")
            return []

        if not run_check(report, f"{rel}: renders", do_render):
            continue
        run_check(report, f"{rel}: kubernetes-validate --strict ({', '.join(K8S_VERSIONS)})", lambda: check_schemas(docs))
        run_check(report, f"{rel}: selectors, ports, ConfigMaps, probes, advertise, GPU, replicas", lambda: check_wiring(docs, EXPECT_GPU.get(d.name)))
        if helper is not None:
            run_check(report, f"{rel}: every flag and SLUICE_* variable exists", lambda: check_k8s_flags(docs, helper))

    summary = f"{report.passed} passed, {report.failed} failed"
    if report.skipped:
        summary += f", {report.skipped} skipped"
    print(summary)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
