"""Crash points: parsing of K8S_DISPATCH_CRASH_AT, and a real SIGKILL in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from k8s_dispatch.delivery.crashpoints import ENV_VAR, Point, armed

CHILD = """
from k8s_dispatch.delivery.crashpoints import crashpoint
for i in range(3):
    print(f"hit {i + 1}", flush=True)
    crashpoint("after_job_create")
print("survived", flush=True)
"""


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("after_job_create", {"after_job_create": 1}),
        ("after_job_create@3", {"after_job_create": 3}),
        (" mid_sweep , before_job_create@2 ,", {"mid_sweep": 1, "before_job_create": 2}),
    ],
)
def test_armed_points_are_parsed_from_the_environment(spec, expected):
    assert armed({ENV_VAR: spec}) == expected


def test_points_are_the_named_ones():
    assert {p.value for p in Point} >= {
        "after_schedule_commit",
        "before_job_create",
        "after_job_create",
        "before_complete_write",
        "after_complete_write",
        "mid_sweep",
    }


def run_child(spec: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if spec is not None:
        env[ENV_VAR] = spec
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("spec", "hits_before_death"),
    [("after_job_create", 1), ("after_job_create@2", 2), ("mid_sweep,after_job_create@3", 3)],
)
def test_an_armed_point_kills_the_process_on_the_chosen_hit(spec, hits_before_death):
    result = run_child(spec)
    assert result.returncode == -signal.SIGKILL
    assert result.stdout.split() == [w for i in range(hits_before_death) for w in ("hit", str(i + 1))]


@pytest.mark.parametrize("spec", [None, "", "before_job_create", "after_job_create@4"])
def test_an_unarmed_point_does_nothing(spec):
    result = run_child(spec)
    assert result.returncode == 0, result.stderr
    assert "survived" in result.stdout
