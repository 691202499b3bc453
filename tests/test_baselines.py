import asyncio

import pytest
import torch

from mdgan.algorithms.flgan import FederatedTrainer, InProcessFederatedWorker, run_flgan
from mdgan.aggregation import fedavg
from mdgan.algorithms.standalone import run_standalone
from mdgan.algorithms.mdgan.trainer import Trainer
from mdgan.algorithms.mdgan.inprocess import build_in_process_workers
from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.models import build_discriminator


def test_fedavg_of_identical_models_is_the_identity():
    state = build_discriminator(ModelSpec(), 3).state_dict()
    averaged = fedavg([state, {k: v.clone() for k, v in state.items()}, state], [1.0, 5.0, 2.0])
    assert all(torch.equal(averaged[k], v) for k, v in state.items())


def test_fedavg_weights_by_shard_size():
    a, b = {"w": torch.tensor([0.0, 4.0])}, {"w": torch.tensor([4.0, 0.0])}
    assert torch.equal(fedavg([a, b], [3.0, 1.0])["w"], torch.tensor([1.0, 3.0]))


@pytest.mark.parametrize("gan,disc_steps", [("acgan", 1), ("gan", 2)])
def test_standalone_gan_equals_mdgan_with_one_worker_holding_all_the_data(gan, disc_steps):
    config = TrainingConfig(workers=1, iterations=15, batch_size=8, disc_steps=disc_steps, seed=3, swap_every=1000,
                            model=ModelSpec(gan=gan)).validate()
    (dataset,) = load_all_shards(DataConfig("synthetic", num_shards=1))

    standalone = GeneratorSide(config)
    run_standalone(config, standalone, dataset)

    mdgan = GeneratorSide(config)
    asyncio.run(Trainer(config, mdgan, build_in_process_workers(config, [dataset])).run())

    moved = False
    for (name, p), q, p0 in zip(standalone.generator.named_parameters(), mdgan.generator.parameters(),
                                GeneratorSide(config).generator.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
        moved |= not torch.equal(p, p0)
    assert moved  # both trained, the same way


def test_flgan_averages_every_period_and_counts_table_iii_traffic():
    config = TrainingConfig(workers=3, iterations=10, batch_size=5, swap_every=4, seed=1).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    server = GeneratorSide(config)
    rounds, records = [], []
    result = run_flgan(config, server, shards, on_iteration=records.append, on_round=rounds.append)
    assert [r["iteration"] for r in rounds] == [4, 8, 10]  # every period, and a last round at the end
    theta_w = (670_219 + 716_560 + 1000) * 4
    assert result.traffic.payload_bytes["server_to_worker"] == 3 * 3 * theta_w
    assert result.traffic.payload_bytes["worker_to_server"] == 3 * 3 * theta_w
    assert len(records) == 10 and records[3].swap_round == 1


def test_flgan_server_ends_with_the_average_of_what_the_workers_trained():
    config = TrainingConfig(workers=2, iterations=3, batch_size=5, swap_every=3).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=2))
    server = GeneratorSide(config)
    workers = [InProcessFederatedWorker(config, shard) for shard in shards]
    trainer = FederatedTrainer(config, server, workers, workers[0].gan.d.discriminator.state_dict())
    asyncio.run(trainer.run())
    trained = [w.gan.g.generator.state_dict() for w in workers]
    assert not all(torch.equal(a, b) for a, b in zip(trained[0].values(), trained[1].values()))  # they differ
    expected = fedavg(trained, [float(len(s)) for s in shards])
    for name, tensor in server.generator.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    expected_d = fedavg([w.gan.d.discriminator.state_dict() for w in workers], [float(len(s)) for s in shards])
    assert all(torch.equal(trainer.discriminator[k], v) for k, v in expected_d.items())


def test_flgan_records_see_the_server_generator_of_their_iteration():
    """The server's G changes at a round's last iteration only: what an evaluation started at an
    iteration inside a round scores is the G of that iteration, not the next average."""
    config = TrainingConfig(workers=2, iterations=6, batch_size=5, swap_every=3).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=2))
    server = GeneratorSide(config)
    seen = []
    run_flgan(config, server, shards, on_iteration=lambda r: seen.append(
        (r.iteration, [p.detach().clone() for p in server.generator.parameters()])))
    initial = [p.detach().clone() for p in GeneratorSide(config).generator.parameters()]
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    g = dict(seen)
    assert same(g[1], initial) and same(g[2], initial)  # round 1 runs on the initial G
    assert not same(g[3], initial)  # its average lands at iteration 3
    assert same(g[4], g[3]) and same(g[5], g[3]) and not same(g[6], g[3])
    assert same(g[6], list(server.generator.parameters()))


@pytest.mark.parametrize("algorithm", ["standalone", "flgan"])
def test_a_local_gan_step_reads_its_statistics_to_the_host_once(tmp_path, monkeypatch, algorithm):
    """The standalone GAN's and FL-GAN's local steps leave their losses and accuracies on D's device and read them
    in one transfer a step (on CUDA each read waits for the device): no .item() of theirs, one .tolist() a step."""
    import traceback

    from mdgan.config import DataConfig, TrainingConfig
    from mdgan.run import EvaluationOptions
    from mdgan.simulation import simulate

    reads = {"item": 0, "tolist": 0}
    for name in reads:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original):
            if traceback.extract_stack(limit=2)[0].filename.endswith("standalone.py"):
                reads[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    config = TrainingConfig(workers=2, iterations=6, batch_size=8, swap_every=3, disc_steps=2).validate()
    simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False, algorithm=algorithm,
             evaluation=EvaluationOptions(every=-1))
    steps = 6 * (1 if algorithm == "standalone" else 2)
    assert reads == {"item": 0, "tolist": steps}
