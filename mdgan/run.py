"""What a run leaves behind: history.jsonl, summary.json, sample grids, a checkpoint; a run directory's
identity and the runs it held before; the evaluation schedule.

Used by the in-process simulation (mdgan/simulation.py) and by the gRPC server alike, so both write the
same files.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace

import torch
from tqdm import tqdm

from mdgan import checkpoint, settings
from mdgan.checkpoint import CheckpointError, CheckpointStore
from mdgan.algorithms.base import IterationRecord, RunResult
from mdgan.config import ConfigError, TrainingConfig, named
from mdgan.gan import GeneratorSide, derive_seed
from mdgan.models import image_shape


log = logging.getLogger(__name__)


def generator_sha256(generator: torch.nn.Module) -> str:
    """A hash of the generator's parameters and buffers (names, shapes, dtypes and raw bytes)."""
    digest = hashlib.sha256()
    for name, tensor in generator.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def machine() -> dict:
    """What computed a run: floating-point results agree bit for bit only where torch dispatched the
    same kernels (the CPU capability level: ATEN_CPU_CAPABILITY pins it), so every summary says so."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY")}


def _finite_or_none(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def evaluation_samples(generator_side: GeneratorSide, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fixed noise (and class-balanced labels for ACGAN) for scoring: the same at every evaluation."""
    spec = generator_side.spec
    rng = torch.Generator().manual_seed(derive_seed(generator_side.config.seed, "evaluation"))
    z = torch.randn(count, spec.latent_dim, generator=rng)  # (count, l)
    labels = torch.arange(count) % spec.num_classes if spec.conditional else None  # (count,)
    return z, labels


class PeriodicEvaluator:
    """Scores G every `every` iterations on a snapshot, in a background thread, so training never
    waits for it; results are picked up by the next history line (all that finished since the line
    before). `finish` waits for those still running and scores the final G."""

    def __init__(self, scorer, generator_side: GeneratorSide, every: int, samples: int,
                 large_every: int = 0, large_samples: int = 0):
        self.scorer = scorer  # anything with evaluate(images) -> dict of scores (mdgan.evaluation.ScoreEvaluator)
        self.generator_side = generator_side
        self.every = every
        self.noise = evaluation_samples(generator_side, samples)
        # every large_every iterations (and at the end) the same G is also scored on large_samples images,
        # keys *_large: FID on a few hundred samples is biased upward, and this measures by how much
        self.large_every = large_every
        self.large_noise = evaluation_samples(generator_side, large_samples) if large_every > 0 else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mdgan-eval")
        self._pending: list[tuple[int, Future]] = []
        self._ready: list[dict] = []  # finished, not yet on a history line (carried across a checkpoint)
        self.latest: dict | None = None
        self.grids = False  # also draw each evaluated G's sample grid (tracking: a picture per evaluation)
        self._grids: dict[int, bytes] = {}  # eval_iteration -> PNG, until take_grids()

    def _images(self, generator: torch.nn.Module, noise) -> torch.Tensor:
        z, labels = noise
        device = self.generator_side.device
        with torch.no_grad():
            return generator.eval()(z.to(device), None if labels is None else labels.to(device))

    def _score(self, generator: torch.nn.Module, iteration: int | None = None, final: bool = False) -> dict:
        if self.grids and iteration is not None:
            png = sample_grid_png(self.generator_side, generator=generator)
            if png is not None:
                self._grids[iteration] = png
        scores = self.scorer.evaluate(self._images(generator, self.noise))
        if self.large_noise is not None and (final or (iteration is not None and iteration % self.large_every == 0)):
            large = self.scorer.evaluate(self._images(generator, self.large_noise))
            scores.update({f"{k}_large": v for k, v in large.items()})
            scores["large_samples"] = len(self.large_noise[0])
        return scores

    def take_grids(self) -> dict[int, bytes]:
        """The sample grids drawn since last asked (eval_iteration -> PNG)."""
        grids, self._grids = self._grids, {}
        return grids

    def maybe_start(self, iteration: int) -> None:
        if self.every > 0 and iteration % self.every == 0:
            snapshot = copy.deepcopy(self.generator_side.generator)  # training goes on with the original
            self._pending.append((iteration, self._pool.submit(self._score, snapshot, iteration)))

    def collect(self) -> list[dict]:
        """Every evaluation ({"eval_iteration", scores...}) finished since last asked, oldest first;
        in order, so one still running holds back those started after it."""
        found, self._ready = self._ready, []
        while self._pending and self._pending[0][1].done():
            iteration, future = self._pending.pop(0)
            found.append({"eval_iteration": iteration, **future.result()})
        if found:
            self.latest = found[-1]
        return found

    def state_dict(self) -> dict:
        """The schedule's state at a checkpoint: evaluations still running are waited for and kept
        for the next history line, which is then the same whether or not the run was resumed."""
        wait([future for _, future in self._pending])
        self._ready += [{"eval_iteration": i, **future.result()} for i, future in self._pending]
        self._pending = []
        return {"ready": list(self._ready), "latest": self.latest}

    def load_state_dict(self, state: dict) -> None:
        self._ready = list(state["ready"])
        self.latest = state["latest"]

    def finish(self, iteration: int) -> list[dict]:
        """Waits for the periodic evaluations still running, then scores the final G: all of them,
        the final one last."""
        wait([future for _, future in self._pending])
        done = self.collect()
        final = {"eval_iteration": iteration,
                 **self._score(copy.deepcopy(self.generator_side.generator), iteration, final=True)}
        self.latest = final
        self._pool.shutdown()
        return done + [final]


