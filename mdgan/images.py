"""Images on disk: one folder of images read and checked (torchvision's ImageFolder layout, or
unlabelled images), and shaped for a model (grey <-> RGB, resized when the aspect ratio matches,
float32 in [-1, 1]). A site's data (mdgan/sites.py) and the emulation's image-folder dataset
(mdgan/data.py) both read images through here.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from mdgan.config import ConfigError, named

log = logging.getLogger("mdgan.sites")

BAD_IMAGE_POLICIES = ("refuse", "skip")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
NUMERIC_CLASSES = 10  # MNIST, CIFAR-10 and the synthetic set label their samples 0..9
_NAMED = 5  # bad files named in an error message (then a count)


@dataclass
class SiteData:
    """One site's data as found on disk, before it is shaped for a model.

    Image folders: `files` (path per sample, checked at load) and `shape`, the (C, H, W) the site
    reports (most common size; RGB if any image is). Their pixels are read again by `conform`, once
    the model's size is known, so a site of large photos never sits in memory at full size.
    Known datasets (MNIST, CIFAR files): `samples`, already (m, d) float32 in [-1, 1].
    labels: (m,) int64, indices into class_names. class_names: the site's class folders, sorted; None
    when the labels are the numbers 0..NUMERIC_CLASSES-1 of a known dataset; () for unlabelled images.
    """

    root: str
    labels: torch.Tensor
    class_names: tuple[str, ...] | None
    files: list[str] | None = None
    shape: tuple[int, int, int] | None = None
    samples: torch.Tensor | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of the images left out

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def labelled(self) -> bool:
        return self.class_names is None or len(self.class_names) > 0

    @property
    def num_classes(self) -> int:
        return NUMERIC_CLASSES if self.class_names is None else len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """(C, H, W) of the images (image folders), or the flat sample shape (known datasets)."""
        return tuple(self.shape) if self.files is not None else tuple(self.samples.shape[1:])

    def conform(self, sample_shape: tuple[int, ...]) -> torch.Tensor:
        """The site's samples as the model takes them: (m, *sample_shape) float32 in [-1, 1]."""
        if self.files is None:
            if math.prod(self.samples.shape[1:]) != math.prod(sample_shape):
                raise ConfigError(f"the samples under {self.root!r} have shape {tuple(self.samples.shape[1:])}, "
                                  f"which does not fit the model's {tuple(sample_shape)}")
            return self.samples.reshape(-1, *sample_shape)
        target = model_image_shape(sample_shape)
        if not resizable(self.image_shape, target):
            raise ConfigError(f"the images under {self.root!r} are {_geometry(self.image_shape)}; the model takes "
                              f"{_geometry(target)}, another aspect ratio (crop or pad them first)")
        pixels = np.empty((len(self.files), *target), dtype=np.uint8)
        for i, path in enumerate(self.files):
            try:
                image = _decode(path)
            except Exception as exc:
                raise ConfigError(f"{path} was read at load but cannot be now ({type(exc).__name__}: {exc}): "
                                  "did the site's folder change?") from None
            if not resizable(image.shape, target):
                raise ConfigError(f"{path} is now {_geometry(image.shape)}: did the site's folder change?")
            pixels[i] = _shape_image(image, target)
        flat = torch.from_numpy(pixels).reshape(len(self.files), -1)
        return flat.to(torch.float32).div_(127.5).sub_(1.0).reshape(-1, *sample_shape)


def model_image_shape(sample_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of the model's samples (flat ones are read as square grey or RGB images)."""
    from mdgan.models import image_shape

    if len(sample_shape) == 3:
        return tuple(sample_shape)
    try:
        return image_shape(math.prod(sample_shape))
    except ValueError as exc:
        raise ConfigError(f"the model's samples {tuple(sample_shape)} are not images: {exc}") from None


def resizable(image: tuple[int, ...], target: tuple[int, int, int]) -> bool:
    """Images of shape (C, H, W) can become `target`: grey <-> RGB, and the same aspect ratio."""
    return (len(image) == 3 and image[0] in (1, 3) and image[1] > 0 and image[2] > 0
            and image[1] * target[2] == image[2] * target[1])


MAX_CLASSES = 10_000  # class names a join may carry (each at most MAX_CLASS_NAME characters)
MAX_CLASS_NAME = 255


def check_class_names(names: tuple[str, ...]) -> str | None:
    """Why a list of class names (from a join, or --classes) is malformed, or None."""
    if len(names) > MAX_CLASSES:
        return f"{len(names)} class names (at most {MAX_CLASSES})"
    if any(not n or len(n) > MAX_CLASS_NAME for n in names):
        return f"class names must have 1 to {MAX_CLASS_NAME} characters"
    if len(set(names)) != len(names):
        return "class names repeat"
    return None


def _list(names) -> str:
    """Names for a message: the first few, then a count."""
    names = list(names)
    return ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")


def _geometry(shape: tuple[int, ...]) -> str:
    if len(shape) != 3:
        return f"samples of shape {shape}"
    return f"{shape[1]}x{shape[2]} {'grey' if shape[0] == 1 else 'RGB'}"


def _shape_image(image: np.ndarray, target: tuple[int, int, int]) -> np.ndarray:
    """One (C, H, W) uint8 image -> `target` (C', H', W'): grey <-> RGB, then bilinear resizing."""
    from PIL import Image

    channels, height, width = target
    if image.shape[0] != channels:
        if channels == 1:  # ITU-R 601-2 luma, as PIL's convert("L")
            luma = (image.astype(np.int32) * np.array([299, 587, 114], dtype=np.int32).reshape(3, 1, 1)).sum(0)
            image = ((luma + 500) // 1000).clip(0, 255).astype(np.uint8)[None]
        else:
            image = np.repeat(image, 3, axis=0)
    if image.shape[1:] != (height, width):  # per plane: the same bilinear filter for grey and RGB
        image = np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(plane)).resize((width, height),
                                                                                         Image.BILINEAR))
                          for plane in image])
    return image


