"""Each program reads its own variables; every program has --version and its exit statuses in --help;
progress bars only on a terminal. Every program runs in this process, from its main(argv), with the
environment it is given (tests/test_launcher.py and the e2e tests start the real processes)."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass

import pytest

from conftest import REPO


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(monkeypatch, capsys):
    """run([module, *argv], env): that program's main(argv), with only `env`'s MDGAN_* variables set."""

    def run(argv: list[str], env: dict | None = None) -> Result:
        module, args = argv[0], argv[1:]
        main = importlib.import_module("services.server.__main__" if module == "services.server" else
                                       "services.worker.__main__" if module == "services.worker" else module).main
        capsys.readouterr()
        with monkeypatch.context() as patch:
            for name in [k for k in os.environ if k.startswith("MDGAN_")]:
                patch.delenv(name)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            try:
                code = main(args)
            except SystemExit as exit:  # (argparse: --help, --version, a bad flag)
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def documented_variables() -> set[str]:
    names = set()
    deployment = ("DEPLOY.md", "KUBERNETES.md", "TLS.md", "DURABILITY.md")
    for doc in ("README.md", *(os.path.join("docs", d) for d in deployment)):
        with open(os.path.join(REPO, doc)) as fh:
            names |= set(re.findall(r"\bMDGAN_[A-Z0-9_]*[A-Z0-9]\b", fh.read()))
    return names


def test_a_services_variable_never_changes_an_mdgan_command(tmp_path, run):
    """The worker's documented MDGAN_SERVER=host:port once made `mdgan certs issue` exit 2 (read as its
    boolean --server). With every variable the docs name set to a value no command takes, every `mdgan`
    command still runs as asked."""
    services_only = {name for name in documented_variables()
                     if not name.startswith(("MDGAN_LOCAL_", "MDGAN_SIMULATE_", "MDGAN_EXPERIMENT_"))}
    assert {"MDGAN_SERVER", "MDGAN_WORKERS", "MDGAN_RESUME", "MDGAN_ITERATIONS"} <= services_only
    env = dict.fromkeys(services_only, "not-a-value-any-command-takes")
    env["MDGAN_SERVER"] = "server.example.org:50051"
    pki = str(tmp_path / "pki")
    for argv in (["certs", "init", pki], ["certs", "issue", pki, "site-a"], ["models"],
                 ["traffic", "--workers", "4"], ["simulate", "--help"], ["local", "--help"],
                 ["experiment", "--help"], ["split", "--help"], ["sample", "--help"]):
        result = run(["mdgan_app.cli", *argv], env)
        assert result.returncode == 0, (argv, result.stderr)
    # a simulate run takes its own variables only: MDGAN_SIMULATE_*, not the services' MDGAN_*
    out = str(tmp_path / "run")
    result = run(["mdgan_app.cli", "simulate", "--dataset", "synthetic", "--workers", "2", "--batch-size", "8",
                  "--eval-every", "-1", "--out", out], {**env, "MDGAN_SIMULATE_ITERATIONS": "3"})
    assert result.returncode == 0, result.stderr
    assert "3 iterations" in result.stdout
    def help_of(*argv: str) -> str:
        return " ".join(run(list(argv)).stdout.split())  # (argparse wraps "[env NAME]" across lines)

    help_text = help_of("mdgan_app.cli", "local", "--help")
    assert "[env MDGAN_LOCAL_WORKERS]" in help_text and "[env MDGAN_WORKERS]" not in help_text
    assert "[env " not in help_of("mdgan_app.cli", "certs", "issue", "--help")  # certs: no variables
    assert "[env MDGAN_WORKERS]" in help_of("services.server", "--help")  # the services keep MDGAN_*


def test_every_program_has_a_version_and_its_exit_statuses_in_its_help(run):
    from importlib.metadata import version

    for module, program in (("mdgan_app.cli", "mdgan"), ("services.server", "mdgan-server"),
                            ("services.worker", "mdgan-worker"), ("services.common.healthcheck", "mdgan-healthcheck")):
        result = run([module, "--version"])
        assert result.returncode == 0 and result.stdout.strip() == f"{program} {version('mdgan')}", result
        help_text = run([module, "--help"]).stdout
        assert "exit status:" in help_text and "128+N" in help_text, program
    assert run(["services.worker", "--help"]).stdout.count("server refused this worker") == 1


def test_no_progress_bar_where_nobody_watches(tmp_path, run):
    """Logs of compose, CI or nohup get no bar (stderr is not a terminal here)."""
    result = run(["mdgan_app.cli", "simulate", "--dataset", "synthetic", "--workers", "2", "--batch-size", "8",
                  "--iterations", "3", "--eval-every", "-1", "--out", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr
    assert "it/s" not in result.stderr and "s/it" not in result.stderr and "\r" not in result.stderr


def test_a_config_file_sets_a_run_below_variables_and_flags(tmp_path, run):
    """--config FILE (TOML, a key per flag) for local, simulate and both services: flag > variable >
    file > default, printed by --print-config; an unknown key or a wrong type is one line naming it."""
    config = tmp_path / "run.toml"
    config.write_text('workers = 2\niterations = 4\nbatch-size = 8\ndataset = "synthetic"\neval-every = -1\n'
                      'swap-optimizer-state = true\n')
    printed = run(["mdgan_app.cli", "simulate", "--config", str(config), "--print-config"]).stdout
    assert "iterations = 4" in printed and "batch-size = 8" in printed and "swap-optimizer-state = true" in printed
    layered = run(["mdgan_app.cli", "simulate", "--config", str(config), "--batch-size", "5", "--print-config"],
                  {"MDGAN_SIMULATE_ITERATIONS": "6"}).stdout
    assert "iterations = 6" in layered and "batch-size = 5" in layered and "workers = 2" in layered
    out = str(tmp_path / "run")
    result = run(["mdgan_app.cli", "simulate", "--config", str(config), "--out", out])
    assert result.returncode == 0 and "4 iterations" in result.stdout, result.stderr
    # a run's launch.toml is such a file: the same settings, the same generator, in another folder
    again = str(tmp_path / "again")
    assert run(["mdgan_app.cli", "simulate", "--config", os.path.join(out, "launch.toml"), "--out", again]).returncode == 0
    import json

    sha = [json.load(open(os.path.join(d, "summary.json")))["generator_sha256"] for d in (out, again)]
    assert sha[0] == sha[1]
    assert "worker-" not in run(["services.worker", "--config", str(config), "--print-config"]).stderr
    for text, message in (("workerz = 2", "unknown key 'workerz'"), ('workers = "two"', "workers = 'two': must be a whole number"),
                          ("no-progress = 1", "true or false"), ('dataset = "imagenet"', "choose from"),
                          ("[training]\nworkers = 2", "unknown key 'training'"), ("workers = ", "not TOML")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text + "\n")
        result = run(["mdgan_app.cli", "simulate", "--config", str(bad), "--out", str(tmp_path / "never")])
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert not os.path.exists(tmp_path / "never")
    assert run(["services.server", "--config", str(tmp_path / "missing.toml")]).returncode == 2


@pytest.mark.slow
def test_mdgan_local_runs_from_a_config_file(tmp_path, run):
    config = tmp_path / "run.toml"
    config.write_text('workers = 2\niterations = 3\nbatch-size = 8\ndataset = "synthetic"\neval-every = -1\n'
                      'swap-every = 2\n')
    result = run(["mdgan_app.cli", "local", "--config", str(config), "--out", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 iterations, 2 of 2 workers alive" in result.stdout


def test_mdgan_certs_runs_without_the_training_code(tmp_path):
    """`mdgan certs` runs where certificates are made (compose's one-shot, the chart's hook Job, a site's
    machine): it parses alone and never imports torch, which costs seconds a call."""
    import subprocess
    import sys

    pki = str(tmp_path / "pki")
    probe = ("import sys; from mdgan_app.cli import main; "
             f"codes = [main(['certs', 'init', {pki!r}]), main(['certs', 'issue', {pki!r}, 'site-a', '--worker'])]; "
             "print(codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0] False", done.stdout
    assert os.path.isfile(os.path.join(pki, "site-a", "tls.crt"))


@pytest.mark.parametrize("argv, message", [
    (["mdgan_app.cli", "certs", "init", "{pki}", "--days", "0"], r"--days: a number of days from 1 to 36,500, got 0"),
    (["mdgan_app.cli", "certs", "init", "{pki}", "--days", "99999999"],
     r"--days: a number of days from 1 to 36,500, got 99999999"),
    (["mdgan_app.cli", "certs", "kit", "{pki}", "site-a", "--server-address", "srv:50051", "--metrics-port", "99999"],
     r"--metrics-port: a port from 1 to 65535, got 99999"),
    (["services.server", "--port", "50051", "--insecure", "--out", "{pki}"], r"unrecognized arguments: --port 50051"),
    (["mdgan_app.cli", "simulate", "--iter", "3", "--dataset", "synthetic", "--out", "{pki}"],
     r"unrecognized arguments: --iter 3"),
    (["mdgan_app.cli", "local", "--keep-checkpoints", "0", "--dataset", "synthetic", "--out", "{pki}"],
     r"--keep-checkpoints: must be at least 1, not 0"),  # (the server refused it, after the run folder was made)
    (["services.worker", "--keep-checkpoints", "0"], r"--keep-checkpoints: must be at least 1, not 0"),
    (["mdgan_app.cli", "simulate", "--eval-samples", "1", "--dataset", "synthetic", "--out", "{pki}"],
     r"--eval-samples: must be at least 2 images \(a FID needs two to compare\), not 1"),  # (FID's traceback at the end)
    (["mdgan_app.cli", "simulate", "--eval-every", "-5", "--dataset", "synthetic", "--out", "{pki}"],
     r"--eval-every: must be a number of iterations, or 0 \(only at the end\) or -1 \(never\), not -5"),
    # a dataset not where --data-root says: refused before the cluster (and its run folder) is made
    (["mdgan_app.cli", "local", "--data-root", "{pki}-data", "--out", "{pki}"], r"MNIST not found under '.*made-data"),
    (["mdgan_app.cli", "local", "--dataset", "cifar10", "--data-root", "{pki}-data", "--out", "{pki}"],
     r"CIFAR-10 not found under '.*made-data/cifar-10-batches-py' \(missing data_batch_1"),
    (["mdgan_app.cli", "local", "--dataset", "imagefolder", "--data-root", "{pki}-data", "--out", "{pki}"],
     r"the data folder '.*made-data' does not exist"),
])
def test_a_flag_out_of_range_or_cut_short_is_refused_before_anything_is_written(tmp_path, run, argv, message):
    """A certificate valid for no day or past X.509's dates, a port no one can reach; and a flag cut short, which
    argparse took for the one it begins (`--port 50051` was --port-file: a server on another port, and a file
    named 50051): each refused in one line (exit 2), and nothing written."""
    folder = tmp_path / "made"
    result = run([part.replace("{pki}", str(folder)) for part in argv])
    assert result.returncode == 2 and re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.stderr and not folder.exists()


@pytest.mark.parametrize("argv, message", [
    (["mdgan_app.cli", "traffic", "--workers", "0"], r"--workers must be at least 1"),
    (["mdgan_app.cli", "traffic", "--shard-size", "0"], r"--shard-size must be at least 1, got 0"),
    (["mdgan_app.cli", "traffic", "--workers", "100000"],
     r"--workers 100000: mnist's 60,000 training images leave each worker none \(give --shard-size\)"),
    (["mdgan_app.cli", "score", "{run}", "--device", "tpu"], r"--device must be cpu, cuda or cuda:N, got 'tpu'"),
])
def test_a_formula_or_score_asked_with_values_out_of_range_is_refused_in_one_line(tmp_path, run, argv, message):
    """(`mdgan traffic --workers 0` divided by zero; `mdgan score --device cuda` without CUDA raised torch's error.)"""
    result = run([part.replace("{run}", str(tmp_path)) for part in argv])
    assert result.returncode == 2 and re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_scoring_on_a_missing_gpu_is_refused_in_one_line(tmp_path, run):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run(["mdgan_app.cli", "score", str(tmp_path), "--device", "cuda"])
    assert result.returncode == 2 and "--device cuda: no CUDA device is available here" in result.stderr, result.stderr


def test_scoring_a_run_on_the_synthetic_dataset_is_refused_in_one_line(tmp_path, run):
    """Its samples have MNIST's shape, but there are no digits to score them against: refused, no scores.json."""
    trained = run(["mdgan_app.cli", "simulate", "--dataset", "synthetic", "--workers", "2", "--iterations", "2",
                   "--eval-every", "-1", "--no-progress", "--out", str(tmp_path / "run")])
    assert trained.returncode == 0, trained.stderr
    result = run(["mdgan_app.cli", "score", str(tmp_path / "run")])
    assert result.returncode == 2 and "this run trained on the synthetic dataset" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "scores.json").exists()


