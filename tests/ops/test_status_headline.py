"""`status` shows a failure by the line that says what went wrong: a Python traceback's exception
line, whole or cut at its start by the termination message's size, never the top of its stack."""

from __future__ import annotations

import pytest

from k8s_dispatch.ops.status import MAX_MESSAGE_CHARS, headline

TRACEBACK = """Traceback (most recent call last):
  File "/app/job.py", line 12, in <module>
    main()
  File "/app/job.py", line 9, in main
    raise ValueError("input has no 'url' field")
ValueError: input has no 'url' field
"""

CHAINED = """Traceback (most recent call last):
  File "/app/job.py", line 3, in <module>
    open("/data/in.json")
FileNotFoundError: [Errno 2] No such file or directory: '/data/in.json'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/app/job.py", line 5, in <module>
    raise RuntimeError("no input")
RuntimeError: no input
"""


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (TRACEBACK, "ValueError: input has no 'url' field"),
        ("..." + TRACEBACK[60:], "ValueError: input has no 'url' field"),  # its start cut off
        (CHAINED, "RuntimeError: no input"),
        ("exit 3: bad input\nsee the log", "exit 3: bad input see the log"),  # no traceback: the whole, one line
        ("  OOMKilled  ", "OOMKilled"),
    ],
)
def test_the_headline_is_the_exception_line(message: str, expected: str) -> None:
    assert headline(message) == expected


def test_a_long_exception_line_is_cut_to_the_report_width() -> None:
    line = headline(TRACEBACK.replace("input has no 'url' field\n", "x" * 500 + "\n"))
    assert line.startswith("ValueError: xxx") and len(line) == MAX_MESSAGE_CHARS and line.endswith("...")
