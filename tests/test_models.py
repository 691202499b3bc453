import json
import subprocess
import sys

import pytest
import torch

from mdgan.config import ConfigError, ModelSpec
from mdgan.models import build_discriminator, build_generator, count_parameters, parameter_report


def test_paper_mlp_parameter_counts():
    report = parameter_report(ModelSpec())
    assert report["generator"]["stack"] == 716_560
    assert report["discriminator"]["stack"] == 670_219
    assert report["generator"]["class_embedding"] == 10 * 100  # counted apart


@pytest.mark.parametrize("width", [1, 64, 128])
def test_disc_width_sets_the_mlp_discriminators_hidden_layers(width):
    d = build_discriminator(ModelSpec(disc_width=width), seed=0)
    assert [layer.out_features for layer in d.stack if isinstance(layer, torch.nn.Linear)] == [width, width, 11]
    assert count_parameters(d) == 784 * width + width * width + 13 * width + 11  # docs/ARCHITECTURES.md
    assert d(torch.zeros(3, 784)).shape == (3, 11)
    assert count_parameters(build_generator(ModelSpec(disc_width=width), seed=0)) == 716_560 + 1_000  # G unchanged


@pytest.mark.parametrize("spec", [ModelSpec(disc_width=0), ModelSpec(disc_width=8193),
                                  ModelSpec(architecture="cnn-mnist", disc_width=128)])
def test_a_disc_width_that_cannot_be_built_is_refused_in_one_line(spec):
    with pytest.raises(ConfigError, match="disc_width"):
        spec.validate()


def test_plain_gan_has_one_output_and_no_embedding():
    spec = ModelSpec(gan="gan")
    gen, disc = build_generator(spec, 0), build_discriminator(spec, 0)
    assert gen.class_embedding is None
    assert disc(torch.zeros(3, 784)).shape == (3, 1)
    assert count_parameters(disc) == 670_219 - 10 * 513  # the class logits are gone


def test_shapes_and_range():
    spec = ModelSpec()
    gen, disc = build_generator(spec, 0), build_discriminator(spec, 0)
    with torch.no_grad():
        x = gen(torch.randn(5, 100), torch.arange(5))
    assert x.shape == (5, 784)
    assert float(x.abs().max()) <= 1.0
    assert disc(x).shape == (5, 11)


def test_initialisation_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_generator(ModelSpec(), 7)
    assert torch.equal(before, torch.get_rng_state())
    b = build_generator(ModelSpec(), 7)
    c = build_generator(ModelSpec(), 8)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown architecture"):
        build_generator(ModelSpec(architecture="resnet"), 0)


def test_models_command_prints_counts_as_json():
    out = subprocess.run([sys.executable, "-m", "mdgan_app.cli", "models"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["mlp"]["acgan"]["generator"]["stack"] == 716_560
    assert report["mlp"]["acgan"]["discriminator"]["stack"] == 670_219
    assert "gan" in report["mlp"]
