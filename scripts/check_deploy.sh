#!/usr/bin/env bash
# Check the deployment files with the real tools (install them with scripts/install_deploy_tools.sh):
#   - helm lint --strict on deploy/k8s/mdgan (default values, and with every optional part on)
#   - helm template | kubernetes-validate --strict -k 1.30.0 (core kinds; the ServiceMonitor and cert-manager
#     Certificate CRDs have no schema in kubernetes-validate, so they get structural checks); mTLS with
#     Secrets (default), plaintext, and cert-manager Certificates; the NetworkPolicies
#   - deploy/k8s/manifests up to date with the chart, and valid through kubectl kustomize
#   - hadolint on Dockerfile.server and Dockerfile.worker
#   - docker-compose config -q on docker-compose.yml (default, scaled, with the download profile) and with
#     the per-site override docker-compose.sites.yml
# Exits non-zero when any check fails; runs them all first.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
K8S_VERSION="${K8S_VERSION:-1.30.0}"
CHART=deploy/k8s/mdgan
TOOLS_BIN="$(scripts/install_deploy_tools.sh --print-bin)"

tool() {  # PATH first, then the tools directory
    local found
    found="$(command -v "$1" 2>/dev/null)" || found="$TOOLS_BIN/$1"
    [[ -x "$found" ]] || { echo "check_deploy: '$1' not found on PATH or in $TOOLS_BIN; run scripts/install_deploy_tools.sh" >&2; exit 2; }
    echo "$found"
}
HELM="$(tool helm)" || exit 2
KUBECTL="$(tool kubectl)" || exit 2
KV="$(tool kubernetes-validate)" || exit 2
HADOLINT="$(tool hadolint)" || exit 2
COMPOSE="$(tool docker-compose)" || exit 2
# a Python with PyYAML: the tools venv has it (kubernetes-validate needs it)
PY="$(dirname "$(readlink -f "$KV")")/python"
[[ -x "$PY" ]] || PY=python3

failures=()
step() {  # step NAME CMD...: run, report, remember failures
    local name="$1"; shift
    echo "=== $name"
    if "$@"; then
        echo "--- ok: $name"
    else
        echo "--- FAILED: $name"
        failures+=("$name")
    fi
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# a stand-in dashboard for rendering the optional dashboard ConfigMap when the real one is absent
DASHBOARD=deploy/grafana/dashboards/mdgan.json
[[ -f "$DASHBOARD" ]] || { echo '{"title": "MD-GAN (stand-in)"}' > "$tmp/dashboard.json"; DASHBOARD="$tmp/dashboard.json"; }
ALL_ON=(--set metrics.serviceMonitor.enabled=true --set grafanaDashboard.enabled=true
        --set-file "grafanaDashboard.json=$DASHBOARD")

validate() {  # validate FILE: kubernetes-validate, failing on errors; its one expected warning is the CRD
    "$KV" --strict --quiet -k "$K8S_VERSION" "$1"
}

render_and_validate() {  # render_and_validate NAME HELM-ARGS...
    local name="$1"; shift
    "$HELM" template mdgan "$CHART" "$@" > "$tmp/$name.yaml" && validate "$tmp/$name.yaml"
}

check_servicemonitor() {
    "$PY" - "$tmp/all-on.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
assert len(monitors) == 1, f"expected one ServiceMonitor, got {len(monitors)}"
sm = monitors[0]
assert sm["apiVersion"] == "monitoring.coreos.com/v1", sm["apiVersion"]
spec = sm["spec"]
assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}, spec
want = spec["selector"]["matchLabels"]
services = [d for d in docs if d["kind"] == "Service"]
matched = [s for s in services if want.items() <= s["metadata"]["labels"].items()]
assert {s["metadata"]["name"] for s in matched} == {"mdgan-server", "mdgan-worker"}, matched
for endpoint in spec["endpoints"]:
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}, endpoint
    for s in matched:
        assert endpoint["port"] in [p["name"] for p in s["spec"]["ports"]], (s["metadata"]["name"], endpoint)
dash = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("grafana-dashboard")]
assert len(dash) == 1 and dash[0]["data"]["mdgan.json"].strip().startswith("{"), "dashboard ConfigMap"
print("ServiceMonitor selects", sorted(s["metadata"]["name"] for s in matched), "on port", spec["endpoints"][0]["port"])
EOF
}

