"""`mdgan audit` on what is deployed: a run of the real services (`mdgan local`) records its split and
is audited like a simulated one, and a site audits its own exposure on its own machine, from its own
folders, against the final generator and the discriminator its worker kept."""

from __future__ import annotations

import os
import shutil

import pytest

from procs import read_json

pytestmark = pytest.mark.slow

SMALL = ["--workers", "2", "--iterations", "6", "--batch-size", "8", "--swap-every", "3", "--eval-every", "-1",
         "--no-progress", "--insecure"]


def test_a_local_run_records_its_split_and_is_audited_as_simulate_is(tmp_path, capsys):
    from mdgan.audit import AuditSettings, audit
    from mdgan_app.cli import main

    flags = [*SMALL, "--dataset", "synthetic", "--max-samples", "400"]
    assert main(["local", *flags, "--out", str(tmp_path / "local")]) == 0
    simulate_flags = [f for f in flags if f != "--insecure"]
    assert main(["simulate", *simulate_flags, "--out", str(tmp_path / "simulate")]) == 0
    local, simulated = (read_json(tmp_path / name / "summary.json") for name in ("local", "simulate"))
    # the workers trained on the subset (--max-samples reaches them), as simulate's did
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["worker_sizes"] == simulated["worker_sizes"] == {"worker-0": 200, "worker-1": 200}
    assert local["data"] == {**simulated["data"], "data_root": os.path.abspath(simulated["data"]["data_root"])}

    settings = AuditSettings(members=50, nonmembers=100, generated=200, bootstrap=0)
    report = audit(str(tmp_path / "local"), settings)
    assert set(report["sites"]) == {"worker-0", "worker-1"}
    assert report["discriminators"]  # each worker kept the D it held at the end, in its state dir
    assert report["nonmember_source"] == "unused training images"
    for site in report["sites"].values():
        assert set(site["attacks"]) == {"d_output", "d_class_loss", "g_distance"}
        assert site["members"] == 50 and 0 <= site["attacks"]["d_output"]["auc"] <= 1
    # the same members and non-members as the simulated run's audit: the same generator, the same g_distance
    again = audit(str(tmp_path / "simulate"), settings)
    assert again["sites"]["worker-1"]["attacks"]["g_distance"] == report["sites"]["worker-1"]["attacks"]["g_distance"]

    # the server's own record: the split without where the data is, which the audit then asks for
    summary = dict(local, data={**local["data"], "data_root": None})
    with open(tmp_path / "local" / "summary.json", "w") as fh:
        import json
        json.dump(summary, fh)
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "local")]) == 2
    assert "give --data-root" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "local"), "--data-root", "data", "--members", "20", "--nonmembers", "40",
                 "--generated", "50", "--bootstrap", "0", "--out", str(tmp_path / "audit")]) == 0
    assert read_json(tmp_path / "audit" / "audit.json")["sites"].keys() == {"worker-0", "worker-1"}


def test_a_site_audits_its_own_exposure_on_its_own_machine(tmp_path, capsys):
    from mdgan_app.cli import main

    assert main(["split", "synthetic", "--workers", "3", "--samples", "300", "--out", str(tmp_path / "all")]) == 0
    sites = tmp_path / "sites"
    for i in (0, 1):  # two sites train; site-2's images are held out (site 0 never saw them)
        shutil.copytree(tmp_path / "all" / f"site-{i}", sites / f"site-{i}")
    out = tmp_path / "run"
    assert main(["local", *SMALL, "--site-dirs", str(sites), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["audit", str(out)]) == 2  # no shared split: each site audits its own
    assert "each site audits its own exposure" in capsys.readouterr().err

    # on site 0's machine: the server's checkpoint.pt alone, the site's folders, its worker's state dir
    machine = tmp_path / "site-0-machine"
    (machine / "run").mkdir(parents=True)
    shutil.copy(out / "checkpoint.pt", machine / "run" / "checkpoint.pt")
    state = out / "workers" / "worker-0"
    report_dir = machine / "audit"
    assert main(["audit", str(machine / "run"), "--site-data", str(sites / "site-0"), "--held-out",
                 str(tmp_path / "all" / "site-2"), "--state-dir", str(state), "--members", "60", "--nonmembers",
                 "60", "--generated", "100", "--bootstrap", "10", "--out", str(report_dir)]) == 0
    report = read_json(report_dir / "audit.json")
    assert list(report["sites"]) == ["worker-0"] and report["discriminators"]
    attacks = report["sites"]["worker-0"]["attacks"]
    assert set(attacks) == {"d_output", "d_class_loss", "g_distance"}
    assert report["sites"]["worker-0"]["members"] == 60 and report["sites"]["worker-0"]["nonmembers"] == 60
    assert "held-out images of the site" in report["nonmember_source"]

    capsys.readouterr()
    for flags, message in ((["--site-data", str(sites / "site-0")], "needs both --site-data"),
                           (["--site-data", str(sites / "site-0"), "--held-out", str(tmp_path / "none")],
                            "--held-out"),
                           (["--site-data", str(sites / "site-0"), "--held-out", str(tmp_path / "all" / "site-2"),
                             "--state-dir", str(tmp_path)], "no discriminator kept there"),
                           (["--state-dir", str(state)], "goes with a site's own audit")):
        assert main(["audit", str(machine / "run"), *flags, "--bootstrap", "0"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