def make_evaluator(generator_side: GeneratorSide, data_root: str | None, every: int, samples: int,
                   reference: int, large_every: int = 0,
                   large_samples: int = settings.default("eval_large_samples")) -> PeriodicEvaluator | None:
    """MNIST score and FID (the paper's metrics) for runs whose samples are MNIST digits."""
    if data_root is None or generator_side.spec.sample_size != 28 * 28 or every < 0:
        return None
    from mdgan.evaluation import ScoreEvaluator

    scorer = ScoreEvaluator.from_mnist_test(data_root, n=reference, seed=0, device=generator_side.device)
    return PeriodicEvaluator(scorer, generator_side, every, samples, large_every, large_samples)


def _append_line(fh, line: str) -> None:
    """One line, flushed (`tail -f` sees it); a failed write (a full disk) names the file."""
    with checkpoint.naming(fh.name):
        fh.write(line + "\n")
        fh.flush()


class RunRecorder:
    """Writes history.jsonl and swaps.jsonl line by line (so `tail -f` works); drives the progress bar."""

    def __init__(self, out_dir: str, total: int, progress: bool = True, description: str = "mdgan",
                 evaluator: PeriodicEvaluator | None = None, resume_at: int | None = None, tracking=None):
        """resume_at: continue a run from its checkpoint at this iteration: the lines written after
        it (by the run that was interrupted) are dropped, so history has no gap and no duplicate."""
        os.makedirs(out_dir, exist_ok=True)
        self.evaluator = evaluator
        self.tracking = tracking  # mdgan.tracking.Tracking: TensorBoard, MLflow (written off the training thread)
        if tracking is not None and evaluator is not None:
            evaluator.grids = True
        self.total = total
        self._final_done = False
        self._eval_seconds = 0.0  # the final evaluation runs inline: kept out of the wall time
        self._wall_before = 0.0  # a resumed run: the wall time up to its checkpoint (its summary counts it all)
        history, swaps = os.path.join(out_dir, "history.jsonl"), os.path.join(out_dir, "swaps.jsonl")
        mode = "w"
        if resume_at is not None:
            checkpoint.truncate_jsonl(history, lambda r: r.get("iteration", 0) <= resume_at)
            checkpoint.truncate_jsonl(swaps, lambda r: r.get("iteration", 0) <= resume_at)
            mode = "a"
        self._history = open(history, mode, encoding="utf-8")
        self._swaps = open(swaps, mode, encoding="utf-8")
        self._bar = tqdm(total=total, initial=resume_at or 0, desc=description, unit="it", disable=not progress,
                         dynamic_ncols=True)
        self.started = time.perf_counter()

    def __call__(self, record: IterationRecord) -> None:
        row = {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in asdict(record).items()}
        privacy = row.pop("privacy", None)
        if self.evaluator is not None:
            if record.iteration == self.total:  # the last line carries the final generator's scores
                evaluations = self._finish(record.iteration)
            else:
                self.evaluator.maybe_start(record.iteration)
                evaluations = self.evaluator.collect()
            if evaluations:  # the newest flat (for plain readers) and all of them, none lost
                row.update(evaluations[-1])
                row["evaluations"] = evaluations
        if privacy and ("evaluations" in row or record.swap_round is not None or record.iteration == self.total):
            row["privacy"] = privacy  # each site's spent (epsilon, delta), as it reported them
        if self.tracking is not None:
            self._track(record, row.get("evaluations") or [])
        _append_line(self._history, json.dumps(row))
        self._bar.update(1)
        if not self._bar.disable:  # (formatting the postfix costs even when no bar is shown)
            self._bar.set_postfix(workers=record.active_workers, g=f"{record.gen_loss:.3f}",
                                  d=f"{record.disc_loss:.3f}", refresh=False)

    def _track(self, record: IterationRecord, evaluations: list[dict]) -> None:
        values = {"loss/generator": record.gen_loss, "loss/discriminator": record.disc_loss,
                  "accuracy/real": record.real_accuracy, "accuracy/generated": record.fake_accuracy,
                  "workers/active": record.active_workers, "workers/answered": record.answered,
                  "workers/lost": record.lost, "workers/rejected": record.rejected, "time/iteration_s": record.seconds}
        if record.swap_round is not None:
            values["swaps/round"] = record.swap_round
        if record.privacy:
            values["privacy/epsilon_max"] = max(p["epsilon"] for p in record.privacy.values())
        self.tracking.metrics(record.iteration, {k: v for k, v in values.items() if _finite_or_none(v) is not None})
        self._track_evaluations(evaluations)

    def _track_evaluations(self, evaluations: list[dict]) -> None:
        """Every evaluation's scores at its iteration, and the sample grid of every G that was scored."""
        for evaluation in evaluations:
            scores = {f"score/{k}": v for k, v in evaluation.items() if k != "eval_iteration" and _finite_or_none(v) is not None}
            self.tracking.metrics(evaluation["eval_iteration"], scores)
        if self.evaluator is not None:
            for iteration, png in sorted(self.evaluator.take_grids().items()):
                self.tracking.image(iteration, "samples", png)

    def swap(self, record: dict) -> None:
        """One line per swap round: the plan (sender -> receiver) and what each worker reported."""
        _append_line(self._swaps, json.dumps(record))

    def state_dict(self) -> dict:
        return {"evaluator": self.evaluator.state_dict() if self.evaluator is not None else None,
                "wall_seconds": self._wall_before + time.perf_counter() - self.started - self._eval_seconds}

    def load_state_dict(self, state: dict) -> None:
        self._wall_before = float(state.get("wall_seconds") or 0.0)  # (older checkpoints: not counted)
        if self.evaluator is not None and state.get("evaluator") is not None:
            self.evaluator.load_state_dict(state["evaluator"])

    def _finish(self, iteration: int) -> list[dict]:
        started = time.perf_counter()
        evaluations = self.evaluator.finish(iteration)
        self._final_done = True
        self._eval_seconds += time.perf_counter() - started
        return evaluations

    def close(self, iteration: int | None = None) -> float:
        """Stop the clock; a run cut short still gets its final generator scored (into the summary)."""
        wall = time.perf_counter() - self.started
        if self.evaluator is not None and iteration and not self._final_done:
            evaluations = self._finish(iteration)
            if self.tracking is not None:  # (a run cut short: its last scores are on no history line)
                self._track_evaluations(evaluations)
        wall -= self._eval_seconds
        wall += self._wall_before
        self._bar.close()
        for fh in (self._history, self._swaps):
            with checkpoint.naming(fh.name):  # (what a failed write left in the buffer is written again here)
                fh.close()
        return wall

    @property
    def scores(self) -> dict | None:
        return None if self.evaluator is None else self.evaluator.latest


