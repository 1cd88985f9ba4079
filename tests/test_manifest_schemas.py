"""The deployment files pass their own tools' checks, not only ours.

* **Kubernetes** (docker/k8s): every object validates *strictly* (unknown fields rejected)
  against the Kubernetes JSON schemas that ``kubernetes-validate`` ships, for every minor
  version from the minimum docker/README.md claims ("Needs Kubernetes 1.27 or newer") up to
  the newest the installed kubernetes-validate has; as written, as this suite's kustomize
  renders them (tests/test_manifests.py) and, where kubectl is installed, as ``kubectl
  kustomize`` renders them. A kind or apiVersion with no schema in a version (a typo, an API
  removed) is a failure. The exceptions are the Prometheus Operator's CRD kinds
  (``ServiceMonitor``, ``PodMonitor`` in servicemonitor.yaml): no PyPI package ships their
  OpenAPI schema, so only their parts whose types are core Kubernetes types (``metadata``:
  ObjectMeta, ``spec.selector``: LabelSelector) are validated against those schemas; the rest
  is checked by tests/test_manifests.py against the Service and pods they select.
  kustomization.yaml is kustomize's configuration, not an object: it is checked for what it
  is (its resources exist and account for every manifest), and is what the rendered checks run.
* **Compose** (docker/compose.yaml): validates against the Compose Specification's JSON schema
  (the copy check-jsonschema vendors, ``vendor.compose-spec``), as written and after
  interpolation (what compose itself validates).
* **Grafana / Prometheus**: every ``expr`` of every dashboard under docker/grafana parses as
  PromQL by ``promtool check rules`` (one recording rule per expression; Grafana's variables
  substituted first, see ``GRAFANA_BUILTINS``), and docker/prometheus.yml passes ``promtool
  check config``.

Each check also runs on a deliberately broken copy, to show that it fails. A check skips only
where its tool is missing (kubernetes-validate or check-jsonschema not importable, promtool or
kubectl not on PATH).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_manifests import compose_walk, kustomize

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
GRAFANA = DOCKER / "grafana"
KUSTOMIZE_API = "kustomize.config.k8s.io/"

# CRD kinds the core schemas cannot know, and the parts of them whose Go types are core
# Kubernetes types (prometheus-operator's monitoringv1: metav1.ObjectMeta, metav1.LabelSelector),
# by the kubernetes-validate schema file of that type.
CRD_CORE_PARTS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"metadata": "objectmeta-meta-v1",
                                                     "spec.selector": "labelselector-meta-v1"},
    ("monitoring.coreos.com/v1", "PodMonitor"): {"metadata": "objectmeta-meta-v1",
                                                 "spec.selector": "labelselector-meta-v1"},
}


# --- Kubernetes -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install -e '.[dev]'): the Kubernetes "
               "schemas are in it")


def claimed_minimum() -> tuple[int, int]:
    """The oldest Kubernetes docker/README.md says the manifests run on."""
    m = re.search(r"Needs Kubernetes (\d+)\.(\d+) or newer", (DOCKER / "README.md").read_text())
    assert m, "docker/README.md no longer states the Kubernetes versions it needs"
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def k8s_versions(kv) -> list[str]:
    """Every minor version from the claimed minimum to the newest kubernetes-validate ships."""
    from kubernetes_validate import utils

    shipped = sorted({tuple(int(x) for x in utils.major_minor(v).split("."))
                      for v in utils.all_versions()})
    low = claimed_minimum()
    assert low in shipped, (f"kubernetes-validate {kv.__version__} has no schemas for "
                            f"{low[0]}.{low[1]}, the minimum docker/README.md claims")
    assert shipped[-1] >= (1, 37), (f"kubernetes-validate {kv.__version__} stops at "
                                    f"{shipped[-1]}; docker/README.md says 1.37 is validated")
    return [f"{a}.{b}" for a, b in shipped if (a, b) >= low]


def _get(doc: dict, path: str):
    for key in path.split("."):
        doc = doc[key]
    return doc


def core_type_errors(value, schema_name: str, version: str) -> list[str]:
    """``value`` against one core type's strict schema in kubernetes-validate, the way its
    ``validate`` does it for whole objects."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    base = f"kubernetes-json-schema/v{version}.0-local-strict"
    schema = utils.schema_contents(f"{base}/{schema_name}.json", version)
    defs = utils.schema_contents(f"{base}/_definitions.json", version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
            for e in validator.iter_errors(value)]


