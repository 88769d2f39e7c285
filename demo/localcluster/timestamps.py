"""Time as the Kubernetes API shows it: RFC 3339 in UTC with second precision (metav1.Time).

The server keeps float seconds internally where precision matters (deadlines, TTLs) and
formats only at the edge of an object.
"""

from __future__ import annotations

import time
from datetime import datetime


def now() -> float:
    return time.time()


_last: tuple[int, str] = (-1, "")


def rfc3339(ts: float) -> str:
    global _last
    second = int(ts)
    if _last[0] != second:  # many objects get stamped within one second: format it once
        _last = (second, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second)))
    return _last[1]


def parse_rfc3339(text: str) -> float:
    """Parse a metav1.Time string; raises ValueError when malformed."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
