"""The paper's CNNs (section V.A): parameter counts, shapes, the feedback gradient, and a training step."""

import argparse
import json

import pytest
import torch

from mdgan.config import ConfigError, DataConfig, ModelSpec, TrainingConfig
from mdgan.data import Shard, make_synthetic
from mdgan.gan import DiscriminatorSide, GeneratorSide, generator_loss
from mdgan.models import (ARCHITECTURE_SAMPLE_SHAPES, ARCHITECTURES, MinibatchDiscrimination, build_discriminator,
                          build_generator, count_parameters, image_shape, parameter_report)

CNNS = {"cnn-mnist": 784, "cnn-cifar10": 3072}

# Our counts of the described layers (docs/ARCHITECTURES.md); the paper's are in comments.
EXPECTED = {
    # paper: G 628,058, D 286,048
    "cnn-mnist": {"generator": 736_705, "discriminator": 1_785_538, "discriminator_gan": 1_703_558},
    # paper: G 628,110, D 100,203
    "cnn-cifar10": {"generator": 2_932_035, "discriminator": 1_785_826, "discriminator_gan": 1_703_846},
}


def spec_for(arch: str, gan: str = "acgan") -> ModelSpec:
    return ModelSpec(architecture=arch, gan=gan, sample_shape=(CNNS[arch],))


def test_mlp_counts_are_still_the_papers():
    report = parameter_report(ModelSpec())
    assert report["generator"]["stack"] == 716_560
    assert report["discriminator"]["stack"] == 670_219


@pytest.mark.parametrize("arch", CNNS)
def test_cnn_parameter_counts(arch):
    acgan, gan = parameter_report(spec_for(arch)), parameter_report(spec_for(arch, "gan"))
    assert acgan["generator"]["stack"] == EXPECTED[arch]["generator"]
    assert acgan["generator"]["class_embedding"] == 10 * 100  # counted apart, as for the MLP
    assert acgan["discriminator"]["stack"] == EXPECTED[arch]["discriminator"]
    assert gan["generator"]["stack"] == EXPECTED[arch]["generator"] and gan["generator"]["class_embedding"] == 0
    assert gan["discriminator"]["stack"] == EXPECTED[arch]["discriminator_gan"]
    # ACGAN's 10 class logits on the 8192 + 5 features are the only difference between the two Ds
    assert acgan["discriminator"]["stack"] - gan["discriminator"]["stack"] == 10 * (8192 + 5 + 1)


def test_counts_layer_by_layer():
    disc = build_discriminator(spec_for("cnn-mnist"), 0)
    convs = [m for m in disc.features if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 32, 64, 128, 256, 512]
    assert [c.kernel_size for c in convs] == [(3, 3)] * 6
    assert count_parameters(disc.minibatch) == 8192 * 5 * 3
    assert count_parameters(disc.head) == (8192 + 5) * 11 + 11
    gen = build_generator(spec_for("cnn-cifar10"), 0)
    assert gen.project[0].out_features == 6144
    deconvs = [m for m in gen.deconv if isinstance(m, torch.nn.ConvTranspose2d)]
    assert [d.out_channels for d in deconvs] == [192, 96, 3] and all(d.kernel_size == (5, 5) for d in deconvs)
    gen = build_generator(spec_for("cnn-mnist"), 0)
    assert gen.project[0].out_features == 6272
    assert [d.out_channels for d in gen.deconv if isinstance(d, torch.nn.ConvTranspose2d)] == [32, 1]