def sample_grid_png(generator_side: GeneratorSide, per_class: int = 10,
                    generator: torch.nn.Module | None = None) -> bytes | None:
    """save_sample_grid's picture as PNG bytes (None: the samples are not images)."""
    import io

    buffer = io.BytesIO()
    with torch.no_grad():
        made = save_sample_grid(generator_side, buffer, per_class, generator)
    return buffer.getvalue() if made else None


def save_sample_grid(generator_side: GeneratorSide, path, per_class: int = 10,
                     generator: torch.nn.Module | None = None) -> bool:
    """A grid of samples from fixed noise: one row per class for ACGAN (class-balanced); False when
    the samples are not images (no grid). `path`: a file name, or a binary file object (PNG).
    generator: a copy of G in eval mode to draw instead of the side's own (an evaluation's snapshot)."""
    from torchvision.utils import save_image

    spec = generator_side.spec
    rng = torch.Generator().manual_seed(derive_seed(generator_side.config.seed, "sample-grid"))
    if spec.conditional:
        labels = torch.arange(spec.num_classes).repeat_interleave(per_class)  # (C*per_class,)
        nrow = per_class
    else:
        labels, nrow = None, 10
    count = spec.num_classes * per_class if spec.conditional else 100
    z = torch.randn(count, spec.latent_dim, generator=rng)
    if generator is None:
        images = generator_side.sample(z, labels)
    else:
        device = generator_side.device
        images = generator(z.to(device), None if labels is None else labels.to(device)).cpu()
    try:
        images = images.reshape(count, *image_shape(spec.sample_size))  # (count, C, H, W)
    except ValueError:
        return False  # samples are not images: no grid
    save_image(images, path, nrow=nrow, normalize=True, value_range=(-1, 1), format="png")
    return True


