"""Names that changed, and still work for a release with a one-line warning: the data-parallel GAN is
the parameter-server GAN (`--algorithm psgan`, its Q `--ps-threshold`). Light (no torch): the parsers of
every program read it."""

from __future__ import annotations

import logging

from mdgan.config import ConfigError

# Names that still work for a release, each with a one-line warning: old name -> new name
RENAMED = {"dpgan": "psgan"}
RENAMED_SETTINGS = {"dp_threshold": "ps_threshold"}  # settings' keys (flags, variables, experiment keys)
_warned: set[str] = set()


def _deprecated(old: str, new: str) -> None:
    if old not in _warned:
        _warned.add(old)
        logging.getLogger("mdgan").warning("%s is deprecated and will be removed in a later release: it is now %s "
                                           "(the parameter-server GAN)", old, new)


def setting_key(key: str) -> str:
    """A setting's key as it is now (an old one, with a one-line warning, once)."""
    if key in RENAMED_SETTINGS:
        _deprecated(f"--{key.replace('_', '-')}", f"--{RENAMED_SETTINGS[key].replace('_', '-')}")
        return RENAMED_SETTINGS[key]
    return key


def canonical(name: str) -> str:
    """An algorithm's name as it is now (an old one, with a one-line warning, once)."""
    if name in RENAMED:
        _deprecated(f"--algorithm {name}", f"--algorithm {RENAMED[name]}")
        return RENAMED[name]
    return name


def renamed_settings(settings: dict) -> dict:
    """Settings keyed as they are now: an old key (dp_threshold) becomes its new one (ps_threshold), and an
    old algorithm name its new one, each with a one-line warning, once. A key given under both names is
    refused."""
    out = dict(settings)
    for old, new in RENAMED_SETTINGS.items():
        if old in out:
            if new in out and out[new] != out[old]:
                raise ConfigError(f"{old} and {new} are one setting ({new}); give it once")
            out[setting_key(old)] = out.pop(old)
    if isinstance(out.get("algorithm"), str):
        out["algorithm"] = canonical(out["algorithm"])
    return out