def test_models_command_lists_the_cnns(capsys):
    from mdgan_app.cli import main

    assert main(["models"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == set(ARCHITECTURES) >= {"mlp", "cnn-mnist", "cnn-cifar10"}
    for arch in CNNS:
        assert report[arch]["acgan"]["generator"]["stack"] == EXPECTED[arch]["generator"]
        assert report[arch]["gan"]["discriminator"]["stack"] == EXPECTED[arch]["discriminator_gan"]
    assert report["mlp"]["acgan"]["discriminator"]["stack"] == 670_219


def test_image_shape():
    assert image_shape(784) == (1, 28, 28)
    assert image_shape(3072) == (3, 32, 32)
    assert ARCHITECTURE_SAMPLE_SHAPES["cnn-mnist"] == (784,) and ARCHITECTURE_SAMPLE_SHAPES["cnn-cifar10"] == (3072,)
    with pytest.raises(ValueError):
        image_shape(100 * 3 + 1)


@pytest.mark.parametrize("arch", CNNS)
@pytest.mark.parametrize("gan", ["acgan", "gan"])
def test_forward_shapes_and_range(arch, gan):
    spec, d = spec_for(arch, gan), CNNS[arch]
    gen, disc = build_generator(spec, 0), build_discriminator(spec, 0)
    labels = torch.arange(5) if gan == "acgan" else None
    with torch.no_grad():
        x = gen(torch.randn(5, 100), labels)
    assert x.shape == (5, d) and x.dtype == torch.float32  # flat, like the MLP
    assert float(x.abs().max()) <= 1.0
    assert disc(x).shape == (5, 11 if gan == "acgan" else 1)
    assert disc(x.view(5, *image_shape(d))).shape == disc(x).shape  # image-shaped input works too
    if gan == "acgan":
        assert gen.class_embedding is not None
        with pytest.raises(ValueError, match="needs labels"):
            gen(torch.randn(2, 100))
    else:
        assert gen.class_embedding is None


@pytest.mark.parametrize("arch", CNNS)
def test_feedback_gradient_flows_to_the_input(arch):
    spec = spec_for(arch)
    gen, disc = build_generator(spec, 1), build_discriminator(spec, 2)
    labels = torch.arange(4)
    x = gen(torch.randn(4, 100), labels).detach().requires_grad_(True)  # X_g
    (feedback,) = torch.autograd.grad(generator_loss(spec, disc(x), labels), x)  # F_n = dJ_gen/dX_g
    assert feedback.shape == (4, CNNS[arch])
    assert torch.isfinite(feedback).all() and float(feedback.abs().sum()) > 0
    # ... and backpropagating it through G reaches every generator parameter
    z = torch.randn(4, 100)
    gen(z, labels).backward(feedback)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gen.parameters())


@pytest.mark.parametrize("arch", CNNS)
def test_build_is_seeded_and_leaves_the_global_rng_alone(arch):
    spec = spec_for(arch)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a, b, c = build_discriminator(spec, 7), build_discriminator(spec, 7), build_discriminator(spec, 8)
    assert torch.equal(before, torch.get_rng_state())
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))
    g1, g2 = build_generator(spec, 3), build_generator(spec, 3)
    assert all(torch.equal(p, q) for p, q in zip(g1.parameters(), g2.parameters()))


def test_wrong_sample_shape_is_refused():
    with pytest.raises(ConfigError, match="3x32x32"):
        build_generator(ModelSpec(architecture="cnn-cifar10", sample_shape=(784,)), 0)
    with pytest.raises(ConfigError, match="1x28x28"):
        build_discriminator(ModelSpec(architecture="cnn-mnist", sample_shape=(3072,)), 0)


def test_minibatch_discrimination_looks_at_the_rest_of_the_batch():
    layer = MinibatchDiscrimination(6, num_kernels=4, kernel_dim=2)
    f = torch.randn(3, 6)
    out = layer(f)
    assert out.shape == (3, 6 + 4) and torch.equal(out[:, :6], f)
    assert torch.equal(layer(f[:1])[:, 6:], torch.zeros(1, 4))  # a batch of one: no other sample
    moved = f.clone()
    moved[2] += 1.0
    assert not torch.allclose(layer(moved)[0, 6:], out[0, 6:])  # sample 0's features depend on sample 2
    # identical samples are maximally close: exp(0) = 1 per other sample
    assert torch.allclose(layer(f[:1].repeat(3, 1))[:, 6:], torch.full((3, 4), 2.0))


