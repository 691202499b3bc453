"""Every site brings its own data: image folders, per-site files, `mdgan split`, the checks at load
and at join, and a gRPC run where each worker process reads only its own folder."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO
from procs import Proc, mdgan, python_module, read_json, start_server
from mdgan.config import ConfigError, DataConfig, ModelSpec, TrainingConfig
from mdgan.data import load_mnist
from mdgan.run import EvaluationOptions
from mdgan.simulation import SiteFolders, simulate
from mdgan.sites import RunClasses, load_site, map_labels
from mdgan.images import find_images, load_imagefolder
from services.common import rpc
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc
from services.server.coordinator import Coordinator

NO_EVAL = EvaluationOptions(every=-1)


def write_pngs(root, images: torch.Tensor, labels: torch.Tensor, indices) -> None:
    """MNIST images (x in [-1, 1]) back to the PNG files a site would hold, ROOT/<label>/<index>.png."""
    for i in indices:
        pixels = ((images[i] + 1) * 127.5).round().to(torch.uint8).reshape(28, 28).numpy()
        folder = os.path.join(root, str(int(labels[i])))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.png"))


def write_idx(root, images: torch.Tensor, labels: torch.Tensor, indices) -> None:
    """The same images as a site's own MNIST files (IDX, torchvision's layout ROOT/MNIST/raw)."""
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    pixels = ((images[indices] + 1) * 127.5).round().to(torch.uint8).reshape(-1, 28, 28).numpy()
    targets = labels[indices].to(torch.uint8).numpy()
    for prefix in ("train", "t10k"):  # torchvision wants both sets present
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as fh:
            fh.write(struct.pack(">IIII", 2051, len(pixels), 28, 28) + pixels.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as fh:
            fh.write(struct.pack(">II", 2049, len(targets)) + targets.tobytes())


# ---------------------------------------------------------------------------------------------
# an ImageFolder of real PNG files is the same data as the IDX files

def test_an_image_folder_of_mnist_pngs_loads_and_trains_like_the_idx_files(tmp_path, mnist_root):
    images, labels = load_mnist(mnist_root)
    sites = {"png": tmp_path / "png", "idx": tmp_path / "idx"}
    for site, picked in enumerate((range(0, 150), range(150, 270))):  # two sites of different sizes
        write_pngs(sites["png"] / f"site-{site}", images, labels, picked)
        write_idx(sites["idx"] / f"site-{site}", images, labels, list(picked))

    folder = load_site("imagefolder", str(sites["png"] / "site-0"))
    assert folder.class_names == tuple(str(c) for c in range(10)) and folder.image_shape == (1, 28, 28)
    _, found = find_images(str(sites["png"] / "site-0"))
    order = [int(os.path.basename(path)[:-4]) for path, _ in found]
    assert sorted(order) == list(range(150))
    assert torch.equal(folder.conform((784,)), images[order])  # bit for bit what the IDX reader gives
    assert torch.equal(map_labels(folder, folder.class_names), labels[order])
    idx_site = load_site("mnist", str(sites["idx"] / "site-0"))
    assert torch.equal(idx_site.conform((784,)), images[:150])

    config = TrainingConfig(workers=2, iterations=6, batch_size=10, swap_every=3, seed=2).validate()
    runs = {}
    for kind, root in sites.items():
        data = DataConfig("imagefolder" if kind == "png" else "mnist", str(root), 2)
        runs[kind] = simulate(config, data, str(tmp_path / f"run-{kind}"), progress=False, evaluation=NO_EVAL,
                              sites=SiteFolders(site_dirs=str(root)))
    # The same images in another order: the same run, trained on the same sites, but not the same bits.
    for summary in runs.values():
        assert summary["iterations"] == 6 and summary["swaps"] == 2
        assert summary["worker_sizes"] == {"worker-0": 150, "worker-1": 120}
        assert summary["final"]["gen_loss"] is not None


def test_images_are_shaped_for_the_model_grey_rgb_and_size(tmp_path):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        os.makedirs(tmp_path / "rgb" / c)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "rgb" / c / f"{i}.png")
    Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8)).save(tmp_path / "rgb" / "a" / "small-grey.png")
    site = load_imagefolder(str(tmp_path / "rgb"))
    assert len(site) == 7 and site.image_shape == (3, 64, 64)  # the grey one is promoted, and resized
    grey = site.conform((784,))  # a 28x28 grey model
    rgb = site.conform((3072,))  # a 32x32 RGB model
    assert grey.shape == (7, 784) and rgb.shape == (7, 3072)
    for x in (grey, rgb):
        assert x.dtype == torch.float32 and -1 <= float(x.min()) and float(x.max()) <= 1
    with pytest.raises(ConfigError, match="another aspect ratio"):
        site.conform((2, 10, 20))


# ---------------------------------------------------------------------------------------------
# bad data: clear errors at load, a refusal at join

def test_bad_site_folders_are_named_at_load(tmp_path):
    os.makedirs(tmp_path / "empty" / "cats")
    with pytest.raises(ConfigError, match=r"no images under .*empty.*class folders cats"):
        load_imagefolder(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_imagefolder(str(tmp_path / "nowhere"))

    good = np.zeros((28, 28), dtype=np.uint8)
    os.makedirs(tmp_path / "site" / "0")
    os.makedirs(tmp_path / "site" / "1")
    for i in range(3):
        Image.fromarray(good).save(tmp_path / "site" / "0" / f"{i}.png")
    (tmp_path / "site" / "1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.fromarray(np.zeros((28, 40), dtype=np.uint8)).save(tmp_path / "site" / "1" / "wide.png")
    (tmp_path / "site" / "1" / "notes.txt").write_text("not an image: ignored")
    with pytest.raises(ConfigError) as refused:
        load_imagefolder(str(tmp_path / "site"))
    message = str(refused.value)
    assert "2 unusable image(s)" in message and "1/broken.png: unreadable" in message
    assert "1/wide.png: 28x40, not the 28x28 aspect ratio" in message and "bad_images skip" in message

    skipped = load_imagefolder(str(tmp_path / "site"), bad_images="skip")
    assert len(skipped) == 3 and skipped.class_names == ("0", "1")  # class 1 is kept, empty at this site
    assert sorted(os.path.basename(p) for p, _ in skipped.skipped) == ["broken.png", "wide.png"]
    # pixels are read again for the model once the run is known: a file broken since then is named
    (tmp_path / "site" / "0" / "1.png").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match=r"0/1.png was read at load but cannot be now.*folder change"):
        skipped.conform((784,))
    with pytest.raises(ConfigError, match="no usable images"):
        os.makedirs(tmp_path / "only-bad" / "x")
        (tmp_path / "only-bad" / "x" / "a.png").write_bytes(b"junk")
        load_imagefolder(str(tmp_path / "only-bad"), bad_images="skip")


def test_the_classes_of_a_site_are_checked_like_the_server_does(tmp_path):
    named = tuple(str(c) for c in range(10))
    run = RunClasses(None, 10, conditional=True)
    assert run.check(named, 10) is None and run.names == named  # the first site sets the run's classes
    assert "differ from the run's" in run.check(named[:9] + ("x",), 10)
    assert "numbers" not in (run.check(None, 10) or "")  # numeric labels 0..9 still fit
    assert "3 classes" in RunClasses(None, 10, True).check(("a", "b", "c"), 3)
    assert "unlabelled" in RunClasses(None, 10, True).check((), 0)
    assert RunClasses(None, 10, conditional=False).check((), 0) is None  # a plain GAN takes anything
    declared = RunClasses(("cat", "dog", "fox"), 3, True)
    assert declared.check(("dog",), 1) is None  # a subset of the declared classes
    assert "owl" in declared.check(("dog", "owl"), 2)


def _join(**fields) -> pb.WorkerMessage:
    join = pb.Join(own_data=True, shard_size=100, peer_address="127.0.0.1:1")
    for name, value in fields.items():
        if isinstance(value, (list, tuple)):
            getattr(join, name).extend(value)
        else:
            setattr(join, name, value)
    return pb.WorkerMessage(join=join)


def test_the_server_checks_what_a_site_brings_at_join():
    async def attempt(coordinator: Coordinator, first: pb.WorkerMessage):
        server = grpc.aio.server(options=rpc.options())
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                await call.write(first)
                try:
                    reply = await call.read()
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
                call.cancel()
                return grpc.StatusCode.OK, reply.welcome
        finally:
            await server.stop(None)

    def status(first, classes=None, **config):
        coordinator = Coordinator(TrainingConfig(workers=2, batch_size=10, **config).validate(), class_names=classes)
        return asyncio.run(attempt(coordinator, first))

    digits = [str(c) for c in range(10)]
    code, welcome = status(_join(image_shape=[3, 56, 56], num_classes=10, class_names=digits, shard_size=123))
    assert code == grpc.StatusCode.OK and welcome.shard_index == 0 and list(welcome.spec.class_names) == digits
    code, detail = status(_join(image_shape=[1, 28, 40], num_classes=10, class_names=digits))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot be resized" in detail
    for shape in ([1, 0, 0], [2, 28, 28], [28, 28]):
        code, detail = status(_join(image_shape=shape, num_classes=10, class_names=digits))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot be resized" in detail, shape
    for names, why in ((["a", "a"] + digits[2:], "repeat"), ([""] + digits[1:], "characters"),
                       (["x" * 300] + digits[1:], "characters"), ([str(i) for i in range(20_000)], "at most")):
        code, detail = status(_join(image_shape=[1, 28, 28], num_classes=len(names), class_names=names))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in detail, detail[:200]
    code, detail = status(_join(image_shape=[1, 28, 28], num_classes=3, class_names=["a", "b", "c"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the site has 3 classes" in detail and "--classes" in detail
    code, detail = status(_join(image_shape=[1, 28, 28], num_classes=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unlabelled" in detail
    code, _ = status(_join(image_shape=[1, 28, 28], num_classes=0), model=ModelSpec(gan="gan"))
    assert code == grpc.StatusCode.OK  # a plain GAN trains on unlabelled images
    code, detail = status(_join(sample_shape=[784], num_classes=10, shard_size=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "< batch size" in detail
    code, welcome = status(_join(sample_shape=[784], num_classes=10, shard_index=1, shard_size=77))
    assert code == grpc.StatusCode.OK and welcome.shard_index == 1
    # a run that names its classes takes a site holding some of them, and refuses other names
    code, welcome = status(_join(image_shape=[1, 28, 28], num_classes=2, class_names=["dog", "cat"]),
                           classes=("cat", "dog", "fox"))
    assert code == grpc.StatusCode.OK and list(welcome.spec.class_names) == ["cat", "dog", "fox"]
    code, detail = status(_join(image_shape=[1, 28, 28], num_classes=1, class_names=["owl"]),
                          classes=("cat", "dog", "fox"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "owl" in detail


def site_worker(tmp_path, port: int, name: str, root) -> "Proc":
    """A worker whose data is a site folder (no --num-shards: its own data)."""
    return python_module(name, ["services.worker", "--server", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                                "--advertise-address", "127.0.0.1", "--shard-index", "assign", "--threads", "1",
                                "--metrics-port", "0", "--connect-timeout", "30", "--dataset", "imagefolder",
                                "--data-root", str(root), "--insecure"], str(tmp_path))


@pytest.mark.slow
def test_a_worker_whose_classes_do_not_fit_the_run_is_refused_and_says_why(tmp_path):
    for name in ("cat", "dog", "fox"):
        os.makedirs(tmp_path / "site" / name)
        for i in range(4):
            Image.fromarray(np.full((28, 28), 40 * i, dtype=np.uint8)).save(tmp_path / "site" / name / f"{i}.png")
    os.makedirs(tmp_path / "empty")
    server, port = start_server(str(tmp_path / "run"), "--workers", "1", "--iterations", "2", "--batch-size", "2",
                                "--dataset", "imagefolder", "--join-timeout", "60")
    workers = []
    try:
        # an empty folder: the worker stops before it dials anyone
        empty = site_worker(tmp_path, port, "empty", tmp_path / "empty")
        workers.append(empty)
        # 3 classes against the run's 10 (an ACGAN, no --classes): refused at join
        wrong = site_worker(tmp_path, port, "wrong", tmp_path / "site")
        workers.append(wrong)
        assert empty.wait(60) == 2
        assert "no images under" in empty.log() and "empty" in empty.log()
        assert wrong.wait(60) == 3  # refused by the server (2: its own data or flags are wrong)
        log = wrong.log()
        assert "INVALID_ARGUMENT" in log and "the site has 3 classes (cat, dog, fox), the run has 10" in log
        assert server.popen.poll() is None  # the server waits on for workers that fit
    finally:
        for proc in [*workers, server]:
            proc.stop()
    assert "join refused" in server.log()


# ---------------------------------------------------------------------------------------------
# three sites made by `mdgan split`, trained over gRPC: each worker reads only its own folder

@pytest.mark.slow
def test_three_sites_over_grpc_each_worker_reads_only_its_own_folder(tmp_path, mnist_root):
    sites = tmp_path / "sites"
    made = json.loads(mdgan("split", "mnist", "--workers", "3", "--split", "dirichlet", "--alpha", "0.3",
                            "--samples", "600", "--split-seed", "1", "--data-root", mnist_root,
                            "--out", str(sites)).stdout)
    sizes = [s["size"] for s in made]
    assert sum(sizes) == 600 and len(set(sizes)) == 3  # different sizes ...
    mixes = [tuple(s["classes"].values()) for s in made]
    assert len(set(mixes)) == 3  # ... and label mixes
    assert all(sorted(os.listdir(sites / f"site-{i}")) == [str(c) for c in range(10)] for i in range(3))

    audit = tmp_path / "audit"
    audit.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "site_audit"),
                                                       os.environ.get("PYTHONPATH", REPO)]),
               MDGAN_AUDIT_ROOT=str(sites), MDGAN_AUDIT_DIR=str(audit))
    flags = ["--dataset", "imagefolder", "--site-dirs", str(sites), "--iterations", "10", "--batch-size", "10",
             "--kappa", "2", "--swap-every", "4", "--seed", "5", "--eval-every", "-1", "--no-progress"]
    # One process per worker, as sites run: what a process opens is then what its worker opens.
    mdgan("local", *flags, "--workers-per-process", "1", "--out", str(tmp_path / "local"), env=env)
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")
    assert local["iterations"] == 10 and local["workers_alive"] == 3 and local["swaps"] == 2
    assert local["worker_sizes"] == simulated["worker_sizes"] == {f"worker-{i}": sizes[i] for i in range(3)}
    assert local["swap_period"] == 4
    assert local["generator_sha256"] == simulated["generator_sha256"]

    # What every process opened under the sites' folder (logged by tests/site_audit/sitecustomize.py).
    # `mdgan local` forks its services from one fork server: a worker is the process that opened its
    # own RUN/logs/worker-i.log (worker i is given SITE_DIRS/site-i).
    real_sites = os.path.realpath(sites)
    worker_reads, others = {}, []
    for name in os.listdir(audit):
        with open(audit / name) as fh:
            argv, *paths = fh.read().splitlines()
        images = [p for p in paths if p.startswith(real_sites + os.sep)]
        logs = [os.path.basename(p)[:-4] for p in paths if p.endswith(".log") and "/logs/worker-" in p]
        if images and logs:
            assert logs[0] not in worker_reads, logs
            worker_reads[f"site-{logs[0].split('-')[1]}"] = images
        else:  # the launcher, its fork server, the server: they read no site's data
            assert not images, (argv, images[:5])
            others.append(argv)
    assert sorted(worker_reads) == ["site-0", "site-1", "site-2"] and others
    for site, paths in worker_reads.items():
        own = os.path.join(real_sites, site)
        images = {os.path.join(folder, f) for folder, _, files in os.walk(own) for f in files}
        assert len(images) == sizes[int(site[-1])]
        # every image of its own, read at load (checked) and again for the model's samples
        assert Counter(p for p in paths if p.endswith(".png")) == Counter({p: 2 for p in images})
        strangers = [p for p in paths if p != own and not p.startswith(own + os.sep)]
        assert not strangers, f"{site}'s worker opened other sites' files: {strangers[:5]}"


def test_unlabelled_sites_train_a_plain_gan_and_the_swap_period_follows_the_smallest_site(tmp_path):
    rng = np.random.default_rng(1)
    for site, count in enumerate((20, 30)):  # images directly in the folder: no classes
        os.makedirs(tmp_path / "sites" / f"site-{site}")
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(
                tmp_path / "sites" / f"site-{site}" / f"{i}.png")
    site = load_imagefolder(str(tmp_path / "sites" / "site-0"))
    assert site.class_names == () and not site.labelled and int(site.labels.abs().sum()) == 0
    data = DataConfig("imagefolder", str(tmp_path), 2)
    plain = TrainingConfig(workers=2, iterations=4, batch_size=10, swap_epochs=1.0, model=ModelSpec(gan="gan"))
    summary = simulate(plain.validate(), data, str(tmp_path / "gan"), progress=False, evaluation=NO_EVAL,
                       sites=SiteFolders(site_dirs=str(tmp_path / "sites")))
    # S = ceil(E * min(m) / b) = ceil(1 * 20 / 10) = 2 (the mean, 25, would give 3)
    assert summary["worker_sizes"] == {"worker-0": 20, "worker-1": 30} and summary["swap_period"] == 2
    assert summary["swaps"] == 2
    acgan = TrainingConfig(workers=2, iterations=4, batch_size=10).validate()
    with pytest.raises(ConfigError, match=r"site-0.*unlabelled.*--gan gan"):
        simulate(acgan, data, str(tmp_path / "acgan"), progress=False, evaluation=NO_EVAL,
                 sites=SiteFolders(site_dirs=str(tmp_path / "sites")))


def test_site_flags_are_checked_before_anything_starts(tmp_path, capsys):
    from mdgan_app.cli import main

    for site in range(2):
        os.makedirs(tmp_path / "sites" / f"site-{site}" / "0")
    for argv, why in ((["local", "--site-dirs", str(tmp_path / "sites"), "--workers", "3"], "holds 2 sites"),
                      (["simulate", "--site-dirs", str(tmp_path / "nowhere")], "is not a folder"),
                      (["simulate", "--site-dirs", str(tmp_path)], "no site-0 folder"),
                      (["simulate", "--site-dirs", str(tmp_path / "sites"), "--classes", "a,a"], "repeat"),
                      (["split", "synthetic", "--workers", "2", "--out", str(tmp_path / "sites")], "exists")):
        assert main(argv) == 2
        assert why in capsys.readouterr().err, argv
