"""A site's own data: what one worker holds when nobody else has it (the real deployment).

A site is a folder. Its format is one of
  * "imagefolder": torchvision's ImageFolder layout, one sub-folder per class (DIR/cat/001.png, ...),
    or, for a plain GAN, unlabelled images directly in DIR;
  * "mnist" / "cifar10": the dataset files in torchvision's layout (DIR/MNIST/raw, ...), here holding
    this site's images only (all of them are its data: nothing is cut out of them).

Loading is in two steps, because only the server knows the image size its model needs:
  1. `load_site` reads and checks every image before the worker joins (so bad data fails early,
     with the file named) and reports m, the classes and the images' shape;
  2. `SiteData.conform` turns them into the model's samples once the run is known: channels
     (grey or RGB), size (resized, bilinear, when the aspect ratio matches), float32 in [-1, 1]
     (x / 127.5 - 1, exactly as mdgan.data's MNIST and CIFAR readers), flattened channel-first.
Labels are mapped from the site's class names to the run's (`map_labels`), so two sites that hold
different subsets of the classes still agree on what label 3 means.

The emulation of the paper (every worker sees a shared dataset and keeps shard i of a seeded split)
stays in mdgan.data; `split_to_sites` turns a dataset into per-site folders to try this path on one
machine (`mdgan split`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter

import torch

from mdgan.config import ConfigError, DataConfig, named
from mdgan.images import (SiteData, _list, load_imagefolder)

log = logging.getLogger(__name__)

# The formats a site folder may have (--dataset), and what to do with a file that is not a usable image.
SITE_FORMATS = ("imagefolder", "mnist", "cifar10", "synthetic")
SITE_PREFIX = "site-"  # `mdgan split` writes DIR/site-0, DIR/site-1, ...


def load_site(dataset: str, root: str, bad_images: str = "refuse") -> SiteData:
    """All of a site's data (nothing is cut out of it), checked; see the module doc."""
    if dataset == "imagefolder":
        return load_imagefolder(root, bad_images)
    if dataset not in SITE_FORMATS:
        raise ConfigError(f"unknown site format {dataset!r}; choose from {SITE_FORMATS}")
    from mdgan.data import load_dataset

    images, labels = load_dataset(DataConfig(dataset, root, 1))
    return SiteData(root, labels, None, samples=images)


def map_labels(site: SiteData, run_classes: tuple[str, ...] | None) -> torch.Tensor:
    """The site's labels as indices into the run's class names (None: numeric labels, kept)."""
    if site.class_names is None or run_classes is None or not site.class_names:
        return site.labels
    index = {name: i for i, name in enumerate(run_classes)}
    missing = [c for c in site.class_names if c not in index]
    if missing:
        raise ConfigError(f"the classes {_list(missing)} of {site.root!r} are not among the run's classes "
                          f"({_list(run_classes)})")
    table = torch.tensor([index[c] for c in site.class_names], dtype=torch.int64)
    return table[site.labels]


def check_classes(site_classes: tuple[str, ...] | None, site_count: int, run_classes: tuple[str, ...] | None,
                  run_count: int, conditional: bool, exact: bool = False) -> str | None:
    """Why a site's classes do not fit the run, or None. The server asks at join; simulate, per site.

    A plain GAN ignores labels. An ACGAN needs labelled data: a site with numeric labels (MNIST,
    CIFAR files) needs the run's number of classes; a site with class folders needs names among
    run_classes (the run's --classes: a subset is fine; exact: the classes an earlier site set,
    which every site must then have), or, while none are set, run_count of them.
    """
    if not conditional:
        return None
    if site_classes is not None and not site_classes:
        return "the site's images are unlabelled (no class folders), and an ACGAN run needs labels: run --gan gan"
    if site_classes is None:
        if run_classes is not None and not exact:
            return f"the site's labels are numbers, the run's classes are named ({_list(run_classes)})"
        if site_count != run_count:
            return f"the site has {site_count} classes, the run has {run_count}"
        return None
    if run_classes is None:
        if len(site_classes) != run_count:
            return (f"the site has {len(site_classes)} classes ({_list(site_classes)}), the run has {run_count}; "
                    "give the server --classes to let each site hold a subset of them")
        return None
    if exact and tuple(site_classes) != tuple(run_classes):
        return (f"the site's classes ({_list(site_classes)}) differ from the run's ({_list(run_classes)}); "
                "give the server --classes to let each site hold a subset of them")
    unknown = [c for c in site_classes if c not in run_classes]
    if unknown:
        return f"the site's classes {_list(unknown)} are not among the run's ({_list(run_classes)})"
    return None


