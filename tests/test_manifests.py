"""The deployment files agree with the programs and with each other.

Every bitps command line in docker/compose.yaml and the Kubernetes manifests (docker/k8s) is
rebuilt the way the container runtime would build it, then parsed by the real CLI
(``build_parser()`` of ``bitps.ps.__main__`` / ``bitps.worker.__main__``):

* compose: ``${VAR:-default}`` interpolation (no variable set, as on a fresh host), the image's
  ENTRYPOINT from docker/Dockerfile in front of ``command``;
* Kubernetes: the kustomization applied (replacements, images, namespace), the container's
  environment (the image's ENV, ``envFrom`` ConfigMaps, ``env:`` entries with ``$(VAR)``
  expansion, what the runtime sets: HOSTNAME, JOB_COMPLETION_INDEX), one pod per StatefulSet
  ordinal / Job index;
* ``/bin/sh -c`` wrappers are run by the real /bin/sh (``-u``: an unset variable is an error)
  with stand-ins for bitps-server / bitps-worker that only record their arguments.

An unresolved variable anywhere is a failure. The settings each process ends up with (flags,
then its environment twins, as the program resolves them) are then checked against the ports
and names declared around it: EXPOSE/ENV/HEALTHCHECK in the Dockerfile, containerPorts, probes,
scrape annotations, the headless Service, the ServiceMonitor/PodMonitor, the --servers lists,
shard ids and ranks, and docker/prometheus.yml's targets.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
PROGRAMS = {"bitps-server": ("bitps.ps.__main__", "shard"),
            "bitps-worker": ("bitps.worker.__main__", "worker")}
SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash"}


class ManifestError(Exception):
    pass


# --- docker/Dockerfile ----------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    env: dict = field(default_factory=dict)
    expose: set = field(default_factory=set)
    entrypoint: list | None = None
    cmd: list | None = None
    healthcheck: str | None = None
    user: str = ""


def _exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


def dockerfile_stages(text: str) -> dict[str, Stage]:
    """The stages of a Dockerfile with what the runtime reads from the image (ENV, EXPOSE,
    ENTRYPOINT, CMD, HEALTHCHECK), inherited along ``FROM <stage>``."""
    lines, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if s.startswith("#") or (not s and buf):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        if buf + s:
            lines.append(buf + s)
        buf = ""
    stages: dict[str, Stage] = {}
    cur: Stage | None = None
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) > 2 and words[1].lower() == "as" else f"#{len(stages)}"
            parent = stages.get(words[0])
            cur = Stage(name)
            if parent is not None:
                cur.env, cur.expose = dict(parent.env), set(parent.expose)
                cur.entrypoint, cur.cmd = parent.entrypoint, parent.cmd
                cur.healthcheck, cur.user = parent.healthcheck, parent.user
            stages[name] = cur
        elif cur is None:
            continue
        elif instr == "ENV":
            words = shlex.split(rest)
            if all("=" in w for w in words):
                cur.env.update(w.split("=", 1) for w in words)
            else:  # legacy ENV key value
                cur.env[words[0]] = rest.split(None, 1)[1]
        elif instr == "EXPOSE":
            cur.expose.update(int(w.split("/")[0]) for w in rest.split())
        elif instr == "ENTRYPOINT":
            cur.entrypoint, cur.cmd = _exec_form(rest), None  # ENTRYPOINT resets CMD
        elif instr == "CMD":
            cur.cmd = _exec_form(rest)
        elif instr == "HEALTHCHECK":
            cur.healthcheck = rest
        elif instr == "USER":
            cur.user = rest
    return stages


STAGES = dockerfile_stages((DOCKER / "Dockerfile").read_text())


# --- variable expansion ---------------------------------------------------------------------------

_COMPOSE_VAR = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}"
    r"|([A-Za-z_][A-Za-z0-9_]*)|(\{[^}]*\}?))")


def compose_interpolate(value: str, env: dict[str, str], where: str) -> str:
    """Compose's interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}``; an unset variable without a default
    is an error here (compose would warn and substitute an empty string)."""

    def one(m: re.Match) -> str:
        dollar, name, op, arg, bare, bad = m.groups()
        if dollar:
            return "$"
        if bad is not None:
            raise ManifestError(f"{where}: bad interpolation {m.group(0)!r}")
        name = name or bare
        value = env.get(name)
        if op in (":-", "-"):
            if value is None or (op == ":-" and value == ""):
                return compose_interpolate(arg, env, where)
            return value
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise ManifestError(f"{where}: ${{{name}}} is required: {arg}")
            return value
        if op in (":+", "+"):
            set_ = value is not None and (op == "+" or value != "")
            return compose_interpolate(arg, env, where) if set_ else ""
        if value is None:
            raise ManifestError(f"{where}: ${{{name}}} is not set and has no default")
        return value

    return _COMPOSE_VAR.sub(one, value)


def compose_walk(node, env: dict[str, str], where: str):
    if isinstance(node, str):
        return compose_interpolate(node, env, where)
    if isinstance(node, list):
        return [compose_walk(v, env, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, dict):
        return {k: compose_walk(v, env, f"{where}.{k}") for k, v in node.items()}
    return node


_K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def k8s_expand(value: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command, args and env values (``$$`` is a literal
    ``$``); a reference to an undefined variable stays as written there, and is an error
    here."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(1) not in env:
            raise ManifestError(f"{where}: $({m.group(1)}) is not defined in the container")
        return env[m.group(1)]

    return _K8S_VAR.sub(one, value)


def run_shell(argv: list[str], env: dict[str, str], stubs: Path, where: str) -> list[str]:
    """The argv a ``sh -c`` wrapper execs, found by running it with ``-u`` under the container's
    environment, with PATH holding only stand-ins of the bitps programs."""
    shell = "/bin/bash" if argv[0].endswith("bash") else "/bin/sh"
    out = subprocess.run([shell, "-u", *argv[1:]], env={**env, "PATH": str(stubs)},
                         capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    if out.returncode != 0 or not out.stdout:
        raise ManifestError(f"{where}: the shell command failed (exit {out.returncode}): "
                            f"{out.stderr.decode(errors='replace').strip()}")
    return out.stdout.decode().split("\0")[:-1]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("stubs")
    for program in PROGRAMS:
        stub = d / program
        stub.write_text(f"#!/bin/sh\nprintf '%s\\0' {program} \"$@\"\n")
        stub.chmod(0o755)
    return d


# --- the real CLIs ------------------------------------------------------------------------------

def cli_parse(program: str, args: list[str], env: dict[str, str], where: str
              ) -> argparse.Namespace:
    """``build_parser().parse_args(args)`` of the real program, then the settings it would run
    with: ``parse_config(args, env)`` where the module has one that takes the environment,
    else the parser built and run under ``env``."""
    module = importlib.import_module(PROGRAMS[program][0])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, env, clear=True):
            module.build_parser().parse_args(args)
            parse_config = getattr(module, "parse_config", None)
            if parse_config and "environ" in inspect.signature(parse_config).parameters:
                result = parse_config(args, env)
                ns = next(r for r in (result if isinstance(result, tuple) else (result,))
                          if isinstance(r, argparse.Namespace))
            else:
                ns = module.build_parser().parse_args(args)
    except SystemExit as exit_:
        raise ManifestError(f"{where}: {program} {shlex.join(args)}: exit {exit_.code}: "
                            f"{err.getvalue().strip()}") from None
    except ValueError as exc:
        raise ManifestError(f"{where}: {program} {shlex.join(args)}: {exc}") from None
    return ns


@dataclass
class Proc:
    """One bitps process as a manifest starts it."""

    where: str
    program: str
    kind: str  # shard | worker
    argv: list[str]
    env: dict[str, str]
    args: argparse.Namespace
    index: int = 0  # StatefulSet ordinal, Job completion index, compose service number
    host: str = ""  # the name other processes reach it by
    spec: dict = field(default_factory=dict)  # the container (k8s) or service (compose)


def make_proc(where, argv, env, stubs, **kw) -> Proc | None:
    if argv and argv[0] in SHELLS and len(argv) > 2 and argv[1] == "-c":
        argv = run_shell(argv, env, stubs, where)
    program = os.path.basename(argv[0]) if argv else ""
    if program not in PROGRAMS:
        return None
    args = cli_parse(program, argv[1:], env, where)
    return Proc(where, program, PROGRAMS[program][1], argv, env, args, **kw)


def _stage_of_image(image: str, images: dict[str, str]) -> Stage:
    name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    if name not in images:
        raise ManifestError(f"image {image!r} is built by no compose service "
                            f"(known: {sorted(images)})")
    return STAGES[images[name]]


# --- docker/compose.yaml ------------------------------------------------------------------------

def _dotenv() -> dict[str, str]:
    path = DOCKER / ".env"
    env = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                env[k.strip()] = v.strip().strip("'\"")
    return env


COMPOSE_TOKEN = "compose-token"
"""The BITPS_TOKEN the compose checks run with: compose.yaml requires one."""


def load_compose(env: dict[str, str] | None = None) -> dict:
    """compose.yaml interpolated with ``env`` (default: the .env file and a token, which the
    file requires)."""
    raw = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    env = {**_dotenv(), "BITPS_TOKEN": COMPOSE_TOKEN} if env is None else env
    return compose_walk(raw, env, "compose.yaml")


def compose_images(compose: dict) -> dict[str, str]:
    """Image name (no tag) -> Dockerfile stage, from the services that build one."""
    out = {}
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if isinstance(build, dict) and "image" in svc:
            assert build.get("dockerfile", "Dockerfile") == "docker/Dockerfile", name
            assert build.get("target") in STAGES, f"{name}: no stage {build.get('target')!r}"
            out[svc["image"].rsplit(":", 1)[0]] = build["target"]
    return out


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def compose_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def compose_procs(compose: dict, stubs: Path) -> list[Proc]:
    images = compose_images(compose)
    procs = []
    for name, svc in compose["services"].items():
        if svc.get("image", "").rsplit(":", 1)[0] not in images:
            continue
        stage = _stage_of_image(svc["image"], images)
        entry = _as_list(svc["entrypoint"]) if "entrypoint" in svc else (stage.entrypoint or [])
        cmd = _as_list(svc["command"]) if "command" in svc else (
            (stage.cmd or []) if "entrypoint" not in svc else [])
        env = {**stage.env, **compose_env(svc)}
        m = re.search(r"(\d+)$", name)
        proc = make_proc(f"compose service {name}", entry + cmd, env, stubs,
                         index=int(m.group(1)) if m else 0, host=name, spec=svc)
        if proc is not None:
            procs.append(proc)
    return procs


# --- docker/k8s -----------------------------------------------------------------------------------

def _get(doc, path: str):
    node = doc
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def _set(doc, path: str, value) -> None:
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[part]
    if last not in node:
        raise KeyError(path)
    node[last] = value


def _matches(doc: dict, select: dict) -> bool:
    return all(doc.get(k) == v if k != "name" else doc["metadata"]["name"] == v
               for k, v in select.items())


def kustomize() -> tuple[list[dict], dict]:
    """The documents ``kubectl apply -k docker/k8s`` would apply (resources, namespace,
    images and the replacements used here), and the kustomization."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for res in kust["resources"]:
        path = K8S / res
        assert path.is_file(), f"kustomization.yaml: resource {res} is missing"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        if kust.get("namespace") and d["kind"] != "Namespace":
            d["metadata"]["namespace"] = kust["namespace"]
    for rep in kust.get("replacements", []):
        src = rep["source"]
        sources = [d for d in docs
                   if _matches(d, {k: v for k, v in src.items() if k != "fieldPath"})]
        assert len(sources) == 1, f"replacement source {src} matches {len(sources)} documents"
        try:
            value = _get(sources[0], src["fieldPath"])
            for target in rep["targets"]:
                hits = [d for d in docs if _matches(d, target["select"])]
                assert hits, f"replacement target {target['select']} matches nothing"
                for d in hits:
                    for path in target["fieldPaths"]:
                        old = _get(d, path)
                        # kustomize keeps a string field a string
                        _set(d, path, str(value) if isinstance(old, str) else value)
        except KeyError as err:
            raise AssertionError(f"kustomization.yaml replacement {rep}: no field "
                                 f"{err.args[0]}") from None
    used = set()
    for d in docs:
        for c in _containers(d):
            for img in kust.get("images", []):
                if c["image"].split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
                    used.add(img["name"])
    unused = [i["name"] for i in kust.get("images", []) if i["name"] not in used]
    assert not unused, f"kustomization.yaml images {unused} match no container"
    return docs, kust


