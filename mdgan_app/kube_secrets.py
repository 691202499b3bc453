"""`mdgan certs secrets`: the Helm chart's own PKI, as ingress-nginx's certgen makes its webhook's
certificate. Run by a hook Job before every install and upgrade, inside the cluster, with a service
account that may read and write Secrets in the release's namespace, it makes sure that

    <ca-secret>       ca.crt, ca.key            the run's CA (made once; kept across upgrades)
    <server-secret>   ca.crt, tls.crt, tls.key  the server's certificate, valid for its Service's names
    <workers-secret>  ca.crt, <pod>.crt, <pod>.key for every worker pod <prefix>-0 .. <prefix>-<N-1>

exist, making only what is missing: a Secret you made is never replaced, and an upgrade that adds
workers adds their certificates to the workers' Secret. It talks to the Kubernetes API over HTTPS
with the pod's service-account token (no client library: the image has none).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.request

from mdgan.config import ConfigError
from services.common import pki

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeAPI:
    """The few Secret calls this needs, against the API server the pod runs under."""

    def __init__(self, server: str, token: str, ca_file: str | None, namespace: str):
        self.server = server.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self.context = ssl.create_default_context(cafile=ca_file)
        self.namespace = namespace

    @classmethod
    def in_cluster(cls, server: str | None = None, token_file: str | None = None, ca_file: str | None = None,
                   namespace: str | None = None) -> "KubeAPI":
        if server is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --api-server")
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        try:
            with open(token_file or os.path.join(SERVICE_ACCOUNT, "token"), encoding="utf-8") as fh:
                token = fh.read().strip()
            if namespace is None:
                with open(os.path.join(SERVICE_ACCOUNT, "namespace"), encoding="utf-8") as fh:
                    namespace = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"the pod's service account is not mounted ({exc}): the Job needs "
                              f"automountServiceAccountToken") from None
        return cls(server, token, ca_file or os.path.join(SERVICE_ACCOUNT, "ca.crt"), namespace)

    def _call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json"):
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers, **({"Content-Type": content_type} if data is not None else {}))
        request = urllib.request.Request(f"{self.server}/api/v1/namespaces/{self.namespace}/secrets{path}",
                                         data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=30) as reply:
                return json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            detail = exc.read().decode(errors="replace")[:300]
            raise ConfigError(f"Kubernetes API: {method} secrets{path}: HTTP {exc.code} {exc.reason}: {detail} "
                              f"(the Job's Role must allow get, create and patch on secrets)") from None
        except urllib.error.URLError as exc:
            raise ConfigError(f"Kubernetes API at {self.server} not reachable: {exc.reason}") from None

    def get(self, name: str) -> dict[str, bytes] | None:
        found = self._call("GET", f"/{name}")
        return None if found is None else {k: base64.b64decode(v) for k, v in (found.get("data") or {}).items()}

    def create(self, name: str, data: dict[str, bytes], labels: dict[str, str]) -> None:
        self._call("POST", "", {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                "metadata": {"name": name, "labels": labels},
                                "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})

    def add(self, name: str, data: dict[str, bytes]) -> None:
        self._call("PATCH", f"/{name}", {"data": {k: base64.b64encode(v).decode() for k, v in data.items()}},
                   content_type="application/merge-patch+json")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def ensure_secrets(api: KubeAPI, *, ca_secret: str, server_secret: str | None, server_name: str,
                   server_sans: list[str], workers_secret: str, worker_prefix: str, workers: int, days: int = 365,
                   labels: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Makes what is missing; returns {secret: [keys written]} (empty lists: nothing was missing)."""
    labels = labels or {}
    written: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        ca = api.get(ca_secret)
        if ca is None:
            pki.init_ca(folder, days=max(days, 3650))
            ca = {"ca.crt": _read(os.path.join(folder, "ca.crt")), "ca.key": _read(os.path.join(folder, "ca.key"))}
            api.create(ca_secret, ca, labels)
            written[ca_secret] = ["ca.crt", "ca.key"]
        else:
            if not {"ca.crt", "ca.key"} <= set(ca):
                raise ConfigError(f"Secret {ca_secret} lacks ca.crt or ca.key: delete it to start a new PKI")
            for key in ("ca.crt", "ca.key"):
                with open(os.path.join(folder, key), "wb") as fh:
                    fh.write(ca[key])
        if server_secret and api.get(server_secret) is None:
            paths = pki.issue(folder, server_name, "server", sans=server_sans, days=days)
            api.create(server_secret, {"ca.crt": ca["ca.crt"], "tls.crt": _read(paths["cert"]),
                                       "tls.key": _read(paths["key"])}, labels)
            written[server_secret] = ["ca.crt", "tls.crt", "tls.key"]
        held = api.get(workers_secret)
        missing = {}
        for i in range(workers):
            pod = f"{worker_prefix}-{i}"
            if held is None or f"{pod}.crt" not in held:
                paths = pki.issue(folder, pod, "worker", days=days)
                missing[f"{pod}.crt"], missing[f"{pod}.key"] = _read(paths["cert"]), _read(paths["key"])
        if held is None:
            api.create(workers_secret, {"ca.crt": ca["ca.crt"], **missing}, labels)
            written[workers_secret] = ["ca.crt", *missing]
        elif missing:
            api.add(workers_secret, missing)
            written[workers_secret] = list(missing)
    return written
