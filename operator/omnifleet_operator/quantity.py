"""Kubernetes resource quantities: just enough to add them and compare them."""

from __future__ import annotations

import re
from decimal import Decimal, DecimalException

_SUFFIX = {
    "": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_RE = re.compile(r"^([+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$")
_BINARY = [("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)]


def parse(q: str | int | float) -> Decimal | None:
    """The value of a quantity, or None when it is not one."""
    if isinstance(q, bool):
        return None
    if isinstance(q, (int, float)):
        return Decimal(str(q))
    m = _RE.match(q.strip())
    if not m or m.group(2) not in _SUFFIX:
        return None
    try:
        return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2)])
    except DecimalException:  # e.g. Overflow: a hex hash such as "12e34567890" spells a number past Decimal's range
        return None


def fmt(value: Decimal) -> str:
    """A short, exact spelling of a value (binary suffix when it divides evenly)."""
    if value == value.to_integral_value():
        n = int(value)
        for suffix, size in _BINARY:
            if n and n % size == 0:
                return f"{n // size}{suffix}"
        return str(n)
    milli = value * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return str(value.normalize())


def add(*quantities: str) -> str:
    total = Decimal(0)
    for q in quantities:
        v = parse(q)
        if v is None:
            raise ValueError(f"not a quantity: {q!r}")
        total += v
    return fmt(total)


def equal(a: object, b: object) -> bool:
    """True when a and b are the same value, also as differently spelled quantities."""
    if a == b:
        return True
    if isinstance(a, (str, int, float)) and isinstance(b, (str, int, float)):
        pa, pb = parse(a), parse(b)
        return pa is not None and pa == pb
    return False
