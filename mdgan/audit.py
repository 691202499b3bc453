"""`mdgan audit RUN`: membership inference against what a run exposed, per site.

Members are each site's own training images (recovered from the run's record of its data split);
non-members are held-out images of the same distribution: the MNIST test set, or, for a run on a
subset (--max-samples), training images no site held. Each attack scores every image (higher: "was
in the training data"); its ROC AUC and its TPR at 1% and 0.1% FPR are reported with bootstrap
confidence intervals (members and non-members resampled).

Attacks:
- `d_output` (white-box on a discriminator, as the peer that receives it at a swap holds it, or the
  server that receives an FL-GAN worker's model): D's real/fake logit on the image (LOGAN, Hayes et
  al. 2019: a D trained on an image calls it real more confidently);
- `d_class_loss` (ACGAN): minus D's class cross-entropy on the image's true label;
- `g_distance` (GAN-Leaks full black-box, Chen et al. 2020): minus the distance from the image to
  the nearest of n generated samples, for anyone holding the generator (or its samples).

The discriminator attacked for site k is the one site k held last (MD-GAN: trained on k's data since
the last swap; the standalone GAN: its only D; FL-GAN: the local D it sent to be averaged at the
last round).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mdgan.config import ConfigError, DataConfig, TrainingConfig, named

ATTACKS = ("d_output", "d_class_loss", "g_distance")
FPRS = (0.01, 0.001)


# -- the statistics ----------------------------------------------------------------------------

def roc_auc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """P(score of a member > score of a non-member) + 1/2 P(tie): the Mann-Whitney form of the AUC."""
    from scipy.stats import rankdata  # (scipy comes with Opacus)

    ranks = rankdata(np.concatenate([members, nonmembers]))  # ties share their average rank
    m, n = len(members), len(nonmembers)
    return float((ranks[:m].sum() - m * (m + 1) / 2) / (m * n))


def roc_curve(members: np.ndarray, nonmembers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every threshold, from (0, 0) to (1, 1)."""
    thresholds = np.unique(np.concatenate([members, nonmembers]))[::-1]
    def at_or_above(scores):  # share of scores >= each threshold
        return 1.0 - np.searchsorted(np.sort(scores), thresholds, side="left") / len(scores)
    return np.concatenate([[0.0], at_or_above(nonmembers)]), np.concatenate([[0.0], at_or_above(members)])


def tpr_at_fpr(members: np.ndarray, nonmembers: np.ndarray, fpr: float) -> float:
    """The largest TPR over thresholds whose FPR is at most `fpr` (strictly above the threshold)."""
    threshold = np.quantile(nonmembers, 1 - fpr, method="higher")  # at most fpr of non-members above it
    return float((members > threshold).mean())


def attack_statistics(members: np.ndarray, nonmembers: np.ndarray, bootstrap: int, seed: int) -> dict:
    """AUC and TPR at each FPR, each with a 95% bootstrap interval."""
    def stats(m, n):
        return [roc_auc(m, n), *(tpr_at_fpr(m, n, f) for f in FPRS)]

    point = stats(members, nonmembers)
    rng = np.random.default_rng(seed)
    draws = np.array([stats(members[rng.integers(0, len(members), len(members))],
                            nonmembers[rng.integers(0, len(nonmembers), len(nonmembers))])
                      for _ in range(bootstrap)]) if bootstrap else None
    names = ["auc", *(f"tpr_at_{f:g}_fpr" for f in FPRS)]
    out = {}
    for k, name in enumerate(names):
        out[name] = point[k]
        if draws is not None:
            out[f"{name}_ci"] = [float(np.percentile(draws[:, k], 2.5)), float(np.percentile(draws[:, k], 97.5))]
    return out


# -- the scores --------------------------------------------------------------------------------

def discriminator_scores(discriminator: torch.nn.Module, conditional: bool, images: torch.Tensor,
                         labels: torch.Tensor) -> dict[str, np.ndarray]:
    """images (n, *shape), labels (n,) -> each D attack's score per image (higher: member)."""
    discriminator.eval()
    with torch.no_grad():
        logits = torch.cat([discriminator(chunk) for chunk in images.split(1024)])  # (n, 1 [+ C])
    scores = {"d_output": logits[:, 0].double().numpy()}
    if conditional:
        scores["d_class_loss"] = (-F.cross_entropy(logits[:, 1:], labels, reduction="none")).double().numpy()
    return scores


def generator_distance_scores(generated: torch.Tensor, images: torch.Tensor) -> np.ndarray:
    """GAN-Leaks: minus the L2 distance to the nearest generated sample; generated (g, d), images (n, d)."""
    generated, images = generated.reshape(len(generated), -1).double(), images.reshape(len(images), -1).double()
    nearest = torch.cat([torch.cdist(chunk, generated).min(dim=1).values for chunk in images.split(512)])
    return (-nearest).numpy()