def write_outputs(out_dir: str, config: TrainingConfig, generator_side: GeneratorSide, result: RunResult,
                  wall_seconds: float, mode: str, extra: dict | None = None, scores: dict | None = None,
                  tracking=None) -> dict:
    """summary.json, samples.png and checkpoint.pt; returns the summary. With `tracking`, the run's
    parameters, its final figures, samples and generator go there too, and the tracking is closed."""
    os.makedirs(out_dir, exist_ok=True)
    last = result.last
    summary = {
        "mode": mode,
        "run_id": (extra or {}).get("run_id"),
        "iterations": result.iterations,
        "workers": result.workers,
        "workers_alive": result.workers_alive,
        "alive": result.alive,
        "wall_seconds": wall_seconds,
        "seconds_per_iteration": wall_seconds / result.iterations if result.iterations else None,
        "generator_sha256": generator_sha256(generator_side.generator),
        "payload_bytes": dict(result.traffic.payload_bytes),
        "label_bytes": result.traffic.label_bytes,
        "swaps": result.swaps,
        "swap_period": result.swap_period,
        "rejections": result.rejections,
        "swaps_refused": result.swaps_refused,
        "stopped_early": result.stopped_early,
        "final": {
            "gen_loss": _finite_or_none(last.gen_loss) if last else None,
            "disc_loss": _finite_or_none(last.disc_loss) if last else None,
            "real_accuracy": _finite_or_none(last.real_accuracy) if last else None,
            "fake_accuracy": _finite_or_none(last.fake_accuracy) if last else None,
        },
        "scores": scores,
        "config": config.to_dict(),
        "machine": machine(),
    }
    if config.privacy.enabled:  # DP-SGD (mdgan/privacy.py): what each site spent, by its own accountant
        summary["privacy"] = privacy_summary(config, result.privacy or {}, (extra or {}).get("worker_sizes") or {})
    summary.update(extra or {})
    save_sample_grid(generator_side, os.path.join(out_dir, "samples.png"))
    checkpoint.atomic_save({"generator": generator_side.generator.state_dict(),
                            "optimizer": generator_side.optimizer.state_dict(),
                            "config": config.to_dict(), "iterations": result.iterations},
                           os.path.join(out_dir, "checkpoint.pt"))
    checkpoint.atomic_write_json(os.path.join(out_dir, "summary.json"), summary)
    if tracking is not None:
        tracking.params({"algorithm": summary.get("algorithm"), "run_id": summary.get("run_id"), "mode": mode,
                         **_flat(config.to_dict())})
        # (the scores went with the evaluations: RunRecorder)
        final = {f"bytes/{k}": v for k, v in summary["payload_bytes"].items()}
        tracking.metrics(result.iterations, {**final, "time/wall_s": wall_seconds})
        for name in ("samples.png", "checkpoint.pt", "summary.json"):
            if os.path.exists(os.path.join(out_dir, name)):
                tracking.artifact(os.path.join(out_dir, name))
        tracking.close()
    return summary


