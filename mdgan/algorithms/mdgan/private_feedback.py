"""Private feedback (--dp-mechanism feedback): only clipped, noised feedback leaves a site.

A site splits its data into K disjoint parts (a permutation seeded by run seed and shard) and keeps one
discriminator per part (`--dp-discriminators K`). Each request of the server (a batch X_d to train on
and a batch X_g to answer on) is served by one part, drawn at random: a fresh random order of the K
parts every K requests, so each part answers once every K requests. That part's discriminator trains
its L steps on its own data and X_d, without noise, and computes the feedback on X_g; each generated
sample's feedback (the gradient of its own loss) is clipped to L2 norm C and Gaussian noise of std
sigma x C, drawn from the site's secret (mdgan/secret_noise.py), is added to it; the answer is counted in the
site's ledger (mdgan/privacy_ledger.py) before it is sent. No discriminator leaves the site: the server orders no
swaps and gives late joiners no copies (a site that refused one anyway would fail the run, not send it).

The privacy of one image, replaced by another (the site's size is public; docs/PRIVACY.md, "Private
feedback", has the argument):

- An answer depends on the site's data only through the drawn part's discriminator; neither which part
  is drawn nor which part an image is in depends on the data. So an image of part p is touched only by
  part p's answers: parallel composition over the parts, each answer a Gaussian mechanism.
- A part's discriminator may change arbitrarily with one image, so each of the b clipped rows may move
  by 2C: the L2 sensitivity of an answer is 2 C sqrt(b), and its noise, sigma C, is
  sigma / (2 sqrt(b)) of it. Opacus's RDP accountant composes n_p such steps at sampling rate 1 for the
  part that answered most (n_p <= ceil(t / K) after t answers).
- The generator, and everything the server does, is post-processing of the answers.
- The random draw of the answering part is not counted as amplification by subsampling: an observer who
  can tell the parts' answers apart learns which part answered, and then the answer is the plain
  Gaussian mechanism for its images (Poisson-subsampling accounting at q = 1/K would not hold).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from mdgan import devices, privacy
from mdgan.config import PrivacySpec, TrainingConfig
from mdgan.data import Shard, ShardSampler
from mdgan.gan import DiscriminatorSide, WorkerBatch, derive_seed
from mdgan.privacy_ledger import PrivacyLedger, adopt_old_accountant, site_ledger
from mdgan.secret_noise import SecretStream
from mdgan.step_results import StepResult


def worker_side(config: TrainingConfig, shard: Shard,
                ledger: PrivacyLedger | None = None) -> "DiscriminatorSide | PrivateFeedbackSide":
    """An MD-GAN worker's discriminator side for this run: K private-feedback parts, or one DiscriminatorSide
    (DP-SGD or no DP); `ledger`: a private site's (mdgan/privacy_ledger.py)."""
    if config.privacy.keeps_discriminators:
        return PrivateFeedbackSide(config, shard, ledger)
    return DiscriminatorSide(config, shard, ledger)


def split_parts(shard: Shard, parts: int, seed: int) -> list[Shard]:
    """The shard's images in `parts` disjoint parts whose sizes differ by at most one."""
    order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed))
    return [dataclasses.replace(shard, images=shard.images[picked], labels=shard.labels[picked])
            for picked in torch.tensor_split(order, parts)]


class AnswerSchedule:
    """Which part answers each request: a fresh random order of the K parts every K requests, drawn from the
    site's secret (round r's order is draw r of its "feedback/schedule" stream), so after t answers every part has
    given floor(t / K) or ceil(t / K). Answer t's part is known before it is given (the budget's check)."""

    def __init__(self, parts: int, stream: SecretStream):
        self.parts = parts
        self._stream = stream
        self._round: tuple[int, list[int]] = (-1, [])

    def part(self, answer: int) -> int:
        """The part that gives answer number `answer` (0, 1, ...) of the site."""
        number, position = divmod(answer, self.parts)
        if self._round[0] != number:
            self._round = (number, torch.argsort(self._stream.uniform(number, self.parts)).tolist())
        return self._round[1][position]


@functools.lru_cache(maxsize=256)
def _gaussian_epsilon(noise_multiplier: float, steps: int, delta: float) -> float:
    """Opacus's RDP epsilon of `steps` Gaussian steps at sampling rate 1 (every answer asks for it; it
    changes once every K answers)."""
    return privacy.spent_epsilon([(noise_multiplier, 1.0, steps)], delta)