def k8s_errors(docs: list[tuple[str, dict]], versions: list[str]) -> list[str]:
    """Every problem kubernetes-validate (strict) finds in ``docs`` ((where, object) pairs) in
    each version; a CRD kind of ``CRD_CORE_PARTS`` has its core-typed parts validated."""
    import kubernetes_validate as kv

    errors = []
    for where, doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind"} <= doc.keys():
            errors.append(f"{where}: not a Kubernetes object (no apiVersion/kind)")
            continue
        name = f"{where}: {doc['kind']}/{doc.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                used = kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(map(str, e.absolute_path)) or "."
                errors.append(f"{name} (Kubernetes {version}): {path}: {e.message}")
            except kv.SchemaNotFoundError as e:
                parts = CRD_CORE_PARTS.get((doc["apiVersion"], doc["kind"]))
                if parts is None:
                    errors.append(f"{name}: {e.message}")
                    continue
                for path, schema_name in parts.items():
                    try:
                        value = _get(doc, path)
                    except (KeyError, TypeError):
                        errors.append(f"{name}: no {path}")
                        continue
                    errors += [f"{name} (Kubernetes {version}): {path}.{msg}"
                               for msg in core_type_errors(value, schema_name, version)]
            else:
                if used != version:
                    errors.append(f"{name}: validated against {used}, not {version}")
    return errors


def manifest_docs(path: Path) -> list[tuple[str, dict]]:
    """The Kubernetes objects of one manifest file (kustomize config is not one)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return [(f"{path.name}[{i}]", d) for i, d in enumerate(docs)
            if not (isinstance(d, dict) and str(d.get("apiVersion", "")).startswith(KUSTOMIZE_API))]


def test_k8s_manifests_validate_against_kubernetes_schemas(k8s_versions):
    files = sorted(K8S.glob("*.y*ml"))
    docs = [d for f in files for d in manifest_docs(f)]
    kinds = sorted({d["kind"] for _, d in docs})
    assert {"Namespace", "ConfigMap", "Service", "StatefulSet", "Job"} <= set(kinds), kinds
    errors = k8s_errors(docs, k8s_versions)
    assert not errors, "\n".join(errors)


def test_k8s_rendered_kustomization_validates(k8s_versions):
    """What ``kubectl apply -k docker/k8s`` applies, as tests/test_manifests.py renders it
    (namespace, images and replacements applied)."""
    docs, _ = kustomize()
    errors = k8s_errors([(f"kustomize[{i}]", d) for i, d in enumerate(docs)], k8s_versions)
    assert not errors, "\n".join(errors)


def test_k8s_kubectl_kustomize_output_validates(k8s_versions, tmp_path):
    """The same, rendered by the real kustomize (``kubectl kustomize``, which also rejects
    unknown fields in kustomization.yaml)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: the real kustomize rendering is not checked")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(out.stdout)
    docs = manifest_docs(rendered)
    mine = {(d["kind"], d["metadata"]["name"]) for d in kustomize()[0]}
    assert {(d["kind"], d["metadata"]["name"]) for _, d in docs} == mine
    errors = k8s_errors(docs, k8s_versions)
    assert not errors, "\n".join(errors)


