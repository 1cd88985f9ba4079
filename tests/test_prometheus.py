"""A real Prometheus scrapes a real local cluster with the project's own ``docker/prometheus.yml``.

The cluster is ``bitps-launch`` (2 shards, 2 workers, loopback, every port picked by the OS and
read back from the ready lines / ``cluster.json``). The scrape config is docker/prometheus.yml
with only what cannot work here changed: each target becomes 127.0.0.1:<port of that process>
and the interval becomes 1 s. Job names, labels and any relabelling stay as the file has them,
so this checks that the file as shipped scrapes every process's ``bitps_*`` series. Then every
query of the Grafana dashboard must be PromQL this Prometheus accepts.

Prometheus is Debian's ``prometheus`` package; when it is missing the test installs it (as root,
with apt-get, without letting the packaged service start) and is skipped, with the reason, only
where that is impossible.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import promtool_problems
from tests.test_processes import _alive

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_YML = ROOT / "docker" / "prometheus.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "bitps.json"
DEFAULT_PORT = 9090  # what Debian's packaged service would listen on: never used here

pytestmark = pytest.mark.timeout(180)


# --- Prometheus: find or install ----------------------------------------------------------------

def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _apt_install(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "--no-install-recommends",
         "prometheus"], env=env, capture_output=True, text=True, timeout=600)


def _install_prometheus() -> str:
    """The prometheus binary, installed with apt-get if it is missing; skips where it can't be."""
    found = shutil.which("prometheus")
    if found:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("prometheus is not installed and installing it needs root "
                    "(apt-get install prometheus)")
    if not shutil.which("apt-get"):
        pytest.skip("prometheus is not installed and there is no apt-get to install it with")
    busy_before = _listening(DEFAULT_PORT)
    # Debian's postinst asks invoke-rc.d to start the service; policy-rc.d exiting 101 says no
    # (container images usually ship one; add it for the install only where they don't).
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        out = _apt_install(env)
        if out.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                           timeout=600)
            out = _apt_install(env)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"apt-get install prometheus failed: {err}")
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)
    found = shutil.which("prometheus")
    if out.returncode != 0 or not found:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-5:])
        pytest.skip(f"apt-get install prometheus failed (exit {out.returncode}): {tail}")
    assert busy_before or not _listening(DEFAULT_PORT), (
        f"installing Debian's prometheus started its packaged service on :{DEFAULT_PORT}")
    return found


# --- the adapted config ---------------------------------------------------------------------------

_TARGET = re.compile(r"(bitps-(?:shard|worker))-(\d+):\d+")


def adapt_config(config: dict, ports: dict[str, list[int]]) -> tuple[dict, dict[str, tuple]]:
    """docker/prometheus.yml with every ``<service>-N:<port>`` target (compose service names)
    rewritten to 127.0.0.1:<ports[service][N]>, and a 1 s scrape interval. Returns the config
    and, for each local target, ``(job name, compose target, static labels)`` from the file."""
    config = json.loads(json.dumps(config))  # a deep copy
    glob = config.setdefault("global", {})
    glob["scrape_interval"] = glob["evaluation_interval"] = "1s"
    glob["scrape_timeout"] = "1s"
    stands_for: dict[str, tuple] = {}
    for job in config["scrape_configs"]:
        for key in ("scrape_interval", "scrape_timeout"):
            if key in job:
                job[key] = "1s"
        for static in job.get("static_configs", []):
            local = []
            for target in static["targets"]:
                m = _TARGET.fullmatch(target)
                assert m, f"job {job['job_name']}: target {target!r} is no bitps service"
                service, index = m.group(1), int(m.group(2))
                assert index < len(ports[service]), (
                    f"job {job['job_name']}: {target} but the cluster has "
                    f"{len(ports[service])} {service} processes")
                address = f"127.0.0.1:{ports[service][index]}"
                stands_for[address] = (job["job_name"], target, static.get("labels", {}))
                local.append(address)
            static["targets"] = local
    return config, stands_for