def _template(doc: dict) -> dict | None:
    kind = doc["kind"]
    if kind in ("StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"):
        return doc["spec"]["template"]
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]
    if kind == "Pod":
        return doc
    return None


def _containers(doc: dict, init: bool = True) -> list[dict]:
    t = _template(doc)
    if t is None:
        return []
    spec = t["spec"]
    return (spec.get("initContainers", []) if init else []) + spec.get("containers", [])


def _pods(doc: dict) -> list[tuple[int, str, dict]]:
    """(index, pod name, runtime-set variables) for each pod the workload runs at once."""
    name, spec = doc["metadata"]["name"], doc.get("spec", {})
    if doc["kind"] == "StatefulSet":
        return [(i, f"{name}-{i}", {"HOSTNAME": f"{name}-{i}"})
                for i in range(spec.get("replicas", 1))]
    if doc["kind"] == "Job" and spec.get("completionMode") == "Indexed":
        return [(i, f"{name}-{i}-abcde", {"HOSTNAME": f"{name}-{i}-abcde",
                                         "JOB_COMPLETION_INDEX": str(i)})
                for i in range(spec.get("completions", 1))]
    return [(0, f"{name}-abcde", {"HOSTNAME": f"{name}-abcde"})]


_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")


def _resource(container: dict, ref: dict) -> str:
    kind, _, res = ref["resource"].partition(".")
    raw = str(container.get("resources", {}).get(kind, {}).get(res, "1"))
    m, d = _CPU.match(raw), _CPU.match(str(ref.get("divisor", "1")))
    if not (m and d):  # memory: not needed here
        return raw
    value = float(m.group(1)) / (1000 if m.group(2) else 1)
    div = float(d.group(1)) / (1000 if d.group(2) else 1)
    return str(max(1, int(-(-value // div))))  # Kubernetes rounds up


def container_env(doc: dict, container: dict, pod: str, runtime: dict, stage: Stage,
                  configmaps: dict[str, dict], where: str) -> dict[str, str]:
    """What the container's processes see: image ENV < envFrom < env (with $(VAR)), plus the
    variables the runtime sets."""
    env = {**stage.env, **runtime}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref is None:
            raise ManifestError(f"{where}: envFrom {src} is not supported by this test")
        if ref["name"] not in configmaps:
            if ref.get("optional"):
                continue
            raise ManifestError(f"{where}: envFrom ConfigMap {ref['name']!r} does not exist")
        env.update({src.get("prefix", "") + k: str(v)
                    for k, v in configmaps[ref["name"]].items()})
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            env[name] = k8s_expand(str(var["value"]), env, f"{where} env {name}")
            continue
        frm = var.get("valueFrom", {})
        if "configMapKeyRef" in frm:
            ref = frm["configMapKeyRef"]
            data = configmaps.get(ref["name"], {})
            if ref["key"] in data:
                env[name] = str(data[ref["key"]])
            elif not ref.get("optional"):
                raise ManifestError(f"{where} env {name}: no ConfigMap key {ref}")
        elif "secretKeyRef" in frm:
            if not frm["secretKeyRef"].get("optional"):
                env[name] = "secret-value"  # a Secret the user creates; only its presence here
        elif "resourceFieldRef" in frm:
            ref = frm["resourceFieldRef"]
            if ref.get("containerName", container["name"]) != container["name"]:
                raise ManifestError(f"{where} env {name}: resourceFieldRef names container "
                                    f"{ref['containerName']!r}, not {container['name']!r}")
            env[name] = _resource(container, ref)
        elif "fieldRef" in frm:
            path = frm["fieldRef"]["fieldPath"]
            env[name] = {"metadata.name": pod,
                         "metadata.namespace": doc["metadata"].get("namespace", "default")
                         }.get(path, f"<{path}>")
        else:
            raise ManifestError(f"{where} env {name}: neither value nor a known valueFrom")
    return env


def k8s_procs(docs: list[dict], images: dict[str, str], stubs: Path) -> list[Proc]:
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs
                  if d["kind"] == "ConfigMap"}
    procs = []
    for doc in docs:
        for index, pod, runtime in _pods(doc) if _template(doc) else []:
            for c in _containers(doc):
                where = f"k8s {doc['kind']}/{doc['metadata']['name']} pod {pod} {c['name']}"
                stage = _stage_of_image(c["image"], images)
                env = container_env(doc, c, pod, runtime, stage, configmaps, where)
                if "command" in c:
                    argv = list(c["command"]) + list(c.get("args", []))
                else:
                    argv = (stage.entrypoint or []) + list(c.get("args", stage.cmd or []))
                argv = [k8s_expand(str(a), env, where) for a in argv]
                if argv[:2] == ["python", "-c"]:
                    continue  # an inline check (the wait-for-shards init container)
                proc = make_proc(where, argv, env, stubs, index=index, host=pod,
                                 spec={"container": c, "doc": doc})
                if proc is None:
                    raise ManifestError(f"{where}: a bitps image running neither bitps-server "
                                        f"nor bitps-worker: {argv}")
                procs.append(proc)
    return procs


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def images(compose) -> dict[str, str]:
    return compose_images(compose)


@pytest.fixture(scope="module")
def cprocs(compose, stubs) -> list[Proc]:
    return compose_procs(compose, stubs)


@pytest.fixture(scope="module")
def k8s() -> tuple[list[dict], dict]:
    return kustomize()


@pytest.fixture(scope="module")
def kprocs(k8s, images, stubs) -> list[Proc]:
    return k8s_procs(k8s[0], images, stubs)


def _one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def _servers(value: str) -> list[tuple[str, int]]:
    out = []
    for entry in value.split(","):
        host, _, port = entry.rpartition(":")
        assert host and port.isdigit(), f"--servers entry {entry!r} is not host:port"
        out.append((host, int(port)))
    return out


# --- the helpers themselves -----------------------------------------------------------------------

def test_expansion_rules(stubs):
    env = {"A": "1", "EMPTY": ""}
    assert compose_interpolate("${A}-$A-${B:-x}-${EMPTY:-d}-${EMPTY-d}-$$A", env, "t") == \
        "1-1-x-d--$A"
    assert compose_interpolate("${B:-${A}}", env, "t") == "1"
    for bad in ("${B}", "$B", "${B:?needed}"):
        with pytest.raises(ManifestError, match="B"):
            compose_interpolate(bad, env, "t")
    assert k8s_expand("$(A) $$(A) $A", env, "t") == "1 $(A) $A"
    with pytest.raises(ManifestError, match=r"\$\(B\)"):
        k8s_expand("--x $(B)", env, "t")
    argv = run_shell(["/bin/sh", "-c", 'exec bitps-server --shard-id "${HOSTNAME##*-}" --x "$A"'],
                     {"HOSTNAME": "bitps-shard-12", "A": "a b"}, stubs, "t")
    assert argv == ["bitps-server", "--shard-id", "12", "--x", "a b"]
    with pytest.raises(ManifestError, match="UNSET"):
        run_shell(["/bin/sh", "-c", 'exec bitps-server --mode "$UNSET"'], {}, stubs, "t")
    with pytest.raises(ManifestError, match="--no-such-flag"):
        cli_parse("bitps-server", ["--no-such-flag"], {}, "t")
    with pytest.raises(ManifestError, match="--mode"):
        cli_parse("bitps-worker", ["--mode", "async"], {}, "t")


def test_dockerfile_images_agree_with_themselves():
    server, worker = STAGES["server"], STAGES["worker"]
    assert server.entrypoint == ["bitps-server"] and worker.entrypoint == ["bitps-worker"]
    ports = {k: int(server.env[f"BITPS_{k}_PORT"]) for k in ("GRPC", "DATA", "METRICS")}
    assert server.expose == set(ports.values()), (server.expose, ports)
    assert server.env["BITPS_HOST"] == "0.0.0.0"
    # The health check asks BITPS_GRPC_PORT, with the same fallback.
    assert server.healthcheck and "BITPS_GRPC_PORT" in server.healthcheck
    fallback = re.search(r"BITPS_GRPC_PORT', '(\d+)'", server.healthcheck)
    assert fallback and int(fallback.group(1)) == ports["GRPC"]
    assert worker.expose == {int(worker.env["BITPS_METRICS_PORT"])}
    assert worker.env["BITPS_METRICS_HOST"] == "0.0.0.0"
    # The image's own defaults parse, and resolve to the ports it exposes.
    args = cli_parse("bitps-server", [], server.env, "Dockerfile server")
    assert (args.grpc_port, args.data_port, args.metrics_port) == (
        ports["GRPC"], ports["DATA"], ports["METRICS"])
    assert args.host == "0.0.0.0"
    args = cli_parse("bitps-worker", ["--servers", "x:1"], worker.env, "Dockerfile worker")
    assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", int(worker.env[
        "BITPS_METRICS_PORT"]))


