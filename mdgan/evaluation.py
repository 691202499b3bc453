"""Evaluation scores of the MD-GAN paper for MNIST: the "MNIST score" and FID.

Both scores replace the ImageNet Inception-v3 network of the usual Inception
score / FID with a small CNN trained on MNIST (shipped in
``mdgan/assets/mnist_classifier.pt``, produced by
``scripts/train_mnist_classifier.py``):

* MNIST score = exp(E_x KL(p(y|x) || p(y))), the Inception score computed with
  the classifier's softmax.  Between 1 (every image gets the same class
  distribution) and 10 (confident predictions, classes balanced).
* FID = Fréchet distance between Gaussian fits of the classifier's penultimate
  activations on generated images and on real reference images.

Images are handled in the GAN's value range: float32 in [-1, 1]
(``pixel / 127.5 - 1``), shape (N, 1, 28, 28) or flattened (N, 784).

The statistics themselves come from torchmetrics (``InceptionScore`` and
``FrechetInceptionDistance``, which accept a custom feature ``nn.Module`` and
then need neither torch-fidelity nor any download).  torchmetrics is imported
lazily, on the first score computed, so that ``import mdgan.evaluation`` (e.g.
for ``MnistClassifier``) stays light for processes that never score.

This module depends on torch (the MNIST test set is read by mdgan.data)
only; it must not import grpc or prometheus_client.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "MnistClassifier",
    "DEFAULT_WEIGHTS",
    "load_mnist_classifier",
    "load_mnist_test_images",
    "mnist_score",
    "fid",
    "ScoreEvaluator",
]

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "assets" / "mnist_classifier.pt"

_IMG_SHAPE = (1, 28, 28)
_IMG_NUMEL = 28 * 28


# --------------------------------------------------------------------------- #
# Classifier
# --------------------------------------------------------------------------- #
class MnistClassifier(nn.Module):
    """Small CNN for MNIST in the GAN's value range [-1, 1].

    conv(1->32, 3x3) -> ReLU -> maxpool2 -> conv(32->64, 3x3) -> ReLU -> maxpool2
    -> linear(3136 -> 64) -> ReLU [penultimate features] -> dropout -> linear(64 -> 10).
    About 220k parameters (~0.9 MB of float32 weights).  No batch norm, so the
    outputs of a sample never depend on the rest of its batch.
    """

    num_features: int = 64  # dimension of features(); torchmetrics' FID reads this name

    def __init__(self, num_features: int = 64, dropout: float = 0.25) -> None:
        super().__init__()
        self.num_features = int(num_features)
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, self.num_features)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(self.num_features, 10)

    def features(self, x: Tensor) -> Tensor:
        """Penultimate activations: x (N,1,28,28) or (N,784) in [-1,1] -> (N, num_features)."""
        x = _as_images(x)  # (N,1,28,28)
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (N,32,14,14)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # (N,64,7,7)
        h = F.relu(self.fc1(h.flatten(1)))  # (N,num_features)
        return h

    def forward(self, x: Tensor) -> Tensor:
        """Logits: x (N,1,28,28) or (N,784) in [-1,1] -> (N,10)."""
        h = self.features(x)  # (N,num_features)
        return self.fc2(self.dropout(h))  # (N,10)


def _as_images(x: Any) -> Tensor:
    """Any (N,784) / (N,1,28,28) / (N,28,28) batch -> float32 tensor (N,1,28,28)."""
    x = torch.as_tensor(x)
    if x.dim() == 0 or x[0].numel() != _IMG_NUMEL:
        raise ValueError(
            f"expected images of shape (N,1,28,28) or (N,784), got {tuple(x.shape)}"
        )
    return x.reshape(x.shape[0], *_IMG_SHAPE).float()


def load_mnist_classifier(
    path: str | Path | None = None, device: str | torch.device = "cpu"
) -> MnistClassifier:
    """Load the classifier weights (default: the shipped ``mdgan/assets/mnist_classifier.pt``).

    The file is a plain state dict (plus its ``num_features``) loaded with
    ``weights_only=True``.  The model is returned in eval mode, with gradients
    disabled, on ``device``.
    """
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"MNIST classifier weights not found at {path}; "
            "run scripts/train_mnist_classifier.py to produce them"
        )
    blob = torch.load(path, map_location="cpu", weights_only=True)
    state = blob["state_dict"] if "state_dict" in blob else blob
    num_features = int(blob.get("num_features", state["fc1.weight"].shape[0]))
    model = MnistClassifier(num_features=num_features)
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    return model.to(device)


# --------------------------------------------------------------------------- #
# Data helper
# --------------------------------------------------------------------------- #
def load_mnist_test_images(
    data_root: str | Path,
    n: int | None = None,
    seed: int = 0,
    return_labels: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """MNIST test images as float32 (n, 1, 28, 28) in [-1, 1] (torchvision layout under data_root).

    ``n=None`` returns all 10,000 in file order; otherwise a random subset of
    ``n`` drawn without replacement with its own generator seeded by ``seed``
    (the global RNG is not touched).  With ``return_labels`` also returns the
    int64 labels (n,).
    """
    from mdgan.data import load_mnist_uint8  # checks the files (a clear error for a corrupt one)

    images, labels = load_mnist_uint8(str(data_root), train=False)  # (10000,784) uint8, (10000,) int64
    images = images.view(-1, 28, 28)
    if n is not None:
        if not 0 < n <= images.shape[0]:
            raise ValueError(f"n must be in [1, {images.shape[0]}], got {n}")
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(images.shape[0], generator=g)[:n]
        images, labels = images[idx], labels[idx]
    x = images.unsqueeze(1).float() / 127.5 - 1.0  # (n,1,28,28) in [-1,1]
    return (x, labels.clone()) if return_labels else x


# --------------------------------------------------------------------------- #
# Scores
# --------------------------------------------------------------------------- #
class _Precomputed(nn.Module):
    """The "feature extractor" handed to torchmetrics.

    The classifier is run once per batch by ``_classifier_outputs`` (logits for
    the MNIST score and penultimate features for FID come from the same forward
    pass), so the metrics receive those outputs and this module only casts them
    to float64: a confident float32 softmax can round a probability to exactly
    0, and torchmetrics' IS then computes 0 * inf = nan for a class that no
    sample predicts.
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = int(num_features)  # read by FrechetInceptionDistance

    def forward(self, x: Tensor) -> Tensor:
        return x.double()  # (B,num_features)