# -- a run -------------------------------------------------------------------------------------

@dataclass
class AuditSettings:
    members: int = 500  # per site (fewer when a site holds fewer)
    nonmembers: int = 1000
    generated: int = 5000
    bootstrap: int = 200
    seed: int = 0
    data_root: str | None = None  # where the run's shared dataset is here (a run of the services records none)


def _pick(count: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count].sort().values


def recover_sites(summary: dict, config: TrainingConfig, settings: AuditSettings = AuditSettings()):
    """Each site's shard and the held-out images, from the run's record of its data; one clear line
    (ConfigError) when the split cannot be recovered."""
    from mdgan.data import load_all_shards, load_stored_dataset, shard_indices, to_unit_range

    data = summary.get("data")
    if not data:
        if summary.get("site_dirs") or summary.get("mode") in ("grpc", "local"):
            raise ConfigError("this run's workers trained on their sites' own data, not on a split of one dataset: "
                              "each site audits its own exposure on its own machine (mdgan audit RUN --site-data "
                              "ITS_FOLDER --held-out ITS_HELD_OUT_FOLDER --state-dir ITS_STATE_DIR)")
        raise ConfigError("this run's summary.json does not record its data split (a run of an older mdgan): "
                          "nothing to audit against")
    data = dict(data)
    if settings.data_root is not None:
        data["data_root"] = settings.data_root
    elif data.get("data_root") is None:
        raise ConfigError(f"this run records how its workers cut {data['dataset']} into shards, not where that data "
                          f"is on this machine: give {named('data_root')} (the folder its workers loaded it from)")
    data = DataConfig(**data)
    try:
        shards = load_all_shards(data, config.model.sample_shape)
    except (OSError, ConfigError) as exc:
        raise ConfigError(f"the run's data ({data.dataset} under {data.data_root}) cannot be loaded: {exc}") from None
    sizes = summary.get("worker_sizes") or {}
    for shard in shards:
        recorded = sizes.get(f"worker-{shard.index}")
        if recorded is not None and recorded != len(shard):
            raise ConfigError(f"the split recovered gives worker-{shard.index} {len(shard)} samples, the run had "
                              f"{recorded}: the data under {data.data_root} is not the run's")
    images, labels = load_stored_dataset(data)
    if data.max_samples and data.max_samples < len(labels):  # held out: the training images no site held
        used = torch.cat(shard_indices(labels, data))
        mask = torch.ones(len(labels), dtype=torch.bool)
        mask[used] = False
        held_images, held_labels = to_unit_range(images[mask]), labels[mask]
    elif data.dataset == "mnist":
        from mdgan.data import load_mnist

        held_images, held_labels = load_mnist(data.data_root, train=False)
    else:
        raise ConfigError(f"no held-out images of {data.dataset}: audit a run on MNIST, or on a subset "
                          f"({named('max_samples')}) whose other images serve as non-members")
    return shards, held_images.reshape(-1, *config.model.sample_shape), held_labels


def final_discriminator(state_dir: str, run_id: str | None) -> dict | None:
    """What a worker kept of a finished run in its state dir (STATE/finished/RUN/discriminator.pt):
    {"discriminator", "worker_id", "run_id", ...}; with run_id None the newest run's. None: nothing kept."""
    from mdgan import checkpoint

    kept = os.path.join(state_dir, checkpoint.FINISHED_DIR)
    if run_id is None:
        try:
            runs = sorted(os.scandir(kept), key=lambda e: e.stat().st_mtime)
        except FileNotFoundError:
            return None
        if not runs:
            return None
        run_id = runs[-1].name
    path = os.path.join(kept, run_id, checkpoint.FINAL_DISCRIMINATOR_FILE)
    return _read(path, ("discriminator", "worker_id")) if os.path.exists(path) else None


def _read(path: str, keys: tuple[str, ...]) -> dict:
    """A discriminators' file a run or a worker wrote, with these keys (CheckpointError when it cannot be read,
    ConfigError when it is another program's), each in one line."""
    from mdgan import checkpoint

    found = checkpoint.load(path)
    if not isinstance(found, dict) or any(key not in found for key in keys):
        raise ConfigError(f"{path}: not the discriminators a run keeps (no {', '.join(keys)})")
    return found


