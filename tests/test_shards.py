"""Non-i.i.d. (Dirichlet) shards, the split flags, and the CIFAR-10 loader on a fake dataset."""

import argparse
import os
import pickle

import numpy as np
import pytest
import torch

from mdgan.config import ConfigError, DataConfig
from mdgan.data import (DIRICHLET_MIN_SHARD, ShardSampler, dirichlet_shard_indices, iid_shard_indices, load_all_shards,
                        load_cifar10, load_dataset, load_shard, shard_indices, take_shard)


def mnist_like_labels(size: int = 60000) -> torch.Tensor:
    return torch.randint(0, 10, (size,), generator=torch.Generator().manual_seed(0))


def label_entropy(labels: torch.Tensor) -> float:
    """Entropy (nats) of a shard's label distribution; log(10) = 2.30 for balanced classes."""
    p = torch.bincount(labels, minlength=10).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def mean_entropy(labels: torch.Tensor, pieces: list[torch.Tensor]) -> float:
    return sum(label_entropy(labels[p]) for p in pieces) / len(pieces)


@pytest.mark.parametrize("alpha,n", [(0.5, 10), (0.1, 10), (0.05, 50), (100.0, 7)])
def test_dirichlet_shards_partition_the_dataset(alpha, n):
    labels = mnist_like_labels()
    pieces = dirichlet_shard_indices(labels, n, alpha, seed=3)
    assert len(pieces) == n and all(p.dtype == torch.int64 for p in pieces)
    everything = torch.cat(pieces)
    assert torch.equal(everything.sort().values, torch.arange(labels.shape[0]))  # disjoint and complete
    assert min(map(len, pieces)) >= DIRICHLET_MIN_SHARD  # at least a batch of b = 100


def test_dirichlet_shards_are_skewed_and_iid_shards_are_not():
    labels = mnist_like_labels()
    iid = mean_entropy(labels, iid_shard_indices(labels.shape[0], 10, 0))
    skewed = mean_entropy(labels, dirichlet_shard_indices(labels, 10, 0.1, 0))
    mild = mean_entropy(labels, dirichlet_shard_indices(labels, 10, 0.5, 0))
    near_iid = mean_entropy(labels, dirichlet_shard_indices(labels, 10, 1000.0, 0))
    assert iid > np.log(10) - 0.01
    assert skewed < mild < near_iid
    assert skewed < iid - 1.0 and mild < iid - 0.3
    assert near_iid > iid - 0.01


def test_dirichlet_split_is_seeded():
    labels = mnist_like_labels(5000)
    a, b, c = (dirichlet_shard_indices(labels, 5, 0.3, s) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_short_shards_are_rebalanced_to_the_minimum():
    # 20 shards at alpha 0.01: almost every draw leaves some shard nearly empty, so the last
    # draw is topped up from the largest shards.
    labels = mnist_like_labels(4000)
    pieces = dirichlet_shard_indices(labels, 20, 0.01, seed=0, min_size=150)
    assert min(map(len, pieces)) >= 150
    assert torch.equal(torch.cat(pieces).sort().values, torch.arange(4000))
    assert mean_entropy(labels, pieces) < mean_entropy(labels, iid_shard_indices(4000, 20, 0)) - 0.5  # still skewed


def test_small_datasets_get_at_least_the_iid_share():
    labels = mnist_like_labels(300)
    pieces = dirichlet_shard_indices(labels, 10, 0.1, seed=0)  # 300 // 10 = 30 < 100
    assert min(map(len, pieces)) >= 30
    with pytest.raises(ConfigError):
        dirichlet_shard_indices(labels, 10, 0.1, seed=0, min_size=31)
    with pytest.raises(ConfigError):
        dirichlet_shard_indices(labels[:5], 6, 0.1, seed=0)


def test_load_take_and_load_all_agree_on_dirichlet_shards():
    config = DataConfig("synthetic", num_shards=4, split_seed=2, split="dirichlet", dirichlet_alpha=0.2)
    shards = load_all_shards(config)
    images, labels = load_dataset(config)
    pieces = shard_indices(labels, config)
    for i, shard in enumerate(shards):
        assert torch.equal(shard.labels, labels[pieces[i]]) and shard.images.shape == (len(pieces[i]), 784)
        one = load_shard(config, i)
        assert torch.equal(one.images, shard.images) and torch.equal(one.labels, shard.labels)
        again = take_shard(images, labels, i, config, (784,))
        assert torch.equal(again.images, shard.images)
        ShardSampler(shard, batch_size=100, seed=0).next_batch()  # every shard holds a batch of 100
    # the iid path is unchanged
    iid = load_all_shards(DataConfig("synthetic", num_shards=4, split_seed=2))
    assert [len(s) for s in iid] == [500] * 4
    assert torch.equal(iid[1].labels, labels[iid_shard_indices(2000, 4, 2)[1]])


def test_a_sample_shape_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError, match="does not fit"):
        load_shard(DataConfig("synthetic", num_shards=2), 0, (3072,))


