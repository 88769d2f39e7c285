"""Sets of completion indexes as an Indexed Job's status and successPolicy write them (pure):
ordered intervals, "1,3-5,7" (two neighbours are written "1,2", as the Job controller's
orderedIntervals.String does), parsed leniently as the controller reads its own status and
strictly as kube-apiserver validates a status or a successPolicy (validateIndexesFormat).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

MAX_INDEX = 2**31  # above any index a Job can have

Interval = tuple[int, int]  # first and last index, inclusive


def merge(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The union of two ordered interval lists, ordered, neighbours joined."""
    out: list[list[int]] = []
    for first, last in sorted([*a, *b]):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return [(f, la) for f, la in out]


def with_indexes(intervals: list[Interval], indexes: Iterable[int]) -> list[Interval]:
    return merge(intervals, [(i, i) for i in sorted(set(indexes))])


def total(intervals: list[Interval]) -> int:
    return sum(last - first + 1 for first, last in intervals)


def has(intervals: list[Interval], index: int) -> bool:
    at = bisect.bisect_right(intervals, (index, MAX_INDEX)) - 1
    return at >= 0 and intervals[at][0] <= index <= intervals[at][1]


def first_missing(intervals: list[Interval], below: int, count: int) -> list[int]:
    """The `count` lowest indexes under `below` that `intervals` lack (firstPendingIndexes)."""
    out: list[int] = []
    candidate = 0
    for first, last in intervals:
        while candidate < below and len(out) < count and candidate < first:
            out.append(candidate)
            candidate += 1
        candidate = max(candidate, last + 1)
    while candidate < below and len(out) < count:
        out.append(candidate)
        candidate += 1
    return out


def members(intervals: list[Interval]) -> Iterable[int]:
    for first, last in intervals:
        yield from range(first, last + 1)


def format_intervals(intervals: list[Interval]) -> str:
    parts = []
    for first, last in intervals:
        if last == first:
            parts.append(str(first))
        elif last == first + 1:
            parts.append(f"{first},{last}")
        else:
            parts.append(f"{first}-{last}")
    return ",".join(parts)


def _atoi(text: str) -> int:
    """Go's strconv.Atoi: an optional sign and decimal digits only."""
    body = text[1:] if text[:1] in "+-" else text
    if not body or not body.isascii() or not body.isdigit():
        raise ValueError(text)
    return int(text)


def parse(text: str | None, completions: int) -> list[Interval]:
    """As the Job controller reads its own status (parseIndexesFromString): a corrupt interval is
    skipped, indexes from `completions` on are dropped."""
    result: list[list[int]] = []
    for part in (text or "").split(",") if text else []:
        limits = part.split("-")
        try:
            first = _atoi(limits[0])
        except ValueError:
            continue
        if first >= completions:
            break
        last = first
        if len(limits) > 1:
            try:
                last = min(_atoi(limits[1]), completions - 1)
            except ValueError:
                continue
        if result and result[-1][1] == first - 1:
            result[-1][1] = last
        else:
            result.append([first, last])
    return [(f, la) for f, la in result]


def _interval(text: str, completions: int) -> Interval:
    limits = text.split("-")
    if len(limits) > 2:
        raise ValueError(
            f'the fragment "{text}" violates the requirement that an index interval can have at most two parts '
            "separated by '-'"
        )
    try:
        first = _atoi(limits[0])
    except ValueError:
        raise ValueError(f'cannot convert string to integer for index: "{limits[0]}"') from None
    if first >= completions:
        raise ValueError(f'too large index: "{limits[0]}"')
    if len(limits) == 1:
        return first, first
    try:
        last = _atoi(limits[1])
    except ValueError:
        raise ValueError(f'cannot convert string to integer for index: "{limits[1]}"') from None
    if last >= completions:
        raise ValueError(f'too large index: "{limits[1]}"')
    if first >= last:
        raise ValueError(f"non-increasing order, previous: {first}, current: {last}")
    return first, last


def validate_format(text: str, completions: int) -> tuple[int, str | None]:
    """kube-apiserver's validateIndexesFormat: (how many indexes, None) or (0, what is wrong)."""
    if not text:
        return 0, None
    count, previous = 0, None
    for part in text.split(","):
        try:
            first, last = _interval(part, completions)
        except ValueError as e:
            return 0, str(e)
        if previous is not None and previous >= first:
            return 0, f"non-increasing order, previous: {previous}, current: {first}"
        count += last - first + 1
        previous = last
    return count, None


def overlap(completed: str, failed: str, completions: int) -> int | None:
    """The first index both strings name (validateFailedIndexesNotOverlapCompleted), or None;
    intervals that do not parse are skipped (their format is reported apart)."""

    def good(text: str) -> list[Interval]:
        out = []
        for part in text.split(",") if text else []:
            try:
                out.append(_interval(part, completions))
            except ValueError:
                continue
        return out

    done, bad = good(completed), good(failed)
    i = j = 0
    while i < len(done) and j < len(bad):
        (c0, c1), (f0, f1) = done[i], bad[j]
        if c0 <= f1 and f0 <= c1:
            return max(c0, f0)
        if c0 <= f0:
            i += 1
        else:
            j += 1
    return None


def match_success_policy(policy: dict[str, Any] | None, completions: int, succeeded: list[Interval]) -> str | None:
    """The message of the first successPolicy rule the succeeded indexes meet (matchSuccessPolicy),
    or None."""
    if not policy or not succeeded:
        return None
    for i, rule in enumerate(policy.get("rules") or []):
        count = rule.get("succeededCount")
        if rule.get("succeededIndexes") is not None:
            wanted = parse(rule["succeededIndexes"], completions)
            if not wanted:
                continue
            met = total(_intersect(wanted, succeeded))
            if met == total(wanted) or (count is not None and met >= count):
                return f"Matched rules at index {i}"
        elif count is not None and total(succeeded) >= count:
            return f"Matched rules at index {i}"
    return None


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out = []
    for a0, a1 in a:
        for b0, b1 in b:
            lo, hi = max(a0, b0), min(a1, b1)
            if lo <= hi:
                out.append((lo, hi))
    return out