def privacy_summary(config: TrainingConfig, spent: dict, worker_sizes: dict) -> dict:
    """summary.json's privacy: what each site spent (sites: its accountant's report) and the sigma it
    trained with (noise_multipliers), resolved from the run's settings and its size as the site resolves
    it (a target epsilon's sigma depends on m_n); noise_multiplier: the sites' sigma when they share one."""
    from mdgan import privacy

    sites = {}
    for worker, size in worker_sizes.items():
        try:
            sites[worker] = privacy.resolve(config.privacy, size, config.batch_size, config.iterations,
                                            config.disc_steps)
        except ConfigError:  # (a site that could not have trained: it reported nothing either)
            continue
    sigmas = {worker: site.noise_multiplier for worker, site in sites.items()}
    shared = set(sigmas.values())
    summary = {"sites": spent, "epsilon_max": max((p["epsilon"] for p in spent.values()), default=None),
               "noise_multiplier": config.privacy.noise_multiplier or (shared.pop() if len(shared) == 1 else None),
               "noise_multipliers": sigmas,
               "target_epsilon": config.privacy.target_epsilon or None, "max_grad_norm": config.privacy.max_grad_norm,
               **privacy.mechanism_summary(config.privacy),
               # secret: each site's noise from a secret of its own; fixed: some site's from --dp-fixed-noise, and
               # the guarantee holds only against those who do not know that number (as the sites report it)
               "noise": "fixed" if any(p.get("noise") == "fixed" for p in spent.values()) or (
                   not spent and config.privacy.fixed_noise is not None) else "secret",
               "withheld": list(privacy.withheld_stats(config.privacy))}
    if config.privacy.mechanism == "feedback":  # what each site's accountant composes (mdgan/privacy.py)
        summary["accounted_noise_multipliers"] = {w: site.accounted_noise_multiplier for w, site in sites.items()}
    return summary


