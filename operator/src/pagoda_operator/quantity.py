"""Kubernetes resource quantities ("64Gi", "500m", "1e3") as numbers, and back to text."""

from __future__ import annotations

import re

_SUFFIXES = {
    "": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60,
}
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?")
GIB = 2.0**30


def parse_quantity(value: str | int | float) -> float:
    """The quantity's value in base units (bytes, cores). Raises ValueError when malformed."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.fullmatch(str(value).strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r} (expected e.g. 64Gi, 500m, 4)")
    number, exponent, suffix = match.groups()
    if exponent:
        return float(number + exponent)
    return float(number) * _SUFFIXES[suffix or ""]


def gib(value: str | int | float) -> float:
    """A byte quantity in GiB."""
    return parse_quantity(value) / GIB


def format_gib(num_gib: float) -> str:
    """GiB as a compact quantity: 64 → "64Gi", 1.5 → "1536Mi"."""
    mib = round(num_gib * 1024)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
