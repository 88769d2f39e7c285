"""Secret inputs at rest: sealed with Fernet (AES-128-CBC and HMAC-SHA256, authenticated) under
the keys of `K8S_DISPATCH_INPUT_KEY`, the first sealing and every one opening (`MultiFernet`), so
that keys rotate without a dispatch in flight losing its input. The database holds only the
token; the plain text exists in the scheduling process and in the create step that writes it
into its Job's Secret."""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from pydantic import SecretStr

from k8s_dispatch.core.errors import SecretInputKeyMissing, SecretInputUnreadable


def _keys(setting: SecretStr | None) -> MultiFernet:
    """Raises: SecretInputKeyMissing: no key is configured."""
    text = setting.get_secret_value() if setting is not None else ""
    keys = [key.strip() for key in text.split(",") if key.strip()]
    if not keys:
        raise SecretInputKeyMissing(
            "a secret input needs K8S_DISPATCH_INPUT_KEY (a Fernet key) to be kept encrypted; none is set"
        )
    return MultiFernet([Fernet(key) for key in keys])


def seal(text: str, setting: SecretStr | None) -> str:
    """The Fernet token of `text` under the first configured key.

    Raises:
        SecretInputKeyMissing: no key is configured.
    """
    return _keys(setting).encrypt(text.encode("utf-8")).decode("ascii")


def unseal(token: str, setting: SecretStr | None) -> str:
    """The text `token` seals, opened with whichever configured key sealed it.

    Raises:
        SecretInputKeyMissing: no key is configured.
        SecretInputUnreadable: no configured key opens it (rotated away), or it was altered.
    """
    try:
        return _keys(setting).decrypt(token.encode("ascii")).decode("utf-8")
    except (InvalidToken, UnicodeError) as e:
        raise SecretInputUnreadable(
            "the secret input cannot be decrypted with any key of K8S_DISPATCH_INPUT_KEY "
            "(the key that sealed it was removed, or the stored token was altered)"
        ) from e
