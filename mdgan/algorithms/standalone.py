"""The paper's standalone baseline: one G and one D on the whole dataset, the usual loop (as in
pytorch/examples dcgan): D steps on (real, G(z).detach()), then one G step through D on the same fake
batch. Its LocalGAN is also an FL-GAN worker's pair (flgan.py). Built from MD-GAN's own
GeneratorSide/DiscriminatorSide, so that with the whole dataset in one shard it starts from MD-GAN's
N = 1 weights, noise and real batches, and its records are MD-GAN's.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mdgan.algorithms.base import Algorithm, InProcessRun, IterationRecord, RunResult, Traffic, last_iteration
from mdgan.algorithms.loop_checkpoints import LoopCheckpoints, loop_checkpoints
from mdgan.config import TrainingConfig
from mdgan.data import Shard
from mdgan.gan import DiscriminatorSide, GeneratorSide, discriminator_loss, generator_loss
from mdgan.privacy_ledger import PrivacyLedger, site_ledger


def read_once(stats: dict) -> dict:
    """A step's statistics with its 0-dim tensors read to the host at once (one transfer, not one a value): the
    floats .item() would give, exactly (float32 values widen to float64 without change)."""
    names = [name for name, value in stats.items() if isinstance(value, torch.Tensor)]
    if not names:
        return stats
    values = torch.stack([stats[name].detach().reshape(()).double() for name in names]).tolist()
    return {**stats, **dict(zip(names, values))}


class LocalGAN:
    """One G and one D trained together on one shard: the standalone GAN, and an FL-GAN worker.

    Built from the same GeneratorSide/DiscriminatorSide as MD-GAN, so that with the whole dataset
    in one shard it starts from MD-GAN's N = 1 weights, noise and real batches.
    """

    def __init__(self, config: TrainingConfig, shard: Shard, generator: GeneratorSide | None = None,
                 ledger: PrivacyLedger | None = None):
        self.config = config
        self.spec = config.model
        self.g = generator or GeneratorSide(config)
        self.d = DiscriminatorSide(config, shard, ledger)

    def state_dict(self) -> dict:
        """Both sides' durable state (weights, Adam, noise, sampler): what a checkpoint of the pair holds."""
        return {"generator_side": self.g.state_dict(), "discriminator_side": self.d.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.g.load_state_dict(state["generator_side"])
        self.d.load_state_dict(state["discriminator_side"])

    def step(self) -> dict:
        spec, D = self.spec, self.d.discriminator
        batches = self.g.generate(1)  # the server's noise stream: same z and labels as MD-GAN
        fake, labels = batches.samples[0], None if batches.labels is None else batches.labels[0]  # (b, *shape), (b,)
        if self.d.private is not None:  # DP-SGD on the real data (mdgan/privacy.py), as an MD-GAN worker's D
            return self._private_step(fake, labels)
        real, real_labels = self.d.sampler.next_batch()
        disc_loss, real_acc, fake_acc = torch.tensor(float("nan")), float("nan"), float("nan")
        for _ in range(self.config.disc_steps):
            real_logits, fake_logits = D(real), D(fake.detach())
            disc_loss = discriminator_loss(spec, real_logits, real_labels, fake_logits, labels)
            self.d.optimizer.zero_grad(set_to_none=True)
            disc_loss.backward()
            self.d.optimizer.step()
            real_acc = (real_logits[:, 0] > 0).float().mean()  # (0-dim, left on D's device)
            fake_acc = (fake_logits[:, 0] <= 0).float().mean()
        gen_loss = generator_loss(spec, D(fake), labels)
        self.g.optimizer.zero_grad(set_to_none=True)
        gen_loss.backward()  # through D into G; D's gradients are dropped before its next step
        self.g.optimizer.step()
        return read_once({"gen_loss": gen_loss, "disc_loss": disc_loss, "real_accuracy": real_acc,
                          "fake_accuracy": fake_acc})

    def _private_step(self, fake: torch.Tensor, labels: torch.Tensor | None) -> dict:
        """The same step with D trained by DP-SGD; G's step is post-processing of the private D. The
        stats carry the spent (epsilon, delta)."""
        spec, D = self.spec, self.d.discriminator
        d_stats = self.d.private_disc_steps(fake.detach(), labels)
        gen_loss = generator_loss(spec, D(fake), labels)
        self.g.optimizer.zero_grad(set_to_none=True)
        gen_loss.backward()  # (D's .grad from this is cleared by its next private step)
        self.g.optimizer.step()
        private = self.d.private
        return read_once({"gen_loss": gen_loss, "disc_loss": d_stats.loss, "real_accuracy": d_stats.real_accuracy,
                          "fake_accuracy": d_stats.fake_accuracy, "epsilon": private.epsilon(),
                          "delta": private.site.delta, "fixed_noise": private.ledger.secret.fixed})


PRIVACY_STATS = ("epsilon", "delta", "fixed_noise")  # a private step's spent budget: per site, never averaged


def site_privacy(stats: dict) -> dict:
    """A site's privacy record from its last step's stats, as MD-GAN's sites report it."""
    return {"epsilon": stats["epsilon"], "delta": stats["delta"],
            "noise": "fixed" if stats.get("fixed_noise") else "secret"}


def iteration_record(t: int, workers: int, answered: int, stats: list[dict], seconds: float,
            averaged: int | None, privacy: dict | None = None) -> IterationRecord:
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0] if k not in PRIVACY_STATS}
    return IterationRecord(iteration=t, active_workers=workers, answered=answered, rejected=0, lost=workers - answered,
                           swap_round=averaged, seconds=seconds, privacy=privacy or None, **mean)


