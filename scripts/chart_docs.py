"""The Helm chart's values.schema.json and README.md, both made from values.yaml (its values and its
comments), so that neither can drift from it:

- the schema refuses every key values.yaml does not have (a typo such as workers.replcas fails
  `helm install` with the key's name), except inside the free-form maps listed in FREE_FORM; each
  value's type is its default's, with the constraints in CONSTRAINTS;
- the README is a table of every value with its default and its comment.

    python scripts/chart_docs.py           # write deploy/k8s/mdgan/values.schema.json and README.md
    python scripts/chart_docs.py --check   # exit 1 if either is not what values.yaml gives
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(REPO, "deploy", "k8s", "mdgan")

# Maps whose keys are the user's (labels, annotations, Kubernetes objects, MDGAN_* settings).
FREE_FORM = {
    "server.settings", "workers.settings", "server.service.annotations", "server.podAnnotations",
    "server.podLabels", "server.nodeSelector", "server.affinity", "server.resources", "server.podSecurityContext",
    "server.securityContext", "workers.podAnnotations", "workers.podLabels", "workers.nodeSelector",
    "workers.affinity", "workers.resources", "workers.podSecurityContext", "workers.securityContext",
    "workers.data.volume", "workers.externalService.annotations", "metrics.serviceMonitor.labels",
    "grafanaDashboard.labels", "grafanaDashboard.annotations", "tls.certManager.issuerRef",
    "prometheusRule.labels", "pki.resources",
}
NUMBER = {"type": ["number", "string"], "pattern": r"^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"}
CONSTRAINTS = {
    "algorithm": {"enum": ["mdgan", "flgan", "pwgan", "psgan"]},
    "global.dataset": {"enum": ["imagefolder", "mnist", "cifar10", "synthetic"]},
    "workers.data.mode": {"enum": ["site", "emulation"]},
    "workers.replicas": {"minimum": 0},
    "server.workers": {"type": ["integer", "null"], "minimum": 1},
    "workers.stopDelaySeconds": {"minimum": 0},
    "workers.terminationGracePeriodSeconds": {"minimum": 0},
    "server.terminationGracePeriodSeconds": {"minimum": 0},
    "pwgan.potentialRounds": {"minimum": 1},
    "pwgan.potentialLr": {**NUMBER, "exclusiveMinimum": 0},
    "pwgan.gradientPenalty": {**NUMBER, "minimum": 0},
    "psgan.threshold": {"type": ["integer", "null"], "minimum": 1},
    "server.address": {"pattern": r"^$|^.+:[0-9]+$"},
    "workers.advertiseAddresses": {"items": {"type": "string", "pattern": r"^.+:[0-9]+$"}},
    "workers.externalService.type": {"enum": ["LoadBalancer", "NodePort", "ClusterIP"]},
    "workers.swaps": {"enum": ["auto", "direct", "relay"]},
    "server.service.type": {"enum": ["ClusterIP", "LoadBalancer", "NodePort"]},
    "server.grpcPort": {"minimum": 1, "maximum": 65535},
    "workers.grpcPort": {"minimum": 1, "maximum": 65535},
    "server.metricsPort": {"minimum": 1, "maximum": 65535},
    "workers.metricsPort": {"minimum": 1, "maximum": 65535},
    "pki.days": {"minimum": 1},
}
SETTINGS = {"type": "object", "propertyNames": {"pattern": "^MDGAN_[A-Z0-9_]+$"},
            "additionalProperties": {"type": ["string", "number", "boolean"]}}


def _type(value) -> dict:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return dict(NUMBER)
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array"}
    return {}  # null: any


def schema_of(value, path: str = "") -> dict:
    if isinstance(value, dict):
        if path in FREE_FORM:
            node = dict(SETTINGS) if path.endswith(".settings") else {"type": "object"}
        else:
            node = {"type": "object", "additionalProperties": False,
                    "properties": {k: schema_of(v, f"{path}.{k}".lstrip(".")) for k, v in value.items()}}
    else:
        node = _type(value)
    node.update(CONSTRAINTS.get(path, {}))
    return node


def schema(values: dict) -> dict:
    return {"$schema": "http://json-schema.org/draft-07/schema#",
            "title": "MD-GAN chart values (made by scripts/chart_docs.py from values.yaml: edit that, then run it)",
            **schema_of(values), "required": ["algorithm"]}


def documented(text: str) -> list[tuple[str, str, str]]:
    """(path, default as written, comment) of every key of values.yaml, in order: a key's comment is the
    full-line comments just above it and the comment at the end of its line (and those continuing it)."""
    rows, stack, pending = [], [], []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("# ----"):
            pending = []
            continue
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if rows and rows[-1][3] is not None and indent > rows[-1][3]:
                rows[-1][2] += " " + comment  # a continued end-of-line comment
            else:
                pending.append(comment)
            continue
        match = re.match(r"^([A-Za-z0-9_]+):(.*)$", stripped)
        if not match:  # a list item or a continuation of a value
            continue
        key, rest = match.groups()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([name for _, name in stack] + [key])
        value, _, comment = rest.partition(" #")
        value = value.strip()
        note = " ".join(pending + ([comment.strip()] if comment.strip() else []))
        rows.append([path, value, note, indent if comment.strip() else None])
        pending = []
        if not value:
            stack.append((indent, key))
    return [(p, v, c) for p, v, c, _ in rows]


def readme(text: str) -> str:
    lines = ["# The mdgan Helm chart", "",
             "One server (a Deployment) and N workers (a StatefulSet), or (`server.enabled=false`) a site's workers",
             "joining a server outside this cluster. How to install it, with every command: `docs/KUBERNETES.md`.",
             "Made by `scripts/chart_docs.py` from `values.yaml`; edit that, then run it.", "",
             "```bash",
             "helm install mdgan deploy/k8s/mdgan -n mdgan --create-namespace     # a demo on synthetic data: it trains",
             "```", "",
             "| value | default | what it is |", "| --- | --- | --- |"]
    for path, value, note in documented(text):
        shown = value.replace("|", "\\|") if value else ""
        lines.append(f"| `{path}` | {'`' + shown + '`' if shown else ''} | {note.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files are not what values.yaml gives")
    args = parser.parse_args()
    with open(os.path.join(CHART, "values.yaml"), encoding="utf-8") as fh:
        text = fh.read()
    wanted = {"values.schema.json": json.dumps(schema(yaml.safe_load(text)), indent=2) + "\n",
              "README.md": readme(text)}
    stale = []
    for name, content in wanted.items():
        path = os.path.join(CHART, name)
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if current != content:
            stale.append(name)
            if not args.check:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(content)
    if args.check and stale:
        print(f"chart_docs: {', '.join(stale)} out of date with values.yaml: run python scripts/chart_docs.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