# ---------------------------------------------------------------------------------------------
# with the rest of the system

def _parser(with_data: bool = True) -> argparse.ArgumentParser:
    from services.common.settings import add_data_arguments, add_training_arguments

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    if with_data:
        add_data_arguments(parser)
    return parser


def test_training_config_takes_the_sample_shape_from_dataset_and_architecture():
    from services.common.settings import training_config

    def shape(argv, with_data=True):
        return training_config(_parser(with_data).parse_args(argv)).model.sample_shape

    assert shape(["--architecture", "cnn-mnist", "--dataset", "mnist"]) == (784,)
    assert shape(["--architecture", "cnn-cifar10", "--dataset", "cifar10"]) == (3072,)
    assert shape(["--architecture", "mlp", "--dataset", "cifar10"]) == (3072,)
    assert shape(["--architecture", "mlp", "--dataset", "synthetic"]) == (784,)
    assert shape(["--architecture", "cnn-cifar10"], with_data=False) == (3072,)  # the server: no --dataset
    assert shape(["--architecture", "mlp"], with_data=False) == (784,)
    for argv in (["--architecture", "cnn-cifar10", "--dataset", "mnist"],
                 ["--architecture", "cnn-cifar10", "--dataset", "synthetic"],
                 ["--architecture", "cnn-mnist", "--dataset", "cifar10"]):
        with pytest.raises(ConfigError, match="works on samples of shape"):
            training_config(_parser().parse_args(argv))


def test_cnn_mnist_trains_end_to_end_in_process(tmp_path):
    from mdgan.simulation import simulate

    config = TrainingConfig(workers=2, iterations=2, batch_size=4, swap_every=1,
                            model=ModelSpec(architecture="cnn-mnist", sample_shape=(784,)))
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False)
    assert summary["iterations"] == 2 and summary["swaps"] >= 1
    assert summary["final"]["gen_loss"] is not None and summary["final"]["disc_loss"] is not None
    assert summary["payload_bytes"]  # batches and feedback travelled


def test_cnn_cifar10_training_step():
    config = TrainingConfig(workers=2, iterations=1, batch_size=4,
                            model=ModelSpec(architecture="cnn-cifar10", sample_shape=(3072,))).validate()
    images, labels = make_synthetic(size=16, dim=3072)
    sides = [DiscriminatorSide(config, Shard(images[i::2], labels[i::2], i, 2)) for i in range(2)]
    server = GeneratorSide(config)
    before = [p.detach().clone() for p in server.generator.parameters()]
    for _ in range(2):
        batches = server.generate(kappa=1)
        assert batches.samples.shape == (1, 4, 3072)
        results = [side.step(batches.for_worker(rank)) for rank, side in enumerate(sides)]
        for r in results:
            assert r.feedback.shape == (4, 3072) and torch.isfinite(r.feedback).all()
        server.update(batches, [(batches.for_worker(rank).generated_index, r.feedback) for rank, r in enumerate(results)])
    assert any(not torch.equal(p, q) for p, q in zip(before, server.generator.parameters()))
    # the swap moves the whole state, minibatch-discrimination tensor included
    sides[1].import_state(sides[0].export_state())
    for p, q in zip(sides[0].discriminator.parameters(), sides[1].discriminator.parameters()):
        assert torch.equal(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("arch", CNNS)
def test_cnns_run_on_cuda(arch):
    spec = spec_for(arch)
    gen, disc = build_generator(spec, 0).cuda(), build_discriminator(spec, 0).cuda()
    labels = torch.arange(4, device="cuda")
    x = gen(torch.randn(4, 100, device="cuda"), labels).detach().requires_grad_(True)
    (feedback,) = torch.autograd.grad(generator_loss(spec, disc(x), labels), x)
    assert feedback.device.type == "cuda" and torch.isfinite(feedback).all()
    cpu_disc = build_discriminator(spec, 0)
    torch.testing.assert_close(disc(x).cpu(), cpu_disc(x.detach().cpu()), rtol=1e-3, atol=1e-3)