def test_kustomization_is_config_not_an_object(kv):
    """kustomization.yaml has no Kubernetes schema (kubernetes-validate says so): it is
    checked as kustomize config. Its resources exist and, with servicemonitor.yaml (the
    CRD kinds, applied apart), are every manifest in docker/k8s."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kust["kind"] == "Kustomization"
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(kust, kv.latest_version(), strict=True)
    resources = kust["resources"]
    assert len(resources) == len(set(resources)), resources
    missing = [r for r in resources if not (K8S / r).is_file()]
    assert not missing, f"kustomization.yaml lists missing files {missing}"
    manifests = {p.name for p in K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    assert manifests - set(resources) == {"servicemonitor.yaml"}, sorted(manifests)
    crd = {(d["apiVersion"], d["kind"]) for _, d in manifest_docs(K8S / "servicemonitor.yaml")}
    assert crd == set(CRD_CORE_PARTS), crd  # only CRD kinds there, none in the kustomization
    assert not any((d["apiVersion"], d["kind"]) in CRD_CORE_PARTS for d in kustomize()[0])


def _shard_statefulset() -> dict:
    return yaml.safe_load((K8S / "shard-statefulset.yaml").read_text())


def _breaks():
    def wrong_type(d):
        d["spec"]["replicas"] = "two"

    def unknown_field(d):
        d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPorts"] = 50051

    def removed_api(d):
        d["apiVersion"] = "apps/v1beta2"  # removed in Kubernetes 1.16

    def bad_probe(d):
        d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"

    return {"wrong type": (wrong_type, "spec.replicas"),
            "unknown field": (unknown_field, "containerPorts"),
            "removed apiVersion": (removed_api, "apps/v1beta2"),
            "probe port must be a number": (bad_probe, "grpc.port")}


@pytest.mark.parametrize("case", list(_breaks()))
def test_k8s_check_rejects_a_broken_statefulset(k8s_versions, tmp_path, case):
    change, expect = _breaks()[case]
    doc = _shard_statefulset()
    change(doc)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    errors = k8s_errors(manifest_docs(path), k8s_versions)
    # every version rejects it, and says where
    assert len(errors) >= len(k8s_versions), errors
    assert all(expect in e for e in errors), errors


def test_k8s_check_validates_what_it_can_of_crd_objects(k8s_versions):
    """ServiceMonitor/PodMonitor have no schema here, but their metadata and selector are core
    types: a wrong type there fails; an unknown kind that is no known CRD fails outright."""
    monitors = manifest_docs(K8S / "servicemonitor.yaml")
    broken = copy.deepcopy(monitors[0][1])
    broken["metadata"]["labels"] = ["app.kubernetes.io/name=bitps-shard"]
    broken["spec"]["selector"]["matchLabel"] = broken["spec"]["selector"].pop("matchLabels")
    errors = k8s_errors([("broken", broken)], k8s_versions[-1:])
    assert any("metadata.labels" in e for e in errors), errors
    assert any("matchLabel" in e for e in errors), errors
    typo = copy.deepcopy(monitors[0][1])
    typo["kind"] = "ServiceMonitors"
    errors = k8s_errors([("typo", typo)], k8s_versions[-1:])
    assert errors and "Couldn't find schema" in errors[0], errors


# --- Compose ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose_schema() -> dict:
    pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    builtin = pytest.importorskip(
        "check_jsonschema.builtin_schemas",
        reason="check-jsonschema is not installed (pip install -e '.[dev]'): the Compose "
               "schema is vendored in it")
    return builtin.get_builtin_schema("vendor.compose-spec")


def compose_errors(path: Path, schema: dict, env: dict[str, str]) -> list[str]:
    """The Compose schema's complaints about ``path``, as written and after interpolation
    with ``env`` (compose validates the interpolated model)."""
    import jsonschema

    raw = yaml.safe_load(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    errors = []
    for label, doc in (("as written", raw), ("interpolated", compose_walk(raw, env, path.name))):
        errors += [f"{path.name} ({label}): {'.'.join(map(str, e.absolute_path)) or '.'}: "
                   f"{e.message}" for e in validator.iter_errors(doc)]
    return errors


COMPOSE_ENV = {"BITPS_TOKEN": "check"}  # required by compose.yaml; the rest have defaults


def test_compose_validates_against_the_compose_spec(compose_schema):
    errors = compose_errors(DOCKER / "compose.yaml", compose_schema, COMPOSE_ENV)
    assert not errors, "\n".join(errors)


def _compose_breaks():
    def unknown_key(c):
        c["services"]["prometheus"]["commands"] = c["services"]["prometheus"].pop("command")

    def bad_condition(c):
        c["services"]["bitps-worker-0"]["depends_on"]["bitps-shard-0"]["condition"] = "healthy"

    def wrong_type(c):
        c["services"]["bitps-worker-0"]["environment"] = "OMP_NUM_THREADS=2"

    return {"unknown service key": (unknown_key, "commands"),
            "depends_on condition": (bad_condition, "healthy"),
            "environment not a list or mapping": (wrong_type, "environment")}


@pytest.mark.parametrize("case", list(_compose_breaks()))
def test_compose_check_rejects_a_broken_file(compose_schema, tmp_path, case):
    change, expect = _compose_breaks()[case]
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())  # anchors merged
    change(compose)
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(compose))
    errors = compose_errors(path, compose_schema, COMPOSE_ENV)
    # rejected as written and interpolated, and the complaint names what is wrong
    for label in ("as written", "interpolated"):
        assert any(f"({label})" in e and expect in e for e in errors), errors


# --- PromQL and the Prometheus config ---------------------------------------------------------

@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    return found


# Grafana's built-in variables, by what they stand for: a range for the $__*interval ones and
# $__range, plain numbers for the _ms/_s forms.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h",
                    "__interval_ms": "60000", "__range_ms": "3600000", "__range_s": "3600"}
_GRAFANA_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def dashboard_exprs(path: Path) -> list[tuple[str, str]]:
    """(where, expr) for every query of a Grafana dashboard, panels in rows included."""
    out = []

    def walk(node, where):
        if isinstance(node, dict):
            for target in node.get("targets", []) or []:
                if isinstance(target, dict) and "expr" in target:
                    out.append((f"{path.name} {where} {node.get('title', '')!r} "
                                f"refId {target.get('refId')}", target["expr"]))
            for i, panel in enumerate(node.get("panels", []) or []):
                walk(panel, f"{where}.panels[{i}]")
    walk(json.loads(path.read_text()), "")
    return out


def dashboard_variables(path: Path) -> dict[str, str]:
    """Grafana's built-ins, then the dashboard's template variables at their current value
    (what Grafana would put in; "All" as the regex ``.*``)."""
    values = dict(GRAFANA_BUILTINS)
    for var in json.loads(path.read_text()).get("templating", {}).get("list", []):
        current = (var.get("current") or {}).get("value")
        if isinstance(current, list):
            current = "|".join(current)
        if current in (None, "", "$__all"):
            current = ".*"
        values[var["name"]] = str(current)
    return values


def substitute(expr: str, values: dict[str, str]) -> tuple[str, list[str]]:
    unknown = []

    def one(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name not in values:
            unknown.append(m.group(0))
            return m.group(0)
        return values[name]

    return _GRAFANA_VAR.sub(one, expr), unknown


def promql_errors(exprs: list[tuple[str, str]], values: dict[str, str], promtool: str,
                  tmp: Path) -> list[str]:
    """``promtool check rules`` over one recording rule per expression (a group per
    expression, named by where it comes from, so that an error says which)."""
    errors, groups = [], []
    for i, (where, expr) in enumerate(exprs):
        text, unknown = substitute(expr, values)
        if unknown:
            errors.append(f"{where}: undefined Grafana variable(s) {unknown} in {expr!r}")
        groups.append({"name": where, "rules": [{"record": f"dashboard:expr_{i}",
                                                 "expr": text}]})
    rules = tmp / "dashboard-rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        errors.append(f"promtool check rules (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    elif f"SUCCESS: {len(exprs)} rules found" not in out.stdout + out.stderr:
        errors.append(f"promtool did not check {len(exprs)} rules:\n{out.stdout}{out.stderr}")
    return errors


def test_dashboard_queries_parse_as_promql(promtool, tmp_path):
    dashboards = sorted(GRAFANA.rglob("*.json"))
    assert dashboards
    for path in dashboards:
        exprs = dashboard_exprs(path)
        assert exprs, f"{path}: no queries found"
        errors = promql_errors(exprs, dashboard_variables(path), promtool, tmp_path)
        assert not errors, "\n".join(errors)


@pytest.mark.parametrize("expr, expect", [
    ("sum by (instance) (rate(bitps_push_bytes_total[$__rate_interval])", "unclosed left"),
    ("histogram_quantile(0.5, sum by (le) rate(bitps_push_latency_seconds_bucket[5m]))",
     "parse error"),
    ("rate(bitps_push_bytes_total{instance=~\"$shard\"}[5m])", "undefined Grafana variable"),
    ("rate(bitps_push_bytes_total[5 m])", "parse error"),
])
def test_promql_check_rejects_a_broken_query(promtool, tmp_path, expr, expect):
    dash = json.loads((GRAFANA / "dashboards" / "bitps.json").read_text())
    dash["panels"][0]["targets"][0]["expr"] = expr
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(dash))
    errors = promql_errors(dashboard_exprs(path), dashboard_variables(path), promtool, tmp_path)
    assert errors and expect in "\n".join(errors), errors
    assert "panels[0]" in "\n".join(errors), errors  # it names the panel


def test_grafana_variables_are_substituted():
    values = {**GRAFANA_BUILTINS, "instance": "bitps-shard-0:9100"}
    text, unknown = substitute(
        'rate(x{instance="$instance"}[$__rate_interval]) / ${__range_s} + [[instance]]', values)
    assert text == 'rate(x{instance="bitps-shard-0:9100"}[1m]) / 3600 + bitps-shard-0:9100'
    assert not unknown


def test_prometheus_config_passes_promtool(promtool):
    out = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_config_check_rejects_a_broken_config(promtool, tmp_path):
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    config["scrape_configs"][0]["static_config"] = config["scrape_configs"][0].pop(
        "static_configs")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "static_config" in out.stdout + out.stderr, out
