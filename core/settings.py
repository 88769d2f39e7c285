"""One settings object for every process, read from `K8S_DISPATCH_*` environment variables.

Validated when it is built, so a bad value fails the process at start with an error naming
the variable. The embedded defaults (SQLite, local Redis, namespace `default`) let the demo
and a first try run with nothing set.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from enum import StrEnum
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from k8s_dispatch.core.errors import ConfigError

ENV_PREFIX = "K8S_DISPATCH_"


class OrphanPolicy(StrEnum):
    """What the sweep does with a Job of ours that has no matching dispatch."""

    REPORT = "report"
    DELETE = "delete"


class PollMode(StrEnum):
    """How poll finds finished Jobs: resume a watch (pay per change), or LIST every Job every poll."""

    WATCH = "watch"
    LIST = "list"


class AddressingStyle(StrEnum):
    """How the object store's URLs name the bucket: in the path (self-hosted stores), as a host name, or boto3's pick."""

    PATH = "path"
    VIRTUAL = "virtual"
    AUTO = "auto"


def is_fernet_key(text: str) -> bool:
    """Whether `text` is a Fernet key: url-safe base64 of 32 bytes (checked here, where the
    setting is read, without importing `cryptography` into every process)."""
    try:
        return len(base64.urlsafe_b64decode(text.encode("ascii"))) == 32 and len(text) == 44
    except (ValueError, UnicodeEncodeError):
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    database_url: str = "sqlite:///k8s-dispatch.db"
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    namespace: str = "default"
    capabilities: Path | None = None  # YAML or JSON file; see workers/resolver.py
    kubeconfig: Path | None = None  # else in-cluster config, else ~/.kube/config

    max_input_bytes: int = Field(default=32 * 1024, gt=0, le=256 * 1024)
    poll_interval_s: float = Field(default=2.0, gt=0)
    poll_page_size: int = Field(default=500, gt=0, le=10_000)
    sweep_interval_s: float = Field(default=30.0, gt=0)
    poll_mode: PollMode = PollMode.WATCH
    # How long poll's watch stream may be kept open between polls (0: a new watch each poll).
    poll_watch_hold_s: float = Field(default=30.0, ge=0, le=1800)
    # A kept watch stream that receives a finished Job polls its namespace at once
    # (`tasks.prompt_poll`), not at the next interval.
    poll_prompt: bool = True
    # While poll's watch is healthy, the sweep LISTs a namespace's Jobs at most this often (its
    # database side runs every sweep); with the watch down, or in LIST mode, every sweep lists.
    sweep_list_interval_s: float = Field(default=600.0, gt=0)
    sweep_grace_s: float = Field(default=30.0, ge=0)
    # Actions of one page that a recovery sweep carries out at once (they wait on the API,
    # the DB and Redis); 1 = one after the other.
    sweep_concurrency: int = Field(default=8, ge=1, le=64)
    guard_lease_ms: int = Field(default=60_000, gt=0)
    max_job_attempts: int = Field(default=3, ge=1)
    orphan_policy: OrphanPolicy = OrphanPolicy.REPORT
    # How long (the database's clock) a dispatch's Job may stay hand-edited (labels or
    # annotations disagreeing with the row) before the dispatch fails `JobTampered`.
    tampered_grace_s: float = Field(default=300.0, ge=0)
    notify_task: str = "engine.dispatch_finished"
    notify_queue: str = "engine"
    key_prefix: str = Field(default="k8s-dispatch", min_length=1, max_length=64)  # Redis keys and Celery queues
    # This deployment's identity, a label on each of its Jobs and in each of its selectors, so
    # that deployments sharing a namespace never see each other's Jobs; default: from key_prefix.
    deployment: str | None = None
    metrics_port: int = Field(default=0, ge=0, le=65535)  # 0: no metrics endpoint
    broker_visibility_timeout_s: int = Field(default=3600, gt=0)
    # Threads per worker process: the tasks wait on the API, the DB and Redis, not the CPU.
    worker_concurrency: int = Field(default=8, ge=1, le=256)
    kube_timeout_s: float = Field(default=10.0, gt=0, le=300)  # each Kubernetes API request
    # The process's API budget (workers/budget.py's DEFAULT_QPS / _BURST): requests per second,
    # 0 = unlimited, and how many may go at once after a quiet spell. Every client of a process
    # shares it; README's configuration table says why these defaults.
    kube_qps: float = Field(default=300.0, ge=0, le=100_000)
    kube_burst: int = Field(default=600, ge=1, le=100_000)

    # --- the object store (results larger than a termination message; artifacts/) ---------
    # An S3-compatible endpoint (http(s)://host:port), or file:///dir for a local directory store
    # (the demo's, one machine only). None: no object store, results stay termination messages.
    object_store_endpoint: str | None = None
    object_store_bucket: str = Field(default="k8s-dispatch", min_length=3, max_length=63)
    object_store_prefix: str = Field(default="results", min_length=1, max_length=200)
    object_store_region: str = "us-east-1"
    object_store_addressing_style: AddressingStyle = AddressingStyle.PATH
    # Credentials: these two, else a mounted Secret's folder holding files `access-key` and
    # `secret-key`, else boto3's own chain (AWS_* variables, ~/.aws, a web identity token).
    object_store_access_key: SecretStr | None = None
    object_store_secret_key: SecretStr | None = None
    object_store_credentials_dir: Path | None = None
    # Presigned uploads ask the store to keep a SHA-256 of each result, so that delivery verifies
    # it with a HEAD instead of reading it back; off for a store that refuses that parameter.
    object_store_server_checksums: bool = True
    # A presigned upload URL lives for the capability's deadlines plus this much.
    object_store_url_slack_s: int = Field(default=600, ge=0, le=86_400)
    # How long a read URL handed to the engine (`api.result_url`) lives.
    object_store_read_url_s: int = Field(default=300, ge=1, le=604_800)
    # Recorded results older than this are deleted by the artifacts sweep; 0: kept until deleted.
    object_store_retention_days: int = Field(default=0, ge=0, le=36_500)
    # An object that is not its dispatch's recorded result is deleted this long after the
    # dispatch ended (or, with no dispatch row at all, after the object was written).
    object_store_orphan_grace_s: float = Field(default=3600.0, ge=0)
    # An input larger than `max_input_bytes` (what a Job's env carries) goes to the object store,
    # up to this size; without an object store such an input is refused (InputTooLarge).
    object_store_max_input_bytes: int = Field(default=64 * 1024 * 1024, gt=0, le=5 * 1024**3)
    # The most of a container's log `archiveLogs` keeps: a longer log keeps its last lines, under
    # a first line that says it was cut. Held in memory while it is copied.
    archive_log_max_bytes: int = Field(default=10 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)

    # --- secret inputs (`schedule(..., secret=True)`) -----------------------------------------
    # Fernet keys (url-safe base64 of 32 bytes), comma-separated: the first encrypts secret
    # inputs at rest, every one decrypts (rotation: put the new key first, keep the old ones
    # until no dispatch sealed with them is running). None: a secret input is refused.
    input_key: SecretStr | None = None

    @field_validator("namespace")
    @classmethod
    def _namespace_is_dns_label(cls, value: str) -> str:
        from k8s_dispatch.core.names import is_dns1123_label

        if not is_dns1123_label(value):
            raise ValueError(f"{value!r} is not a valid namespace name (DNS-1123 label)")
        return value

    @field_validator("deployment")
    @classmethod
    def _deployment_is_label_value(cls, value: str | None) -> str | None:
        from k8s_dispatch.core.names import is_label_value

        if value is not None and (not value or not is_label_value(value)):
            raise ValueError(
                f"{value!r} is not a valid label value (1-63 letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit)"
            )
        return value

    @field_validator("database_url", "redis_url")
    @classmethod
    def _url_has_scheme(cls, value: str) -> str:
        if "://" not in value:
            raise ValueError(f"{value!r} is not a URL (expected scheme://...)")
        return value

    @field_validator("object_store_endpoint")
    @classmethod
    def _endpoint_is_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not re.match(r"^(https?://[^/\s]+/?|file:///\S*)$", value):
            raise ValueError(f"{value!r} is not an http(s)://host[:port] endpoint or a file:///path directory")
        return value

    @field_validator("object_store_prefix")
    @classmethod
    def _prefix_is_key_part(cls, value: str) -> str:
        if value != value.strip("/") or "//" in value or not re.match(r"^[A-Za-z0-9!_.*'()/-]+$", value):
            raise ValueError(f"{value!r} is not a key prefix (safe characters, no leading, trailing or double '/')")
        return value

    @property
    def max_stored_input_bytes(self) -> int | None:
        """The largest input `schedule` takes: `object_store_max_input_bytes` with an object
        store, else None (inputs then stay within `max_input_bytes`)."""
        return self.object_store_max_input_bytes if self.object_store_endpoint is not None else None

    @field_validator("input_key")
    @classmethod
    def _input_keys_are_fernet_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        for i, key in enumerate(value.get_secret_value().split(",")):
            if not is_fernet_key(key.strip()):
                # The key itself is never echoed: only which one is wrong.
                raise ValueError(f"key {i + 1} is not a Fernet key (url-safe base64 of 32 bytes)")
        return value

    @model_validator(mode="after")
    def _object_store_credentials(self) -> Settings:
        if (self.object_store_access_key is None) != (self.object_store_secret_key is None):
            raise ValueError("object_store_access_key and object_store_secret_key are set together or not at all")
        folder = self.object_store_credentials_dir
        if folder is not None and not all((folder / name).is_file() for name in ("access-key", "secret-key")):
            raise ValueError(f"object_store_credentials_dir {str(folder)!r} lacks the files access-key and secret-key")
        return self

    @model_validator(mode="after")
    def _capabilities_file_exists(self) -> Settings:
        if self.capabilities is not None and not self.capabilities.is_file():
            raise ValueError(f"capabilities file {str(self.capabilities)!r} does not exist")
        return self

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def effective_deployment(self) -> str:
        """The deployment label's value: `deployment`, else derived from `key_prefix`."""
        return self.deployment or deployment_from_prefix(self.key_prefix)


_NOT_IN_LABEL = re.compile(r"[^-A-Za-z0-9_.]+")


def deployment_from_prefix(key_prefix: str) -> str:
    """The default deployment identity (pure): the key prefix when it is a label value, else
    its label-safe characters (cut to 52) and 10 hex digits of its SHA-256, so that two
    prefixes never share a default."""
    from k8s_dispatch.core.names import is_label_value

    if key_prefix and is_label_value(key_prefix):
        return key_prefix
    slug = _NOT_IN_LABEL.sub("-", key_prefix)[:52].strip("-_.") or "kd"
    return f"{slug}-{hashlib.sha256(key_prefix.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build and validate settings from `environ` (default: the process environment).

    Raises:
        ConfigError: naming each invalid `K8S_DISPATCH_*` variable and why.
    """
    try:
        if environ is None:
            return Settings()
        values = {key[len(ENV_PREFIX) :].lower(): value for key, value in environ.items() if key.startswith(ENV_PREFIX)}
        return Settings.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(
            f"{ENV_PREFIX}{'.'.join(str(p) for p in err['loc']).upper() or '(settings)'}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from e


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, loaded once from the environment."""
    return load_settings()