@pytest.mark.parametrize("command, under", [("local", False), ("simulate", False), ("simulate", True)])
def test_an_out_that_is_a_file_or_inside_one_is_refused_in_one_line(tmp_path, run, command, under):
    """(It was Python's `[Errno 17] File exists` or `[Errno 20] Not a directory`.) The file is left as it was."""
    taken = tmp_path / "taken"
    taken.write_text("a user's file\n")
    out = taken / "run" if under else taken
    result = run(["mdgan_app.cli", command, "--dataset", "synthetic", "--iterations", "2", "--out", str(out)])
    said = f"--out {out}: {taken} is a file" if under else f"--out {out} is a file"
    assert result.returncode == 2 and f"{said}, not a folder: choose another --out" in result.stderr, result.stderr
    assert "Errno" not in result.stderr and taken.read_text() == "a user's file\n"


def test_mdgan_split_refuses_before_it_writes_a_site(tmp_path, run):
    """No sites, an --out that is a file, and a site folder already there (site-1: site-0 was written before it was
    seen): each one line, and nothing written."""
    taken = tmp_path / "taken"
    taken.write_text("")
    (tmp_path / "sites" / "site-1").mkdir(parents=True)
    for flags, said in ((["--workers", "0", "--out", str(tmp_path / "none")], "--workers must be at least 1, got 0"),
                        (["--workers", "2", "--out", str(taken)], f"--out {taken} is a file, not a folder"),
                        (["--workers", "2", "--out", str(tmp_path / "sites")], "site-1' exists; choose an empty --out")):
        result = run(["mdgan_app.cli", "split", "synthetic", "--samples", "40", *flags])
        assert result.returncode == 2 and said in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sites", "taken"]
    assert [p.name for p in (tmp_path / "sites").iterdir()] == ["site-1"] and not any((tmp_path / "sites").rglob("*.png"))