@torch.no_grad()
def _classifier_outputs(classifier: MnistClassifier, images: Any, batch_size: int):
    """Yield (features (B,F), logits (B,10)) over ``images`` in batches, on the classifier's device."""
    if classifier.training:
        raise ValueError("the classifier must be in eval mode (dropout) to score images")
    dev = _device_of(classifier)
    x = _as_images(images.detach() if isinstance(images, Tensor) else images)  # (N,1,28,28)
    if x.shape[0] == 0:
        raise ValueError("need at least one image")
    for i in range(0, x.shape[0], batch_size):
        h = classifier.features(x[i : i + batch_size].to(dev))  # (B,F)
        yield h, classifier.fc2(h)  # (B,F), (B,10); dropout is the identity in eval mode


def _torchmetrics():
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
        from torchmetrics.image.inception import InceptionScore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "mdgan.evaluation needs torchmetrics (pip install torchmetrics==1.9.0)"
        ) from e
    return InceptionScore, FrechetInceptionDistance


# Metric kwargs: MD-GAN talks over gRPC, but if a caller happens to have
# torch.distributed initialised, scores must still be computed locally.
_LOCAL = dict(sync_on_compute=False, dist_sync_on_step=False)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _on_device(classifier: MnistClassifier, device) -> MnistClassifier:
    """The classifier on ``device`` (None: where it already is); never moves the caller's copy."""
    if device is None:
        return classifier
    want, have = torch.device(device), _device_of(classifier)
    if want.type == have.type and (want.index is None or want.index == have.index):
        return classifier
    return copy.deepcopy(classifier).to(device)


def _new_is_metric(splits: int):
    InceptionScore, _ = _torchmetrics()
    with warnings.catch_warnings():
        # "Metric `InceptionScore` will save all extracted features in buffer": intended.
        warnings.simplefilter("ignore", UserWarning)
        return InceptionScore(feature=_Precomputed(10), splits=splits, **_LOCAL)


def _is_compute(metric) -> float:
    # torchmetrics permutes the samples with the global CPU RNG before splitting.  Fork
    # that RNG so scoring never changes a training run's random stream, and seed the
    # fork: the order of the samples moves the float64 mean by an ulp, which made the
    # score of the same images depend on whatever had drawn from the RNG before.
    # std over a single split is nan and warns: only the mean is used.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.random.default_generator.manual_seed(0)
        warnings.simplefilter("ignore", UserWarning)
        mean, _std = metric.compute()
    return float(mean)