@pytest.mark.parametrize("kwargs,match", [({"split": "by-class"}, "unknown split"),
                                          ({"split": "dirichlet", "dirichlet_alpha": 0.0}, "dirichlet_alpha"),
                                          ({"dirichlet_alpha": float("nan")}, "dirichlet_alpha"),
                                          ({"dataset": "imagenet"}, "unknown dataset")])
def test_data_config_is_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DataConfig(**kwargs).validate()


def test_split_flags_and_environment(monkeypatch):
    from services.common.settings import EnvArgumentParser, add_data_arguments, data_config

    parser = EnvArgumentParser()
    add_data_arguments(parser)
    config = data_config(parser.parse_args(["--split", "dirichlet", "--dirichlet-alpha", "0.3",
                                            "--dataset", "cifar10"]), 5)
    assert (config.split, config.dirichlet_alpha, config.dataset, config.num_shards) == ("dirichlet", 0.3, "cifar10", 5)
    assert data_config(parser.parse_args([]), 2).split == "iid"
    monkeypatch.setenv("MDGAN_SPLIT", "dirichlet")
    monkeypatch.setenv("MDGAN_DIRICHLET_ALPHA", "2.5")
    parser = EnvArgumentParser()
    add_data_arguments(parser)
    config = data_config(parser.parse_args([]), 2)
    assert (config.split, config.dirichlet_alpha) == ("dirichlet", 2.5)


def test_help_shows_each_options_default_and_its_variable(monkeypatch):
    import argparse

    from services.common.settings import EnvArgumentParser

    monkeypatch.setenv("MDGAN_STEP_TIMEOUT", "7")
    parser = EnvArgumentParser(formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400, max_help_position=100))
    parser.add_argument("--step-timeout", type=float, default=60.0, help="deadline (s)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="every C iterations")
    parser.add_argument("--ratio", default="90%", help="a share")
    parser.add_argument("--out", default=None, help="run directory")
    parser.add_argument("--san", action="append", default=[], help="a name")
    parser.add_argument("--insecure", action="store_true", help="plaintext")
    parser.add_argument("--pin", default="auto", help="auto (default): pinned")
    lines = {line.split()[0]: " ".join(line.split()) for line in parser.format_help().splitlines()
             if line.strip().startswith("--")}
    # the built-in default (the variable's value is what parsing uses), then the variable
    assert lines["--step-timeout"].endswith("deadline (s) (default: 60.0) [env MDGAN_STEP_TIMEOUT]")
    assert lines["--checkpoint-every"].endswith("every C iterations (default: 0) [env MDGAN_CHECKPOINT_EVERY]")
    assert lines["--ratio"].endswith("a share (default: 90%) [env MDGAN_RATIO]")
    for option in ("--out", "--san", "--insecure", "--pin"):  # nothing to show, or said already
        assert "(default:" not in lines[option], lines[option]
    assert parser.parse_args([]).step_timeout == 7.0


def test_an_environment_value_outside_an_options_choices_is_a_usage_error(monkeypatch, capsys):
    # argparse checks the choices of a value given on the command line only: a variable (mdgan local's
    # own, MDGAN_LOCAL_*) is checked here, before `mdgan local` starts any process with it.
    from mdgan_app import cli

    monkeypatch.setenv("MDGAN_LOCAL_CPU_SCHEDULING", "bogus")
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["local"])
    assert exit_.value.code == 2
    assert "MDGAN_LOCAL_CPU_SCHEDULING='bogus': invalid choice (choose from 'batch', 'normal')" in capsys.readouterr().err
    # the command line comes first: a flag given overrides the variable, which is then not used
    assert cli.build_parser().parse_args(["local", "--cpu-scheduling", "batch"]).cpu_scheduling == "batch"
    monkeypatch.setenv("MDGAN_LOCAL_CPU_SCHEDULING", "normal")
    monkeypatch.setenv("MDGAN_LOCAL_PIN_WORKERS", "off")
    monkeypatch.setenv("MDGAN_LOCAL_KAPPA", "3")
    args = cli.build_parser().parse_args(["local"])
    assert (args.cpu_scheduling, args.pin_workers, args.kappa) == ("normal", "off", 3)


