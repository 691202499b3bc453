"""Monitoring: the Prometheus configs, rules and the Grafana dashboard, checked with the real tools.

(a) promtool (Debian's prometheus package; scripts/check_prometheus.sh installs it): check config,
    check rules, test rules; the dashboard JSON is what its generator makes.
(b) a real Prometheus scraping a real `mdgan local` cluster (through the run's metrics_targets.json,
    with the repository's rule files loaded): every panel query of the dashboard returns data, the
    rule groups are loaded and healthy, the recording rules record, no alert fires on a healthy run.
(c) a real Prometheus running the Kubernetes config's relabeling on simulated pods (Debian's build
    has no Kubernetes discovery, so the pods come through file_sd with the __meta_kubernetes_* labels
    Kubernetes discovery would give them).

Without prometheus/promtool these tests skip, or fail when CI=true.
"""

from __future__ import annotations

import copy
import glob
import json
import math
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

import pytest
import yaml

from procs import Proc

from conftest import REPO

PROM_DIR = os.path.join(REPO, "deploy", "prometheus")
RULE_FILES = sorted(glob.glob(os.path.join(PROM_DIR, "rules", "*.yml")))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "dashboards", "mdgan.json")
GENERATOR = os.path.join(REPO, "deploy", "grafana", "generate_dashboard.py")

# Scrape the local cluster every second; Grafana's $__rate_interval is max($__interval + scrape
# interval, 4 x scrape interval), which is 4 s here for any range shorter than ~1 h.
SCRAPE_S = 1
GRAFANA_VARIABLES = {"__rate_interval": f"{4 * SCRAPE_S}s", "__interval": f"{SCRAPE_S}s", "__range": "5m",
                     "__range_s": "300", "__interval_ms": str(1000 * SCRAPE_S)}

# Panel targets that a healthy short run cannot fill, by (panel title, refId). Keep this minimal:
# every other target must return data. These are still sent to Prometheus (a bad query fails).
EXEMPT = {
    # mdgan_worker_departures_total{reason} has no series until a worker leaves; nobody leaves a healthy run.
    ("Joins and departures", "B"): "no worker departs a healthy run",
    # mdgan_rejected_inputs_total{reason} has no series until validation refuses an input.
    ("Rejected inputs", "A"): "no input is refused in a healthy run",
    ("Discriminators refused at swaps", "A"): "no honest discriminator is refused (docs/PRIVACY.md)",
    # mdgan_evaluation_score{metric} is set only when the server scores the generator, which needs the
    # MNIST test set (MNIST runs only); the synthetic run scores nothing.
    ("Evaluation scores", "A"): "no evaluation on synthetic data (MNIST score)",
    ("Evaluation scores", "B"): "no evaluation on synthetic data (FID)",
}


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed (bash scripts/check_prometheus.sh installs Debian's prometheus package)"
    if _ci():
        pytest.fail(message)
    pytest.skip(message)


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _ok(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(result.args)} exited {result.returncode}:\n{output}"
    return output


def _without_kubernetes_sd(config: dict) -> dict:
    """The config with each kubernetes_sd_configs [{role: pod}] swapped for file_sd_configs (Debian's
    Prometheus has no Kubernetes discovery); every relabel rule stays as written."""
    config = copy.deepcopy(config)
    for job in config["scrape_configs"]:
        sds = job.pop("kubernetes_sd_configs")
        assert [sd.get("role") for sd in sds] == ["pod"], f"{job['job_name']}: expected one pod discovery"
        job["file_sd_configs"] = [{"files": ["pods.json"], "refresh_interval": "1s"}]
    return config


def _write_config(config: dict, directory: str) -> str:
    """Write a config beside a link to the rules folder (rule_files are relative to the config)."""
    os.makedirs(directory, exist_ok=True)
    link = os.path.join(directory, "rules")
    if not os.path.exists(link):
        os.symlink(os.path.join(PROM_DIR, "rules"), link)
    path = os.path.join(directory, "prometheus.yml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
    return path


def _load_yaml(path: str) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


# --- (a) promtool ---------------------------------------------------------------------------------

def test_promtool_check_config(tmp_path):
    promtool = _tool("promtool")
    out = _ok(_run([promtool, "check", "config", os.path.join(PROM_DIR, "prometheus.yml")]))
    assert f"{len(RULE_FILES)} rule files found" in out, out

    k8s = os.path.join(PROM_DIR, "prometheus-k8s.yml")
    result = _run([promtool, "check", "config", k8s])
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        # Debian's promtool: check everything but the discovery block itself.
        config = _without_kubernetes_sd(_load_yaml(k8s))
        path = _write_config(config, str(tmp_path / "k8s"))
        (tmp_path / "k8s" / "pods.json").write_text("[]")
        result = _run([promtool, "check", "config", path])
    out = _ok(result)
    assert f"{len(RULE_FILES)} rule files found" in out, out


def test_promtool_check_rules():
    promtool = _tool("promtool")
    assert {os.path.basename(p) for p in RULE_FILES} >= {"mdgan-alerts.yml", "mdgan-recording.yml"}
    out = _ok(_run([promtool, "check", "rules", *RULE_FILES]))
    assert "FAILED" not in out, out


def test_promtool_test_rules():
    promtool = _tool("promtool")
    tests = sorted(glob.glob(os.path.join(PROM_DIR, "tests", "*.test.yml")))
    assert tests
    out = _ok(_run([promtool, "test", "rules", *tests]))
    assert "SUCCESS" in out, out
    # every alert of the rule files has a unit test
    alerts = {r["alert"] for path in RULE_FILES for g in _load_yaml(path)["groups"] for r in g["rules"] if "alert" in r}
    tested = {case["alertname"] for path in tests for t in _load_yaml(path)["tests"]
              for case in t.get("alert_rule_test", [])}
    assert alerts == tested, f"alerts without a unit test: {alerts - tested}"


def _panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))   # panels inside collapsed rows
    return [p for p in found if p["type"] != "row"]


