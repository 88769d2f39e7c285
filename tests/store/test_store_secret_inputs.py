"""Secret inputs in the store (PostgreSQL and SQLite): sealed at rest, out of the event log,
idempotent on the opened value, readable after a key rotation, refused without a key or with a
size a Secret should not hold; larger plain inputs admitted only up to the stored limit."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.errors import (
    ConfigError,
    IdempotencyConflict,
    InputTooLarge,
    SecretInputKeyMissing,
    SecretInputUnreadable,
)
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import Dispatch
from k8s_dispatch.store.secret_inputs import seal, unseal

OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()
KEY = SecretStr(NEW)
SECRET = {"password": "hunter2-not-in-the-log"}


def test_a_secret_input_is_sealed_in_its_row_and_absent_from_its_event(
    db_sessionmaker: sessionmaker[Session], new_case: Callable[..., Any], schedule_for: Callable[..., Any]
) -> None:
    case = new_case(db_sessionmaker)
    result = schedule_for(db_sessionmaker, case, input=SECRET, secret=True, input_key=KEY)
    with transaction(db_sessionmaker) as session:
        row = session.get(Dispatch, result.dispatch_id)
        assert row is not None and row.input is None and row.secret_input is not None
        assert "hunter2" not in row.secret_input
        assert json.loads(unseal(row.secret_input, KEY)) == SECRET
        [event] = dispatches.events_for(session, result.dispatch_id)
        assert event.payload["input"] is None and event.payload["secret"] is True
        assert "hunter2" not in json.dumps(event.payload)


def test_a_repeat_is_compared_with_the_opened_seal(
    db_sessionmaker: sessionmaker[Session], new_case: Callable[..., Any], schedule_for: Callable[..., Any]
) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case, input=SECRET, secret=True, input_key=KEY, idempotency_key="k1")
    again = schedule_for(db_sessionmaker, case, input=SECRET, secret=True, input_key=KEY, idempotency_key="k1")
    assert (again.dispatch_id, again.created) == (first.dispatch_id, False)
    for different in ({"input": {"password": "other"}, "secret": True}, {"input": SECRET, "secret": False}):
        with pytest.raises(IdempotencyConflict):
            schedule_for(db_sessionmaker, case, input_key=KEY, idempotency_key="k1", **different)


def test_without_a_key_nothing_is_written(
    db_sessionmaker: sessionmaker[Session],
    new_case: Callable[..., Any],
    schedule_for: Callable[..., Any],
    count_rows: Callable[..., dict[str, int]],
) -> None:
    case = new_case(db_sessionmaker)
    before = count_rows(db_sessionmaker)
    with pytest.raises(SecretInputKeyMissing):
        schedule_for(db_sessionmaker, case, input=SECRET, secret=True)
    with pytest.raises(InputTooLarge):  # a Secret's value stays within the env's limit
        schedule_for(db_sessionmaker, case, input="x" * 2000, secret=True, input_key=KEY, max_stored_input_bytes=10**6)
    assert count_rows(db_sessionmaker) == before


def test_a_plain_input_over_the_env_limit_needs_the_stored_limit(
    db_sessionmaker: sessionmaker[Session], new_case: Callable[..., Any], schedule_for: Callable[..., Any]
) -> None:
    case = new_case(db_sessionmaker)
    with pytest.raises(InputTooLarge):
        schedule_for(db_sessionmaker, case, input="x" * 2000)
    result = schedule_for(db_sessionmaker, case, input="x" * 2000, max_stored_input_bytes=4000)
    assert result.created
    with pytest.raises(InputTooLarge):
        schedule_for(db_sessionmaker, case, input="x" * 5000, max_stored_input_bytes=4000)


def test_keys_rotate_the_first_seals_every_one_opens() -> None:
    token = seal('{"a":1}', SecretStr(OLD))
    assert unseal(token, SecretStr(f"{NEW},{OLD}")) == '{"a":1}'
    with pytest.raises(SecretInputUnreadable):
        unseal(token, SecretStr(NEW))
    assert unseal(seal("x", SecretStr(f"{NEW},{OLD}")), SecretStr(NEW)) == "x"


def test_the_setting_takes_only_fernet_keys_and_never_echoes_one() -> None:
    assert load_settings({"K8S_DISPATCH_INPUT_KEY": f"{NEW}, {OLD}"}).input_key is not None
    with pytest.raises(ConfigError) as failed:
        load_settings({"K8S_DISPATCH_INPUT_KEY": f"{NEW},not-a-key-at-all"})
    assert "key 2 is not a Fernet key" in str(failed.value) and "not-a-key-at-all" not in str(failed.value)