def run_standalone(config: TrainingConfig, generator: GeneratorSide, dataset: Shard,
                   on_iteration: Callable[[IterationRecord], None] | None = None,
                   discriminators: dict | None = None, stop_after: int | None = None,
                   ledger: PrivacyLedger | None = None, checkpoints: LoopCheckpoints | None = None) -> RunResult:
    gan = LocalGAN(config, dataset, generator, ledger)
    last, until, start = None, last_iteration(config, stop_after), 0
    resumed = checkpoints.restore() if checkpoints is not None else None
    if resumed is not None:
        gan.load_state_dict(resumed["pair"])
        start = int(resumed["iteration"])
    for t in range(start + 1, until + 1):
        started = time.perf_counter()
        stats = gan.step()
        privacy = {"worker-0": site_privacy(stats)} if "epsilon" in stats else None
        last = iteration_record(t, 1, 1, [stats], time.perf_counter() - started, None, privacy)
        if on_iteration:
            on_iteration(last)
        if checkpoints is not None:
            checkpoints.after(t - 1, t, until, lambda: {"pair": gan.state_dict()})
    if discriminators is not None:
        discriminators["worker-0"] = {k: v.detach().clone() for k, v in gan.d.discriminator.state_dict().items()}
    return RunResult(iterations=until, workers=1, workers_alive=1, swaps=0, rejections=0,
                     swap_period=0, traffic=Traffic(), last=last, privacy=last.privacy if last else None)


def run_in_process(run: InProcessRun) -> RunResult:
    """The standalone GAN (`mdgan simulate --algorithm standalone`): run.config has one worker, whose
    shard is the whole dataset."""
    return run_standalone(run.config, run.generator, run.shards[0], on_iteration=run.recorder,
                          discriminators=run.discriminators, stop_after=run.stop_after,
                          ledger=site_ledger(run.config.privacy, 0, run.sites_root(), run.ledger_run_id()),
                          checkpoints=loop_checkpoints(run, "standalone"))


def per_worker_per_iteration(config: TrainingConfig, shard_size: int, options=None) -> dict[str, float]:
    return {"server_to_worker": 0, "worker_to_server": 0, "worker_to_worker": 0}  # nothing travels


ALGORITHM = Algorithm(
    name="standalone", title="a standalone GAN", run_in_process=run_in_process,
    per_worker_per_iteration=per_worker_per_iteration, served=False, crashes=False, whole_dataset=True,
    private=("sgd",), resumable=True)