def test_dashboard_is_generated_and_uses_the_prometheus_datasource():
    _ok(_run([sys.executable, GENERATOR, "--check"]))
    with open(DASHBOARD) as fh:
        dashboard = json.load(fh)
    assert dashboard["uid"] == "mdgan" and dashboard["schemaVersion"] >= 39
    panels = _panels(dashboard)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # every query goes to the `datasource` variable's Prometheus (Grafana's default one unless picked),
    # so the dashboard works where the datasource has another uid than the provisioned `prometheus`
    ours = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == ours, panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == ours, (panel["title"], t["refId"])
            assert "vector(" not in t["expr"], (panel["title"], t["refId"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["worker"]["datasource"] == ours
    with open(os.path.join(REPO, "deploy", "k8s", "mdgan", "dashboards", "mdgan.json")) as fh:
        assert json.load(fh) == dashboard  # the chart ships the same dashboard
    provisioning = _load_yaml(os.path.join(REPO, "deploy", "grafana", "provisioning", "datasources", "prometheus.yml"))
    (source,) = provisioning["datasources"]
    assert (source["name"], source["uid"], source["url"]) == ("Prometheus", "prometheus", "http://prometheus:9090")
    assert set(EXEMPT) <= {(p["title"], t["refId"]) for p in panels for t in p["targets"]}


# --- a real Prometheus ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """The Debian prometheus binary on 127.0.0.1, with a config and a tsdb in a temp folder."""

    def __init__(self, config: dict, directory: str):
        binary = _tool("prometheus")
        self.config_path = _write_config(config, directory)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = Proc("prometheus", [
            binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={directory}/data",
            f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            os.path.join(directory, "prometheus.log"), cwd=directory)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.popen.poll() is None, \
                f"prometheus exited {self.process.popen.returncode}:\n{self.log()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {timeout} s:\n{self.log()}")

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:      # 400/422: a bad query; the body says why
            body = json.load(exc)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def log(self) -> str:
        return self.process.log()

    def stop(self) -> None:
        self.process.stop()


def _has_data(result: list[dict]) -> bool:
    """At least one series with a number (a NaN alone draws nothing)."""
    return any(not math.isnan(float(sample["value"][1])) for sample in result)


def _substitute(expr: str, values: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown variable ${name} in {expr}"
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def _dashboard_queries() -> list[tuple[str, str, str]]:
    with open(DASHBOARD) as fh:
        dashboard = json.load(fh)
    values = dict(GRAFANA_VARIABLES)
    for variable in dashboard["templating"]["list"]:     # "All": the variable's allValue
        values[variable["name"]] = variable["allValue"] if variable.get("includeAll") else variable["current"]["value"]
    return [(panel["title"], t["refId"], _substitute(t["expr"], values))
            for panel in _panels(dashboard) for t in panel["targets"]]


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the `mdgan local` CLI and the server/workers it started (its own process group)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)          # the CLI forwards SIGTERM to its children
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)         # anything left in the group
    except ProcessLookupError:
        pass
    process.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_and_rules_on_a_live_local_cluster(tmp_path):
    promtool = _tool("promtool")
    out = tmp_path / "run"
    out.mkdir()
    targets = out / "metrics_targets.json"     # written by `mdgan local` before it starts the processes
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                   "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": ["rules/*.yml"],
        # the targets carry their job (mdgan-server, mdgan-worker) as a label, which wins over job_name
        "scrape_configs": [{"job_name": "mdgan-local",
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
    }
    prometheus = Prometheus(config, str(tmp_path / "prometheus"))
    cluster_log = open(tmp_path / "local.log", "w")
    cluster = None

    def logs() -> str:
        cluster_log.flush()
        text = (tmp_path / "local.log").read_text()[-3000:]
        for path in sorted(glob.glob(str(out / "logs" / "*.log"))):
            with open(path) as fh:
                text += f"\n--- {os.path.basename(path)}\n" + fh.read()[-1500:]
        return text + "\n--- prometheus\n" + prometheus.log()

    try:
        prometheus.wait_ready()
        cluster = subprocess.Popen(
            [sys.executable, "-m", "mdgan_app.cli", "local", "--workers", "2", "--relayed", "1", "--iterations", "400",
             "--dataset", "synthetic", "--swap-every", "50", "--no-progress", "--out", str(out)],
            cwd=REPO, stdout=cluster_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

        # Wait until Prometheus has seen the whole cluster training (all targets up, iterations
        # moving at the server and at both workers, a swap done); then query everything at that time.
        window = GRAFANA_VARIABLES["__rate_interval"]
        ready = [
            'up{job="mdgan-server"} == 1',
            'count(up{job="mdgan-worker"} == 1) == 2',
            f'rate(mdgan_iterations_total{{job="mdgan-server"}}[{window}]) > 0',
            f'count(rate(mdgan_iterations_total{{job="mdgan-worker"}}[{window}]) > 0) == 2',
            'mdgan_swaps_total{job="mdgan-server", outcome="complete"} > 0',
            # each side counts a swap on its own and is scraped on its own: wait for the workers' counts too
            'sum(mdgan_swap_paths_total{job="mdgan-worker"}) > 0',
            'sum(mdgan_swaps_total{job="mdgan-worker"}) > 0',
        ]
        deadline = time.monotonic() + 150
        at = None
        while time.monotonic() < deadline:
            now = time.time()
            if all(prometheus.query(expr, now) for expr in ready):
                at = now
                break
            assert cluster.poll() is None, f"the cluster ended ({cluster.returncode}) before it was seen training:\n{logs()}"
            time.sleep(0.5)
        assert at is not None, "Prometheus did not see the cluster training: " + ", ".join(
            expr for expr in ready if not prometheus.query(expr)) + "\n" + logs()

        # Series that first appear between two scrapes may take one more scrape: ask again for a few
        # seconds before calling a panel empty.
        queries = _dashboard_queries()
        deadline = time.monotonic() + 10
        while True:
            empty = []
            for title, ref, expr in queries:
                result = prometheus.query(expr, at)    # a query Prometheus refuses fails here, exempt or not
                if (title, ref) not in EXEMPT and not _has_data(result):
                    empty.append(f"{title} [{ref}]: {expr}")
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1)
            at = time.time()
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty) + "\n" + logs()
        assert len(queries) - len(EXEMPT) >= 30

        # The rule groups are loaded, evaluated and healthy; the recording rules record.
        groups = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            groups = {g["name"]: g for g in prometheus.api("rules")["groups"]}
            rules = [r for g in groups.values() for r in g["rules"]]
            if {"mdgan-alerts", "mdgan-recording"} <= set(groups) and all(r["health"] == "ok" for r in rules):
                break
            time.sleep(0.5)
        assert {"mdgan-alerts", "mdgan-recording"} <= set(groups), sorted(groups)
        expected = {r.get("record") or r.get("alert") for path in RULE_FILES for g in _load_yaml(path)["groups"]
                    for r in g["rules"]}
        loaded = {r["name"] for g in groups.values() for r in g["rules"]}
        assert loaded == expected
        unhealthy = [(r["name"], r["health"], r.get("lastError")) for g in groups.values() for r in g["rules"]
                     if r["health"] != "ok"]
        assert not unhealthy, unhealthy
        firing = [(r["name"], a["labels"]) for r in groups["mdgan-alerts"]["rules"] for a in r.get("alerts", [])
                  if a["state"] == "firing"]
        assert not firing, f"alerts firing on a healthy run: {firing}"
        # A rule can be healthy yet have last run just before the rates had two samples: its record
        # appears at a later evaluation (every SCRAPE_S), so wait for that rather than read it once.
        records = sorted({r["name"] for r in groups["mdgan-recording"]["rules"]})
        deadline = time.monotonic() + 30
        while True:
            without = [name for name in records if not _has_data(prometheus.query(name))]
            if not without or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not without, f"recording rules without data: {without}\n{logs()}"

        # The run ends well, and its final expositions pass promtool's lint.
        try:
            code = cluster.wait(max(5.0, deadline - time.monotonic() + 60))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the cluster did not finish:\n{logs()}") from None
        assert code == 0, logs()
        dumps = sorted(glob.glob(str(out / "metrics" / "*.prom")))
        assert len(dumps) == 3, dumps
        for path in dumps:
            with open(path) as fh:
                result = subprocess.run([promtool, "check", "metrics"], stdin=fh, capture_output=True, text=True,
                                        timeout=30)
            assert result.returncode == 0, f"{path}: {result.stdout}{result.stderr}"
    finally:
        if cluster is not None:
            _stop_group(cluster)
        cluster_log.close()
        prometheus.stop()


# --- (c) the Kubernetes relabeling ----------------------------------------------------------------

def _pod(name: str, ip: str, ports: list[int], component: str, *, app: str = "mdgan", phase: str = "Running",
         scrape: str | None = "true", metrics_port: int = 9100) -> list[dict]:
    """The target groups Kubernetes pod discovery gives for one pod: one per container port."""
    labels = {
        "__meta_kubernetes_namespace": "ml",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_phase": phase,
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
        "__meta_kubernetes_pod_label_app_kubernetes_io_instance": "mdgan",
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
        "__meta_kubernetes_pod_annotation_prometheus_io_port": str(metrics_port),
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    }
    if scrape is not None:
        labels["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] = scrape
    host = f"[{ip}]" if ":" in ip else ip
    return [{"targets": [f"{host}:{port}"], "labels": {**labels, "__meta_kubernetes_pod_container_port_number": str(port)}}
            for port in ports]


def test_kubernetes_relabeling_on_simulated_pods(tmp_path):
    config = _without_kubernetes_sd(_load_yaml(os.path.join(PROM_DIR, "prometheus-k8s.yml")))
    # Loopback pod IPs only: Prometheus will try to scrape the kept targets.
    pods = [
        *_pod("mdgan-server-6f7c9-x2x4k", "127.0.0.2", [50051, 9100], "server"),
        *_pod("mdgan-worker-0", "127.0.0.3", [50052, 9101], "worker", metrics_port=9101),
        *_pod("mdgan-worker-1", "0:0:0:0:0:0:0:1", [50052, 9101], "worker", metrics_port=9101),   # IPv6
        *_pod("mdgan-worker-2", "127.0.0.4", [50052, 9101], "worker", metrics_port=9101, phase="Succeeded"),
        *_pod("mdgan-worker-3", "127.0.0.5", [50052, 9101], "worker", metrics_port=9101, scrape=None),
        *_pod("mdgan-worker-4", "127.0.0.6", [50052, 9101], "worker", metrics_port=9101, scrape="false"),
        *_pod("other-server-0", "127.0.0.7", [8080], "server", app="other", metrics_port=8080),
    ]
    directory = tmp_path / "k8s"
    directory.mkdir()
    (directory / "pods.json").write_text(json.dumps(pods))
    prometheus = Prometheus(config, str(directory))
    try:
        prometheus.wait_ready()
        expected = {
            ("mdgan-server", "mdgan-server-6f7c9-x2x4k", "http://127.0.0.2:9100/metrics"),
            ("mdgan-worker", "mdgan-worker-0", "http://127.0.0.3:9101/metrics"),
            ("mdgan-worker", "mdgan-worker-1", "http://[0:0:0:0:0:0:0:1]:9101/metrics"),
        }
        active = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            data = prometheus.api("targets", state="any")
            active = {(t["labels"]["job"], t["labels"]["instance"], t["scrapeUrl"]) for t in data["activeTargets"]}
            if active == expected:
                break
            time.sleep(0.5)
        assert active == expected, f"active targets: {sorted(active)}\n{prometheus.log()}"
        for target in data["activeTargets"]:
            labels = target["labels"]
            assert labels["pod"] == labels["instance"] and labels["namespace"] == "ml" and labels["release"] == "mdgan"
            assert target["scrapePool"] == labels["job"]
        dropped = {t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in data["droppedTargets"]}
        assert {"mdgan-worker-2", "mdgan-worker-3", "mdgan-worker-4", "other-server-0"} <= dropped
    finally:
        prometheus.stop()


def test_every_metric_and_alert_is_documented_and_the_chart_ships_the_same_rules():
    """docs/MONITORING.md lists every metric telemetry.py declares and explains every alert; the Helm
    chart's PrometheusRule takes the very rule files Prometheus loads."""
    from services.common.telemetry import Telemetry

    with open(os.path.join(REPO, "docs", "MONITORING.md")) as fh:
        doc = fh.read()
    declared = {m.name + ("_total" if m.type == "counter" else "") for role in ("server", "worker")
                for m in Telemetry(role).registry.collect() if m.name.startswith("mdgan_")}
    assert declared and [m for m in sorted(declared) if f"`{m}`" not in doc] == []
    alerts = {rule["alert"] for group in _load_yaml(os.path.join(PROM_DIR, "rules", "mdgan-alerts.yml"))["groups"]
              for rule in group["rules"] if "alert" in rule}
    assert alerts and [a for a in sorted(alerts) if f"| `{a}`" not in doc] == []
    for name in ("mdgan-alerts.yml", "mdgan-recording.yml"):
        with open(os.path.join(PROM_DIR, "rules", name)) as ours, \
                open(os.path.join(REPO, "deploy", "k8s", "mdgan", "rules", name)) as chart:
            assert ours.read() == chart.read(), name


def test_the_services_expose_the_standard_process_metrics():
    from prometheus_client import generate_latest

    from services.common.telemetry import Telemetry

    text = generate_latest(Telemetry("worker").registry).decode()
    for series in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
                   "python_gc_objects_collected_total"):
        assert f"\n{series}" in "\n" + text, series