@pytest.mark.parametrize("argv, message", [
    (["local", "--join-timeout", "-1"], "argument --join-timeout: a number of seconds above 0, got '-1'"),
    (["local", "--step-timeout", "0"], "argument --step-timeout: a number of seconds above 0, got '0'"),
    (["local", "--heartbeat-interval", "nan"], "argument --heartbeat-interval: a finite number of seconds"),
    (["local", "--swap-timeout", "soon"], "argument --swap-timeout: a number of seconds, got 'soon'"),
    (["local", "--threads", "-2"], "argument --threads: must be >= 0, got -2"),
    (["simulate", "--threads", "two"], "argument --threads: a whole number, got 'two'"),
    (["local", "--checkpoint-every", "-1"], "argument --checkpoint-every: must be at least 0, not -1"),
])
def test_durations_and_thread_counts_out_of_range_are_usage_errors(argv, message, capsys):
    # A deadline of 0 s used to start a run that timed out at once or not at all; --threads -2 ran
    # with torch's default, oversubscribed: said at once instead.
    from mdgan_app import cli

    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("service, argv, message", [
    ("worker", ["--server", "localhost:notaport"], "argument --server: HOST:PORT with a port from 1 to 65535"),
    ("worker", ["--server", "[::1]:0"], "argument --server: HOST:PORT with a port from 1 to 65535"),
    ("worker", ["--listen", ":50052"], "argument --listen: HOST:PORT with a port from 0 to 65535"),
    ("server", ["--listen", "0.0.0.0:65536"], "argument --listen: HOST:PORT with a port from 0 to 65535"),
    ("worker", ["--metrics-port", "70000"], "argument --metrics-port: a port from 0 to 65535, got 70000"),
    ("server", ["--metrics-port", "-5"], "argument --metrics-port: a port from 0 to 65535, got -5"),
    ("server", ["--log-level", "loud"], "argument --log-level: one of debug, info, warning, error, critical"),
])
def test_the_services_addresses_ports_and_log_levels_are_checked_as_flags(service, argv, message, capsys):
    # They used to be taken as given: a malformed --server was retried for --connect-timeout, a port
    # above 65535 or an unknown log level ended in a traceback, a negative port meant "none".
    from services.server.__main__ import build_parser as server_parser
    from services.worker.__main__ import build_parser as worker_parser

    parser = server_parser() if service == "server" else worker_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_good_addresses_and_grpc_targets_pass_unchanged():
    from services.worker.__main__ import build_parser as worker_parser

    for server in ("mdgan-server:50051", "10.0.0.7:1", "[::1]:50051", "dns:///mdgan-server.ns.svc:50051",
                   "unix:/run/mdgan.sock"):
        assert worker_parser().parse_args(["--server", server]).server == server
    args = worker_parser().parse_args(["--listen", "[::]:0", "--metrics-port", "0", "--log-level", "debug"])
    assert (args.listen, args.metrics_port, args.log_level) == ("[::]:0", 0, "DEBUG")


def test_the_health_probe_refuses_an_address_it_could_never_reach(capsys):
    # It answered NOT SERVING (exit 1), as for a service that is down: a typo in a probe looked like an outage.
    from services.common import healthcheck

    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(["notanaddress", "--insecure"])
    assert exit_.value.code == 2 and "argument address: HOST:PORT" in capsys.readouterr().err


def test_the_services_durations_are_checked_from_the_environment_too(monkeypatch, capsys):
    from services.server.__main__ import build_parser as server_parser
    from services.worker.__main__ import build_parser as worker_parser

    monkeypatch.setenv("MDGAN_STOP_GRACE", "0")  # 0: do not wait, a valid choice
    assert server_parser().parse_args([]).stop_grace == 0
    monkeypatch.setenv("MDGAN_STOP_GRACE", "-5")
    with pytest.raises(SystemExit):
        server_parser().parse_args([])
    assert "MDGAN_STOP_GRACE='-5': a number of seconds, 0 or more, got '-5'" in capsys.readouterr().err
    monkeypatch.setenv("MDGAN_SERVER_TIMEOUT", "0")
    with pytest.raises(SystemExit):
        worker_parser().parse_args([])
    assert "MDGAN_SERVER_TIMEOUT='0': a number of seconds above 0, got '0'" in capsys.readouterr().err
    # the command line wins: a good flag overrides a bad variable, and a bad flag is named as the flag
    assert worker_parser().parse_args(["--server-timeout", "30"]).server_timeout == 30
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--server-timeout", "-1"])
    assert "argument --server-timeout: a number of seconds above 0, got '-1'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# CIFAR-10 from torchvision's layout, on fake files written the way the official ones are

