"""`mdgan certs secrets`, the Helm chart's own PKI, against a stand-in of the Kubernetes API's Secret
endpoints over HTTPS (with a bearer token, as a pod's service account has): it makes what is missing,
keeps what exists, and adds the certificates of workers an upgrade adds."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO
from services.common import pki

TOKEN = "service-account-token"


class FakeSecretsAPI:
    """GET/POST/PATCH of /api/v1/namespaces/NS/secrets[/NAME], as the API server answers them."""

    def __init__(self, folder: str):
        pki.provision_run(folder, [], server="api", server_sans=["127.0.0.1"])
        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str):
                api.calls.append((method, self.path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"message": "Unauthorized"})
                prefix = "/api/v1/namespaces/mdgan/secrets"
                if not self.path.startswith(prefix):
                    return self._reply(404, {"message": "no such namespace"})
                name = self.path[len(prefix):].lstrip("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if method == "GET":
                    return self._reply(200, api.secrets[name]) if name in api.secrets else self._reply(404, {})
                if method == "POST":
                    name = body["metadata"]["name"]
                    if name in api.secrets:
                        return self._reply(409, {"message": "AlreadyExists"})
                    api.secrets[name] = body
                    return self._reply(201, body)
                if method == "PATCH" and name in api.secrets:
                    assert self.headers["Content-Type"] == "application/merge-patch+json"
                    api.secrets[name]["data"].update(body["data"])
                    return self._reply(200, api.secrets[name])
                return self._reply(404, {})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PATCH(self):
                self._route("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(os.path.join(folder, "api", "tls.crt"), os.path.join(folder, "api", "tls.key"))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.ca = os.path.join(folder, "ca.crt")
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def data(self, name: str) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in self.secrets[name]["data"].items()}


@pytest.fixture
def api(tmp_path):
    fake = FakeSecretsAPI(str(tmp_path / "api-pki"))
    yield fake
    fake.server.shutdown()


def secrets(api: FakeSecretsAPI, tmp_path, workers: int, token: str = TOKEN) -> subprocess.CompletedProcess:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    return subprocess.run(
        [sys.executable, "-m", "mdgan_app.cli", "certs", "secrets", "--api-server", api.url, "--api-ca", api.ca,
         "--token-file", str(token_file), "--namespace", "mdgan", "--ca-secret", "mdgan-ca",
         "--server-secret", "mdgan-server-tls", "--server-name", "mdgan-server", "--server-san", "mdgan-server",
         "--server-san", "mdgan-server.mdgan.svc", "--workers-secret", "mdgan-worker-tls",
         "--worker-prefix", "mdgan-worker", "--workers", str(workers), "--label", "app.kubernetes.io/name=mdgan"],
        cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_charts_pki_makes_what_is_missing_and_keeps_what_exists(api, tmp_path):
    first = secrets(api, tmp_path, 2)
    assert first.returncode == 0, first.stderr
    assert set(api.secrets) == {"mdgan-ca", "mdgan-server-tls", "mdgan-worker-tls"}
    ca = api.data("mdgan-ca")
    server = api.data("mdgan-server-tls")
    workers = api.data("mdgan-worker-tls")
    assert set(workers) == {"ca.crt", "mdgan-worker-0.crt", "mdgan-worker-0.key", "mdgan-worker-1.crt",
                            "mdgan-worker-1.key"}
    assert server["ca.crt"] == workers["ca.crt"] == ca["ca.crt"]  # one CA
    assert pki.check_credentials(ca["ca.crt"], server["tls.crt"]) is None
    name, sans, role = pki.certificate_names(server["tls.crt"])
    assert (name, role) == ("mdgan-server", pki.ROLE_SERVER) and "mdgan-server.mdgan.svc" in sans
    for i in range(2):
        assert pki.certificate_names(workers[f"mdgan-worker-{i}.crt"])[::2] == (f"mdgan-worker-{i}", pki.ROLE_WORKER)
        assert pki.check_credentials(ca["ca.crt"], workers[f"mdgan-worker-{i}.crt"]) is None
    assert api.secrets["mdgan-ca"]["metadata"]["labels"] == {"app.kubernetes.io/name": "mdgan"}

    # an upgrade to 3 workers: the CA, the server's and the first two workers' certificates stay
    again = secrets(api, tmp_path, 3)
    assert again.returncode == 0, again.stderr
    assert "mdgan-worker-2.crt" in again.stdout and api.data("mdgan-ca") == ca
    assert api.data("mdgan-server-tls") == server
    grown = api.data("mdgan-worker-tls")
    assert all(grown[k] == v for k, v in workers.items())
    assert pki.check_credentials(ca["ca.crt"], grown["mdgan-worker-2.crt"]) is None
    # nothing missing: nothing written
    before = len(api.calls)
    assert "nothing to do" in secrets(api, tmp_path, 3).stdout
    assert {method for method, _ in api.calls[before:]} == {"GET"}


def test_a_refusal_of_the_api_is_one_clear_line(api, tmp_path):
    refused = secrets(api, tmp_path, 1, token="wrong")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "HTTP 401" in refused.stderr and "Role must allow get, create and patch on secrets" in refused.stderr
    assert not api.secrets