def load_discriminators(run_dir: str, config: TrainingConfig, run_id: str | None = None) -> dict[str, dict] | None:
    """worker id -> its final D: discriminators.pt (simulate --save-discriminators), else what each worker
    of `mdgan local` kept at the run's end (OUT/workers/worker-K/finished/RUN), else each worker's
    latest checkpoint (OUT/workers/RUN/worker-K); None when none exists."""
    from mdgan import checkpoint

    path = os.path.join(run_dir, "discriminators.pt")
    if os.path.exists(path):
        saved = _read(path, ("discriminators",))["discriminators"]
        if not isinstance(saved, dict):
            raise ConfigError(f"{path}: not the discriminators a run keeps (worker id -> state)")
        return saved
    root = os.path.join(run_dir, "workers")
    found = {}
    if run_id and os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            kept = final_discriminator(os.path.join(root, name), run_id)
            if kept is not None:
                found[kept["worker_id"]] = kept["discriminator"]
    if found:
        return found
    if os.path.isdir(root):
        for run_id in os.listdir(root):
            for name in sorted(os.listdir(os.path.join(root, run_id))):
                store = checkpoint.CheckpointStore(os.path.join(root, run_id, name))
                held = store.holding("worker")
                if held:
                    found[name] = store.load(max(held), "worker")["discriminator"]
    return found or None


def audit(run_dir: str, settings: AuditSettings = AuditSettings()) -> dict:
    """Every attack on every site of the run in run_dir: the report that audit.json holds."""
    from mdgan.sampling import load_run

    run = load_run(run_dir)
    config, summary = run.config, run.summary
    shards, held_images, held_labels = recover_sites(summary, config, settings)
    discriminators = load_discriminators(run_dir, config, summary.get("run_id"))
    nonmember_source = "unused training images" if (summary["data"] or {}).get("max_samples") else "MNIST test set"
    return _attack(run, [SiteMembers(f"worker-{s.index}", s.index, s.images, s.labels) for s in shards],
                   held_images, held_labels,
                   discriminators, nonmember_source, settings)


def audit_site(run_dir: str, site_data: str, held_out: str, dataset: str = "imagefolder",
               state_dir: str | None = None, settings: AuditSettings = AuditSettings()) -> dict:
    """One site's own audit, on its own machine: its images (site_data, in the `dataset` format its worker
    read) the members, images of its own it never trained on (held_out, the same format) the non-members;
    attacked with the run's final generator (run_dir: its checkpoint.pt, from the server) and, from the
    worker's state dir, the discriminator it held at the run's end."""
    from mdgan.sampling import load_run, load_generator
    from mdgan.sites import load_site, map_labels

    if os.path.exists(os.path.join(run_dir, "summary.json")):
        run = load_run(run_dir)
    else:  # the generator alone (checkpoint.pt), as a server's operator may hand it to a site
        from mdgan.sampling import Run

        generator = load_generator(run_dir)
        run = Run(run_dir, generator, None, {})
    spec = run.generator.spec
    classes = tuple(run.summary.get("classes") or ()) or None

    def images_of(folder: str, what: str):
        try:
            site = load_site(dataset, folder)
            return site.conform(spec.sample_shape), map_labels(site, classes)
        except (ConfigError, OSError) as exc:
            raise ConfigError(f"{what} {folder}: {exc}") from None

    members, member_labels = images_of(site_data, "--site-data")
    held_images, held_labels = images_of(held_out, "--held-out")
    discriminators, worker = None, "site"
    if state_dir is not None:
        kept = final_discriminator(state_dir, run.summary.get("run_id"))
        if kept is None:
            raise ConfigError(f"--state-dir {state_dir}: no discriminator kept there for run "
                              f"{run.summary.get('run_id') or '(the newest)'} (a worker keeps the one it held at a "
                              "finished run's end, with --state-dir)")
        worker = kept["worker_id"] or worker
        discriminators = {worker: kept["discriminator"]}
    index = int(worker.rpartition("-")[2]) if worker.startswith("worker-") else 0  # (its draws: as the run's audit)
    return _attack(run, [SiteMembers(worker, index, members, member_labels)], held_images, held_labels, discriminators,
                   f"held-out images of the site ({held_out})", settings)


@dataclass
class SiteMembers:
    """One site's members: its worker id, its rank (which seeds its draws), images (m, *shape), labels (m,)."""

    worker: str
    index: int
    images: torch.Tensor
    labels: torch.Tensor


def _discriminator(spec, state, worker: str) -> torch.nn.Module:
    """The run's discriminator network holding a worker's kept state; ConfigError when it is not one of its."""
    from mdgan.models import build_discriminator

    disc = build_discriminator(spec, 0)
    try:
        disc.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:  # (another network's, or not a state at all)
        raise ConfigError(f"{worker}'s kept discriminator is not this run's network: "
                          f"{' '.join(str(exc).split())[:300]}") from None
    return disc


