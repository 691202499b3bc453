"""What a worker trains on, and what its joins tell the server of it: its site's own data (shaped for
the run's model at the welcome), its shard of a shared dataset (emulation), or the whole shared dataset
it cuts the shard the server assigns from."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.data import Shard, take_shard
from mdgan.images import NUMERIC_CLASSES, SiteData
from mdgan.sites import map_labels
from services.common.proto import coordinator_pb2 as pb
from services.worker.algorithms.base import ServerGone

log = logging.getLogger("mdgan.worker")


@dataclass(frozen=True)
class WorkerData:
    """What a worker trains on: exactly one of its site's own data (shaped for the model once the server's
    spec arrives; its slot chosen by the operator, or None: by the server), its shard of a shared dataset
    (emulation; index chosen by the operator), or the whole shared dataset it will cut its shard from
    once the server assigns an index."""

    shard: Shard | None = None
    dataset: tuple[torch.Tensor, torch.Tensor, DataConfig] | None = None
    site: SiteData | None = None
    slot: int | None = None
    # how the shared dataset an emulated worker's shard comes from was cut (the server records it for
    # `mdgan audit`); a worker assigned its shard has it with its dataset
    split: DataConfig | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.shard, self.dataset, self.site)) != 1:
            raise ValueError("give a site's data, a shard, or a dataset to take the assigned shard from")


class HeldData:
    """A worker's data through its runs: `shard` once it has one (None: until the welcome names it)."""

    def __init__(self, data: WorkerData):
        self.shard = data.shard
        self.dataset = data.dataset
        self.split = data.split if data.split is not None else (data.dataset[2] if data.dataset is not None else None)
        self.site = data.site
        self.slot = data.slot
        self._site_join: pb.Join | None = None  # a site's data facts, sent again on every rejoin

    def join(self) -> pb.Join:
        """The data facts of a join (or rejoin)."""
        if self.site is not None or self._site_join is not None:
            if self._site_join is None:  # what the site tells the server about its data, kept for rejoins
                site = self.site
                self._site_join = pb.Join(own_data=True, shard_size=len(site),
                                          num_classes=site.num_classes if site.labelled else 0,
                                          class_names=site.class_names or ())
                if site.files is not None:  # images: shaped for the model once its spec is known
                    self._site_join.image_shape.extend(site.image_shape)
                else:
                    self._site_join.sample_shape.extend(site.image_shape)
            join = pb.Join()
            join.CopyFrom(self._site_join)
            if self.shard is not None:  # back after a break: the slot this site held
                join.shard_index = self.shard.index
            elif self.slot is not None:
                join.shard_index = self.slot
            return join
        if self.shard is not None:
            images, labels = self.shard.images, self.shard.labels
            join = pb.Join(shard_index=self.shard.index, shard_size=len(self.shard))
        else:
            images, labels, _ = self.dataset
            join = pb.Join(dataset_size=images.shape[0])
        join.sample_shape.extend(images.shape[1:])
        # the dataset's classes, not the shard's: a non-i.i.d. shard may lack the last ones
        join.num_classes = max(NUMERIC_CLASSES, int(labels.max()) + 1)
        if self.split is not None:
            d = self.split
            join.split.CopyFrom(pb.EmulatedSplit(dataset=d.dataset, split=d.split, split_seed=d.split_seed,
                                                 dirichlet_alpha=d.dirichlet_alpha, max_samples=d.max_samples,
                                                 num_shards=d.num_shards))
        return join

    def take(self, config: TrainingConfig, index: int, classes: tuple[str, ...] | None) -> Shard:
        """The shard this worker trains on in the run of `config`, slot `index` (the welcome's); classes: the
        run's class names (a site's labels are mapped to them)."""
        if self.site is not None:
            site = self.site
            try:
                images, labels = site.conform(config.model.sample_shape), map_labels(site, classes)
            except ConfigError as exc:
                raise ServerGone(f"this site's data does not fit the run: {exc}") from exc
            self.shard = Shard(images, labels, index, config.workers)
            self.site = None  # keep only the shaped samples
            log.info("slot %d of %d: this site's %d samples, shaped %s", index, config.workers,
                     len(self.shard), tuple(config.model.sample_shape))
        elif self.shard is None:
            images, labels, data = self.dataset
            data = replace(data, num_shards=config.workers)
            self.shard = take_shard(images, labels, index, data, config.model.sample_shape)
            self.dataset = None  # keep only our shard
            log.info("the server assigned shard %d of %d (%d samples)", self.shard.index, config.workers,
                     len(self.shard))
        elif self.shard.num_shards != config.workers:
            raise ServerGone(f"this worker cut the data into {self.shard.num_shards} shards but the run has "
                             f"{config.workers} workers: set --num-shards {config.workers}")
        return self.shard
