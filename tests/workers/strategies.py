"""Hypothesis strategies for dispatch refs, inputs and capability specs.

Shared by the manifest/label property tests here and by the localcluster test that creates
the generated Jobs for real (`from tests.workers.strategies import ...`). Each `*_any`
strategy mixes valid values (of both kinds: label-safe and needing a hash) with invalid ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from k8s_dispatch.workers.capability import CapabilitySpec
from k8s_dispatch.workers.resolver import demo_resolver
from k8s_dispatch.workers.types import DispatchRef

# Characters `str.isprintable` accepts: no control, format, private-use, unassigned or
# separator characters, except the plain space.
PRINTABLE = st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"), include_characters=" ")

label_values = st.from_regex(r"\A[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z")
dns_labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
hash_lookalikes = st.text("0123456789abcdef", min_size=40, max_size=40).map(lambda h: "h-" + h)


def printable_text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(PRINTABLE, min_size=1, max_size=max_size)


def mostly(
    valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any], *, one_in: int = 12
) -> st.SearchStrategy[Any]:
    """`valid`, but `invalid` about once in `one_in` draws: with a dozen fields per case,
    a good share of cases is still fully valid and gets built."""
    return st.integers(0, one_in - 1).flatmap(lambda i: invalid if i == one_in - 1 else valid)


dispatch_ids = st.uuids().map(str)
dispatch_ids_any = mostly(dispatch_ids, st.one_of(st.text(max_size=40), dispatch_ids.map(str.upper)))

engine_ids = st.one_of(label_values, printable_text(128), hash_lookalikes)
engine_ids_any = mostly(engine_ids, st.one_of(st.text(max_size=140), st.just(""), printable_text(200)))

idempotency_keys = st.one_of(
    label_values, printable_text(256), hash_lookalikes, st.text(PRINTABLE, min_size=200, max_size=256)
)
idempotency_keys_any = mostly(idempotency_keys, st.one_of(st.text(max_size=300), st.just(""), printable_text(400)))

# Config-valid names: capabilities longer than 63 or with ':' or '/' need a hash as labels.
capability_names = st.from_regex(r"\A[A-Za-z0-9]([-A-Za-z0-9_.:/]{0,126}[A-Za-z0-9])?\Z")
capability_names_any = mostly(capability_names, engine_ids_any)
worker_names = dns_labels
worker_names_any = mostly(worker_names, engine_ids_any)

namespaces = dns_labels
namespaces_any = mostly(namespaces, st.text(max_size=70))

refs = st.builds(
    DispatchRef,
    dispatch_id=dispatch_ids,
    case_id=engine_ids,
    tenancy_id=engine_ids,
    capability=capability_names,
    worker_name=worker_names,
    idempotency_key=idempotency_keys,
)
refs_any = st.builds(
    DispatchRef,
    dispatch_id=dispatch_ids_any,
    case_id=engine_ids_any,
    tenancy_id=engine_ids_any,
    capability=capability_names_any,
    worker_name=worker_names_any,
    idempotency_key=idempotency_keys_any,
)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=16,
)
# What `encode_input` must refuse: NaN/inf, non-JSON types, lone surrogates.
non_json_values = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.sets(st.integers(), min_size=1, max_size=3),
    st.binary(min_size=1, max_size=8),
    st.text(st.characters(categories=("Cs",)), min_size=1, max_size=3),
    st.lists(st.sampled_from([float("nan"), b"x"]), min_size=1, max_size=2).map(lambda xs: {"k": xs}),
)
inputs_any = mostly(json_values, non_json_values)

_BASE_SPEC = demo_resolver().spec("demo.wordcount")

metadata_keys = st.one_of(
    st.from_regex(
        r"\A([a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?\.)?example\.com/[A-Za-z0-9]([-A-Za-z0-9_.]{0,20}[A-Za-z0-9])?\Z"
    ),
    label_values.filter(lambda key: key not in ("job-name", "controller-uid")),  # the Job controller's
)
metadata_keys_any = mostly(
    metadata_keys,
    st.one_of(
        st.text(max_size=20), st.sampled_from(["k8s-dispatch.io/case-id", "app.kubernetes.io/managed-by", "job-name"])
    ),
    one_in=40,
)
quantities = st.one_of(
    st.integers(0, 10_000).map(str),
    st.builds(lambda n, s: f"{n}{s}", st.integers(0, 4096), st.sampled_from(["m", "Mi", "Gi", "k", "Ki", "M"])),
)
resources = st.dictionaries(
    st.sampled_from(["requests", "limits"]),
    st.dictionaries(st.sampled_from(["cpu", "memory", "example.com/gpu"]), quantities, max_size=3),
    max_size=2,
)
resources_any = mostly(
    resources,
    st.dictionaries(
        st.text(max_size=8), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2), max_size=2
    ),
)
env_names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,20}\Z")
env_values = st.text(st.characters(exclude_characters="\x00"), max_size=30)
env_any = st.dictionaries(
    mostly(env_names, st.one_of(st.text(max_size=10), st.just("K8S_DISPATCH_INPUT")), one_in=40),
    mostly(env_values, st.text(max_size=30), one_in=40),
    max_size=4,
)


@st.composite
def capability_specs(draw: Any, *, name: str, worker_name: str, valid: bool = False) -> CapabilitySpec:
    """A spec for `name` run by `worker_name`: the demo's, with drawn labels, annotations,
    env, resources, deadline and backoff. With `valid=False` some fields may be invalid."""
    keys = metadata_keys if valid else metadata_keys_any
    return replace(
        _BASE_SPEC,
        name=name,
        worker_name=worker_name,
        env=draw(st.dictionaries(env_names, env_values, max_size=4) if valid else env_any),
        resources=draw(resources.filter(_requests_within_limits) if valid else resources_any),
        labels=draw(
            st.dictionaries(
                keys, label_values if valid else mostly(label_values, st.text(max_size=70), one_in=40), max_size=3
            )
        ),
        annotations=draw(st.dictionaries(keys, st.text(max_size=100), max_size=3)),
        namespace=draw(st.none() | (namespaces if valid else namespaces_any)),
        active_deadline_seconds=draw(
            st.none() | st.integers(1, 86_400)
            if valid
            else mostly(st.none() | st.integers(1, 86_400), st.integers(-5, 0))
        ),
        backoff_limit=draw(st.integers(0, 6) if valid else mostly(st.integers(0, 6), st.integers(-2, -1))),
    )


def _requests_within_limits(res: dict[str, dict[str, str]]) -> bool:
    from k8s_dispatch.workers.manifest import parse_quantity

    limits = res.get("limits", {})
    return all(
        name not in limits or parse_quantity(q) <= parse_quantity(limits[name])  # type: ignore[operator]
        for name, q in res.get("requests", {}).items()
    )