def _attack(run, sites: list[SiteMembers], held_images: torch.Tensor,
            held_labels: torch.Tensor, discriminators: dict | None, nonmember_source: str,
            settings: AuditSettings) -> dict:
    """Every attack on every site, against non-members
    drawn from the held-out images: the report."""
    summary = run.summary
    algorithm = summary.get("algorithm", "mdgan")
    spec = run.generator.spec
    attacked = {worker: _discriminator(spec, state, worker) for worker, state in (discriminators or {}).items()
                if any(site.worker == worker for site in sites)}  # (each checked before any attack runs)
    nonmember_pick = _pick(settings.nonmembers, len(held_labels), settings.seed + 1)
    non_images, non_labels = held_images[nonmember_pick], held_labels[nonmember_pick]
    noise = torch.Generator().manual_seed(settings.seed + 2)
    z = torch.randn(settings.generated, spec.latent_dim, generator=noise)
    fake_labels = torch.arange(settings.generated) % spec.num_classes if spec.conditional else None
    with torch.no_grad():
        generated = run.generator(z, fake_labels)  # (g, d)
    non_g = generator_distance_scores(generated, non_images)
    report = {"run": os.path.abspath(run.path), "algorithm": algorithm, "iterations": summary.get("iterations"),
              "privacy": summary.get("privacy"), "settings": settings.__dict__,
              "nonmember_source": nonmember_source, "discriminators": discriminators is not None, "sites": {}}
    curves = {}
    for site_members in sites:
        worker, index, site_images, site_labels = (site_members.worker, site_members.index, site_members.images,
                                                   site_members.labels)
        pick = _pick(min(settings.members, len(site_labels)), len(site_labels), settings.seed + 3 + index)
        images, labels = site_images[pick], site_labels[pick]
        site = {"members": len(pick), "nonmembers": len(nonmember_pick), "attacks": {}}
        member_scores = {"g_distance": generator_distance_scores(generated, images)}
        nonmember_scores = {"g_distance": non_g}
        if worker in attacked:
            disc = attacked[worker]
            member_scores.update(discriminator_scores(disc, spec.conditional, images, labels))
            nonmember_scores.update(discriminator_scores(disc, spec.conditional, non_images, non_labels))
        for attack in ATTACKS:
            if attack in member_scores:
                site["attacks"][attack] = attack_statistics(member_scores[attack], nonmember_scores[attack],
                                                            settings.bootstrap, settings.seed + index)
                curves.setdefault(attack, []).append((member_scores[attack], nonmember_scores[attack]))
        report["sites"][worker] = site
    report["summary"] = {}
    for attack in curves:
        aucs = [s["attacks"][attack]["auc"] for s in report["sites"].values() if attack in s["attacks"]]
        report["summary"][attack] = {"auc_mean": float(np.mean(aucs)), "auc_max": float(np.max(aucs))}
    report["_curves"] = curves  # (for the plot; not written to audit.json)
    return report


def write_report(report: dict, out_dir: str) -> list[str]:
    """audit.json and roc.png in out_dir; their paths."""
    from mdgan import checkpoint

    os.makedirs(out_dir, exist_ok=True)
    curves = report.pop("_curves", {})
    path = os.path.join(out_dir, "audit.json")
    checkpoint.atomic_write_json(path, report)
    written = [path]
    if curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 4), squeeze=False)
        for ax, (attack, pairs) in zip(axes[0], sorted(curves.items())):
            for k, (members, nonmembers) in enumerate(pairs):
                fpr, tpr = roc_curve(members, nonmembers)
                ax.plot(fpr, tpr, lw=1, alpha=0.7, label=f"worker-{k}" if len(pairs) <= 10 else None)
            ax.plot([1e-4, 1], [1e-4, 1], "k--", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(1e-3, 1)
            ax.set_ylim(1e-3, 1.02)
            ax.set_title(f"{attack}: mean AUC {report['summary'][attack]['auc_mean']:.3f}")
            ax.set_xlabel("false positive rate")
            ax.set_ylabel("true positive rate")
        handles, labels = axes[0][0].get_legend_handles_labels()
        if handles:
            axes[0][-1].legend(fontsize=7, loc="lower right")
        fig.suptitle(f"membership inference: {report['algorithm']}, {report['iterations']} iterations"
                     + (f", epsilon {report['privacy']['epsilon_max']:.2f}" if report.get("privacy") else ""))
        fig.tight_layout()
        png = os.path.join(out_dir, "roc.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written


def table(report: dict) -> str:
    """The console table: one row per site and attack."""
    lines = [f"{'site':10} {'attack':13} {'AUC':>6} {'95% CI':>15} {'TPR@1%':>7} {'TPR@0.1%':>8}"]
    for worker, site in report["sites"].items():
        for attack, s in site["attacks"].items():
            ci = s.get("auc_ci")
            lines.append(f"{worker:10} {attack:13} {s['auc']:6.3f} "
                         f"{(f'[{ci[0]:.3f}, {ci[1]:.3f}]' if ci else ''):>15} "
                         f"{s['tpr_at_0.01_fpr']:7.3f} {s['tpr_at_0.001_fpr']:8.3f}")
    return "\n".join(lines)

