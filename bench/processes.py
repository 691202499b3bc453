"""What the multi-process benchmarks share: reading a history being written, a PKI identity's flags,
and stopping every process a measurement started, whatever happened to it."""

from __future__ import annotations

import json
import os
import subprocess


def read_jsonl(path: str) -> list[dict]:
    """The complete lines of a JSON-lines file that may be under way (a last half line is left out)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh.read().split("\n")[:-1] if line.strip()]


def tls_flags(pki_dir: str, name: str) -> list[str]:
    """--tls-* flags for identity `name` of a PKI made by `mdgan certs` (services.common.pki)."""
    folder = os.path.join(pki_dir, name)
    return ["--tls-ca", os.path.join(folder, "ca.crt"), "--tls-cert", os.path.join(folder, "tls.crt"),
            "--tls-key", os.path.join(folder, "tls.key")]


def kill_all(processes: list[subprocess.Popen]) -> None:
    """Kills those still running and reaps them all (a measurement's `finally`)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
