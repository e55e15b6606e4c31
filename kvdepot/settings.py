"""What the daemon's options and the connector's settings share: the error of a
value that cannot be used, and sizes and durations written the way people write them."""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it and says why."""


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


_AMOUNT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def _amount(text, units: dict, refusal: str) -> float:
    """A number and a unit of `units` (none: the first) -> the number in the base unit."""
    match = _AMOUNT.fullmatch(str(text))
    if not match or match.group(2).lower() not in units:
        raise ConfigError(f"{text!r} {refusal}")
    return float(match.group(1)) * units[match.group(2).lower()]


def parse_size(text: str | int) -> int:
    """'64GiB', '512MiB', '1.5G', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    return int(_amount(text, _SIZE_UNITS, "is not a size; write e.g. 64GiB, 512MiB or 4096"))


def format_size(size: int) -> str:
    """Bytes as parse_size reads them back: 268435456 -> '256MiB', 1000 -> '1000'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = _SIZE_UNITS[unit.lower()]
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float) -> float:
    """'6h', '30m', '90s', '45' (seconds) -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    return _amount(text, _DURATION_UNITS, "is not a duration; write e.g. 6h, 30m, 90s or 45 (seconds)")
