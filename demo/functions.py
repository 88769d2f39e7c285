"""Functions the demo capabilities run through `k8s_dispatch.container.runner`: small work whose result a
test can recompute. Each takes the dispatch's input (a JSON object) and returns JSON (`report`:
bytes, for a capability whose results go to the object store); bad input raises `ValueError`,
which the runner turns into a failed container.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from typing import Any

MAX_PRIMES_LIMIT = 1_000_000  # a sieve of this size takes well under a second
MAX_SLEEP_S = 3600.0
MAX_REPORT_ROWS = 1_000_000  # about 45 MB of CSV
_REGIONS = ("north", "south", "east", "west")
_PRODUCTS = ("bolts", "nuts", "gears", "springs", "valves", "washers")


def _field(data: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(data, dict) or name not in data:
        raise ValueError(f"input must be an object with a {name!r} field")
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"input field {name!r} must be {kind}, not {type(value).__name__}")
    return value


def wordcount(data: Any) -> dict[str, int]:
    """`{"text": str}` -> lines, words and characters, as `wc` counts them."""
    text = _field(data, "text", str)
    return {"lines": text.count("\n"), "words": len(text.split()), "chars": len(text)}


def sha256(data: Any) -> dict[str, Any]:
    """`{"text": str}` -> the SHA-256 of its UTF-8 bytes."""
    raw = _field(data, "text", str).encode("utf-8")
    return {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}


def primes(data: Any) -> dict[str, Any]:
    """`{"limit": n}` (0..1,000,000) -> how many primes are <= n, the largest and their sum."""
    limit = _field(data, "limit", int)
    if not 0 <= limit <= MAX_PRIMES_LIMIT:
        raise ValueError(f"limit must be between 0 and {MAX_PRIMES_LIMIT}, not {limit}")
    sieve = bytearray([1]) * (limit + 1)
    sieve[: min(2, limit + 1)] = bytes(min(2, limit + 1))
    for n in range(2, math.isqrt(limit) + 1):
        if sieve[n]:
            sieve[n * n :: n] = bytes(len(range(n * n, limit + 1, n)))
    found = [n for n in range(limit + 1) if sieve[n]]
    return {"limit": limit, "count": len(found), "largest": found[-1] if found else None, "sum": sum(found)}


def report(data: Any) -> bytes:
    """`{"rows": n, "seed": s}` (n in 0..1,000,000) -> a CSV of sales, a header and n rows of about
    45 bytes: the same bytes for the same input (`random.Random(seed).random()` is the sequence
    Python promises to keep across versions; prices are whole cents, so no float is printed)."""
    rows = _field(data, "rows", int)
    seed = _field(data, "seed", int)
    if not 0 <= rows <= MAX_REPORT_ROWS:
        raise ValueError(f"rows must be between 0 and {MAX_REPORT_ROWS}, not {rows}")
    draw = random.Random(seed).random
    lines = ["row,region,product,units,unit_price,total"]
    for row in range(rows):
        rest, region = divmod(int(draw() * (1 << 53)), len(_REGIONS))  # one draw a row, 53 bits
        rest, product = divmod(rest, len(_PRODUCTS))
        rest, units = divmod(rest, 500)
        cents = 100 + rest % 9_900
        total = (units + 1) * cents
        lines.append(
            f"{row},{_REGIONS[region]},{_PRODUCTS[product]},{units + 1},"
            f"{cents // 100}.{cents % 100:02d},{total // 100}.{total % 100:02d}"
        )
    return ("\n".join(lines) + "\n").encode("ascii")


def echo(data: Any) -> Any:
    """Returns its input: for round-trip tests."""
    return data


def sleep(data: Any) -> dict[str, float]:
    """`{"seconds": s}` -> sleeps, then returns it: for deadline (timeout) tests."""
    seconds = float(_field(data, "seconds", (int, float)))
    if not 0 <= seconds <= MAX_SLEEP_S:
        raise ValueError(f"seconds must be between 0 and {MAX_SLEEP_S}")
    time.sleep(seconds)
    return {"slept": seconds}


def fail(data: Any) -> None:
    """Always raises: for failure tests. `{"message": str}` sets the error's text."""
    message = data.get("message", "demo failure") if isinstance(data, dict) else "demo failure"
    raise RuntimeError(str(message))