# ---------------------------------------------------------------------------------------------
# reading a site folder

def find_images(root: str) -> tuple[tuple[str, ...], list[tuple[str, int]]]:
    """The class names and (path, class index) of every image file under root, in a fixed order.

    Sub-folders of root are the classes (sorted by name, as torchvision's ImageFolder; a class
    folder may be empty: this site has none of that class), searched recursively; with no
    sub-folder the images directly in root are unlabelled (class_names ()). Hidden entries and
    files without an image extension are ignored, as ImageFolder does.
    """
    if not os.path.isdir(root):
        raise ConfigError(f"the data folder {root!r} does not exist")
    entries = sorted(e for e in os.listdir(root) if not e.startswith("."))
    classes = tuple(e for e in entries if os.path.isdir(os.path.join(root, e)))
    found: list[tuple[str, int]] = []
    if not classes:
        found = [(os.path.join(root, e), 0) for e in entries if e.lower().endswith(IMAGE_EXTENSIONS)]
    for index, name in enumerate(classes):
        for folder, dirs, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [(os.path.join(folder, f), index) for f in sorted(files)
                      if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
    if not found:
        layout = f"class folders {', '.join(classes[:_NAMED])}" if classes else "no class folders"
        raise ConfigError(f"no images under {root!r} ({layout}; looked for {', '.join(IMAGE_EXTENSIONS)}): a site "
                          "folder holds one sub-folder of images per class, or the images themselves for a plain GAN")
    return classes, found


def _decode(path: str) -> np.ndarray:
    """One image -> (C, H, W) uint8, C = 1 (grey) or 3 (RGB); raises OSError/ValueError if unreadable."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        if image.mode in ("1", "L", "I;16", "I", "F", "LA") or (image.mode == "P" and _grey_palette(image)):
            image = image.convert("L")
            return np.array(image)[None]
        image = image.convert("RGB")
        return np.ascontiguousarray(np.array(image).transpose(2, 0, 1))


def _grey_palette(image) -> bool:
    palette = image.getpalette() or []
    return all(palette[i] == palette[i + 1] == palette[i + 2] for i in range(0, len(palette) - 2, 3))


def _bad(root: str, bad: list[tuple[str, str]], policy: str) -> None:
    if not bad:
        return
    listed = "; ".join(f"{os.path.relpath(p, root)}: {why}" for p, why in bad[:_NAMED])
    more = f" (and {len(bad) - _NAMED} more)" if len(bad) > _NAMED else ""
    if policy == "refuse":
        raise ConfigError(f"{len(bad)} unusable image(s) under {root!r}: {listed}{more}; fix or remove them, or "
                          f"pass {named('bad_images')} skip to train without them")
    log.warning("skipping %d unusable image(s) under %s: %s%s", len(bad), root, listed, more)


def load_imagefolder(root: str, bad_images: str = "refuse") -> SiteData:
    """Read and check every image of a site folder (see find_images); keep their paths, not their pixels.

    An image is unusable when it cannot be decoded, or when its aspect ratio differs from the
    site's (that of the most common (H, W)), so it could not be resized like the others.
    bad_images "refuse" (default) raises ConfigError naming them; "skip" leaves them out, with a
    warning. Sizes may differ (all are resized to the model's), grey and RGB may mix.
    """
    if bad_images not in BAD_IMAGE_POLICIES:
        raise ConfigError(f"{named('bad_images')} must be one of {BAD_IMAGE_POLICIES}, got {bad_images!r}")
    classes, found = find_images(root)
    readable: list[tuple[str, int, tuple[int, int, int]]] = []
    bad: list[tuple[str, str]] = []
    for path, label in found:
        try:
            readable.append((path, label, _decode(path).shape))
        except Exception as exc:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError...)
            bad.append((path, f"unreadable ({type(exc).__name__}: {exc})"))
    kept = []
    sizes = Counter(shape[1:] for _, _, shape in readable)
    if sizes:
        (height, width), _ = max(sizes.items(), key=lambda kv: (kv[1], kv[0]))
        for path, label, (_, h, w) in readable:
            if h * width != w * height:
                bad.append((path, f"{h}x{w}, not the {height}x{width} aspect ratio of the other images"))
            else:
                kept.append((path, label, _))
    _bad(root, bad, bad_images)
    if not kept:
        raise ConfigError(f"no usable images under {root!r}: all {len(found)} were skipped")
    channels = max(shape[0] for _, _, shape in readable if shape[1] * width == shape[2] * height)
    return SiteData(root, torch.tensor([label for _, label, _ in kept], dtype=torch.int64), classes,
                    files=[path for path, _, _ in kept], shape=(channels, height, width), skipped=bad)