def test_compose_commands_parse_with_the_real_cli(compose, stubs):
    try:
        procs = compose_procs(compose, stubs)
    except ManifestError as err:
        pytest.fail(str(err))
    kinds = sorted(p.kind for p in procs)
    assert kinds == ["shard", "shard", "worker", "worker"], [p.where for p in procs]


def test_k8s_commands_parse_with_the_real_cli(k8s, images, stubs):
    docs, _ = k8s
    try:
        kprocs = k8s_procs(docs, images, stubs)
    except ManifestError as err:
        pytest.fail(str(err))
    sts, job = _one(docs, "StatefulSet"), _one(docs, "Job")
    assert sorted(p.kind for p in kprocs) == (["shard"] * sts["spec"]["replicas"]
                                              + ["worker"] * job["spec"]["completions"])


def _check_shard_ports(p: Proc, stage: Stage, problems: list) -> None:
    a = p.args
    if a.host != "0.0.0.0":
        problems.append(f"{p.where}: binds {a.host}, unreachable from other containers")
    if a.grpc_port != int(p.env.get("BITPS_GRPC_PORT", "50051")):
        problems.append(f"{p.where}: --grpc-port {a.grpc_port} but the image's HEALTHCHECK "
                        f"asks BITPS_GRPC_PORT={p.env.get('BITPS_GRPC_PORT')}")
    if not {a.grpc_port, a.data_port, a.metrics_port} <= stage.expose:
        problems.append(f"{p.where}: ports {a.grpc_port}/{a.data_port}/{a.metrics_port} not "
                        f"all in the image's EXPOSE {sorted(stage.expose)}")