check_certificates() {
    "$PY" - "$tmp/cert-manager.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
assert sorted(certs) == ["mdgan-server", "mdgan-worker-0", "mdgan-worker-1"], sorted(certs)
for name, cert in certs.items():
    spec = cert["spec"]
    assert cert["apiVersion"] == "cert-manager.io/v1" and spec["issuerRef"]["name"] == "run-ca", name
    assert spec["commonName"] == name and name in spec["dnsNames"], name
    assert {"server auth", "client auth"} <= set(spec["usages"]), name
    role = "mdgan-server" if name == "mdgan-server" else "mdgan-worker"
    assert spec["subject"]["organizationalUnits"] == [role], name
[sts] = [d for d in docs if d["kind"] == "StatefulSet"]
[tls] = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
secrets = [s["secret"]["name"] for s in tls["projected"]["sources"]]
assert secrets == [certs[n]["spec"]["secretName"] for n in ("mdgan-worker-0", "mdgan-worker-1")], secrets
print("Certificates:", ", ".join(sorted(certs)), "; workers mount", ", ".join(secrets))
EOF
}

step "helm lint --strict (default values)" "$HELM" lint --strict "$CHART"
step "helm lint --strict (worker-only release)" "$HELM" lint --strict "$CHART" --set server.enabled=false \
    --set server.address=hub.example.org:50051
step "helm lint --strict (ServiceMonitor + dashboard on)" "$HELM" lint --strict "$CHART" "${ALL_ON[@]}"
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (default values)" render_and_validate default
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (8 workers, synthetic, no persistence, no metrics)" \
    render_and_validate variant --set workers.replicas=8 --set global.dataset=synthetic \
    --set server.persistence.enabled=false --set workers.persistence.enabled=false --set metrics.enabled=false --set server.runDirPerStart=false
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (sites bound to existing volumes)" \
    render_and_validate sites --set workers.data.mode=site --set global.dataset=imagefolder --set workers.replicas=3 \
    --set-json 'workers.data.claim.existingVolumes=["pv-a","pv-b","pv-c"]'
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (worker-only release: a site joining an outside server)" \
    render_and_validate worker-only --set server.enabled=false --set server.address=hub.example.org:50051 \
    --set workers.replicas=1 --set tls.workersSecret=site-tls --set-json 'workers.advertiseAddresses=["site.example.org:50052"]' \
    --set workers.externalService.enabled=true
step "values.schema.json and the chart's README.md made from values.yaml" "$PY" scripts/chart_docs.py --check
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (emulation, download demo)" \
    render_and_validate emulation --set workers.data.mode=emulation --set workers.data.download=true --set global.dataset=mnist
echo "note: kubernetes-validate has no schema for the ServiceMonitor CRD (monitoring.coreos.com/v1); it validates"
echo "      the core kinds of that render and the ServiceMonitor gets a structural check instead"
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (ServiceMonitor + dashboard on)" \
    render_and_validate all-on "${ALL_ON[@]}"
step "ServiceMonitor selects both Services' metrics ports" check_servicemonitor
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (plaintext: tls.enabled=false, no NetworkPolicy)" \
    render_and_validate plaintext --set tls.enabled=false --set networkPolicy.enabled=false
echo "note: the cert-manager Certificate CRD has no schema in kubernetes-validate either (a warning); the"
echo "      core kinds of that render are validated, and the Certificates get a structural check"
step "helm template | kubernetes-validate --strict -k $K8S_VERSION (cert-manager Certificates, allow-list)" \
    render_and_validate cert-manager --set tls.certManager.enabled=true --set tls.certManager.issuerRef.name=run-ca \
    --set 'tls.allowedWorkers={mdgan-worker-0,mdgan-worker-1}'
step "cert-manager Certificates: one for the server, one per worker, mounted where the pods read them" check_certificates
step "deploy/k8s/manifests up to date with the chart" scripts/render_k8s_manifests.sh --check
step "kubectl kustomize deploy/k8s/manifests | kubernetes-validate --strict -k $K8S_VERSION" \
    bash -c '"$1" kustomize deploy/k8s/manifests > "$2" && "$3" --strict --quiet -k "$4" "$2"' _ \
    "$KUBECTL" "$tmp/kustomized.yaml" "$KV" "$K8S_VERSION"
step "hadolint Dockerfile.server Dockerfile.worker" "$HADOLINT" Dockerfile.server Dockerfile.worker
step "docker-compose config -q" "$COMPOSE" -f docker-compose.yml config -q
step "docker-compose config -q (MDGAN_WORKERS=5, bind-mounted data, download profile)" \
    env MDGAN_WORKERS=5 MDGAN_DATA_DIR=/srv/mnist "$COMPOSE" -f docker-compose.yml --profile download config -q
step "docker-compose config -q (+ docker-compose.sites.yml: one service per site)" \
    "$COMPOSE" -f docker-compose.yml -f docker-compose.sites.yml config -q

echo
if (( ${#failures[@]} )); then
    echo "check_deploy: ${#failures[@]} check(s) FAILED:"
    printf '  - %s\n' "${failures[@]}"
    exit 1
fi
echo "check_deploy: all checks passed"