class RunClasses:
    """The run's classes as sites join: declared (--classes) or set by the first site with class
    folders. The same rules for the server (at join) and for simulate (site by site)."""

    def __init__(self, declared: tuple[str, ...] | None, count: int, conditional: bool):
        self.declared = declared
        self.fixed: tuple[str, ...] | None = None
        self.count = count
        self.conditional = conditional

    @property
    def names(self) -> tuple[str, ...] | None:
        return self.declared or self.fixed

    def check(self, site_classes: tuple[str, ...] | None, site_count: int) -> str | None:
        """Why this site cannot join, or None (and then its classes may fix the run's)."""
        if self.declared is not None:
            return check_classes(site_classes, site_count, self.declared, self.count, self.conditional)
        why = check_classes(site_classes, site_count, self.fixed, self.count, self.conditional, exact=True)
        if why is None and self.conditional and site_classes and self.fixed is None:
            self.fixed = tuple(site_classes)
        return why


def site_shards(site_dirs: str, fmt: str, workers: int, sample_shape: tuple[int, ...], run: RunClasses,
                bad_images: str = "refuse") -> list:
    """Every site of an in-process run (simulate): SITE_DIRS/site-i becomes worker i's shard, checked
    and shaped exactly as a worker does it for the server."""
    from mdgan.data import Shard

    found = count_sites(site_dirs)
    if found != workers:
        raise ConfigError(f"{site_dirs!r} holds {found} site folders; the run has {workers} workers")
    sites = [load_site(fmt, site_dir(site_dirs, i), bad_images) for i in range(workers)]
    for i, site in enumerate(sites):
        why = run.check(site.class_names, site.num_classes if site.labelled else 0)
        if why:
            raise ConfigError(f"{site_dir(site_dirs, i)}: {why}")
    return [Shard(site.conform(sample_shape), map_labels(site, run.names), i, workers) for i, site in enumerate(sites)]


def site_dir(site_dirs: str, index: int) -> str:
    return os.path.join(site_dirs, f"{SITE_PREFIX}{index}")


def count_sites(site_dirs: str) -> int:
    """How many site-0, site-1, ... folders there are (consecutive from 0)."""
    if not os.path.isdir(site_dirs):
        raise ConfigError(f"{named('site_dirs')} {site_dirs!r} is not a folder")
    n = 0
    while os.path.isdir(site_dir(site_dirs, n)):
        n += 1
    if n == 0:
        raise ConfigError(f"no {SITE_PREFIX}0 folder under {site_dirs!r} (`mdgan split` writes one per site)")
    return n


# ---------------------------------------------------------------------------------------------
# mdgan split: a dataset -> one folder per site

def split_to_sites(config: DataConfig, out_dir: str, fmt: str = "png", samples: int | None = None) -> list[dict]:
    """Cut a dataset into config.num_shards sites (config.split: iid or dirichlet) and write each one
    as OUT/site-i, an ImageFolder of PNG files (one folder per class, every class present, empty where
    the site has none of it). Returns one {"site", "path", "size", "classes": {name: count}} per site.

    samples: only the dataset's first `samples` images (quick trials). Existing site folders are
    refused rather than mixed with new files.
    """
    from PIL import Image

    from mdgan.data import load_dataset, shard_indices
    from mdgan.models import image_shape

    if fmt != "png":
        raise ConfigError(f"unknown site format {fmt!r}: png")
    images, labels = load_dataset(config.validate())
    if samples is not None:
        if samples < config.num_shards:
            raise ConfigError(f"--samples {samples} cannot be cut into {config.num_shards} sites")
        images, labels = images[:samples], labels[:samples]
    pieces = shard_indices(labels, config)
    channels, height, width = image_shape(images.shape[1])
    # back to the bytes on disk: x = p / 127.5 - 1 exactly inverts for p in 0..255
    pixels = images.add(1.0).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8).reshape(-1, channels, height, width)
    num_classes = int(labels.max()) + 1 if labels.numel() else 0
    names = [str(c).zfill(len(str(num_classes - 1))) for c in range(num_classes)]
    taken = [site_dir(out_dir, site) for site in range(len(pieces)) if os.path.exists(site_dir(out_dir, site))]
    if taken:  # (all looked at before any is written: no split half-made next to an earlier one)
        raise ConfigError(f"{taken[0]!r} exists; choose an empty --out")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for site, picked in enumerate(pieces):
        root = site_dir(out_dir, site)
        tmp = root + ".partial"
        if os.path.exists(tmp):  # left by an interrupted split: not to be mixed with this one
            shutil.rmtree(tmp)
        for name in names:
            os.makedirs(os.path.join(tmp, name), exist_ok=True)
        counts = Counter()
        for i in picked.tolist():
            label = int(labels[i])
            plane = pixels[i].numpy()
            image = Image.fromarray(plane[0]) if channels == 1 else Image.fromarray(plane.transpose(1, 2, 0))
            image.save(os.path.join(tmp, names[label], f"{i:06d}.png"))
            counts[names[label]] += 1
        os.replace(tmp, root)  # a site folder appears whole or not at all
        written.append({"site": site, "path": root, "size": len(picked),
                        "classes": {n: counts.get(n, 0) for n in names}})
    return written
