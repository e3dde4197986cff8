"""Byte sizes as people write them ("80GiB", "1.5TB", "4096") and back."""
from __future__ import annotations

import re

from kvcache.allocator.errors import KVCacheError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, field: str = "size") -> int:
    """Bytes in ``text``: KB/MB/GB/TB are powers of 1000; K/M/G/T and KiB/MiB/GiB/TiB of 1024."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise KVCacheError(f"{field}: must not be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise KVCacheError(f"{field}: cannot read {text!r} as a size; write e.g. 80GiB, 512MB or 4096")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num: float) -> str:
    """``num`` bytes in binary units with three significant digits ("72.0 GiB")."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= scale:
            return f"{num / scale:.3g} {unit}" if num / scale < 100 else f"{num / scale:.1f} {unit}"
    return f"{int(num)} B"