# --- processes ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=5) as reply:
        doc = json.loads(reply.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"({path.name}: missing)"
    return f"--- {path.name}:\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-lines:])


def test_adapt_config_rewrites_only_targets_and_intervals():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    adapted, stands_for = adapt_config(config, {"bitps-shard": [1001, 1002],
                                                "bitps-worker": [2001, 2002]})
    assert [j["job_name"] for j in adapted["scrape_configs"]] == [
        j["job_name"] for j in config["scrape_configs"]]
    for old, new in zip(config["scrape_configs"], adapted["scrape_configs"]):
        strip = lambda job: {k: v for k, v in job.items()
                             if k not in ("static_configs", "scrape_interval", "scrape_timeout")}
        assert strip(old) == strip(new)
        for s_old, s_new in zip(old["static_configs"], new["static_configs"]):
            assert s_old.get("labels") == s_new.get("labels")
    assert sorted(stands_for) == [f"127.0.0.1:{p}" for p in (1001, 1002, 2001, 2002)]


def test_prometheus_scrapes_every_shard_and_worker(tmp_path):
    binary = _install_prometheus()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch_log = run_dir / "launch.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with launch_log.open("wb") as log:  # the child keeps its own descriptor
        launch = subprocess.Popen(
            [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--workers", "2",
             "--mode", "async", "--run-dir", str(run_dir), "--server-arg=--metrics-port=0",
             "--", "--steps", "100000", "--seq-len", "32", "--batch-size", "2",
             "--corpus-bytes", "200000", "--log-every", "1000", "--metrics-port", "0"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    prometheus = None
    cluster: dict = {}
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "cluster.json").exists():
            if launch.poll() is not None:
                pytest.fail(f"bitps-launch exited {launch.returncode} before every worker "
                            f"started\n{_tail(launch_log, 30)}")
            assert time.monotonic() < deadline, "cluster.json never appeared"
            time.sleep(0.2)
        cluster = json.loads((run_dir / "cluster.json").read_text())
        ports = {"bitps-shard": [s["metrics_port"] for s in cluster["shards"]],
                 "bitps-worker": [w["metrics_port"] for w in cluster["workers"]]}
        assert all(p > 0 for p in ports["bitps-shard"] + ports["bitps-worker"]), ports

        config, stands_for = adapt_config(yaml.safe_load(PROMETHEUS_YML.read_text()), ports)
        # Which process each local address is: (service, compose-style name).
        process = {f"127.0.0.1:{p}": (service, f"{service}-{i}") for service, ps in ports.items()
                   for i, p in enumerate(ps)}
        unlisted = [name for address, (_, name) in process.items() if address not in stands_for]
        assert not unlisted, f"docker/prometheus.yml scrapes no target for {unlisted}"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        web = f"127.0.0.1:{_free_port()}"
        assert not web.endswith(f":{DEFAULT_PORT}")
        prom_log = tmp_path / "prometheus.log"
        with prom_log.open("wb") as log:
            prometheus = subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={web}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://{web}"

        # Poll until every process has bitps_* series stored under the job the file puts it in.
        series_query = 'count by (job, instance) ({__name__=~"bitps_.+"})'
        targets: list[dict] = []
        counts: dict[str, tuple[str, int]] = {}
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            assert prometheus.poll() is None, f"prometheus exited\n{_tail(prom_log)}"
            assert launch.poll() is None, f"bitps-launch exited\n{_tail(launch_log, 30)}"
            try:
                targets = _api(base, "/api/v1/targets", state="active")["activeTargets"]
                result = _api(base, "/api/v1/query", query=series_query)["result"]
            except OSError:  # not listening yet
                time.sleep(0.5)
                continue
            counts = {r["metric"]["instance"]: (r["metric"].get("job", ""), int(r["value"][1]))
                      for r in result}
            if all(counts.get(t, ("", 0))[1] > 0 for t in process):
                break
            time.sleep(0.5)

        health = {t["labels"]["instance"]: t for t in targets}
        missing = []
        for address, (_, name) in sorted(process.items(), key=lambda kv: kv[1][1]):
            job, target, _ = stands_for[address]
            job_seen, n = counts.get(address, ("", 0))
            if n == 0 or job_seen != job:
                t = health.get(address, {})
                missing.append(f"{name} (job {job}, target {target} -> {address}): {n} bitps_* "
                               f"series under job {job_seen!r}, health {t.get('health')!r}, "
                               f"last error {t.get('lastError')!r}")
        assert not missing, ("targets not scraped:\n  " + "\n  ".join(missing) + "\n"
                             + _tail(prom_log) + "\n" + _tail(run_dir / "worker-0.log"))

        # Prometheus's own linter on every live endpoint (docs/metrics.md: names and units)
        for address, (_, name) in sorted(process.items()):
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
                assert promtool_problems(reply.read().decode()) == [], name

        up = _api(base, "/api/v1/query", query="up")["result"]
        assert {r["metric"]["instance"]: r["value"][1] for r in up} == {t: "1" for t in process}
        # Each role's own metrics come from its processes, with the file's job and labels.
        for service, metric in (("bitps-shard", "bitps_live_workers"),
                                ("bitps-worker", "bitps_worker_loss")):
            got = {r["metric"]["instance"]: r["metric"]
                   for r in _api(base, "/api/v1/query", query=metric)["result"]}
            want = {t for t, (s, _) in process.items() if s == service}
            assert set(got) == want, (metric, got)
            for address, labels in got.items():
                job, _, static = stands_for[address]
                assert labels["job"] == job and static.items() <= labels.items(), labels

        # Every dashboard query is PromQL this Prometheus accepts (Grafana's variables filled in).
        dash = json.loads(DASHBOARD.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = (target["expr"].replace("$__rate_interval", "4s")
                        .replace("$__range", "1m").replace("$__interval", "1s"))
                try:
                    _api(base, "/api/v1/query", query=expr)
                except urllib.error.HTTPError as err:
                    pytest.fail(f"dashboard panel {panel['title']!r}: {expr}: "
                                f"{err.read().decode(errors='replace')}")
    finally:
        if prometheus is not None:
            _stop(prometheus)
        # SIGTERM makes the launcher tear the cluster down; its children also die with it.
        _stop(launch, grace=20)
        end = time.monotonic() + 10
        pids = list(cluster.get("pids", {}).values())
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not [p for p in pids if _alive(p)]
