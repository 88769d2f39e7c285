"""The object-store suites' fixtures from elsewhere: real worker and beat processes (`deploy`)."""

from __future__ import annotations

from tests.tasks.conftest import deploy  # noqa: F401  (the fixture)
