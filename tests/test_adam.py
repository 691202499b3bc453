"""mdgan/adam.py: the project's Adam moves weights exactly as torch.optim.Adam's per-tensor loop, on the CPU and on
CUDA, per tensor and over the parameters laid end to end (its form on CUDA), and keeps its state in torch's format
(checkpoints, swapped optimizer states)."""

import copy

import pytest
import torch

from conftest import DEVICES, cuda_only
from mdgan.adam import ENVIRONMENT, Adam, flat_wanted
from mdgan.config import DataConfig, ModelSpec, OptimizerSpec, PrivacySpec, TrainingConfig
from mdgan.gan import make_adam
from mdgan.models import build_discriminator
from mdgan.simulation import simulate


def _nets(device: str, architecture: str):
    spec = ModelSpec(architecture=architecture)
    return [build_discriminator(spec, 1).to(device) for _ in range(2)]


def _steps(nets, optimizers, device: str, steps: int, seed: int = 0, skip: int | None = None) -> None:
    noise = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=noise) * 10 ** torch.randint(-4, 2, (), generator=noise)
                 for p in nets[0].parameters()]
        for net, optimizer in zip(nets, optimizers):
            for i, (p, g) in enumerate(zip(net.parameters(), grads)):
                p.grad = None if i == skip else g.to(device)
            optimizer.step()


def _same(nets, ours, torchs) -> None:
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)
    mine, theirs = ours.state_dict(), torchs.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for key, state in mine["state"].items():
        for name, value in state.items():
            other = theirs["state"][key][name]
            assert value.shape == other.shape and value.device == other.device and value.dtype == other.dtype
            assert torch.equal(value, other), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["mlp", "cnn-mnist"])
@pytest.mark.parametrize("beta1", [0.5, 0.9])  # (0.5: lerp_'s multiply is exact; 0.9, what users set, is not)
def test_adam_takes_torch_adams_per_tensor_steps_bit_for_bit(device, architecture, beta1):
    """60 steps (the bias corrections change every step), gradients across six orders of magnitude, one parameter
    without a gradient: the same weights and the same state as torch.optim.Adam(foreach=False), bit for bit."""
    nets = _nets(device, architecture)
    spec = OptimizerSpec(lr=2e-4, beta1=beta1, beta2=0.999)
    ours = make_adam(nets[0], spec)
    torchs = torch.optim.Adam(nets[1].parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2), foreach=False)
    assert isinstance(ours, Adam)
    _steps(nets, [ours, torchs], device, 60, skip=1)
    _same(nets, ours, torchs)
    mine, theirs = ours.state_dict(), torchs.state_dict()
    assert mine["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"] and 1 not in mine["state"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["mlp", "cnn-mnist"])
@pytest.mark.parametrize("beta1", [0.5, 0.9])  # (0.5: lerp_'s multiply is exact; 0.9, what users set, is not)
def test_the_flat_step_takes_torch_adams_per_tensor_steps_bit_for_bit(device, architecture, beta1):
    """Over the parameters laid end to end (CUDA's form; forced here on the CPU too): 40 steps the same as torch's
    per-tensor loop; then a checkpoint of torch's loaded, 10 more; then the state cleared (a swap without moments),
    10 more; then a parameter without a gradient (per tensor from then on, on the flat moments), 10 more."""
    nets = _nets(device, architecture)
    spec = OptimizerSpec(lr=2e-4, beta1=beta1, beta2=0.999)
    ours = Adam(nets[0].parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2), flat=True)
    torchs = torch.optim.Adam(nets[1].parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2), foreach=False)
    _steps(nets, [ours, torchs], device, 40)
    flat = ours._flat[0]
    assert ours.state[next(nets[0].parameters())]["exp_avg"]._base is flat.exp_avg  # the flat form ran
    _same(nets, ours, torchs)
    ours.load_state_dict(copy.deepcopy(torchs.state_dict()))
    _steps(nets, [ours, torchs], device, 10, seed=1)
    assert ours._flat[0] is not flat  # rebuilt from the loaded moments
    _same(nets, ours, torchs)
    ours.state.clear()
    torchs.state.clear()
    _steps(nets, [ours, torchs], device, 10, seed=2)
    _same(nets, ours, torchs)
    _steps(nets, [ours, torchs], device, 10, seed=3, skip=2)
    _same(nets, ours, torchs)


