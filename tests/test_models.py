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