PER_BATCH = 12


def write_fake_cifar10(root) -> tuple[np.ndarray, list[int]]:
    """cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}, pickled like the originals."""
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    all_data, all_labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8)
        data[0, 0], data[0, 1] = 0, 255  # the extremes map to -1 and 1
        labels = rng.integers(0, 10, size=PER_BATCH).tolist()
        entry = {"batch_label": f"fake {name}", "labels": labels, "data": data,
                 "filenames": [f"img_{i}.png" for i in range(PER_BATCH)]}
        with open(os.path.join(folder, name), "wb") as fh:
            pickle.dump(entry, fh, protocol=2)
        if name != "test_batch":
            all_data.append(data)
            all_labels += labels
    meta = {"num_cases_per_batch": PER_BATCH, "num_vis": 3072,
            "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]}
    with open(os.path.join(folder, "batches.meta"), "wb") as fh:
        pickle.dump(meta, fh, protocol=2)
    return np.concatenate(all_data), all_labels


def test_cifar10_loads_flat_channel_first_in_range(tmp_path):
    raw, raw_labels = write_fake_cifar10(tmp_path)
    images, labels = load_cifar10(str(tmp_path))
    assert images.shape == (5 * PER_BATCH, 3072) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == raw_labels
    assert float(images.min()) == -1.0 and float(images.max()) == 1.0
    assert torch.equal(images, torch.from_numpy(raw).float() / 127.5 - 1)
    test_images, test_labels = load_cifar10(str(tmp_path), train=False)
    assert test_images.shape == (PER_BATCH, 3072) and test_labels.shape == (PER_BATCH,)


def test_cifar10_order_matches_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    write_fake_cifar10(tmp_path)
    # torchvision checks the md5 of every file against the official archive: only the real files
    # pass, so it is switched off here to compare the two readers on the fake ones.
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)
    reference = tv_cifar.CIFAR10(str(tmp_path), train=True, download=False)
    images, labels = load_cifar10(str(tmp_path))
    hwc = torch.from_numpy(reference.data)  # (n, 32, 32, 3), torchvision's HWC
    assert torch.equal(((images + 1) * 127.5).round().to(torch.uint8).view(-1, 3, 32, 32), hwc.permute(0, 3, 1, 2))
    assert labels.tolist() == list(reference.targets)
    from mdgan.models import image_shape

    assert image_shape(images.shape[1]) == (3, 32, 32)


def test_cifar10_md5_check_refuses_unofficial_files(tmp_path):
    write_fake_cifar10(tmp_path)
    with pytest.raises(ConfigError, match="md5"):
        load_cifar10(str(tmp_path), verify_md5=True)


def test_cifar10_missing_or_malformed_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="CIFAR-10 not found"):
        load_cifar10(str(tmp_path))
    write_fake_cifar10(tmp_path)
    with open(os.path.join(tmp_path, "cifar-10-batches-py", "data_batch_3"), "wb") as fh:
        pickle.dump({"data": np.zeros((2, 784), dtype=np.uint8), "labels": [0, 1]}, fh)
    with pytest.raises(ConfigError, match="not a CIFAR-10 batch"):
        load_cifar10(str(tmp_path))


def test_cifar10_shards(tmp_path):
    write_fake_cifar10(tmp_path)
    config = DataConfig("cifar10", str(tmp_path), num_shards=3)
    shards = load_all_shards(config, (3072,))
    assert [s.images.shape for s in shards] == [(20, 3072)] * 3
    assert torch.equal(load_shard(config, 2).images, shards[2].images)  # default: the data's own flat shape
    dirichlet = load_all_shards(DataConfig("cifar10", str(tmp_path), num_shards=3, split="dirichlet"))
    assert sum(len(s) for s in dirichlet) == 60 and min(len(s) for s in dirichlet) >= 20


def test_cifar10_flags_reach_the_loader(tmp_path):
    from services.common.settings import add_data_arguments, data_config

    write_fake_cifar10(tmp_path)
    parser = argparse.ArgumentParser()
    add_data_arguments(parser)
    config = data_config(parser.parse_args(["--dataset", "cifar10", "--data-root", str(tmp_path)]), 2)
    assert load_dataset(config)[0].shape == (60, 3072)