def _new_fid_metric(num_features: int, reset_real_features: bool = True):
    _, FrechetInceptionDistance = _torchmetrics()
    return FrechetInceptionDistance(
        feature=_Precomputed(num_features), reset_real_features=reset_real_features, **_LOCAL
    )


def mnist_score(
    images: Any,
    classifier: MnistClassifier,
    splits: int = 1,
    batch_size: int = 1000,
    device: str | torch.device | None = None,
) -> float:
    """MNIST score (Inception score with the MNIST classifier): exp(E_x KL(p(y|x) || p(y))).

    images: (N,1,28,28) or (N,784) in [-1,1].  ``splits=1`` (default) scores the
    whole set at once, which keeps a 500-image sample meaningful; with
    ``splits=k`` the mean over k disjoint chunks is returned.  ``device``:
    where to compute (default: the classifier's device).
    """
    clf = _on_device(classifier, device)
    metric = _new_is_metric(splits).to(_device_of(clf))
    for _h, logits in _classifier_outputs(clf, images, batch_size):
        metric.update(logits)  # (B,10)
    return _is_compute(metric)


def fid(
    images: Any,
    reference_images: Any,
    classifier: MnistClassifier,
    batch_size: int = 1000,
    device: str | torch.device | None = None,
) -> float:
    """Fréchet distance between Gaussian fits of the classifier's penultimate
    features on ``images`` and on ``reference_images`` (each (N,1,28,28) or
    (N,784) in [-1,1], N >= 2; use N well above ``classifier.num_features`` for
    full-rank covariances).  ``device``: where to compute (default: the
    classifier's device)."""
    clf = _on_device(classifier, device)
    metric = _new_fid_metric(clf.num_features).to(_device_of(clf))
    for h, _logits in _classifier_outputs(clf, reference_images, batch_size):
        metric.update(h, real=True)  # (B,F)
    for h, _logits in _classifier_outputs(clf, images, batch_size):
        metric.update(h, real=False)  # (B,F)
    return float(metric.compute())


class ScoreEvaluator:
    """MNIST score + FID against a fixed reference set, for periodic use during training.

    The reference features (their running sums, kept by torchmetrics' FID with
    ``reset_real_features=False``) are computed once here; each ``evaluate``
    runs the classifier once over the images to score.  ``device`` (default
    cpu) is where scoring runs; a classifier elsewhere is copied there, the
    caller's model is never moved.

        ev = ScoreEvaluator.from_mnist_test(data_root, n=2000)
        ev.evaluate(generator(z).detach())  # {"mnist_score": ..., "fid": ...}
    """

    def __init__(
        self,
        classifier: MnistClassifier,
        reference_images: Any,
        device: str | torch.device | None = "cpu",
        splits: int = 1,
        batch_size: int = 1000,
    ) -> None:
        self.classifier = _on_device(classifier, device)
        self.device = _device_of(self.classifier)
        self.splits = splits
        self.batch_size = batch_size
        self.n_reference = _as_images(reference_images).shape[0]
        if self.n_reference < 2:
            raise ValueError("the reference set needs at least 2 images")
        self._fid = _new_fid_metric(self.classifier.num_features, reset_real_features=False)
        self._fid = self._fid.to(self.device)
        for h, _logits in _classifier_outputs(self.classifier, reference_images, batch_size):
            self._fid.update(h, real=True)  # (B,F)

    @classmethod
    def from_mnist_test(
        cls,
        data_root: str | Path,
        n: int = 2000,
        seed: int = 0,
        classifier: MnistClassifier | None = None,
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> "ScoreEvaluator":
        """Reference set = ``n`` random MNIST test images; classifier = the shipped weights."""
        if classifier is None:
            classifier = load_mnist_classifier(device=device)
        ref = load_mnist_test_images(data_root, n=n, seed=seed)  # (n,1,28,28)
        return cls(classifier, ref, device=device, **kwargs)

    def evaluate(self, images: Any) -> dict[str, float]:
        """Score images (N,1,28,28) or (N,784) in [-1,1] -> {"mnist_score": float, "fid": float}.

        FID needs N >= 2 (and N well above ``classifier.num_features`` to be meaningful).
        """
        is_metric = _new_is_metric(self.splits).to(self.device)
        self._fid.reset()  # drops the previously scored set, keeps the reference sums
        for h, logits in _classifier_outputs(self.classifier, images, self.batch_size):
            is_metric.update(logits)  # (B,10)
            self._fid.update(h, real=False)  # (B,F)
        return {"mnist_score": _is_compute(is_metric), "fid": float(self._fid.compute())}