def _check_worker_metrics(p: Proc, stage: Stage, problems: list) -> None:
    a = p.args
    if a.metrics_port < 0:
        problems.append(f"{p.where}: metrics off, but Prometheus scrapes workers")
    elif a.metrics_port not in stage.expose:
        problems.append(f"{p.where}: metrics port {a.metrics_port} not in EXPOSE "
                        f"{sorted(stage.expose)}")
    if a.metrics_host != "0.0.0.0":
        problems.append(f"{p.where}: metrics on {a.metrics_host}, unreachable by Prometheus")


def test_compose_topology_and_ports_agree(compose, cprocs):
    problems: list[str] = []
    shards = sorted((p for p in cprocs if p.kind == "shard"), key=lambda p: p.args.shard_id)
    workers = sorted((p for p in cprocs if p.kind == "worker"), key=lambda p: p.args.rank)
    if [p.args.shard_id for p in shards] != list(range(len(shards))):
        problems.append(f"shard ids {[p.args.shard_id for p in shards]}")
    for p in shards:
        if p.args.num_shards != len(shards):
            problems.append(f"{p.where}: --num-shards {p.args.num_shards}, {len(shards)} shards")
        if p.index != p.args.shard_id:
            problems.append(f"{p.where}: the service name says shard {p.index}, --shard-id "
                            f"{p.args.shard_id}")
        _check_shard_ports(p, STAGES["server"], problems)
    if [p.args.rank for p in workers] != list(range(len(workers))):
        problems.append(f"ranks {[p.args.rank for p in workers]}")
    for p in workers:
        if p.args.world_size != len(workers):
            problems.append(f"{p.where}: --world-size {p.args.world_size}, {len(workers)} "
                            f"workers")
        want = [(s.host, s.args.grpc_port) for s in shards]
        if _servers(p.args.servers) != want:
            problems.append(f"{p.where}: --servers {p.args.servers}, the shards in id order "
                            f"are {want}")
        _check_worker_metrics(p, STAGES["worker"], problems)
        deps = p.spec.get("depends_on", {})
        for s in shards:
            if (deps.get(s.host) or {}).get("condition") != "service_healthy":
                problems.append(f"{p.where}: does not wait for {s.host} to be healthy")
            elif not (STAGES["server"].healthcheck or s.spec.get("healthcheck")):
                problems.append(f"{s.where}: service_healthy without any health check")
    services = compose["services"]
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}) or {}:
            if dep not in services:
                problems.append(f"compose service {name}: depends_on unknown {dep}")
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if src.startswith("."):
                path = (DOCKER / src).resolve()
                if not path.exists():
                    problems.append(f"compose service {name}: volume source {src} is missing")
    # Prometheus and Grafana reach each other under the names and ports their configs use.
    prom_port = 9090
    for arg in services["prometheus"].get("command", []):
        if arg.startswith("--web.listen-address="):
            prom_port = int(arg.rsplit(":", 1)[1])
    if not any(str(p).endswith(f":{prom_port}") for p in services["prometheus"].get("ports", [])):
        problems.append(f"compose prometheus: port {prom_port} not published")
    sources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml")
                             .read_text())
    for s in sources["datasources"]:
        if s["url"] != f"http://prometheus:{prom_port}":
            problems.append(f"grafana datasource {s['name']}: url {s['url']}, Prometheus is "
                            f"http://prometheus:{prom_port}")
    assert not problems, "\n".join(problems)


