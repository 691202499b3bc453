#!/usr/bin/env python3
"""Generate deploy/grafana/dashboards/mdgan.json, the Grafana dashboard of an mdgan run.

    python3 deploy/grafana/generate_dashboard.py           # write the JSON next to this script
    python3 deploy/grafana/generate_dashboard.py --check   # exit 1 if the committed JSON is stale

Plain Python, no dependencies: edit the panels here, regenerate, commit both files.

The metrics are declared in services/common/telemetry.py. The server (job mdgan-server) and the
workers (job mdgan-worker) export the same names, so every query selects the role by job. Wire
bytes are counted by the sender and by the receiver: direction totals use side="sender" only (the
server sends server_to_worker; workers send worker_to_server and worker_to_worker), so nothing is
counted twice. Every target uses the dashboard's `datasource` variable (a Prometheus datasource,
by default the one Grafana has as default: `prometheus` in deploy/grafana/provisioning), so the same
JSON works in a Grafana whose Prometheus has another uid. The chart ships the same file
(deploy/k8s/mdgan/dashboards/mdgan.json) for Grafana's sidecar.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "dashboards", "mdgan.json")
CHART_COPY = os.path.join(HERE, "..", "k8s", "mdgan", "dashboards", "mdgan.json")  # Helm reads files in its chart only

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SERVER = 'job="mdgan-server"'
WORKERS = 'job="mdgan-worker", instance=~"$worker"'
RI = "$__rate_interval"


class Layout:
    """Hands out panel ids and grid positions, row by row (24 columns)."""

    def __init__(self):
        self.panels: list[dict] = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_height = 0

    def _place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        self.panels.append({"type": "row", "id": self.next_id, "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.next_id += 1
        self.y += 1

    def add(self, panel: dict, w: int, h: int) -> None:
        panel["id"] = self.next_id
        panel["gridPos"] = self._place(w, h)
        self.next_id += 1
        self.panels.append(panel)


def target(ref: str, expr: str, legend: str = "__auto") -> dict:
    return {"refId": ref, "datasource": dict(DATASOURCE), "editorMode": "code", "expr": expr,
            "legendFormat": legend, "range": True, "instant": False}


def timeseries(title: str, description: str, targets: list[dict], unit: str = "short", *, stack: bool = False,
               min_value: float | None = None, max_value: float | None = None, overrides: list | None = None,
               threshold: float | None = None, draw: str = "line") -> dict:
    custom = {
        "drawStyle": draw, "lineWidth": 1, "fillOpacity": 20 if stack else 10, "showPoints": "never",
        "spanNulls": False, "axisPlacement": "auto", "axisSoftMin": 0 if min_value is None else None,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "line+area" if threshold is not None else "off"},
    }
    custom = {k: v for k, v in custom.items() if v is not None}
    steps = [{"color": "green", "value": None}]
    if threshold is not None:
        steps.append({"color": "red", "value": threshold})
    defaults = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"},
                "thresholds": {"mode": "absolute", "steps": steps}}
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": dict(DATASOURCE),
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def stat(title: str, description: str, expr: str, unit: str = "short", *, decimals: int | None = None,
         thresholds: list[tuple[str, float | None]] | None = None) -> dict:
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute",
                               "steps": [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": description, "datasource": dict(DATASOURCE),
        "targets": [target("A", expr, "__auto")],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto",
                    "orientation": "auto"},
    }


def by_ref(ref: str, properties: list[dict]) -> dict:
    return {"matcher": {"id": "byFrameRefID", "options": ref}, "properties": properties}


def build() -> dict:
    lay = Layout()

    # --- Overview ------------------------------------------------------------------------------
    lay.row("Overview")
    lay.add(stat("Progress", "Iterations completed by the server, of the iterations the run is configured for.",
                 f"mdgan_iterations_total{{{SERVER}}} / mdgan_run_iterations{{{SERVER}}}", "percentunit",
                 decimals=1), 4, 4)
    lay.add(stat("Iteration", "Global iterations the server has completed.",
                 f"mdgan_iterations_total{{{SERVER}}}", "none"), 4, 4)
    lay.add(stat("Workers alive", "Workers taking part in the run, as the server sees them.",
                 f"mdgan_workers_alive{{{SERVER}}}", "none"), 4, 4)
    lay.add(stat("Workers expected", "Workers the run was configured for.",
                 f"mdgan_workers_expected{{{SERVER}}}", "none"), 4, 4)
    lay.add(stat("Worker targets up", "Worker /metrics endpoints Prometheus scrapes successfully.",
                 'sum(up{job="mdgan-worker"})', "none"), 4, 4)
    lay.add(stat("Since last iteration", "Time since the server completed its last iteration (empty before "
                 "the first one). MdganTrainingStalled fires after 6 minutes without one.",
                 f"time() - (mdgan_last_iteration_timestamp_seconds{{{SERVER}}} > 0)", "s", decimals=1,
                 thresholds=[("green", None), ("orange", 60), ("red", 300)]), 4, 4)

    # --- Training ------------------------------------------------------------------------------
    lay.row("Training")
    lay.add(timeseries(
        "Iteration rate",
        "Global iterations per second: completed by the server, served by each worker.",
        [target("A", f"sum(rate(mdgan_iterations_total{{{SERVER}}}[{RI}]))", "server"),
         target("B", f"sum by (instance) (rate(mdgan_iterations_total{{{WORKERS}}}[{RI}]))", "{{instance}}")],
        "suffix: it/s"), 12, 8)
    lay.add(timeseries(
        "Iteration duration",
        "Wall time of one global iteration at the server: quantiles from the histogram, and the mean.",
        [target("A", f"histogram_quantile(0.5, sum by (le) (rate(mdgan_iteration_duration_seconds_bucket{{{SERVER}}}[{RI}])))", "p50"),
         target("B", f"histogram_quantile(0.9, sum by (le) (rate(mdgan_iteration_duration_seconds_bucket{{{SERVER}}}[{RI}])))", "p90"),
         target("C", f"histogram_quantile(0.99, sum by (le) (rate(mdgan_iteration_duration_seconds_bucket{{{SERVER}}}[{RI}])))", "p99"),
         target("D", f"sum(rate(mdgan_iteration_duration_seconds_sum{{{SERVER}}}[{RI}])) / "
                     f"(sum(rate(mdgan_iteration_duration_seconds_count{{{SERVER}}}[{RI}])) > 0)", "mean")],
        "s"), 12, 8)
    lay.add(timeseries(
        "Server phase time per iteration",
        "Seconds each server phase takes per iteration on average (generate, wait_feedback, update; swap "
        "rounds spread over the iterations), stacked: the stack is about the iteration time.",
        [target("A", f"sum by (phase) (rate(mdgan_iteration_phase_duration_seconds_sum{{{SERVER}}}[{RI}])) "
                     f"/ on () group_left () (sum(rate(mdgan_iterations_total{{{SERVER}}}[{RI}])) > 0)", "{{phase}}")],
        "s", stack=True), 12, 8)
    lay.add(timeseries(
        "Worker phase time per iteration",
        "Seconds each worker phase takes per iteration it serves (disc_steps, feedback; swaps spread over "
        "the iterations), by worker.",
        [target("A", f"sum by (instance, phase) (rate(mdgan_iteration_phase_duration_seconds_sum{{{WORKERS}}}[{RI}])) "
                     f"/ on (instance) group_left () "
                     f"(sum by (instance) (rate(mdgan_iterations_total{{{WORKERS}}}[{RI}])) > 0)",
                "{{instance}} {{phase}}")],
        "s"), 12, 8)
    lay.add(timeseries(
        "Phase duration p90",
        "90th percentile of each phase's wall time, server and workers.",
        [target("A", f"histogram_quantile(0.9, sum by (phase, le) "
                     f"(rate(mdgan_iteration_phase_duration_seconds_bucket{{{SERVER}}}[{RI}])))", "server {{phase}}"),
         target("B", f"histogram_quantile(0.9, sum by (instance, phase, le) "
                     f"(rate(mdgan_iteration_phase_duration_seconds_bucket{{{WORKERS}}}[{RI}])))",
                "{{instance}} {{phase}}")],
        "s"), 24, 8)

    # --- Model ---------------------------------------------------------------------------------
    lay.row("Model")
    lay.add(timeseries(
        "Generator loss",
        "J_gen on the generated batches: the server's mean over the answering workers, and each worker's own. "
        "Under private feedback the sites withhold it from the server (their discriminators are not private): "
        "each site's own endpoint keeps it.",
        [target("A", f"mdgan_generator_loss{{{SERVER}}}", "server (mean)"),
         target("B", f"mdgan_generator_loss{{{WORKERS}}}", "{{instance}}")]), 8, 8)
    lay.add(timeseries(
        "Discriminator loss",
        "J_disc of the last discriminator step: the server's mean, and each worker's. Computed on a site's real "
        "images, so under DP the sites withhold it from the server (its series is empty): each site's own "
        "endpoint keeps it.",
        [target("A", f"mdgan_discriminator_loss{{{SERVER}}}", "server (mean)"),
         target("B", f"mdgan_discriminator_loss{{{WORKERS}}}", "{{instance}}")]), 8, 8)
    lay.add(timeseries(
        "Discriminator accuracy",
        "Share of samples the discriminators classify right, on real and on generated data. Under DP the sites "
        "withhold the real accuracy from the server (DP-SGD), or both (private feedback); each site's own "
        "endpoint keeps them.",
        [target("A", f"mdgan_discriminator_accuracy{{{SERVER}}}", "server {{data}}"),
         target("B", f"mdgan_discriminator_accuracy{{{WORKERS}}}", "{{instance}} {{data}}")],
        "percentunit", min_value=0, max_value=1), 8, 8)
    lay.add(timeseries(
        "Evaluation scores",
        "Latest evaluation of the generator at the server, when evaluation runs: MNIST score (higher is "
        "better, left axis) and FID (lower is better, right axis).",
        [target("A", f'mdgan_evaluation_score{{{SERVER}, metric="mnist_score"}}', "MNIST score"),
         target("B", f'mdgan_evaluation_score{{{SERVER}, metric="fid"}}', "FID")],
        overrides=[by_ref("B", [{"id": "custom.axisPlacement", "value": "right"}])], draw="line"), 24, 8)

    # --- Cluster -------------------------------------------------------------------------------
    lay.row("Cluster")
    lay.add(timeseries(
        "Workers alive vs expected",
        "Workers the server trains with, the number the run expects, and worker targets Prometheus can "
        "scrape. MdganWorkerDown fires when alive < expected for 2 minutes, or a worker target is down for 1.",
        [target("A", f"mdgan_workers_alive{{{SERVER}}}", "alive"),
         target("B", f"mdgan_workers_expected{{{SERVER}}}", "expected"),
         target("C", 'sum(up{job="mdgan-worker"})', "targets up")],
        "none", min_value=0,
        overrides=[by_ref("B", [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                {"id": "color", "value": {"mode": "fixed", "fixedColor": "text"}}])]), 8, 8)
    lay.add(timeseries(
        "Joins and departures",
        "Workers admitted by the server, and workers that left the run, by reason (cumulative).",
        [target("A", f"mdgan_worker_joins_total{{{SERVER}}}", "joined"),
         target("B", f"sum by (reason) (mdgan_worker_departures_total{{{SERVER}}})", "left: {{reason}}")],
        "none", min_value=0), 8, 8)
    lay.add(timeseries(
        "Discriminator swaps",
        "Swap rounds at the server by outcome, and swaps each worker took part in (cumulative).",
        [target("A", f"sum by (outcome) (mdgan_swaps_total{{{SERVER}}})", "server {{outcome}}"),
         target("B", f"sum by (instance, outcome) (mdgan_swaps_total{{{WORKERS}}})", "{{instance}} {{outcome}}")],
        "none", min_value=0), 8, 8)
    lay.add(timeseries(
        "Swaps: direct against relayed",
        "Discriminators the workers pushed, straight to the receiver's Peer service or through the server's relay "
        "(sites that take no inbound connection; docs/DEPLOY.md), and the relay's pushes by the receiver's answer "
        "(DATA_LOSS: a sealed push that did not open); cumulative.",
        [target("A", f"sum by (path) (mdgan_swap_paths_total{{{WORKERS}}})", "pushed {{path}}"),
         target("B", f"sum by (outcome) (mdgan_relayed_pushes_total{{{SERVER}}})", "relay: {{outcome}}")],
        "none", min_value=0), 12, 7)
    lay.add(timeseries(
        "Relayed bytes by site",
        "Sealed discriminator bytes the server's relay forwarded, by receiving site, cumulative (each crosses "
        "the server's link twice: in from the sender, out to the receiver).",
        [target("A", f"sum by (receiver) (mdgan_relayed_bytes_total{{{SERVER}}})", "to {{receiver}}")],
        "bytes", min_value=0), 12, 7)
    lay.add(timeseries(
        "Rejected inputs",
        "Inputs refused by validation, by process and reason (cumulative): feedback at the server, peer "
        "discriminators at the workers. MdganInputsRejected fires on any increase.",
        [target("A", "sum by (job, instance, reason) (mdgan_rejected_inputs_total)", "{{job}} {{instance}} {{reason}}")],
        "none", min_value=0), 24, 7)

    # --- Privacy and integrity (docs/PRIVACY.md) -----------------------------------------------
    lay.row("Privacy and integrity")
    lay.add(timeseries(
        "Privacy spent (epsilon) per site",
        "Differentially private runs: the epsilon each site has spent so far, by the RDP accountant over its "
        "own ledger at its delta (mdgan_privacy_epsilon). The run's --dp-target-epsilon and a site's "
        "--dp-max-epsilon are caps: a site leaves before going past them.",
        [target("A", "max by (instance) (mdgan_privacy_epsilon)", "{{instance}}")], "none", min_value=0), 12, 7)
    lay.add(timeseries(
        "Discriminators refused at swaps",
        "Received discriminators a worker's swap check refused (not finite, wrong norm or direction, or a "
        "loss worse than knowing nothing on its own data): the worker kept its own for the round.",
        [target("A", 'sum by (instance) (mdgan_rejected_inputs_total{reason="discriminator"})', "{{instance}}")],
        "none", min_value=0), 12, 7)

    # --- Wire ----------------------------------------------------------------------------------
    lay.row("Wire")
    lay.add(timeseries(
        "Traffic by direction",
        "Bytes per second on the wire by direction, counted by the sender: the tensor payload of the "
        "paper's Table III, and the serialized messages (payload, labels, framing, control).",
        [target("A", f'sum by (direction) (rate(mdgan_wire_payload_bytes_total{{side="sender"}}[{RI}]))',
                "{{direction}} payload"),
         target("B", f'sum by (direction) (rate(mdgan_wire_message_bytes_total{{side="sender"}}[{RI}]))',
                "{{direction}} message")],
        "Bps", overrides=[by_ref("A", [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}])]),
        12, 8)
    lay.add(timeseries(
        "Traffic per worker",
        "Serialized bytes per second each worker sends (up) and receives (down), all directions.",
        [target("A", f'sum by (instance) (rate(mdgan_wire_message_bytes_total{{{WORKERS}, side="sender"}}[{RI}]))',
                "{{instance}} sent"),
         target("B", f'sum by (instance) (rate(mdgan_wire_message_bytes_total{{{WORKERS}, side="receiver"}}[{RI}]))',
                "{{instance}} received")],
        "Bps", overrides=[by_ref("B", [{"id": "custom.transform", "value": "negative-Y"}])]), 12, 8)
    lay.add(timeseries(
        "Messages by kind",
        "Messages per second by direction and kind, counted by the sender.",
        [target("A", f'sum by (direction, kind) (rate(mdgan_wire_messages_total{{side="sender"}}[{RI}]))',
                "{{direction}} {{kind}}")],
        "suffix: msg/s"), 12, 8)
    lay.add(timeseries(
        "Wire overhead",
        "Message bytes / payload bytes - 1 by direction, over the series that carried payload in the "
        "window (control messages and idle directions are left out). MdganWireOverheadHigh fires above "
        "5% for 5 minutes.",
        [target("A", f'sum by (direction) (rate(mdgan_wire_message_bytes_total{{side="sender"}}[{RI}]) '
                     f'and rate(mdgan_wire_payload_bytes_total{{side="sender"}}[{RI}]) > 0) '
                     f'/ sum by (direction) (rate(mdgan_wire_payload_bytes_total{{side="sender"}}[{RI}]) > 0) - 1',
                "{{direction}}")],
        "percentunit", threshold=0.05), 12, 8)

    return {
        "uid": "mdgan",
        "title": "MD-GAN",
        "description": "An MD-GAN run: the generator server and its workers (services/common/telemetry.py).",
        "tags": ["mdgan"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "refresh": 1, "regex": "", "hide": 0, "skipUrlSync": False, "options": [],
            "current": {"selected": False, "text": "default", "value": "default"}}, {
            "name": "worker", "label": "Worker", "type": "query", "datasource": dict(DATASOURCE),
            "definition": 'label_values(mdgan_iterations_total{job="mdgan-worker"}, instance)',
            "query": {"qryType": 1, "query": 'label_values(mdgan_iterations_total{job="mdgan-worker"}, instance)',
                      "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2, "sort": 3, "multi": True, "includeAll": True, "allValue": ".+",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
            "regex": "", "hide": 0, "skipUrlSync": False}]},
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    text = render()
    outputs = [args.output] + ([os.path.normpath(CHART_COPY)] if args.output == OUTPUT else [])
    if args.check:
        stale = [o for o in outputs if not os.path.exists(o) or open(o).read() != text]
        for output in stale:
            print(f"{output} is stale: run {os.path.relpath(__file__)}", file=sys.stderr)
        return 1 if stale else 0
    for output in outputs:
        os.makedirs(os.path.dirname(output), exist_ok=True)
        with open(output, "w") as fh:
            fh.write(text)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