def _flat(values: dict, prefix: str = "") -> dict:
    """Nested settings as one level (model.architecture, ...), for a tracker's parameters."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ---------------------------------------------------------------------------------------------
# durable runs: a run directory has an identity (run_identity.json) and checkpoints (checkpoints/)

RESUME_MODES = ("no", "yes", "auto")  # yes: there must be a run to resume; auto: resume one if there is
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"{named('run_id')} {run_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return run_id


@dataclass
class RunStart:
    """How a run starts: its id, its config, and (resuming) the checkpoint it continues from."""

    run_id: str
    config: TrainingConfig
    resumed_from: int | None = None  # None: from iteration 0
    state: dict | None = None  # the server's state at resumed_from
    new: bool = False  # a new run: start_run writes its identity (and clears what an older run left)
    replaces_finished: bool = False  # new, in a folder whose finished run it replaces (--overwrite)

    @property
    def resuming(self) -> bool:
        return self.resumed_from is not None


class RunFinished(ConfigError):
    """The run folder holds a finished run, and replacing it was not asked for (--overwrite)."""


def is_finished(out_dir: str) -> bool:
    """A run folder whose run has ended: its summary.json is written last."""
    return os.path.exists(os.path.join(out_dir, "summary.json"))


def refuse_a_file_on_the_way(folder: str, key: str) -> None:
    """ConfigError naming setting `key` when `folder`, or the nearest part of its path that is there, is a file:
    no folder can be made there."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "" if existing == os.path.abspath(folder) else f": {existing}"
        raise ConfigError(f"{named(key)} {folder}{where} is a file, not a folder: choose another {named(key)}")


def check_out_dir(out_dir: str, resume: str = "no", overwrite: bool = False) -> None:
    """Refuses, reading only, a run that would overwrite a finished one without `overwrite`, or
    resume one that has finished: called before anything is written to out_dir."""
    if resume not in RESUME_MODES:
        raise ConfigError(f"{named('resume')} must be one of {RESUME_MODES}, got {resume!r}")
    refuse_a_file_on_the_way(out_dir, "out")
    if not is_finished(out_dir):
        return
    if resume == "yes":
        raise RunFinished(f"--resume: the run in {out_dir} has finished (summary.json); nothing to resume")
    if not overwrite:
        raise RunFinished(f"--out {out_dir} holds a finished run (summary.json): give --overwrite to replace it "
                          f"with a new run, or choose another --out")


def plan_run(out_dir: str, config: TrainingConfig, resume: str = "no", run_id: str | None = None,
             overwrite: bool = False) -> RunStart:
    """How the run in out_dir starts, reading only: a new run, or the unfinished one there continued from
    its last complete checkpoint (its saved config wins over the flags). A finished run there is replaced
    only with `overwrite`; start_run then writes."""
    if run_id is not None:
        check_run_id(run_id)
    check_out_dir(out_dir, resume, overwrite)
    path = os.path.join(out_dir, checkpoint.RUN_FILE)
    finished = is_finished(out_dir)
    if resume != "no" and os.path.exists(path) and not finished:
        saved = checkpoint.read_identity(out_dir)
        if run_id is not None and run_id != saved["run_id"]:
            raise CheckpointError(f"{out_dir} holds run {saved['run_id']!r}, not run {run_id!r}")
        saved_config = replace(TrainingConfig.from_dict(saved["config"]), device=config.device)
        if saved_config != replace(config, device=config.device):
            log.info("resuming with the run's saved configuration, not the flags given")
        store = CheckpointStore(os.path.join(out_dir, "checkpoints"))
        latest = store.latest_complete()
        if latest is None:  # stopped before its first complete checkpoint: the same run, from the start
            log.warning("run %s has no complete checkpoint: starting it again from iteration 0", saved["run_id"])
            return RunStart(saved["run_id"], saved_config, 0, None)
        try:
            state = store.load(latest, "server")
        except CheckpointError as exc:  # (damaged after it was written whole: the one before it may be whole)
            raise CheckpointError(f"{exc}; to resume from the checkpoint before it, remove {store.folder(latest)}") \
                from None
        if not isinstance(state, dict) or state.get("run_id") != saved["run_id"]:
            found = state.get("run_id") if isinstance(state, dict) else None
            raise CheckpointError(f"checkpoint {latest} in {out_dir} belongs to run {found!r}, not to this run "
                                  f"{saved['run_id']!r}")
        log.info("resuming run %s from its checkpoint at iteration %d", saved["run_id"], latest)
        return RunStart(saved["run_id"], saved_config, latest, state)
    if resume == "yes":
        raise CheckpointError(f"--resume: {out_dir} holds no run to resume (no {checkpoint.RUN_FILE})")
    return RunStart(run_id or uuid.uuid4().hex[:12], config, new=True, replaces_finished=finished)