def test_a_copy_of_a_flat_adam_goes_on_as_the_original():
    """copy.deepcopy of a network with its Adam (as the async trainer copies G's side): the copy keeps the flat form
    and takes the original's steps, bit for bit."""
    net = _nets("cpu", "mlp")[0]
    ours = Adam(net.parameters(), lr=2e-4, betas=(0.5, 0.999), flat=True)
    _steps([net], [ours], "cpu", 3)
    twin_net, twin = copy.deepcopy((net, ours))
    assert twin.flat is True
    _steps([net, twin_net], [ours, twin], "cpu", 3, seed=1)
    assert twin._flat and all(torch.equal(a, b) for a, b in zip(net.parameters(), twin_net.parameters()))


def test_the_flat_step_is_cudas_form_and_the_per_tensor_loop_the_cpus(monkeypatch):
    """flat=None (make_adam's): flat where the parameters are on CUDA (unless MDGAN_FLAT_ADAM=0), per tensor on the
    CPU, whose runs are unchanged by it."""
    assert flat_wanted(torch.device("cuda", 0)) and not flat_wanted(torch.device("cpu"))
    monkeypatch.setenv(ENVIRONMENT, "0")
    assert not flat_wanted(torch.device("cuda", 0))
    monkeypatch.delenv(ENVIRONMENT)
    nets = _nets("cpu", "mlp")
    ours = make_adam(nets[0], OptimizerSpec())
    torchs = torch.optim.Adam(nets[1].parameters(), lr=ours.defaults["lr"], betas=ours.defaults["betas"],
                              foreach=False)
    _steps(nets, [ours, torchs], "cpu", 3)
    assert ours.flat is None and not ours._flat
    _same(nets, ours, torchs)
    if torch.cuda.is_available():
        nets = _nets("cuda", "mlp")
        ours = make_adam(nets[0], OptimizerSpec())
        _steps(nets[:1], [ours], "cuda", 2)
        assert ours._flat


@cuda_only
def test_moments_read_on_a_lane_are_not_handed_out_again_before_the_lane_has_read_them():
    """A swap's or a checkpoint's moments are made on the main stream; the flat moments are rebuilt from them on a
    worker's lane (mdgan/cuda_lanes.py), which drops them. While the lane has not run that copy (held here by a
    sleeping kernel), tensors the main stream makes and fills do not take their memory, and the steps end where
    the same steps on one stream end."""
    nets = _nets("cuda", "mlp")
    optimizers = [Adam(net.parameters(), lr=2e-4, betas=(0.5, 0.999), flat=True) for net in nets]
    _steps(nets, optimizers, "cuda", 2)
    for optimizer in optimizers:  # (torch's load keeps the tensors it is given: these, made on the main stream)
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    loaded = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
              for state in optimizers[0].state.values() for t in (state["exp_avg"], state["exp_avg_sq"])]
    _steps(nets[1:], optimizers[1:], "cuda", 1, seed=1)  # the reference: on the main stream
    noise = torch.Generator().manual_seed(1)  # (_steps' gradients, made before the lane waits)
    grads = [(torch.randn(p.shape, generator=noise) * 10 ** torch.randint(-4, 2, (), generator=noise)).to("cuda")
             for p in nets[0].parameters()]
    torch.cuda.empty_cache()  # (what the main stream has cached besides the loaded moments: little to take below)
    lane = torch.cuda.Stream()
    lane.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(lane):
        torch.cuda._sleep(2_000_000_000)  # (about a second: the copy below waits behind it)
        for p, grad in zip(nets[0].parameters(), grads):
            p.grad = grad
        optimizers[0].step()  # the flat moments rebuilt from the loaded ones, on the lane
    made, reserved = [], torch.cuda.memory_reserved()
    while torch.cuda.memory_reserved() == reserved:  # every large block the main stream has cached, taken and filled
        made.append(torch.full((393_216,), float("nan"), device="cuda"))  # (1.5 MB: the allocator's large blocks)
    for tensor in made:
        start = tensor.data_ptr()
        assert all(start + tensor.numel() * tensor.element_size() <= low or start >= high for low, high in loaded)
    torch.cuda.synchronize()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)


