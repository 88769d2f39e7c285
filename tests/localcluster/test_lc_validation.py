"""Name, label and object validation (pure): Hypothesis for names, tables for Job/Pod rules."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.demo.localcluster import validation
from k8s_dispatch.demo.localcluster.apierrors import FieldErrorType

SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@given(st.text(alphabet="abcz09-.A_", max_size=70))
def test_job_names_must_be_subdomains_of_at_most_63_characters(name: str) -> None:
    errs = validation.validate_name(name, max_len=63)
    ok = bool(SUBDOMAIN.match(name)) and len(name) <= 63
    assert (errs == []) is ok
    if not ok:
        assert errs[0].field == "metadata.name" and errs[0].type is FieldErrorType.INVALID


@given(st.text(alphabet="abz09-.", min_size=1, max_size=70))
def test_namespace_names_must_be_labels(name: str) -> None:
    errs = validation.validate_name(name, label=True)
    assert (errs == []) is (bool(re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", name)) and len(name) <= 63)


@given(st.text(alphabet="aZ09-_./ ", max_size=70))
def test_label_values_follow_the_label_grammar(value: str) -> None:
    ok = len(value) <= 63 and bool(re.match(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", value))
    assert (validation.validate_labels({"k": value}, "metadata.labels") == []) is ok


def _job(**spec_and_template: object) -> dict:
    containers = spec_and_template.pop("containers", [{"name": "c", "image": "i"}])
    restart = spec_and_template.pop("restartPolicy", "Never")
    return {
        "metadata": {"name": "j", "namespace": "default"},
        "spec": {
            "selector": {},
            "template": {"spec": {"restartPolicy": restart, "containers": containers}},
            **spec_and_template,
        },
    }


@pytest.mark.parametrize(
    ("job", "field", "message"),
    [
        (
            _job(restartPolicy="Always"),
            "spec.template.spec.restartPolicy",
            'Required value: valid values: "OnFailure", "Never"',
        ),  # as kube-apiserver 1.36 words it
        (_job(containers=[]), "spec.template.spec.containers", "Required value"),
        (_job(containers=[{"name": "c"}]), "spec.template.spec.containers[0].image", "Required value"),
        (
            _job(containers=[{"name": "C_1", "image": "i"}]),
            "spec.template.spec.containers[0].name",
            'Invalid value: "C_1"',
        ),
        (_job(backoffLimit=-1), "spec.backoffLimit", "Invalid value: -1: must be greater than or equal to 0"),
        (
            _job(containers=[{"name": "c", "image": "i", "env": [{"name": "1X", "value": "v"}]}]),
            "spec.template.spec.containers[0].env[0].name",
            'Invalid value: "1X"',
        ),
    ],
)
def test_invalid_jobs_name_the_field(job: dict, field: str, message: str) -> None:
    errs = validation.validate_job(job, selector_matches=True)
    assert any(e.field == field and e.body().startswith(message) for e in errs), [str(e) for e in errs]


def test_a_valid_job_has_no_errors_and_a_selector_mismatch_is_reported() -> None:
    assert validation.validate_job(_job(), selector_matches=True) == []
    errs = validation.validate_job(_job(), selector_matches=False)
    assert [e.field for e in errs] == ["spec.template.metadata.labels"]


def test_job_template_and_selector_are_immutable() -> None:
    old = _job()
    new = _job(containers=[{"name": "c", "image": "other"}])
    assert [e.field for e in validation.validate_job_update(old, new)] == ["spec.template"]
    assert validation.validate_job_update(old, _job(backoffLimit=3)) == []


def test_finalizers_cannot_be_added_while_deleting() -> None:
    old = {"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z", "finalizers": ["a"]}}
    assert validation.validate_metadata_update(old, {"metadata": {"finalizers": ["a", "b"]}})
    assert validation.validate_metadata_update(old, {"metadata": {"finalizers": []}}) == []
