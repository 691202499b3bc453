"""The deployment files, checked with the real tools, and the compose file's services run for real.

Tools (helm, kubernetes-validate, hadolint, docker-compose) are found on PATH or in the tools
directory of scripts/install_deploy_tools.sh. Missing tools skip these tests, except under CI=true,
where they fail: CI installs them with that script.

The last tests take the server and worker services of docker-compose.yml (entrypoint, environment,
replicas, volumes) and run them as local processes, with only addresses, ports and paths rewritten to
loopback and temporary folders: the configuration the containers get is the one that is exercised.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import yaml

from procs import Proc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(REPO, "deploy", "k8s", "mdgan")
COMPOSE_FILE = os.path.join(REPO, "docker-compose.yml")
K8S_VERSION = "1.30.0"
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


# ----------------------------------------------------------------------------------------------- tools

def tools_bin() -> str:
    base = os.environ.get("MDGAN_TOOLS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mdgan-deploy-tools")
    return os.path.join(base, "bin")


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=tools_bin())
    if found:
        return found
    reason = f"{name} not found on PATH or in {tools_bin()}: run scripts/install_deploy_tools.sh"
    if IN_CI:
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


def run(argv: list[str], *, input: str | None = None, env: dict | None = None, check: bool = True,
        timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def helm_template(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([tool("helm"), "template", "mdgan", CHART, *args], check=check)


def render(*args: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(helm_template(*args).stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def validate(manifests: str) -> subprocess.CompletedProcess:
    return run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"], input=manifests,
               check=False)


def stand_in_dashboard(tmp_path) -> str:
    real = os.path.join(REPO, "deploy", "grafana", "dashboards", "mdgan.json")
    if os.path.isfile(real):
        return real
    path = tmp_path / "dashboard.json"
    path.write_text('{"title": "MD-GAN (stand-in)"}')
    return str(path)


# ------------------------------------------------------------------------------------------ Helm chart

def test_helm_lint_strict(tmp_path):
    run([tool("helm"), "lint", "--strict", CHART])
    run([tool("helm"), "lint", "--strict", CHART, "--set", "metrics.serviceMonitor.enabled=true",
         "--set", "grafanaDashboard.enabled=true", "--set-file", f"grafanaDashboard.json={stand_in_dashboard(tmp_path)}"])


@pytest.mark.parametrize("values", [
    [],
    ["--set", "workers.replicas=8", "--set", "global.dataset=synthetic",
     "--set", "server.persistence.enabled=false", "--set", "workers.persistence.enabled=false", "--set", "metrics.enabled=false",
     "--set", "server.runDirPerStart=false"],
    ["--set", "workers.data.download=false",
     "--set-json", 'workers.data.volume={"persistentVolumeClaim":{"claimName":"mnist","readOnly":true}}',
     "--set", "server.persistence.existingClaim=runs", "--set", "global.imageRegistry=registry.example.com/mdgan"],
], ids=["defaults", "synthetic-8-workers", "existing-claims"])
def test_helm_template_is_valid_kubernetes(values):
    result = validate(helm_template(*values).stdout)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_is_strict():
    """The validator really rejects what a cluster would: an unknown field and a wrong type."""
    rendered = helm_template().stdout
    for broken in (rendered.replace("podManagementPolicy:", "podManagementPolicyy:"),
                   rendered.replace("containerPort: 50052", "containerPort: fifty")):
        assert broken != rendered
        assert validate(broken).returncode != 0


def test_optional_servicemonitor_and_dashboard(tmp_path):
    assert not by_kind(render(), "ServiceMonitor")
    docs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "grafanaDashboard.enabled=true",
                  "--set-file", f"grafanaDashboard.json={stand_in_dashboard(tmp_path)}")
    # kubernetes-validate has no schema for the CRD: it validates the core kinds and warns about it
    core = [doc for doc in docs if doc["kind"] != "ServiceMonitor"]
    result = validate(yaml.safe_dump_all(core))
    assert result.returncode == 0, result.stdout + result.stderr
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["name"] for s in services) == ["mdgan-server", "mdgan-worker"]
    for service in services:
        assert "metrics" in [port["name"] for port in service["spec"]["ports"]]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # job names the alert rules and the dashboard select on, whatever the release is called
    assert sorted(s["metadata"]["labels"][monitor["spec"]["jobLabel"]] for s in services) == \
        ["mdgan-server", "mdgan-worker"]
    [dashboard] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "mdgan-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(dashboard["data"]["mdgan.json"])
    # by default the chart ships its own copy of the repository's dashboard
    [shipped] = [d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"] == "mdgan-grafana-dashboard"]
    with open(os.path.join(REPO, "deploy", "grafana", "dashboards", "mdgan.json")) as fh:
        assert json.loads(shipped["data"]["mdgan.json"]) == json.load(fh)
    # and the alert rules as a PrometheusRule, when asked (the operator's CRD)
    assert not by_kind(render(), "PrometheusRule")
    [rule] = by_kind(render("--set", "prometheusRule.enabled=true"), "PrometheusRule")
    assert {g["name"] for g in rule["spec"]["groups"]} == {"mdgan-alerts", "mdgan-recording"}


def test_workers_replicas_is_the_one_scaling_value():
    docs = render("--set", "workers.replicas=5", "--set", "workers.data.mode=emulation", "--set", "global.dataset=mnist")
    [statefulset] = by_kind(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 5
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-server"]["MDGAN_WORKERS"] == "5"
    assert config["mdgan-worker"]["MDGAN_NUM_SHARDS"] == "5"
    assert config["mdgan-worker"]["MDGAN_SHARD_INDEX"] == "auto"
    assert config["mdgan-server"]["MDGAN_DATASET"] == config["mdgan-worker"]["MDGAN_DATASET"] == "mnist"
    # sites: no shards, each worker's data is its own
    sites = {c["metadata"]["name"]: c["data"] for c in by_kind(render("--set", "workers.replicas=5", "--set",
                                                                      "workers.data.mode=site", "--set",
                                                                      "global.dataset=imagefolder"), "ConfigMap")}
    assert sites["mdgan-server"]["MDGAN_WORKERS"] == "5" and "MDGAN_NUM_SHARDS" not in sites["mdgan-worker"]
    assert sites["mdgan-server"]["MDGAN_DATASET"] == sites["mdgan-worker"]["MDGAN_DATASET"] == "imagefolder"
    # the default: the demo that trains with nothing set (synthetic data, shards of it)
    demo = {c["metadata"]["name"]: c["data"] for c in by_kind(render(), "ConfigMap")}
    assert demo["mdgan-worker"]["MDGAN_DATASET"] == "synthetic" and demo["mdgan-worker"]["MDGAN_NUM_SHARDS"] == "2"
    # the derived settings cannot be overridden out of step with workers.replicas
    for flag in ("server.settings.MDGAN_WORKERS=3", "workers.settings.MDGAN_NUM_SHARDS=3",
                 "workers.settings.MDGAN_DATASET=synthetic"):
        result = helm_template("--set", flag, check=False)
        assert result.returncode != 0 and "set by the chart" in result.stderr


def test_one_value_picks_the_algorithm():
    """`algorithm` is the server's MDGAN_ALGORITHM (workers take it from the server's spec); each
    algorithm's options reach the server only with it; values.schema.json refuses what no run takes."""
    def server_config(*args: str) -> dict:
        [config] = [c["data"] for c in by_kind(render(*args), "ConfigMap") if c["metadata"]["name"] == "mdgan-server"]
        return config

    default = server_config()
    assert default["MDGAN_ALGORITHM"] == "mdgan" and default["MDGAN_CHECKPOINT_EVERY"] == "100"
    assert not {"MDGAN_POTENTIAL_ROUNDS", "MDGAN_PS_THRESHOLD"} & set(default)
    pwgan = server_config("--set", "algorithm=pwgan", "--set", "pwgan.potentialRounds=3",
                          "--set", "pwgan.potentialLr=0.5")
    assert (pwgan["MDGAN_ALGORITHM"], pwgan["MDGAN_POTENTIAL_ROUNDS"], pwgan["MDGAN_POTENTIAL_LR"],
            pwgan["MDGAN_GRADIENT_PENALTY"]) == ("pwgan", "3", "0.5", "10")
    assert pwgan["MDGAN_CHECKPOINT_EVERY"] == "0"  # checkpoints are MD-GAN's; the other servers refuse them
    psgan = server_config("--set", "algorithm=psgan", "--set", "workers.replicas=3", "--set", "psgan.threshold=2")
    assert (psgan["MDGAN_ALGORITHM"], psgan["MDGAN_PS_THRESHOLD"]) == ("psgan", "2")
    assert "MDGAN_PS_THRESHOLD" not in server_config("--set", "algorithm=psgan")  # every worker
    assert "MDGAN_POTENTIAL_ROUNDS" not in psgan
    workers = [c["data"] for c in by_kind(render("--set", "algorithm=pwgan"), "ConfigMap")
               if c["metadata"]["name"] == "mdgan-worker"]
    assert workers and "MDGAN_ALGORITHM" not in workers[0]
    result = validate(helm_template("--set", "algorithm=psgan", "--set", "psgan.threshold=1").stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    for bad, says in ((("--set", "algorithm=wgan"), "algorithm"),
                      (("--set", "pwgan.potentialRounds=0"), "potentialRounds"),
                      (("--set", "pwgan.potentialLr=fast"), "potentialLr"),
                      (("--set", "psgan.threshold=0"), "threshold"),
                      (("--set", "algorithm=psgan", "--set", "psgan.threshold=3"), "more than the run's 2 workers"),
                      (("--set", "server.settings.MDGAN_ALGORITHM=pwgan"), "set by the chart")):
        result = helm_template(*bad, check=False)
        assert result.returncode != 0 and says in result.stderr, (bad, result.stderr)


def test_each_worker_mounts_its_own_site_volume():
    """Site mode: a claim per worker, read-only, no shared data volume, no download."""
    site = ("--set", "workers.data.mode=site", "--set", "global.dataset=imagefolder")
    [statefulset] = by_kind(render(*site), "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "data" not in [v["name"] for v in pod["volumes"]]  # not one volume for every pod ...
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"]["volumeClaimTemplates"]}  # ... but per pod
    assert set(claims) == {"data", "state"}  # its site's data, and its own state (durable runs)
    assert claims["data"]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "data"]
    assert mount["mountPath"] == "/data" and mount["readOnly"] is True
    assert not by_kind(render(*site), "PersistentVolumeClaim")[1:]  # only the server's runs claim

    # the sites' existing volumes, in worker order: claim data-<statefulset>-i bound to volume i, kept
    docs = render(*site, "--set", "workers.replicas=3", "--set-json",
                  'workers.data.claim.existingVolumes=["pv-a","pv-b","pv-c"]')
    claims = {c["metadata"]["name"]: c for c in by_kind(docs, "PersistentVolumeClaim")}
    for i, volume in enumerate(["pv-a", "pv-b", "pv-c"]):
        claim = claims[f"data-mdgan-worker-{i}"]
        assert claim["spec"]["volumeName"] == volume
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    result = validate(helm_template(*site, "--set-json", 'workers.data.claim.existingVolumes=["pv-a","pv-b"]').stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    for bad, why in ((["--set-json", 'workers.data.claim.existingVolumes=["pv-a"]'], "1 volumes for 2 workers"),
                     (["--set", "workers.data.download=true"], "needs workers.data.mode=emulation"),
                     (["--set", "workers.data.mode=shared"], "workers.data.mode")):
        result = helm_template(*site, *bad, check=False)
        assert result.returncode != 0 and why in result.stderr, result.stderr

    # emulation: one shared volume source, the download init container only when asked (demos)
    [emulated] = by_kind(render("--set", "workers.data.mode=emulation"), "StatefulSet")
    assert [c["metadata"]["name"] for c in emulated["spec"]["volumeClaimTemplates"]] == ["state"]  # no data claim
    assert "initContainers" not in emulated["spec"]["template"]["spec"]
    assert {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}} in emulated["spec"]["template"]["spec"]["volumes"]


def test_pods_are_locked_down_and_probed():
    docs = render()
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
    assert len(workloads) == 2
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False
        tmp_volumes = [v["name"] for v in pod["volumes"] if "emptyDir" in v]
        for container in pod.get("initContainers", []) + pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]
            assert any(m["mountPath"] == "/tmp" and m["name"] in tmp_volumes for m in container["volumeMounts"])
        for container in pod["containers"]:
            # the kubelet's gRPC probe cannot speak mTLS: mdgan-healthcheck with the pod's own credentials
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["exec"]["command"][0] == "mdgan-healthcheck", (container["name"], probe)
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["MDGAN_TLS_CA"] == "/etc/mdgan/tls/ca.crt" and env["MDGAN_TLS_CERT"].endswith(".crt")
            assert any(m["name"] == "tls" and m["readOnly"] for m in container["volumeMounts"])
    [statefulset] = by_kind(docs, "StatefulSet")
    headless = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == statefulset["spec"]["serviceName"]]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    env = {e["name"]: e.get("value") for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MDGAN_ADVERTISE_ADDRESS"] == "$(POD_NAME).mdgan-worker.$(POD_NAMESPACE).svc.cluster.local:50052"


def test_worker_pods_stay_up_while_the_server_checkpoints_its_stop():
    # `helm uninstall` deletes every pod at once: workers that got their SIGTERM with the server's were
    # gone before its stop checkpoint, which then lacked their states and was not resumed.
    def worker_container(*args: str) -> tuple[dict, dict]:
        [statefulset] = by_kind(render(*args), "StatefulSet")
        pod = statefulset["spec"]["template"]["spec"]
        return pod, pod["containers"][0]

    pod, container = worker_container()
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["terminationGracePeriodSeconds"] > 10
    assert "lifecycle" not in worker_container("--set", "workers.stopDelaySeconds=0")[1]
    result = validate(helm_template("--set", "workers.stopDelaySeconds=25").stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    for bad in (["--set", "workers.stopDelaySeconds=30"], ["--set", "workers.stopDelaySeconds=-1"],
                ["--set", "workers.stopDelaySeconds=5", "--set", "workers.terminationGracePeriodSeconds=5"]):
        result = helm_template(*bad, check=False)
        assert result.returncode != 0 and "stopDelaySeconds" in result.stderr, (bad, result.stderr)


def test_tls_secrets_cert_manager_and_plaintext():
    docs = render()
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-server"]["MDGAN_INSECURE"] == config["mdgan-worker"]["MDGAN_INSECURE"] == "false"
    [deployment], [statefulset] = by_kind(docs, "Deployment"), by_kind(docs, "StatefulSet")
    volumes = {w["kind"]: {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
               for w in (deployment, statefulset)}
    assert volumes["Deployment"]["tls"]["secret"]["secretName"] == "mdgan-server-tls"
    assert volumes["StatefulSet"]["tls"]["secret"]["secretName"] == "mdgan-worker-tls"
    [worker] = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["MDGAN_TLS_CERT"] == "/etc/mdgan/tls/$(POD_NAME).crt"  # a pod's identity is its name
    # cert-manager: a Certificate per identity, the workers' Secrets projected side by side
    docs = render("--set", "tls.certManager.enabled=true", "--set", "tls.certManager.issuerRef.name=run-ca",
                  "--set", "workers.replicas=3", "--set", "tls.allowedWorkers={mdgan-worker-0,mdgan-worker-1}")
    certificates = {c["metadata"]["name"]: c["spec"] for c in by_kind(docs, "Certificate")}
    assert sorted(certificates) == ["mdgan-server", "mdgan-worker-0", "mdgan-worker-1", "mdgan-worker-2"]
    assert "mdgan-server" in certificates["mdgan-server"]["dnsNames"]
    assert certificates["mdgan-worker-2"]["subject"]["organizationalUnits"] == ["mdgan-worker"]
    [statefulset] = by_kind(docs, "StatefulSet")
    [tls] = [v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert [s["secret"]["name"] for s in tls["projected"]["sources"]] == [
        f"mdgan-worker-{i}-tls" for i in range(3)]
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-server"]["MDGAN_ALLOWED_WORKERS"] == "mdgan-worker-0,mdgan-worker-1"
    result = validate(yaml.safe_dump_all([d for d in docs if d["kind"] != "Certificate"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert helm_template("--set", "tls.certManager.enabled=true", check=False).returncode != 0  # no issuer
    # plaintext on request: --insecure everywhere, native gRPC probes, no credentials mounted
    docs = render("--set", "tls.enabled=false")
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-server"]["MDGAN_INSECURE"] == "true"
    for workload in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        [container] = workload["spec"]["template"]["spec"]["containers"]
        assert "grpc" in container["readinessProbe"]
        assert "tls" not in [v["name"] for v in workload["spec"]["template"]["spec"]["volumes"]]


def test_the_default_install_provisions_its_own_pki_and_trains_a_demo():
    """`helm install` with nothing set: a hook Job (with a Role that may only get, create and patch
    Secrets) makes the CA and every certificate before the pods start; the data are the synthetic demo."""
    docs = render()
    result = validate(helm_template().stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    [job] = by_kind(docs, "Job")
    hooks = {d["kind"]: d["metadata"]["annotations"]["helm.sh/hook"] for d in docs
             if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    assert hooks == dict.fromkeys(("ServiceAccount", "Role", "RoleBinding", "Job"), "pre-install,pre-upgrade")
    [role] = by_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "patch"]}]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["mdgan", "certs", "secrets"] and "--workers=2" in command
    assert "--server-secret=mdgan-server-tls" in command and "--workers-secret=mdgan-worker-tls" in command
    mounted = {v["name"]: v for v in by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["volumes"]}
    assert mounted["tls"]["secret"]["secretName"] == "mdgan-worker-tls"  # what the Job writes
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-worker"]["MDGAN_DATASET"] == "synthetic"
    # with your own Secrets or cert-manager it has nothing to make
    for off in (["--set", "pki.enabled=false"], ["--set", "tls.certManager.enabled=true", "--set",
                                                 "tls.certManager.issuerRef.name=ca-issuer"]):
        assert not by_kind(render(*off), "Job")


def test_a_worker_only_release_joins_an_outside_server_and_holds_no_server():
    site = ("--set", "server.enabled=false", "--set", "server.address=hub.example.org:50051", "--set",
            "workers.replicas=1", "--set", "tls.workersSecret=paris-tls", "--set-json",
            'workers.advertiseAddresses=["paris.example.org:50052"]', "--set", "workers.externalService.enabled=true")
    docs = render(*site)
    result = validate(helm_template(*site).stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [d["metadata"]["name"] for d in docs]
    assert not [n for n in names if "server" in n] and not by_kind(docs, "Deployment") and not by_kind(docs, "Job")
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-worker"]["MDGAN_SERVER"] == "hub.example.org:50051"
    assert config["mdgan-worker-advertise"] == {"mdgan-worker-0": "paris.example.org:50052"}
    [service] = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "mdgan-worker-0-peer"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "mdgan-worker-0"
    [policy] = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["ingress"][0] == {"ports": [{"port": 50052, "protocol": "TCP"}]}  # peers dial in from outside
    worker = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "MDGAN_ADVERTISE_ADDRESS" in " ".join(worker["command"])
    for bad, why in ((["--set", "server.enabled=false"], "needs server.address"),
                     (["--set", "server.enabled=false", "--set", "server.address=hub.example.org"], "server.address"),
                     (["--set", "server.enabled=false", "--set", "server.address=h:1", "--set-json",
                       'workers.advertiseAddresses=["a:1"]', "--set", "workers.replicas=2"], "lists 1 addresses")):
        result = helm_template(*bad, check=False)
        assert result.returncode != 0 and why in result.stderr, result.stderr


def test_on_mnist_the_server_reads_the_workers_dataset_and_scores_the_generator():
    """Emulation on MNIST: the server mounts the workers' data volume (one source: the one given
    replaces the default emptyDir) and scores G on its test set, which feeds the dashboard's scores."""
    pvc = ("--set", "workers.data.mode=emulation", "--set", "global.dataset=mnist", "--set-json",
           'workers.data.volume={"persistentVolumeClaim":{"claimName":"mnist","readOnly":true}}')
    docs = render(*pvc)
    result = validate(helm_template(*pvc).stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    server = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    worker = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]
    for pod in (server, worker):
        [volume] = [v for v in pod["volumes"] if v["name"] == "data"]
        assert volume == {"name": "data", "persistentVolumeClaim": {"claimName": "mnist", "readOnly": True}}
    assert {"name": "MDGAN_EVAL_DATA_ROOT", "value": "/data"} in server["containers"][0]["env"]
    downloaded = by_kind(render("--set", "workers.data.mode=emulation", "--set", "global.dataset=mnist", "--set",
                                "workers.data.download=true"), "Deployment")[0]["spec"]["template"]["spec"]
    assert [c["name"] for c in downloaded["initContainers"]] == ["download-data"]
    demo = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]  # synthetic: nothing to score against
    assert "data" not in [v["name"] for v in demo["volumes"]]


def test_a_server_only_release_waits_for_the_sites_of_other_clusters():
    hub = ("--set", "workers.replicas=0", "--set", "server.workers=2", "--set", "pki.enabled=false",
           "--set", "tls.serverSecret=hub-tls", "--set", "server.service.type=LoadBalancer")
    docs = render(*hub)
    result = validate(helm_template(*hub).stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    config = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    assert config["mdgan-server"]["MDGAN_WORKERS"] == "2"
    [server_policy] = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "mdgan-server"]
    assert server_policy["spec"]["ingress"][0] == {"ports": [{"port": 50051, "protocol": "TCP"}]}  # sites dial in
    result = helm_template("--set", "workers.replicas=0", check=False)
    assert result.returncode != 0 and "at least 1 worker" in result.stderr


def test_the_values_schema_refuses_every_unknown_key_and_the_chart_readme_is_current():
    run([sys.executable, os.path.join(REPO, "scripts", "chart_docs.py"), "--check"])
    for typo, where in ((["--set", "workers.replcas=3"], "replcas"), (["--set", "servr.enabled=false"], "servr"),
                        (["--set", "workers.data.mdoe=site"], "mdoe"), (["--set", "tls.enabld=false"], "enabld")):
        result = helm_template(*typo, check=False)
        assert result.returncode != 0 and where in result.stderr, result.stderr
    assert helm_template("--set", "server.settings.MDGAN_ITERATIONS=10").returncode == 0  # free-form: MDGAN_*
    assert helm_template("--set", "server.podLabels.team=gan").returncode == 0
    with open(os.path.join(CHART, "README.md")) as fh:
        readme = fh.read()
    with open(os.path.join(CHART, "values.yaml")) as fh:
        values = yaml.safe_load(fh)

    def paths(node, prefix=""):
        for key, value in node.items():
            yield prefix + key
            if isinstance(value, dict) and prefix + key not in ("server.settings", "workers.settings"):
                yield from paths(value, prefix + key + ".")
    assert [p for p in paths(values) if f"| `{p}` |" not in readme] == []


def test_network_policies_let_only_workers_in():
    """The server's port from the workers; a worker's Peer port from the other workers and from the
    server (which dials a joiner's Peer address once, to refuse an unreachable one)."""
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(render(), "NetworkPolicy")}
    assert sorted(policies) == ["mdgan-server", "mdgan-worker"]
    pods = {component: {"podSelector": {"matchLabels": {"app.kubernetes.io/component": component,
                                                         "app.kubernetes.io/instance": "mdgan",
                                                         "app.kubernetes.io/name": "mdgan"}}}
            for component in ("server", "worker")}
    for name, grpc_port, metrics_port, callers in (("mdgan-server", 50051, 9100, ["worker"]),
                                                   ("mdgan-worker", 50052, 9101, ["worker", "server"])):
        spec = policies[name]
        assert spec["policyTypes"] == ["Ingress"]
        rules = {rule["ports"][0]["port"]: rule["from"] for rule in spec["ingress"]}
        assert sorted(rules) == sorted([grpc_port, metrics_port])
        assert rules[grpc_port] == [pods[c] for c in callers]
        assert rules[metrics_port] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]
    assert not by_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy")


def test_plain_manifests_are_up_to_date_and_valid():
    tool("helm")  # the script needs it; skip/fail the same way as the other tests
    run(["bash", os.path.join(REPO, "scripts", "render_k8s_manifests.sh"), "--check"])
    kustomized = run([tool("kubectl"), "kustomize", os.path.join(REPO, "deploy", "k8s", "manifests")]).stdout
    result = validate(kustomized)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(doc["kind"] for doc in yaml.safe_load_all(kustomized) if doc) == [
        "ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Job", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "Role",
        "RoleBinding", "Service", "Service", "ServiceAccount", "StatefulSet"]


# ------------------------------------------------------------------------------- Dockerfiles, compose

def test_hadolint_dockerfiles():
    run([tool("hadolint"), "Dockerfile.server", "Dockerfile.worker"])


def test_dockerfiles_follow_the_conventions():
    for name, port, metrics in (("Dockerfile.server", 50051, 9100), ("Dockerfile.worker", 50052, 9101)):
        text = open(os.path.join(REPO, name)).read()
        assert text.count("\nFROM ") >= 2, "multi-stage"
        assert re.search(r"^ARG BASE_IMAGE=", text, flags=re.M)
        assert re.search(r"^ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu$", text, flags=re.M)
        assert re.search(r"^USER 10001:10001$", text, flags=re.M), "non-root, numeric (runAsNonRoot can check it)"
        assert f"EXPOSE {port} {metrics}" in text
        assert "HEALTHCHECK" in text and "mdgan-healthcheck" in text


def test_compose_config_is_valid():
    compose = tool("docker-compose")
    run([compose, "-f", COMPOSE_FILE, "config", "-q"])
    scaled = json.loads(run([compose, "-f", COMPOSE_FILE, "config", "--format", "json"],
                            env={"MDGAN_WORKERS": "5", "MDGAN_DATA_DIR": SHARED_DATA}).stdout)["services"]
    assert scaled["worker"]["deploy"]["replicas"] == 5
    assert scaled["worker"]["environment"]["MDGAN_NUM_SHARDS"] == "5"
    assert scaled["server"]["environment"]["MDGAN_WORKERS"] == "5"
    # one variable picks the algorithm (the server's; workers take it from its spec)
    assert scaled["server"]["environment"]["MDGAN_ALGORITHM"] == "mdgan"
    assert scaled["server"]["environment"]["MDGAN_PS_THRESHOLD"] is None  # unset unless the shell sets it
    picked = json.loads(run([compose, "-f", COMPOSE_FILE, "config", "--format", "json"],
                            env={"MDGAN_ALGORITHM": "psgan", "MDGAN_PS_THRESHOLD": "1"}).stdout)["services"]
    assert (picked["server"]["environment"]["MDGAN_ALGORITHM"], picked["server"]["environment"]["MDGAN_PS_THRESHOLD"]) \
        == ("psgan", "1")
    assert "MDGAN_ALGORITHM" not in picked["worker"]["environment"]
    assert scaled["worker"]["volumes"][0]["type"] == "bind"
    assert {"server", "worker", "prometheus", "grafana"} <= set(scaled)
    with_data = run([compose, "-f", COMPOSE_FILE, "--profile", "download", "config", "--services"]).stdout.split()
    assert "data" in with_data


def test_compose_sites_override_mounts_only_each_sites_folder():
    compose = tool("docker-compose")
    sites_file = os.path.join(REPO, "docker-compose.sites.yml")
    services = json.loads(run([compose, "-f", COMPOSE_FILE, "-f", sites_file, "config", "--format", "json"],
                              env={"MDGAN_SITE_0": "/srv/paris", "MDGAN_SITE_1": "/srv/lyon"}).stdout)["services"]
    sites = sorted(name for name in services if name.startswith("site-"))
    assert sites == ["site-0", "site-1"]
    assert services["worker"]["deploy"]["replicas"] == 0  # the emulation's workers are off
    assert services["server"]["environment"]["MDGAN_WORKERS"] == str(len(sites))
    assert services["server"]["environment"]["MDGAN_DATASET"] == "imagefolder"
    sources = []
    for i, name in enumerate(sites):
        service = services[name]
        # one folder of data, its own, read-only; besides it only the certificates and its own state volume
        [volume] = [v for v in service["volumes"] if v["type"] == "bind"]
        assert volume["target"] == "/data" and volume["read_only"] is True
        sources.append(volume["source"])
        named = {v["target"]: v for v in service["volumes"] if v["type"] == "volume"}
        assert set(named) == {"/tls", "/state"} and named["/tls"]["read_only"] is True
        assert named["/state"]["source"].endswith(f"{name}-state")
        env = service["environment"]
        assert "MDGAN_NUM_SHARDS" not in env and env["MDGAN_DATA_ROOT"] == "/data"  # its own data, not a shard
        assert env["MDGAN_SHARD_INDEX"] == str(i) and env["MDGAN_ADVERTISE_ADDRESS"] == f"{name}:50052"
        assert "worker" in service["networks"]["default"]["aliases"]  # Prometheus' DNS discovery finds it
        assert env["MDGAN_TLS_CERT"] == f"/tls/worker-{i}/tls.crt" and env["MDGAN_STATE_DIR"] == "/state"
    assert sources == ["/srv/paris", "/srv/lyon"]


def _kit(*argv: str) -> None:
    from mdgan_app.cli import main

    assert main(["certs", "kit", *argv]) == 0


def _rendered(compose: str, kit: str) -> dict:
    """`docker compose config` of a kit, as its machine would run it (from inside the kit's folder)."""
    proc = subprocess.run([compose, "config", "--format", "json"], capture_output=True, text=True, cwd=kit,
                          timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith(("KIT_", "MDGAN_"))})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_kits_render_compose_files_that_work_across_hosts(tmp_path, capsys):
    """Three sites and a server, each from its kit alone: every address and port a remote peer needs is
    published and advertised, no service of one machine depends on another's, the server's Prometheus
    finds every site by the address it is reached at, and no kit holds the CA's key."""
    compose = tool("docker-compose")
    from mdgan_app.cli import main

    pki = str(tmp_path / "pki")
    assert main(["certs", "init", pki]) == 0
    for i, (host, port) in enumerate([("paris.example.org", 50052), ("lyon.example.org", 50062),
                                      ("10.1.2.3", 50072)]):
        _kit(pki, f"site-{i}", "--server-address", "hub.example.org:50051", "--advertise", f"{host}:{port}",
             "--metrics-port", str(9101 + i))
    _kit(pki, "hub", "--server", "--server-address", "hub.example.org:50051")
    with open(os.path.join(pki, "ca.key"), "rb") as fh:
        ca_key = fh.read()
    for i, (host, port) in enumerate([("paris.example.org", 50052), ("lyon.example.org", 50062), ("10.1.2.3", 50072)]):
        kit = os.path.join(pki, "kits", f"site-{i}")
        services = _rendered(compose, kit)["services"]
        assert list(services) == ["worker"]  # one machine, one worker: nothing of another machine's
        worker = services["worker"]
        assert "depends_on" not in worker
        env = worker["environment"]
        assert env["MDGAN_SERVER"] == "hub.example.org:50051"
        assert env["MDGAN_ADVERTISE_ADDRESS"] == f"{host}:{port}" and env["MDGAN_LISTEN"] == f"0.0.0.0:{port}"
        published = {(int(p["target"]), int(p["published"])) for p in worker["ports"]}
        assert published == {(port, port), (9101 + i, 9101 + i)}  # the Peer port as advertised, and /metrics
        assert env["MDGAN_METRICS_PORT"] == str(9101 + i)
        mounts = {v["target"]: v for v in worker["volumes"]}
        assert mounts["/data"]["read_only"] and mounts["/tls"]["read_only"]
        assert {"/data", "/tls", "/state"} == set(mounts)
        assert env["MDGAN_TLS_CERT"].startswith("/tls/") and "MDGAN_INSECURE" not in env
        from services.common import pki as pki_module

        with open(os.path.join(kit, "tls", "tls.crt"), "rb") as fh:
            name, sans, role = pki_module.certificate_names(fh.read())
        assert (name, role) == (f"site-{i}", pki_module.ROLE_WORKER) and host in sans
        assert os.stat(os.path.join(kit, "tls", "tls.key")).st_mode & 0o077 == 0  # the owner's only
        for folder, _, files in os.walk(kit):
            for f in files:
                with open(os.path.join(folder, f), "rb") as fh:
                    assert fh.read() != ca_key, f
    hub = os.path.join(pki, "kits", "hub")
    services = _rendered(compose, hub)["services"]
    assert set(services) == {"server", "prometheus", "grafana"}
    server = services["server"]
    assert {(int(p["target"]), int(p["published"])) for p in server["ports"]} == {(50051, 50051)}
    assert server["environment"]["MDGAN_WORKERS"] == "3"
    assert server["environment"]["MDGAN_ALLOWED_WORKERS"] == "site-0,site-1,site-2"
    for service in ("prometheus", "grafana"):  # the consoles: on the server's machine only
        assert all(p.get("host_ip") == "127.0.0.1" for p in services[service]["ports"]), service
    with open(os.path.join(hub, "prometheus", "targets", "sites.json")) as fh:
        targets = sorted(t for group in json.load(fh) for t in group["targets"])
    assert targets == ["10.1.2.3:9103", "lyon.example.org:9102", "paris.example.org:9101"]
    with open(os.path.join(hub, "tls", "tls.crt"), "rb") as fh:
        name, sans, role = pki_module.certificate_names(fh.read())
    assert role == pki_module.ROLE_SERVER and "hub.example.org" in sans


@pytest.mark.parametrize("argv, message", [
    (["site-9", "--server-address", "hub.example.org"], "has no port: give HOST:PORT"),
    (["site-9", "--server-address", "localhost:50051"], "loopback address, which other machines cannot reach"),
    (["site-9", "--server-address", "hub.example.org:50051", "--advertise", "site-9:99999"], "a port from 1 to 65535"),
    (["bad name", "--server-address", "hub.example.org:50051"], "is not a usable identity"),
    (["hub", "--server", "--server-address", "hub.example.org:50051"], "write the sites' kits first"),
])
def test_a_kit_that_cannot_work_is_one_clear_line(tmp_path, capsys, argv, message):
    from mdgan_app.cli import main

    pki = str(tmp_path / "pki")
    assert main(["certs", "init", pki]) == 0
    assert main(["certs", "kit", pki, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(os.path.join(pki, "kits"))  # nothing half written


def test_a_kit_checks_a_certificate_it_did_not_issue(tmp_path, capsys):
    """Another CA's certificate, one for another name or role, one not valid for the address, one not
    yet valid (a machine whose clock is behind): each refused in one line that says how to fix it."""
    import datetime

    from mdgan_app.cli import main
    from services.common import pki as pki_module

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    for folder in (ours, theirs):
        pki_module.init_ca(folder)
    pki_module.issue(theirs, "site-0")  # a certificate of another CA, copied in
    shutil.copytree(os.path.join(theirs, "site-0"), os.path.join(ours, "site-0"))
    assert main(["certs", "kit", ours, "site-0", "--server-address", "hub.example.org:50051"]) == 2
    assert "was not issued by the CA in" in capsys.readouterr().err
    pki_module.issue(ours, "site-1")  # ours, but without the name it is reached at
    assert main(["certs", "kit", ours, "site-1", "--server-address", "hub.example.org:50051", "--advertise",
                 "paris.example.org:50052"]) == 2
    err = capsys.readouterr().err
    assert "not for 'paris.example.org'" in err and "--san paris.example.org --overwrite" in err
    pki_module.issue(ours, "hub", "worker")  # a worker's certificate for the server
    assert main(["certs", "kit", ours, "hub", "--server", "--workers", "1", "--server-address",
                 "hub.example.org:50051"]) == 2
    assert "not a mdgan-server one" in capsys.readouterr().err
    behind = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=2)
    assert "not valid before" in pki_module.check_identity(ours, "site-1", "worker", None, now=behind)
    assert not os.path.exists(os.path.join(ours, "kits"))


# ------------------------------------------------- the compose services, run as local processes

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict):
    """Compose's variable interpolation (the subset this file uses), applied to every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group(1) or match.group(4), match.group(2), match.group(3)
        current = env.get(name)
        if op == ":-":
            return current if current else default
        if op == "-":
            return current if current is not None else default
        if op is None:
            return current or ""
        raise AssertionError(f"interpolation {match.group(0)!r} not handled by this test")

    return _VAR.sub(one, value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def console_script_shims(tmp_path) -> str:
    """A folder of stand-ins for the project's console scripts that this venv lacks (an editable
    install made before a script was added): each runs the same entry point as the image's."""
    import tomllib

    shims = tmp_path / "console-scripts"
    shims.mkdir()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    for name, target in scripts.items():
        if shutil.which(name, path=os.path.dirname(sys.executable)):
            continue
        module, func = target.split(":")
        shim = shims / name
        shim.write_text(f"#!/bin/sh\nexec '{sys.executable}' -c 'import sys; from {module} import {func}; "
                        f"sys.argv[0] = \"{name}\"; sys.exit({func}())' \"$@\"\n")
        shim.chmod(0o755)
    return str(shims)


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def write_site_folders(root, sizes: list[int]) -> list[str]:
    """Small image folders (10 classes of random 28x28 grey PNGs), one per site, of different sizes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folders = []
    for site, per_class in enumerate(sizes):
        folder = os.path.join(root, f"site-{site}")
        for label in range(10):
            os.makedirs(os.path.join(folder, str(label)))
            for i in range(per_class):
                pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, str(label), f"{i}.png"))
        folders.append(folder)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["synthetic", "mnist", "sites"])
def test_compose_services_run_as_local_processes(tmp_path, dataset):
    """Runs the compose file's own service commands and environment as local processes (no containers).
    "sites": with the docker-compose.sites.yml override, every site's worker on its own folder."""
    if dataset == "mnist" and not os.path.isdir(os.path.join(SHARED_DATA, "MNIST", "raw")):
        if IN_CI:
            pytest.fail(f"MNIST missing under {SHARED_DATA}")
        pytest.skip(f"MNIST not found under {SHARED_DATA}")
    iterations, workers = 4, 2
    # the file's own knobs, as a user sets them in the shell or in .env
    # (swap epochs: a discriminator swap every 2 iterations, so the workers dial each other's advertised address)
    knobs = {"MDGAN_WORKERS": str(workers), "MDGAN_ITERATIONS": str(iterations), "MDGAN_DATASET": dataset,
             "MDGAN_BATCH_SIZE": "10", "MDGAN_SWAP_EPOCHS": "0.02" if dataset == "synthetic" else "0.0005",
             "MDGAN_DATA_DIR": SHARED_DATA if dataset == "mnist" else ""}
    if dataset == "sites":  # 30 and 50 images: S = ceil(0.5 * 30 / 10) = 2
        sites = write_site_folders(tmp_path / "sites", [3, 5])
        knobs.update(MDGAN_DATASET="", MDGAN_SWAP_EPOCHS="0.5", MDGAN_SITE_0=sites[0], MDGAN_SITE_1=sites[1])
    with open(COMPOSE_FILE) as fh:
        compose = interpolate(yaml.safe_load(fh), knobs)
    services = compose["services"]
    worker_services = ["worker"] * int(services["worker"]["deploy"]["replicas"])
    if dataset == "sites":  # the override, merged as compose does for these keys
        with open(os.path.join(REPO, "docker-compose.sites.yml")) as fh:
            override = interpolate(yaml.safe_load(fh), knobs)["services"]
        services["server"]["environment"].update(override["server"]["environment"])
        assert override["worker"]["deploy"]["replicas"] == 0
        worker_services = sorted(name for name in override if name.startswith("site-"))
        services.update({name: override[name] for name in worker_services})

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MDGAN_")}
    base_env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), console_script_shims(tmp_path),
                                        base_env.get("PATH", "")])

    def volume_paths(service: dict) -> dict[str, str]:
        """container path -> host path: bind mounts stay, named volumes become temporary folders."""
        paths = {}
        for spec in service.get("volumes", []):
            source, target = spec.split(":")[:2]
            if source.startswith((".", "/")):
                paths[target] = os.path.join(REPO, source) if source.startswith(".") else source
            else:
                paths[target] = str(tmp_path / "volumes" / source)
                os.makedirs(paths[target], exist_ok=True)
        return paths

    # addresses of the compose network (service:port) -> loopback ports of the local processes
    server_port, server_metrics = free_port(), free_port()
    network = {f"server:{services['server']['environment']['MDGAN_LISTEN'].rsplit(':', 1)[1]}":
               f"127.0.0.1:{server_port}"}

    def environment(name: str, grpc_port: int, metrics_port: int) -> dict:
        env = dict(base_env)
        paths = volume_paths(services[name])
        for key, value in services[name]["environment"].items():
            if value is None:  # a bare key: compose passes it from the shell when set there, else leaves it unset
                if key not in knobs:
                    continue
                value = knobs[key]
            value = str(value)
            if key == "MDGAN_LISTEN":
                value = f"127.0.0.1:{grpc_port}"
            elif key == "MDGAN_METRICS_PORT":
                value = str(metrics_port)
            value = network.get(value, value)
            for target, host in paths.items():
                if value == target or value.startswith(target + "/"):
                    value = host + value[len(target):]
            assert not re.fullmatch(r"[a-z][\w-]*:\d+", value) or value.startswith("127."), (key, value)
            env[key] = value
        env["MDGAN_METRICS_ADDRESS"] = "127.0.0.1"  # containers listen on all their interfaces
        return env

    def argv(name: str) -> list[str]:
        entrypoint = services[name]["entrypoint"]
        return (entrypoint if isinstance(entrypoint, list) else ["/bin/sh", "-c", entrypoint]) + \
            list(services[name].get("command") or [])

    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[Proc] = []
    try:
        # the one-shot `certs` service first (the others wait for it to complete), as compose runs it
        if "certs" in services:
            certs = Proc("certs", argv("certs"), str(logs / "certs.log"), env=environment("certs", 0, 0),
                         cwd=str(logs))
            assert certs.wait(120) == 0, certs.log()
        server_env = environment("server", server_port, server_metrics)
        assert server_env["MDGAN_WORKERS"] == str(workers) and server_env["MDGAN_ITERATIONS"] == str(iterations)
        server = Proc("server", argv("server"), str(logs / "server.log"), env=server_env, cwd=str(logs))
        procs.append(server)

        # the compose healthcheck, pointed at the local server, until it reports SERVING
        check = [network.get(a, a.replace("localhost:50051", f"127.0.0.1:{server_port}"))
                 for a in services["server"]["healthcheck"]["test"][1:]]
        deadline = time.monotonic() + 120
        # with the container's own environment: its MDGAN_TLS_* credentials
        while run(check, env=server_env, check=False).returncode != 0:
            assert server.popen.poll() is None, f"server exited early:\n{server.log()}"
            assert time.monotonic() < deadline, f"server never healthy:\n{server.log()}"
            time.sleep(0.5)
        scraped = {"server": scrape(server_metrics)}

        assert len(worker_services) == workers
        worker_metrics = []
        for i, service in enumerate(worker_services):
            grpc_port, metrics_port = free_port(), free_port()
            # a container advertises its IP (or its service name) on the compose network; here that is loopback
            network[f"{service}:50052"] = f"127.0.0.1:{grpc_port}"
            env = environment(service, grpc_port, metrics_port)
            env["MDGAN_ADVERTISE_ADDRESS"] = f"127.0.0.1:{grpc_port}"
            env["HOSTNAME"] = f"replica-{i}"  # each container has a host name of its own
            assert env["MDGAN_SERVER"] == f"127.0.0.1:{server_port}"
            if dataset == "sites":  # its own folder, nothing else: no shards
                assert "MDGAN_NUM_SHARDS" not in env and env["MDGAN_SHARD_INDEX"] == str(i)
                assert env["MDGAN_DATA_ROOT"] == sites[i] and env["MDGAN_DATASET"] == "imagefolder"
            else:
                assert env["MDGAN_NUM_SHARDS"] == str(workers) and env["MDGAN_SHARD_INDEX"] == "assign"
            if dataset == "mnist":
                assert env["MDGAN_DATA_ROOT"] == SHARED_DATA
            procs.append(Proc(f"worker-{i}", argv(service), str(logs / f"worker-{i}.log"), env=env, cwd=str(logs)))
            worker_metrics.append(metrics_port)

        deadline = time.monotonic() + 300
        while any(p.popen.poll() is None for p in procs):
            if not scraped.get("server") and server.popen.poll() is None:
                scraped["server"] = scrape(server_metrics)
            for i, port in enumerate(worker_metrics):
                if not scraped.get(f"worker-{i}") and procs[i + 1].popen.poll() is None:
                    scraped[f"worker-{i}"] = scrape(port)
            if time.monotonic() > deadline:
                raise AssertionError("run did not finish in 300 s:\n" +
                                     "\n".join(f"--- {p.name}\n{p.log()}" for p in procs))
            time.sleep(0.2)
        for proc in procs:
            assert proc.popen.returncode == 0, f"{proc.name} exited {proc.popen.returncode}:\n{proc.log()}"
        if "certs" in services:  # secure by default: every process ran with mutual TLS
            assert "(mutual TLS)" in server.log(), server.log()
            assert all("mutual TLS as 'worker-" in p.log() for p in procs[1:]), [p.log() for p in procs[1:]]
    finally:
        for proc in procs:
            proc.stop()

    out = server_env["MDGAN_OUT"]
    assert out.startswith(str(tmp_path)), out
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    assert summary["iterations"] == iterations
    assert summary["workers"] == workers and summary["workers_alive"] == workers
    assert summary["swaps"] >= 1, summary  # peer to peer, at the addresses the workers advertised
    if dataset == "sites":
        assert summary["worker_sizes"] == {"worker-0": 30, "worker-1": 50}
    for name in ("history.jsonl", "samples.png", "checkpoint.pt"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert scraped.get("server") and "mdgan_" in scraped["server"], "server /metrics"
    assert any(text and "mdgan_" in text for key, text in scraped.items() if key.startswith("worker")), \
        "no worker /metrics answered during the run"


def test_data_download_commands_run(tmp_path):
    """The chart's init container and the compose `data` service run torchvision's download; with the
    data already in place (../shared/data) that is a no-op, so their code runs here without a network."""
    if not os.path.isdir(os.path.join(SHARED_DATA, "MNIST", "raw")):
        if IN_CI:
            pytest.fail(f"MNIST missing under {SHARED_DATA}")
        pytest.skip(f"MNIST not found under {SHARED_DATA}")
    [statefulset] = by_kind(render("--set", "workers.data.mode=emulation", "--set", "workers.data.download=true",
                                   "--set", "global.dataset=mnist"), "StatefulSet")
    [init] = statefulset["spec"]["template"]["spec"]["initContainers"]
    with open(COMPOSE_FILE) as fh:
        data_service = interpolate(yaml.safe_load(fh), {})["services"]["data"]
    assert data_service["environment"]["MDGAN_DATA_ROOT"] == "/data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDGAN_")}
    env.update(MDGAN_DATASET="mnist", MDGAN_DATA_ROOT=SHARED_DATA)
    for argv in (init["command"], data_service["entrypoint"]):
        assert argv[0] == "python3"
        result = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=120,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert f"mnist ready in {SHARED_DATA}" in result.stdout