def start_run(out_dir: str, run: RunStart) -> RunStart:
    """Writes a new run's identity in out_dir (a finished run it replaces is recorded as ended, and an
    older run's checkpoints and summary are removed); a resumed run is left as it is."""
    if not run.new:
        return run
    os.makedirs(out_dir, exist_ok=True)
    if run.replaces_finished:
        log.info("the run in %s has finished: starting a new one there (--overwrite)", out_dir)
        _record_finished_run(out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)  # never resumed into this run
    if run.replaces_finished:  # a new run: a crash before its end must not look like the old run's end
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, "summary.json"))
    checkpoint.atomic_write_json(os.path.join(out_dir, checkpoint.RUN_FILE),
                                 {"run_id": run.run_id, "config": run.config.to_dict()})
    return run


def open_run(out_dir: str, config: TrainingConfig, resume: str = "no", run_id: str | None = None,
             overwrite: bool = False) -> RunStart:
    """plan_run, then start_run: for callers with nothing to check in between."""
    return start_run(out_dir, plan_run(out_dir, config, resume, run_id, overwrite))


FINISHED_RUNS_FILE = "finished_runs.json"  # the ids of the runs a run directory held before its current one
FINISHED_RUNS_KEPT = 1000


def _record_finished_run(out_dir: str) -> None:
    """Before a new run replaces a finished one in out_dir, keep the finished one's id: a worker that
    was away at its end still holds it, and is told it is over (finished_run_ids)."""
    try:
        finished = checkpoint.read_json(os.path.join(out_dir, checkpoint.RUN_FILE))["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    ids = [i for i in _read_finished_runs(out_dir) if i != finished] + [finished]
    checkpoint.atomic_write_json(os.path.join(out_dir, FINISHED_RUNS_FILE), ids[-FINISHED_RUNS_KEPT:])


def _read_finished_runs(out_dir: str) -> list[str]:
    try:
        ids = checkpoint.read_json(os.path.join(out_dir, FINISHED_RUNS_FILE))
    except (OSError, ValueError):
        return []
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []


def finished_run_ids(out_dir: str) -> set[str]:
    """The runs known to have ended: those out_dir held before its current run, and those of the run
    directories beside it that have a summary.json (a server that starts every run in a directory of
    its own, as the Helm chart's does)."""
    ids = set(_read_finished_runs(out_dir))
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        siblings = [e.path for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return ids
    for folder in siblings:
        if os.path.abspath(folder) == os.path.abspath(out_dir):  # its own run, ended or not, is its own business
            continue
        if not os.path.isfile(os.path.join(folder, "summary.json")):
            continue
        try:
            run_id = checkpoint.read_json(os.path.join(folder, checkpoint.RUN_FILE)).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(run_id, str):
            ids.add(run_id)
    return ids


@dataclass(frozen=True)
class EvaluationOptions:
    """Scores every `every` iterations (0: only at the end; -1: never) on `samples` generated images,
    against `reference` MNIST test images found under `data_root`."""

    data_root: str | None = None
    every: int = settings.default("eval_every")
    samples: int = settings.default("eval_samples")
    reference: int = settings.default("eval_reference")
    # > 0: every this many iterations, and at the end, also scored on large_samples images
    large_every: int = settings.default("eval_large_every")
    large_samples: int = settings.default("eval_large_samples")
