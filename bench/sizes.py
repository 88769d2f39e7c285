"""How big each benchmark runs: the full size (`python -m bench`, a few minutes on 2 cores) and
the quick "smoke" size (`--quick`, seconds: for the smoke test; its figures mean little).

Targets from the issues apply only at the full size, where the sizes are the issues' own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Size:
    name: str
    rounds: int  # interleaved rounds per comparison
    # 1. localcluster speed (issue 3)
    create_clients: int  # concurrent client threads, each with its own keep-alive connection
    creates: int  # Job creates per variant per round
    list_jobs: int  # Jobs in the namespace listed in pages
    list_page: int
    # 2. polling: one paginated LIST vs a GET per Job
    poll_jobs: int
    # 3. the adapter: raw JSON vs the client's models, for one page
    adapter_page: int
    # 4. delivery
    dispatches: int  # end to end, per variant per round (both variants: twice this per round)
    delivery_rounds: int
    guard_completions: int  # per variant per round
    # 5. recovery
    backlog: int  # terminal Jobs with their dispatches, per variant per round
    recovery_rounds: int
    check_targets: bool  # the issues' targets are judged (full size only)


FULL = Size(
    name="full",
    rounds=3,
    create_clients=4,
    creates=500,
    list_jobs=10_000,
    list_page=500,
    poll_jobs=1000,
    adapter_page=500,
    dispatches=100,
    delivery_rounds=2,
    guard_completions=100,
    backlog=300,
    recovery_rounds=2,
    check_targets=True,
)

QUICK = Size(
    name="quick",
    rounds=2,
    create_clients=2,
    creates=40,
    list_jobs=120,
    list_page=50,
    poll_jobs=40,
    adapter_page=40,
    dispatches=6,
    delivery_rounds=1,
    guard_completions=10,
    backlog=12,
    recovery_rounds=1,
    check_targets=False,
)

SIZES = {s.name: s for s in (FULL, QUICK)}