def test_a_relayed_sites_kit_opens_no_port_and_the_chart_takes_the_setting(tmp_path, capsys):
    """A site that only dials out (--swaps relay): its kit tells its worker so, advertises nothing, publishes the
    Peer port on 127.0.0.1 only (its own healthcheck) and its README asks to open nothing for the swaps. A relayed
    kit with an --advertise, or a server kit with --swaps, is one line. The chart's workers.swaps reaches the pods,
    and relay without TLS is refused at render."""
    compose = tool("docker-compose")
    from mdgan_app.cli import main

    pki = str(tmp_path / "pki")
    assert main(["certs", "init", pki]) == 0
    _kit(pki, "site-r", "--server-address", "hub.example.org:50051", "--swaps", "relay")
    kit = os.path.join(pki, "kits", "site-r")
    [worker] = _rendered(compose, kit)["services"].values()
    env = worker["environment"]
    assert env["MDGAN_SWAPS"] == "relay" and "MDGAN_ADVERTISE_ADDRESS" not in env
    peer = [p for p in worker["ports"] if int(p["target"]) == 50052]
    assert [p.get("host_ip") for p in peer] == ["127.0.0.1"]
    readme = open(os.path.join(kit, "README.txt"), encoding="utf-8").read()
    assert "takes no inbound connection" in readme and "Open nothing for\nthe swaps" in readme
    for argv, message in ((["site-x", "--server-address", "hub.example.org:50051", "--swaps", "relay", "--advertise",
                            "x.example.org:50052"], "dialled by nobody"),
                          (["hub", "--server", "--server-address", "hub.example.org:50051", "--swaps", "relay"],
                           "are a site's")):
        capsys.readouterr()
        assert main(["certs", "kit", pki, *argv]) == 2
        assert message in capsys.readouterr().err
    [statefulset] = by_kind(render("--set", "workers.swaps=relay"), "StatefulSet")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in container["env"]}["MDGAN_SWAPS"] == "relay"
    refused = helm_template("--set", "workers.swaps=relay", "--set", "tls.enabled=false", check=False)
    assert refused.returncode != 0 and "workers.swaps relay needs tls.enabled" in refused.stderr
    assert helm_template("--set", "workers.swaps=sometimes", check=False).returncode != 0
