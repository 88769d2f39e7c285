"""Label and field selector parsing and matching: tables of cases and Hypothesis properties."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.demo.localcluster.selectors import (
    SelectorError,
    format_label_selector,
    from_label_selector_object,
    parse_field_selector,
    parse_label_selector,
)

LABELS = {"app": "web", "tier": "front", "n": "5"}


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app=db", False),
        ("app!=db", True),
        ("missing!=x", True),
        ("app in (web,db)", True),
        ("app in (db)", False),
        ("app notin (db)", True),
        ("app notin (web)", False),
        ("missing notin (web)", True),
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("n>3", True),
        ("n<3", False),
        ("missing>3", False),
        ("app=web,tier=front", True),
        ("app=web,tier=back", False),
        (" app = web , tier in ( front , back ) ", True),
        ("app=", False),
    ],
)
def test_label_selector_matches_as_kubernetes_does(text: str, matches: bool) -> None:
    assert parse_label_selector(text).matches(LABELS) is matches


@pytest.mark.parametrize(
    "text",
    [
        "app in ()",
        "=web",
        "app web",
        "app in (web",
        "a=b=c",
        "app in web",
        "n>x",
        "bad key=1",
        "app=bad value!",
        ",",
        "app,",
    ],
)
def test_malformed_label_selectors_are_rejected(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(text)


def test_selector_object_matches_labels_and_expressions() -> None:
    sel = from_label_selector_object(
        {
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["front", "back"]},
                {"key": "gone", "operator": "DoesNotExist"},
            ],
        }
    )
    assert sel.matches(LABELS)
    assert not sel.matches({"app": "web", "tier": "db"})
    assert not from_label_selector_object(None).matches(LABELS)
    assert from_label_selector_object({}).matches(LABELS)


def test_format_round_trips_through_the_parser() -> None:
    obj = {
        "matchLabels": {"a": "1", "b": "2"},
        "matchExpressions": [{"key": "c", "operator": "NotIn", "values": ["x"]}],
    }
    text = format_label_selector(obj)
    assert text == "a=1,b=2,c notin (x)"
    assert parse_label_selector(text).matches({"a": "1", "b": "2"})
    assert not parse_label_selector(text).matches({"a": "1", "b": "2", "c": "x"})


FIELDS = {"metadata.name", "metadata.namespace", "status.successful"}


def test_field_selectors_parse_negate_and_unescape() -> None:
    reqs = parse_field_selector(r"metadata.name=a\,b,metadata.namespace!=kube-system", FIELDS)
    assert [(r.field, r.value, r.negate) for r in reqs] == [
        ("metadata.name", "a,b", False),
        ("metadata.namespace", "kube-system", True),
    ]
    with pytest.raises(SelectorError, match=r"field label not supported: spec.foo"):
        parse_field_selector("spec.foo=1", FIELDS)
    with pytest.raises(SelectorError):
        parse_field_selector("metadata.name", FIELDS)


# --- properties ----------------------------------------------------------------------------

_alnum = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_middle = st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.")
name_part = st.builds(lambda a, m, b: a + "".join(m) + b, _alnum, st.lists(_middle, max_size=10), _alnum) | _alnum
label_value = st.just("") | name_part
keys = st.lists(name_part, min_size=1, max_size=4, unique=True)


@given(labels=st.dictionaries(name_part, label_value, max_size=5), key=name_part, value=name_part)
def test_equality_and_inequality_are_complements(labels: dict[str, str], key: str, value: str) -> None:
    eq = parse_label_selector(f"{key}={value}").matches(labels)
    ne = parse_label_selector(f"{key}!={value}").matches(labels)
    assert eq != ne
    assert eq == (labels.get(key) == value)


@given(
    labels=st.dictionaries(name_part, label_value, max_size=5),
    key=name_part,
    values=st.lists(name_part, min_size=1, max_size=4),
)
def test_in_and_notin_are_complements(labels: dict[str, str], key: str, values: list[str]) -> None:
    vs = ",".join(values)
    is_in = parse_label_selector(f"{key} in ({vs})").matches(labels)
    assert is_in != parse_label_selector(f"{key} notin ({vs})").matches(labels)
    assert is_in == (key in labels and labels[key] in values)


@given(labels=st.dictionaries(name_part, label_value, max_size=5), key=name_part)
def test_exists_and_not_exists_are_complements(labels: dict[str, str], key: str) -> None:
    assert parse_label_selector(key).matches(labels) == (key in labels)
    assert parse_label_selector(f"!{key}").matches(labels) == (key not in labels)


@given(labels=st.dictionaries(name_part, name_part, min_size=1, max_size=6))
def test_a_selector_of_an_objects_own_labels_selects_it(labels: dict[str, str]) -> None:
    text = ",".join(f"{k}={v}" for k, v in labels.items())
    assert parse_label_selector(text).matches(labels)
    assert from_label_selector_object({"matchLabels": labels}).matches(labels)


@given(
    parts=st.lists(st.tuples(name_part, name_part), min_size=1, max_size=4),
    labels=st.dictionaries(name_part, name_part, max_size=5),
)
def test_a_conjunction_matches_iff_every_requirement_does(parts: list[tuple[str, str]], labels: dict[str, str]) -> None:
    text = ",".join(f"{k}={v}" for k, v in parts)
    assert parse_label_selector(text).matches(labels) == all(labels.get(k) == v for k, v in parts)


@given(st.text(max_size=30))
def test_the_parser_raises_only_selector_errors(text: str) -> None:
    with contextlib.suppress(SelectorError):
        parse_label_selector(text)
