"""How big each benchmark runs: `smoke` (`--smoke`, seconds: the test suite's; its figures mean
little), `quick` (the default, `make bench`: everything in about 2 minutes on 2 cores) and
`full` (`--full`, `make bench FULL=1`: the issues' own sizes where they name one).

Targets are judged at quick and full, never at smoke. A benchmark whose knobs are not listed
here keys its own by `size.name` ("smoke", "quick", "full").
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Size:
    name: str  # "smoke", "quick" or "full": the key other modules' own size tables use
    rounds: int  # interleaved rounds per comparison
    # localcluster's own speed (figure 6)
    create_clients: int  # concurrent client threads, each with its own keep-alive connection
    creates: int  # Job creates per variant per round
    list_jobs: int  # Jobs in the namespace listed in pages
    list_page: int
    # the adapter: raw JSON vs the client's models, for one page
    adapter_page: int
    # dispatch throughput (figure 1): the threads, the worker's and the raw client's alike (its Jobs
    # and rounds are dispatch_throughput.KNOBS)
    dispatch_threads: int
    # admission (issue 17): the queues measured side by side (dispatches waiting behind a full
    # limit), and the admission passes timed per queue and kind
    admission_queued: tuple[int, int]
    admission_passes: int
    check_targets: bool  # the issues' targets are judged (quick and full)


QUICK = Size(
    name="quick",
    rounds=2,
    create_clients=4,
    creates=300,
    list_jobs=10_000,
    list_page=500,
    adapter_page=500,
    dispatch_threads=8,
    admission_queued=(1_000, 100_000),
    admission_passes=200,
    check_targets=True,
)
# The others as what they change of quick: the differences are the point of each (the same
# keyword shape as above is a table's rows, not a copy).
SMOKE = replace(
    QUICK,
    name="smoke",
    create_clients=2,
    creates=40,
    list_jobs=120,
    list_page=50,
    adapter_page=40,
    dispatch_threads=4,
    admission_queued=(200, 2_000),
    admission_passes=20,
    check_targets=False,
)
FULL = replace(QUICK, name="full", rounds=5, creates=1000, admission_passes=1000)

SIZES = {s.name: s for s in (SMOKE, QUICK, FULL)}
