#!/usr/bin/env bash
# Check the monitoring files with the real promtool:
#   promtool check config   deploy/prometheus/prometheus.yml, deploy/prometheus/prometheus-k8s.yml
#   promtool check rules    deploy/prometheus/rules/*.yml
#   promtool test rules     deploy/prometheus/tests/*.test.yml
# and that deploy/grafana/dashboards/mdgan.json is what deploy/grafana/generate_dashboard.py makes.
#
# Installs Debian's prometheus package (promtool included) when promtool is missing: needs root or
# sudo and the Debian mirror; about 15 s. Set PROMTOOL=/path/to/promtool to use another build.
#
# Debian builds Prometheus without Kubernetes service discovery, so its promtool rejects
# `kubernetes_sd_configs`. With such a promtool the Kubernetes config is checked as a copy in which
# each `kubernetes_sd_configs: [{role: pod}]` is swapped for a file_sd_configs stanza: everything else
# (relabel rules, rule_files, globals) is checked as written. tests/test_monitoring.py runs those
# relabel rules for real on simulated pods. An upstream promtool checks the file as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

PROM=deploy/prometheus
failed=0
fail() { echo "FAILED: $*" >&2; failed=1; }

PROMTOOL=${PROMTOOL:-promtool}
if ! command -v "$PROMTOOL" >/dev/null 2>&1; then
  if [ "$PROMTOOL" != promtool ]; then
    echo "PROMTOOL=$PROMTOOL not found" >&2
    exit 1
  fi
  SUDO=
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "promtool is missing and installing it needs root" >&2; exit 1; }
    SUDO="sudo -n"
  fi
  echo "== installing prometheus (promtool) from Debian"
  start=$(date +%s)
  $SUDO apt-get update -q >/dev/null
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null
  echo "   installed in $(( $(date +%s) - start )) s"
fi
"$PROMTOOL" --version 2>&1 | head -n 1

echo "== promtool check config"
"$PROMTOOL" check config "$PROM/prometheus.yml" || fail "check config $PROM/prometheus.yml"

k8s="$PROM/prometheus-k8s.yml"
if out=$("$PROMTOOL" check config "$k8s" 2>&1); then
  echo "$out"
elif grep -q "field kubernetes_sd_configs not found" <<<"$out"; then
  echo "   (this promtool has no Kubernetes discovery: checking $k8s with file_sd_configs in its place)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  ln -s "$PWD/$PROM/rules" "$tmp/rules"          # rule_files resolve relative to the config file
  echo "[]" > "$tmp/pods.json"
  sd=$(grep -c '^    kubernetes_sd_configs:$' "$k8s" || true)
  roles=$(grep -A1 '^    kubernetes_sd_configs:$' "$k8s" | grep -c '^      - role: pod$' || true)
  jobs=$(grep -c '^  - job_name:' "$k8s" || true)
  if [ "$sd" -lt 1 ] || [ "$sd" != "$roles" ] || [ "$sd" != "$jobs" ]; then
    fail "$k8s: expected every job to use 'kubernetes_sd_configs: [- role: pod]' ($jobs jobs, $sd sd, $roles role: pod)"
  fi
  sed -e 's/^    kubernetes_sd_configs:$/    file_sd_configs:/' \
      -e 's/^      - role: pod$/      - files: [pods.json]/' "$k8s" > "$tmp/prometheus-k8s.yml"
  "$PROMTOOL" check config "$tmp/prometheus-k8s.yml" || fail "check config $k8s (kubernetes_sd_configs swapped)"
else
  echo "$out" >&2
  fail "check config $k8s"
fi

echo "== promtool check rules"
"$PROMTOOL" check rules "$PROM"/rules/*.yml || fail "check rules"

echo "== promtool test rules"
"$PROMTOOL" test rules "$PROM"/tests/*.test.yml || fail "test rules"

echo "== dashboard is up to date with its generator"
if command -v python3 >/dev/null 2>&1; then
  python3 deploy/grafana/generate_dashboard.py --check && echo "   deploy/grafana/dashboards/mdgan.json: fresh" \
    || fail "deploy/grafana/dashboards/mdgan.json is stale"
else
  echo "   python3 missing: skipped"
fi

if [ "$failed" != 0 ]; then
  echo "check_prometheus: FAILED" >&2
  exit 1
fi
echo "check_prometheus: OK"
