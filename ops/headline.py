"""A failure's message as a report shows it: the line an operator needs first, cut to fit.

Shared by `status` (a dispatch's failure) and the map progress of `status` and `show` (an
item's failure), so both cut a traceback the same way.
"""

from __future__ import annotations

MAX_MESSAGE_CHARS = 200  # of a failure's message, in a report


def headline(message: str) -> str:
    """The part of a failure's message an operator needs first, on one line: for a Python
    traceback (whole, or its end cut by the termination message's size), its last unindented
    line, the exception and its text (`ValueError: ...`), not the top of the stack."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    in_traceback = any(
        line.startswith("Traceback (most recent call last)") or line.lstrip().startswith('File "') for line in lines
    )
    if in_traceback:
        for line in reversed(lines):
            if not line[0].isspace() and not line.startswith(_NOT_THE_EXCEPTION):
                return trim(line)
    return trim(message.strip())


# Unindented lines of a traceback that are not its exception line.
_NOT_THE_EXCEPTION = ("Traceback", "...", "During handling of the above exception", "The above exception")


def trim(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` on one line, at most `limit` characters (its end cut to `...`)."""
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 3] + "..."
