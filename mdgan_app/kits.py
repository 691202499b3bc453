"""`mdgan certs kit`: one self-contained bundle per machine of a consortium, the way users of federated
frameworks know startup kits. A site's kit is all its operator copies to that site's machine:

    KIT/tls/ca.crt, tls.crt, tls.key   the run's CA certificate (never its key), and this identity's
                                       certificate (valid for the names it is reached by) and key
    KIT/mdgan.env                      the service's settings (MDGAN_* variables): the server's address,
                                       the address the other sites reach this one at, the TLS files
    KIT/.env                           what docker compose fills in (ports, image tag, the data folder)
    KIT/docker-compose.yml             one worker (a site), or the server with Prometheus and Grafana
    KIT/README.txt                     what to run, and the ports to open
    (server) KIT/prometheus/, KIT/grafana/   scrape targets of every site, alert rules, the dashboard

The PKI folder remembers every kit it made (PKI/kits.json), so the server's kit lists every site's
/metrics address for its Prometheus (write the server's kit again after adding a site).
"""

from __future__ import annotations

import json
import os
import shutil
import string
from dataclasses import asdict, dataclass

from mdgan.config import ConfigError
from services.common import pki

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kit_templates")
DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")  # a checkout's deploy/
KITS_FILE = "kits.json"
DEFAULT_PEER_PORT, DEFAULT_METRICS_PORT, SERVER_METRICS_PORT = 50052, 9101, 9100
# where a kit's tls/ folder is mounted in its containers, and who runs them (the images' user; .env may
# change it to the owner of the kit's key)
TLS_ENV = {"MDGAN_TLS_CA": "/tls/ca.crt", "MDGAN_TLS_CERT": "/tls/tls.crt", "MDGAN_TLS_KEY": "/tls/tls.key"}
RUN_AS = {"KIT_UID": 10001, "KIT_GID": 10001}


def image_tag() -> str:
    """The tag the images are built and pushed with (docs/DEPLOY.md): this package's version, as the Helm
    chart's appVersion."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mdgan")
    except PackageNotFoundError:
        return "latest"


@dataclass(frozen=True)
class Kit:
    """One machine's part of a consortium, as PKI/kits.json records it."""

    name: str
    role: str  # "server" or "worker"
    address: str  # HOST:PORT others dial: the server's Coordinator, or a site's Peer service
    metrics: str  # HOST:PORT of its /metrics