def test_a_state_saved_by_torchs_adam_goes_on_in_ours_as_in_torchs():
    """A checkpoint of either loads in the other and the run goes on the same: the state's format is torch's."""
    nets = _nets("cpu", "mlp")
    spec = OptimizerSpec()
    torchs = torch.optim.Adam(nets[1].parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2), foreach=False)
    ours = make_adam(nets[0], spec)
    _steps(nets, [ours, torchs], "cpu", 5)
    ours.load_state_dict(copy.deepcopy(torchs.state_dict()))  # (as a checkpoint holds it: its own tensors)
    _steps(nets, [ours, torchs], "cpu", 5, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


def test_a_closure_is_refused():
    with pytest.raises(ValueError, match="closure"):
        make_adam(torch.nn.Linear(2, 1), OptimizerSpec()).step(lambda: 0.0)


@pytest.mark.parametrize("algorithm, changes", [
    ("mdgan", {}), ("mdgan", {"swap_optimizer_state": True, "disc_steps": 2}), ("pwgan", {}), ("psgan", {}),
    ("mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0, fixed_noise=1)}),
    ("mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0, mechanism="feedback", discriminators=2, fixed_noise=1),
               "swap_every": None})], ids=["mdgan", "swapped-moments", "pwgan", "psgan", "dp-sgd", "dp-feedback"])
def test_a_run_with_every_adam_flat_ends_on_the_per_tensor_runs_generator(tmp_path, monkeypatch, algorithm, changes):
    """A whole CPU run with every Adam in the flat form (CUDA's; swaps, with and without the moments, clearing and
    replacing the state between steps; DP-SGD's Adam under Opacus, the private feedback's several discriminators)
    ends on the generator of the run with the per-tensor loop, bit for bit."""
    config = TrainingConfig(**{"workers": 3, "kappa": 2, "iterations": 6, "batch_size": 8, "swap_every": 2, "seed": 5,
                               **changes}).validate()
    data = DataConfig("synthetic", num_shards=3)
    plain = simulate(config, data, str(tmp_path / "plain"), progress=False, algorithm=algorithm)["generator_sha256"]
    original, made, flat_steps = Adam.__init__, [], set()
    monkeypatch.setattr(Adam, "__init__", lambda self, params, lr, betas, flat=None: made.append(self) or original(
        self, params, lr, betas, flat=True))
    step = Adam._flat_step
    monkeypatch.setattr(Adam, "_flat_step", lambda self, *a: flat_steps.add(id(self)) or step(self, *a))
    flat = simulate(config, data, str(tmp_path / "flat"), progress=False, algorithm=algorithm)["generator_sha256"]
    assert flat == plain
    assert len(made) > 1 and flat_steps == {id(adam) for adam in made}  # (G's, every D's: under Opacus's too)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("asked", [{"weight_decay": 0.01}, {"amsgrad": True}, {"maximize": True}])
def test_a_loaded_state_that_asks_for_what_this_adam_does_not_do_is_refused_at_its_step(device, asked):
    """This Adam has no weight decay, amsgrad or maximize (no setting asks for them); a torch Adam's state_dict that
    does, loaded, would have its steps taken without them: the step refuses, the weights unchanged."""
    nets = _nets(device, "mlp")
    ours = Adam(nets[0].parameters(), lr=2e-4, betas=(0.9, 0.999))
    torchs = torch.optim.Adam(nets[1].parameters(), lr=2e-4, betas=(0.9, 0.999), foreach=False, **asked)
    _steps(nets[1:], [torchs], device, 2)
    ours.load_state_dict(copy.deepcopy(torchs.state_dict()))
    for p in nets[0].parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in nets[0].parameters()]
    with pytest.raises(ValueError, match=f"takes no {next(iter(asked))}"):
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(before, nets[0].parameters()))
    with pytest.raises(TypeError):
        Adam(nets[0].parameters(), lr=2e-4, betas=(0.9, 0.999), **asked)