class FeedbackMechanism:
    """The site's mechanism: each answer's rows clipped to C and noised, counted in the site's ledger before it
    leaves. Noise is drawn on the CPU from the site's secret stream, at the index of the answer (the same numbers
    on any device, never twice for two answers)."""

    def __init__(self, site: privacy.SitePrivacy, ledger: PrivacyLedger):
        self.site = site
        self.ledger = ledger
        self.schedule = AnswerSchedule(site.discriminators, ledger.secret.stream("feedback/schedule"))
        self.noise = ledger.secret.stream("feedback/noise")

    @property
    def answers(self) -> list[int]:
        return list(self.ledger.answers)

    def next_part(self) -> int:
        return self.schedule.part(self.ledger.answers_given)

    def sanitize(self, per_sample: torch.Tensor) -> torch.Tensor:
        """(b, *shape) gradients of each sample's own loss -> each row clipped to L2 norm C, plus N(0, (sigma C)^2),
        the noise of the site's next answer."""
        rows = per_sample.reshape(len(per_sample), -1)  # (b, d)
        norms = rows.norm(dim=1, keepdim=True)  # (b, 1)
        clipped = rows * (self.site.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)  # Opacus's clip factor
        noise = self.noise.normal(self.ledger.answers_given, rows.numel(),
                                  self.site.noise_multiplier * self.site.max_grad_norm).view(rows.shape)
        return (clipped + noise.to(rows.device, rows.dtype)).view_as(per_sample)

    def answer(self, part: int, per_sample: torch.Tensor) -> torch.Tensor:
        """Part `part`'s answer, sanitized, and counted against that part (written) before it is returned:
        (b, *shape)."""
        sanitized = self.sanitize(per_sample)
        self.ledger.count_answer(part)
        return sanitized

    def _epsilon(self, answers: list[int]) -> float:
        # each part's images are touched by its own answers only: the part that answered most bounds all
        return _gaussian_epsilon(self.site.accounted_noise_multiplier, max(answers), self.site.delta)

    def epsilon(self) -> float:
        return self._epsilon(self.ledger.answers)

    def epsilon_after_iteration(self) -> float:
        """The epsilon after the next answer (the site's budget)."""
        answers = list(self.ledger.answers)
        answers[self.next_part()] += 1
        return self._epsilon(answers)


class PrivateFeedbackSide:
    """A site's K discriminators (each a DiscriminatorSide over its own part, trained without noise) and the
    mechanism that sanitizes their answers. It has no state to export: its discriminators never leave."""

    def __init__(self, config: TrainingConfig, shard: Shard, ledger: PrivacyLedger | None = None):
        self.config = config
        self.spec = config.model
        self.device = devices.resolve(config.device)
        self.shard = shard
        site = privacy.resolve(config.privacy, len(shard), config.batch_size, config.iterations, config.disc_steps)
        k = site.discriminators
        plain = dataclasses.replace(config, privacy=PrivacySpec())  # each part trains its D without noise
        self.parts: list[DiscriminatorSide] = []
        for j, part in enumerate(split_parts(shard, k, derive_seed(config.seed, "dp-feedback-parts", shard.index))):
            side = DiscriminatorSide(plain, part)
            side.sampler = ShardSampler(side.sampler.shard, config.batch_size,
                                        derive_seed(config.seed, f"dp-feedback-sampling/{shard.index}", j))
            self.parts.append(side)
        ledger = ledger or site_ledger(config.privacy, shard.index, None, "")  # (None: in memory)
        self.private = FeedbackMechanism(site, ledger)

    @property
    def shard_index(self) -> int:
        return self.shard.index

    @property
    def discriminator(self) -> torch.nn.Module:
        """The first part's discriminator (what a run keeps of this site for `mdgan audit`)."""
        return self.parts[0].discriminator

    def step(self, batch: WorkerBatch) -> StepResult:
        """The drawn part trains and answers; its answer's rows are clipped and noised. The feedback sent is
        the gradient of the batch's mean loss, as without DP: each sample's own-loss gradient is b times it."""
        started = time.perf_counter()
        part = self.private.next_part()
        result = self.parts[part].step(batch)
        rows = len(result.feedback)
        feedback = self.private.answer(part, result.feedback * rows) / rows  # (b, *shape)
        return dataclasses.replace(result, feedback=feedback, epsilon=self.private.epsilon(),
                                   fixed_noise=self.private.ledger.secret.fixed,
                                   delta=self.private.site.delta,
                                   feedback_seconds=time.perf_counter() - started - result.disc_seconds)

    # -- durable state (a checkpoint, kept on the worker) ------------------------------------------
    def state_dict(self) -> dict:
        return {"shard_index": self.shard_index, "parts": [side.state_dict() for side in self.parts],
                "privacy": {"ledger": True}}

    def load_state_dict(self, state: dict) -> None:
        if int(state["shard_index"]) != self.shard_index:
            raise ValueError(f"saved state of shard {state['shard_index']}, this worker holds shard {self.shard_index}")
        if "parts" not in state:
            raise ValueError("saved state of a run without private feedback; this run keeps its discriminators")
        if len(state["parts"]) != len(self.parts):
            raise ValueError(f"saved state of {len(state['parts'])} discriminators, this site has {len(self.parts)}")
        for side, saved in zip(self.parts, state["parts"]):
            side.load_state_dict({**saved, "shard_index": side.shard_index})
        adopt_old_accountant(self.private.ledger, state["privacy"])

    # -- what a site with private feedback never does ------------------------------------------------
    def _refuse(self, *_args, **_kwargs):
        raise PermissionError("private feedback (--dp-mechanism feedback): this site's discriminators never leave it "
                              "and it takes none in")

    export_state = import_state = adopt = state_layout = _refuse