def host_port(text: str, what: str, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) of HOST:PORT ([V6]:PORT), or one clear line saying what to give instead."""
    text = (text or "").strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ConfigError(f"{what} {text!r} has no port: give HOST:PORT, e.g. {text or 'server.example.org'}:50051")
        host, port = text, str(default_port)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{what} {text!r}: give HOST:PORT with a port from 1 to 65535")
    if host in pki.LOOPBACK_NAMES or host.startswith("127."):
        raise ConfigError(f"{what} {text!r} is a loopback address, which other machines cannot reach: give the name "
                          f"or address they dial")
    return host, int(port)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_kits(pki_dir: str) -> dict[str, Kit]:
    try:
        with open(os.path.join(pki_dir, KITS_FILE), encoding="utf-8") as fh:
            return {k["name"]: Kit(**k) for k in json.load(fh)}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{os.path.join(pki_dir, KITS_FILE)} is unreadable ({exc}): move it away and write the "
                          f"kits again") from None


def _remember(pki_dir: str, kit: Kit) -> None:
    from mdgan.checkpoint import atomic_write_json

    kits = read_kits(pki_dir)
    kits[kit.name] = kit
    atomic_write_json(os.path.join(pki_dir, KITS_FILE), [asdict(k) for k in kits.values()])


def _identity(pki_dir: str, name: str, role: str, must_name: str, days: int) -> dict[str, str]:
    """The identity's files in PKI/NAME: issued now (valid for `must_name`) if there are none, else
    checked (signed by this PKI's CA, of this role, valid now and for `must_name`)."""
    paths = pki.identity_paths(pki_dir, name)
    if not os.path.exists(paths["cert"]):
        return pki.issue(pki_dir, name, role, sans=[must_name], days=days)
    problem = pki.check_identity(pki_dir, name, role, must_name)
    if problem:
        raise ConfigError(problem)
    return paths


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _env(values: dict[str, object]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def _copy_tls(paths: dict[str, str], kit_dir: str) -> None:
    os.makedirs(os.path.join(kit_dir, "tls"), exist_ok=True)
    for key, name, mode in (("ca", "ca.crt", 0o644), ("cert", "tls.crt", 0o644), ("key", "tls.key", 0o600)):
        with open(paths[key], "rb") as fh:
            data = fh.read()
        target = os.path.join(kit_dir, "tls", name)
        fd = os.open(target + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(target + ".tmp", mode)  # (an existing file keeps its mode through O_CREAT)
        os.replace(target + ".tmp", target)


def _prepare(kit_dir: str, overwrite: bool) -> None:
    if os.path.exists(kit_dir) and os.listdir(kit_dir) and not overwrite:
        raise ConfigError(f"{kit_dir} exists: give --overwrite to write the kit again there (its key too), or "
                          f"another --out")
    os.makedirs(kit_dir, exist_ok=True)


def site_kit(pki_dir: str, name: str, server_address: str, advertise: str | None = None, *, swaps: str = "auto",
             metrics_port: int = DEFAULT_METRICS_PORT, slot: str = "assign", out: str | None = None,
             days: int = 365, overwrite: bool = False, tag: str | None = None) -> str:
    """A site's kit (its worker); returns the kit's folder."""
    pki.check_name(name)
    tag = tag or image_tag()
    host_port(server_address, "--server-address")
    host, port = host_port(advertise or name, "--advertise", DEFAULT_PEER_PORT)
    if not (slot == "assign" or slot.isdigit()):
        raise ConfigError(f"--slot {slot!r}: a number (this site's rank in the run) or 'assign' (the server picks)")
    kit_dir = out or os.path.join(pki_dir, "kits", name)
    paths = _identity(pki_dir, name, "worker", host, days)
    _prepare(kit_dir, overwrite)
    _copy_tls(paths, kit_dir)
    relayed = swaps == "relay"
    _write(os.path.join(kit_dir, "mdgan.env"), _env({
        "MDGAN_SERVER": server_address,
        "MDGAN_LISTEN": f"0.0.0.0:{port}",
        # relay: discriminators come down the site's own connection to the server; nobody dials it
        "MDGAN_SWAPS": swaps,
        **({} if relayed else {"MDGAN_ADVERTISE_ADDRESS": _address(host, port)}),  # what the other sites dial
        "MDGAN_SHARD_INDEX": slot,
        "MDGAN_METRICS_PORT": metrics_port,
        **TLS_ENV,
        "MDGAN_DATA_ROOT": "/data", "MDGAN_DATASET": "imagefolder",  # this site's own images (mdgan.sites)
        "MDGAN_STATE_DIR": "/state",
        "MDGAN_CONNECT_TIMEOUT": 600, "MDGAN_SERVER_TIMEOUT": 600,
        # this site's own integrity and privacy limits (docs/PRIVACY.md): it checks every discriminator
        # pushed to it whatever the server says; MDGAN_DP_MAX_EPSILON empty: no budget of its own
        "MDGAN_SWAP_CHECK": "on", "MDGAN_DP_MAX_EPSILON": "",
    }))
    _write(os.path.join(kit_dir, ".env"), _env({
        "KIT_PEER_PORT": port, "KIT_PEER_BIND": "127.0.0.1" if relayed else "0.0.0.0",  # (relay: its healthcheck only)
        "KIT_METRICS_PORT": metrics_port, "KIT_TAG": tag,
        "KIT_SITE_DATA": "./data", **RUN_AS}))
    shutil.copyfile(os.path.join(TEMPLATES, "site-compose.yml"), os.path.join(kit_dir, "docker-compose.yml"))
    if relayed:
        ports = f"""The worker dials the server at {server_address} and takes no inbound connection (MDGAN_SWAPS=relay):
the other sites' discriminators come through the server's relay, down this site's own connection,
sealed end to end between the two sites (the relay can neither read nor alter them). Open nothing for
the swaps. Optional:
  {metrics_port}/tcp  /metrics (plain HTTP), to the server's Prometheus only, for this site's panels
Outgoing: to {server_address} and to the other sites' Peer ports (where they take direct swaps).
"""
    else:
        ports = f"""The worker dials the server at {server_address} and serves its Peer service on port {port}, which the
other sites reach as {_address(host, port)}. Open to the consortium's machines only:
  {port}/tcp  the Peer service (mutual TLS: the other sites push their discriminators here)
  {metrics_port}/tcp  /metrics (plain HTTP: open it to the server's Prometheus only)
Outgoing: to {server_address} and to the other sites' Peer ports. A site that cannot open a port: make
its kit with --swaps relay (or keep MDGAN_SWAPS=auto: the server relays a site it cannot dial).
"""
    _write(os.path.join(kit_dir, "README.txt"), f"""mdgan site kit: {name}

This folder is all site {name} needs: copy it to the site's machine (it holds the site's private key:
copy it over a channel you trust, and keep it readable by the user that runs the worker only).

1. Put the site's images in ./data (one sub-folder per class), or set KIT_SITE_DATA in .env.
2. The key is readable by its owner only: set KIT_UID and KIT_GID in .env to that owner's ids
   (`id -u`, `id -g`), or run `sudo chown -R 10001:10001 tls` (the image's user).
3. docker compose up -d      (image mdgan-worker:{tag}: docs/DEPLOY.md says how to build and push it)

{ports}Its certificate is valid for {host} until it expires ({days} days from its issue): see docs/DURABILITY.md,
"Certificates", to rotate it.
""")
    _remember(pki_dir, Kit(name, "worker", _address(host, port), _address(host, metrics_port)))
    return kit_dir


def server_kit(pki_dir: str, name: str, server_address: str, *, workers: int | None = None,
               metrics_port: int = SERVER_METRICS_PORT, out: str | None = None, days: int = 365,
               overwrite: bool = False, tag: str | None = None) -> str:
    """The server's kit (the server, Prometheus scraping every site that has a kit, Grafana)."""
    pki.check_name(name)
    tag = tag or image_tag()
    host, port = host_port(server_address, "--server-address")
    sites = [k for k in read_kits(pki_dir).values() if k.role == "worker"]
    workers = workers if workers is not None else len(sites)
    if workers < 1:
        raise ConfigError("the server's kit needs the number of sites: write the sites' kits first, or give --workers N")
    if not os.path.isdir(os.path.join(DEPLOY, "grafana", "dashboards")):
        raise ConfigError(f"the server's kit takes Prometheus' rules and Grafana's dashboard from the repository's "
                          f"deploy/ folder, which is not at {DEPLOY}: write it from a checkout (pip install -e .)")
    kit_dir = out or os.path.join(pki_dir, "kits", name)
    paths = _identity(pki_dir, name, "server", host, days)
    _prepare(kit_dir, overwrite)
    _copy_tls(paths, kit_dir)
    _write(os.path.join(kit_dir, "mdgan.env"), _env({
        "MDGAN_LISTEN": f"0.0.0.0:{port}",
        "MDGAN_WORKERS": workers,
        "MDGAN_DATASET": "imagefolder",
        "MDGAN_OUT": "/runs/mdgan",
        "MDGAN_RESUME": "auto",  # a restarted server continues its unfinished run
        "MDGAN_CHECKPOINT_EVERY": 100,
        "MDGAN_METRICS_PORT": metrics_port,
        **TLS_ENV,
        "MDGAN_ALLOWED_WORKERS": ",".join(k.name for k in sites),  # only the sites this PKI made kits for
        "MDGAN_JOIN_TIMEOUT": 3600,
    }))
    _write(os.path.join(kit_dir, ".env"), _env({"KIT_SERVER_PORT": port, "KIT_TAG": tag, **RUN_AS}))
    shutil.copyfile(os.path.join(TEMPLATES, "server-compose.yml"), os.path.join(kit_dir, "docker-compose.yml"))
    with open(os.path.join(TEMPLATES, "prometheus.yml"), encoding="utf-8") as fh:
        prometheus = string.Template(fh.read()).substitute(server_metrics_port=metrics_port)
    _write(os.path.join(kit_dir, "prometheus", "prometheus.yml"), prometheus)
    write_targets(pki_dir, os.path.join(kit_dir, "prometheus", "targets", "sites.json"))
    shutil.copytree(os.path.join(DEPLOY, "prometheus", "rules"), os.path.join(kit_dir, "prometheus", "rules"),
                    dirs_exist_ok=True)
    for part in ("provisioning", "dashboards"):
        shutil.copytree(os.path.join(DEPLOY, "grafana", part), os.path.join(kit_dir, "grafana", part),
                        dirs_exist_ok=True)
    _write(os.path.join(kit_dir, "README.txt"), f"""mdgan server kit: {name}

This folder is all the server's machine needs (it holds the server's private key, not the CA's).

1. The key is readable by its owner only: set KIT_UID and KIT_GID in .env to that owner's ids, or run
   `sudo chown -R 10001:10001 tls` (the image's user).
2. docker compose up -d      (images mdgan-server:{tag}, prom/prometheus, grafana/grafana)
3. Grafana: http://localhost:3000 on this machine (ssh -L 3000:localhost:3000 to reach it).

The server waits for {workers} sites ({', '.join(k.name for k in sites) or 'none with a kit yet'}) at
{server_address}. Open {port}/tcp to the sites' machines. Outgoing: to every site's /metrics port
(prometheus/targets/sites.json). After writing another site's kit, write this kit again (or copy the
new prometheus/targets/sites.json here): Prometheus re-reads it by itself.
""")
    _remember(pki_dir, Kit(name, "server", _address(host, port), _address(host, metrics_port)))
    return kit_dir


def write_targets(pki_dir: str, path: str) -> list[dict]:
    """Prometheus file_sd targets: every site that has a kit, by its /metrics address."""
    targets = [{"targets": [k.metrics], "labels": {"site": k.name}}
               for k in read_kits(pki_dir).values() if k.role == "worker"]
    _write(path, json.dumps(targets, indent=2) + "\n")
    return targets