def test_prometheus_targets_are_the_compose_processes(cprocs):
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    by_host = {p.host: p for p in cprocs}
    problems, seen = [], []
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            role = static.get("labels", {}).get("role")
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                p = by_host.get(host)
                if p is None:
                    problems.append(f"job {job['job_name']}: {target}: no such compose service")
                    continue
                seen.append(host)
                if int(port) != p.args.metrics_port:
                    problems.append(f"job {job['job_name']}: {target}, but {p.where} serves "
                                    f"metrics on {p.args.metrics_port}")
                if role is not None and role != p.kind:
                    problems.append(f"job {job['job_name']}: {target} labelled role={role}, "
                                    f"it is a {p.kind}")
        if job.get("metrics_path", "/metrics") != "/metrics":
            problems.append(f"job {job['job_name']}: metrics_path {job['metrics_path']}")
    missing = sorted(set(by_host) - set(seen))
    twice = sorted({h for h in seen if seen.count(h) > 1})
    assert not problems and not missing and not twice, (problems, f"unscraped {missing}",
                                                        f"scraped twice {twice}")


def test_k8s_topology_and_ports_agree(k8s, kprocs, images):
    docs, kust = k8s
    problems: list[str] = []
    sts, job = _one(docs, "StatefulSet"), _one(docs, "Job")
    svc = next((d for d in docs if d["kind"] == "Service"
                and d["metadata"]["name"] == sts["spec"]["serviceName"]), None)
    assert svc is not None, f"no Service {sts['spec']['serviceName']!r} for the StatefulSet"
    if svc["spec"].get("clusterIP") != "None":
        problems.append("the shard Service is not headless: no per-pod DNS names")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    if not svc["spec"]["selector"].items() <= pod_labels.items():
        problems.append(f"Service selector {svc['spec']['selector']} misses the shard pods")
    if not sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items():
        problems.append("StatefulSet selector does not match its own pods")
    if not job["spec"].get("selector", {}).get("matchLabels", {}).items() <= \
            job["spec"]["template"]["metadata"]["labels"].items():
        problems.append("Job selector does not match its own pods")

    shards = sorted((p for p in kprocs if p.kind == "shard"), key=lambda p: p.index)
    workers = sorted((p for p in kprocs if p.kind == "worker"), key=lambda p: p.index)
    replicas = sts["spec"]["replicas"]
    for p in shards:
        a, c = p.args, p.spec["container"]
        if (a.shard_id, a.num_shards) != (p.index, replicas):
            problems.append(f"{p.where}: shard {a.shard_id} of {a.num_shards}, the pod is "
                            f"ordinal {p.index} of {replicas}")
        _check_shard_ports(p, STAGES["server"], problems)
        ports = _ports(c)
        want = {"grpc": a.grpc_port, "data": a.data_port, "metrics": a.metrics_port}
        if a.health_port > 0:
            want["health"] = a.health_port
        else:  # issue 29: the kubelet's gRPC probe speaks plaintext only
            problems.append(f"{p.where}: no --health-port, so the probes cannot check a shard "
                            f"whose gRPC port speaks TLS")
        if ports != want:
            problems.append(f"{p.where}: containerPorts {ports}, the shard listens on {want}")
        # the health port when there is one: plaintext, so probes work under TLS too
        health = (a.health_port, "health") if a.health_port > 0 else (a.grpc_port, "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            got = c.get(probe, {}).get("grpc", {}).get("port")
            if got not in health:
                problems.append(f"{p.where}: {probe} asks port {got}, the health service is "
                                f"on {health[0]}")
    for p in workers:
        a, c = p.args, p.spec["container"]
        n = job["spec"]["completions"]
        if (a.rank, a.world_size) != (p.index, n) or job["spec"]["parallelism"] != n:
            problems.append(f"{p.where}: rank {a.rank} of {a.world_size}; the Job runs index "
                            f"{p.index} of {n} completions, parallelism "
                            f"{job['spec']['parallelism']}")
        _check_worker_metrics(p, STAGES["worker"], problems)
        if _ports(c).get("metrics") != a.metrics_port:
            problems.append(f"{p.where}: containerPort metrics {_ports(c).get('metrics')}, the "
                            f"worker serves {a.metrics_port}")
        # Headless Service: a pod's DNS name reaches its container ports directly.
        want = [(f"{sts['metadata']['name']}-{s.index}.{svc['metadata']['name']}",
                 s.args.grpc_port) for s in shards]
        if _servers(a.servers) != want:
            problems.append(f"{p.where}: --servers {a.servers}, the shards are {want}")

    # Service ports: named like the container ports, pointing at them, equal to them (the
    # DNS names of a headless Service bypass the port mapping, so they must be equal).
    shard_ports = _ports(sts["spec"]["template"]["spec"]["containers"][0])
    for sp in svc["spec"]["ports"]:
        target = sp.get("targetPort", sp["port"])
        resolved = shard_ports.get(target) if isinstance(target, str) else target
        if resolved is None or resolved != sp["port"] or shard_ports.get(sp["name"]) != sp["port"]:
            problems.append(f"Service port {sp}: the shard container has {shard_ports}")
    shard_ports.pop("health", None)  # for the kubelet's probes only: not in the Service
    if {sp["name"] for sp in svc["spec"]["ports"]} != set(shard_ports):
        problems.append(f"Service ports {[sp['name'] for sp in svc['spec']['ports']]} vs "
                        f"container ports {sorted(shard_ports)}")

    # The pods run as the images' user (runAsNonRoot needs the numeric USER).
    for doc in (sts, job):
        ctx = doc["spec"]["template"]["spec"].get("securityContext", {})
        for c in _containers(doc):
            user = _stage_of_image(c["image"], images).user
            want = f"{ctx.get('runAsUser')}:{ctx.get('runAsGroup')}"
            if ctx.get("runAsNonRoot") and user != want:
                problems.append(f"{doc['kind']}/{doc['metadata']['name']} {c['name']}: runs as "
                                f"{want}, the image's USER is {user!r}")

    # Scrape annotations name the metrics port.
    for doc, kind in ((sts, "shard"), (job, "worker")):
        ann = doc["spec"]["template"]["metadata"].get("annotations", {})
        port = _ports(doc["spec"]["template"]["spec"]["containers"][0]).get("metrics")
        if ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") != \
                str(port):
            problems.append(f"{kind} pods: prometheus.io/port {ann.get('prometheus.io/port')}, "
                            f"metrics is {port}")

    # ServiceMonitor / PodMonitor (applied apart from the kustomization).
    monitors = [d for d in yaml.safe_load_all((K8S / "servicemonitor.yaml").read_text()) if d]
    for m in monitors:
        where = f"{m['kind']}/{m['metadata']['name']}"
        if kust.get("namespace") and m["metadata"].get("namespace") != kust["namespace"]:
            problems.append(f"{where}: namespace {m['metadata'].get('namespace')}, the "
                            f"kustomization deploys to {kust['namespace']}")
        sel = m["spec"]["selector"]["matchLabels"]
        if m["kind"] == "ServiceMonitor":
            names = {sp["name"] for sp in svc["spec"]["ports"]}
            if not sel.items() <= svc["metadata"].get("labels", {}).items():
                problems.append(f"{where}: selector {sel} misses Service "
                                f"{svc['metadata']['name']}")
            endpoints = m["spec"]["endpoints"]
        elif m["kind"] == "PodMonitor":
            names = set(_ports(job["spec"]["template"]["spec"]["containers"][0]))
            if not sel.items() <= job["spec"]["template"]["metadata"]["labels"].items():
                problems.append(f"{where}: selector {sel} misses the worker pods")
            endpoints = m["spec"]["podMetricsEndpoints"]
        else:
            problems.append(f"{where}: unexpected kind")
            continue
        for ep in endpoints:
            if ep.get("port") not in names:
                problems.append(f"{where}: port {ep.get('port')!r} is none of {sorted(names)}")
            if ep.get("path", "/metrics") != "/metrics":
                problems.append(f"{where}: path {ep['path']}")

    # The ConfigMap's counts, as the kustomization leaves them.
    cm = _one(docs, "ConfigMap")["data"]
    if cm.get("BITPS_NUM_SHARDS") != str(replicas) or \
            cm.get("BITPS_WORLD_SIZE") != str(job["spec"]["parallelism"]):
        problems.append(f"ConfigMap counts {cm.get('BITPS_NUM_SHARDS')}/"
                        f"{cm.get('BITPS_WORLD_SIZE')} vs replicas {replicas}/parallelism "
                        f"{job['spec']['parallelism']}")
    assert not problems, "\n".join(problems)


def test_compose_and_k8s_run_the_same_cluster(cprocs, kprocs):
    """Same ports and training flags in both places (the defaults of compose's variables are
    the ConfigMap's values)."""
    keys = ("grpc_port", "data_port", "metrics_port", "mode", "staleness", "optimizer", "lr",
            "heartbeat_timeout", "steps", "batch_size", "seq_len", "metrics_host", "host")

    def settings(procs, kind):
        out = set()
        for p in procs:
            if p.kind == kind:
                ns = vars(p.args)
                out.add(tuple((k, ns[k]) for k in keys if k in ns))
        return out

    for kind in ("shard", "worker"):
        c, k = settings(cprocs, kind), settings(kprocs, kind)
        assert len(c) == 1 and c == k, (kind, c, k)


# --- the token is not optional --------------------------------------------------------------------

def test_the_token_is_required_in_compose_and_kubernetes(k8s, cprocs, kprocs):
    """Shards bind 0.0.0.0 in their containers and pods, so a cluster started without a token
    would take any peer on the network: compose refuses to start without BITPS_TOKEN, and
    every bitps container in Kubernetes takes it from a Secret that is not optional (the pod
    does not start without it)."""
    with pytest.raises(ManifestError, match="BITPS_TOKEN"):
        load_compose(_dotenv())  # a fresh host: no token given
    for p in cprocs:
        assert p.env.get("BITPS_TOKEN") == COMPOSE_TOKEN, p.where
    refs = []
    for doc in k8s[0]:
        if not _template(doc):
            continue
        for c in _template(doc)["spec"].get("containers", []):
            env = {v["name"]: v for v in c.get("env", [])}
            if c.get("image", "").split(":")[0].split("/")[-1] in ("bitps-server",
                                                                    "bitps-worker"):
                ref = env["BITPS_TOKEN"]["valueFrom"]["secretKeyRef"]
                assert ref["name"] == "bitps-token" and ref["key"] == "token", ref
                assert not ref.get("optional", False), (doc["metadata"]["name"], ref)
                refs.append(doc["metadata"]["name"])
    assert len(refs) >= 2, refs  # the shards' StatefulSet and the workers' Job
    for p in kprocs:
        assert p.env.get("BITPS_TOKEN") == "secret-value", p.where  # required, so present
