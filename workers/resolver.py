"""The capability resolver: capability name -> how to run it, loaded and checked when built.

A resolver is built from a YAML (`.yaml`, `.yml`) or JSON (`.json`) file, or a mapping, and
validates everything then, so recovery that runs first thing at start-up can already route.
Problems are reported together in one `ConfigError`, each line naming the file, the
capability and the field (a capability's values are checked once its types are right).
Schema (field names as Kubernetes spells them)::

    capabilities:                      # required, at least one
      demo.wordcount:                  # capability name: letters, digits, -_.:/ (<= 128)
        worker: demo-text              # required, DNS-1123 label
        image: k8s-dispatch:latest     # required
        command: [python, -m, k8s_dispatch.container.runner]   # list of strings, default: image entrypoint
        args: [k8s_dispatch.demo.functions:wordcount] # list of strings, default []
        env: {LOG_LEVEL: info}         # string -> string (K8S_DISPATCH_INPUT is reserved)
        resources:                     # requests/limits: resource name -> quantity
          requests: {cpu: 50m, memory: 64Mi}
          limits: {memory: 128Mi}
        namespace: jobs                # default: the settings' namespace
        activeDeadlineSeconds: 600     # absent: 3600; null: no deadline
        queueTimeoutSeconds: 900       # scheduled -> Job created (quota, API down); absent/null: no limit
        startTimeoutSeconds: 600       # Job created -> its container started (default 600)
        imagePullTimeoutSeconds: 300   # a Pod pulling its image in vain (default 300)
        configErrorTimeoutSeconds: 60  # a Pod waiting on its config, e.g. a Secret (default 60)
        backoffLimit: 0                # default 0: one pod, a failure fails the Job at once
        labels: {team: search}         # added to Job and Pod; ours cannot be overridden
        annotations: {owner: me}
        runAsUser: 65534               # the Pod's uid, for an image whose own user is root
        runAsGroup: 65534
        securityOverrides:             # the `restricted` defaults this capability turns off, each with why:
          automountServiceAccountToken: "it reads its ConfigMap through the API"
          # also runAsNonRoot, allowPrivilegeEscalation, capabilities (drop ALL), seccompProfile
        failOnExitCodes: [3]           # exit codes that fail the Job at once (FailJob); 1-255
        retryOnExitCodes: [75]         # exit codes counted against backoffLimit (Count): needs backoffLimit >= 1
        maxDisruptions: 3              # evictions/preemptions tolerated (never counted as failures); one more: Disrupted
        queue: team-a                  # a Kueue LocalQueue: Jobs created suspended, labelled for it; Kueue admits them
        results: objectStore           # default terminationMessage (JSON <= 4 KiB); objectStore: any size, verified
        maxResultBytes: 1073741824     # objectStore only: a larger result fails ResultTooLarge (default 1 GiB)
        archiveLogs: onFailure         # Pods' logs kept in the object store: onFailure (default), always, never
    limits:                            # optional: fair-share limits, see core/limits.py
      tenancies: {default: {maxRunning: 100}, acme: {maxRunning: 3, weight: 2}}
      capabilities: {demo.sha256: {maxRunning: 5}}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import yaml

from k8s_dispatch.core.errors import ConfigError, UnknownCapability
from k8s_dispatch.core.limits import Limits
from k8s_dispatch.core.limits import parse as parse_limits
from k8s_dispatch.workers.backends import Worker
from k8s_dispatch.workers.capability import (
    ARCHIVE_LOGS_ALWAYS,
    ARCHIVE_LOGS_KINDS,
    ARCHIVE_LOGS_ON_FAILURE,
    DEFAULT_ACTIVE_DEADLINE_S,
    DEFAULT_BACKOFF_LIMIT,
    DEFAULT_CONFIG_ERROR_TIMEOUT_S,
    DEFAULT_IMAGE_PULL_TIMEOUT_S,
    DEFAULT_MAX_DISRUPTIONS,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_START_TIMEOUT_S,
    EMPTY,
    MAX_RESULT_BYTES_LIMIT,
    RESULTS_KINDS,
    RESULTS_OBJECT_STORE,
    RESULTS_TERMINATION_MESSAGE,
    CapabilitySpec,
)
from k8s_dispatch.workers.manifest import MAX_INT32, spec_problems
from k8s_dispatch.workers.types import CapabilityName, WorkerName, is_capability_name

if TYPE_CHECKING:
    from k8s_dispatch.core.settings import Settings

log = logging.getLogger(__name__)

_REQUIRED = ("worker", "image")
_FIELDS = (
    "worker", "image", "command", "args", "env", "resources", "namespace",
    "activeDeadlineSeconds", "backoffLimit", "labels", "annotations",
    "runAsUser", "runAsGroup", "securityOverrides",
    "queueTimeoutSeconds", "startTimeoutSeconds", "imagePullTimeoutSeconds", "configErrorTimeoutSeconds",
    "retryOnExitCodes", "failOnExitCodes", "maxDisruptions", "queue", "results", "maxResultBytes", "archiveLogs",
)  # fmt: skip
_NULLABLE = ("activeDeadlineSeconds", "queueTimeoutSeconds")  # null: no limit
# The clocks (seconds): config field -> CapabilitySpec attribute; each a positive integer.
_CLOCKS = {
    "queueTimeoutSeconds": "queue_timeout_seconds",
    "startTimeoutSeconds": "start_timeout_seconds",
    "imagePullTimeoutSeconds": "image_pull_timeout_seconds",
    "configErrorTimeoutSeconds": "config_error_timeout_seconds",
}
_YAML_SUFFIXES = (".yaml", ".yml")
_JSON_SUFFIXES = (".json",)


class CapabilityResolver:
    """The validated capability table. Build it with `from_file`, `from_mapping` or `demo_resolver`."""

    def __init__(
        self,
        specs: Mapping[str, CapabilitySpec],
        *,
        source: str,
        default_namespace: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        """Prefer the `from_*` constructors; this one checks the specs but not the raw config.

        `default_namespace` is where a capability that names none runs (the settings'
        namespace; `from_settings` and `Runtime` set it): what `namespace_for` answers.
        `limits`: the fair-share limits (`core.limits`), which `store.dispatches.schedule` reads
        to queue what they cover.
        """
        problems = [] if specs else [f"{source}: no capability is defined"]
        for name, spec in specs.items():
            if spec.name != name:
                problems.append(f"{source}: capability {name!r}: field 'name': the spec is named {spec.name!r}")
            problems.extend(
                f"{source}: capability {name!r}: field {fld!r}: {why}"
                for fld, why in [*spec_problems(spec), *clock_problems(spec), *results_problems(spec)]
            )
        limits = limits if limits is not None else Limits()
        problems.extend(
            f"{source}: limits.capabilities.{name}: no such capability (defined: {', '.join(sorted(specs))})"
            for name in sorted(limits.capabilities)
            if name not in specs
        )
        if problems:
            raise ConfigError("invalid capability config:\n" + "\n".join(problems))
        self.source = source
        self.default_namespace = default_namespace
        self.limits = limits
        self._specs: dict[str, CapabilitySpec] = dict(specs)

    @classmethod
    def from_file(cls, path: str | Path) -> CapabilityResolver:
        """Load a `.yaml`/`.yml` or `.json` capability file.

        Raises:
            ConfigError: the file cannot be read or parsed, or any capability is invalid; the
                message names the file (and the capability and field).
        """
        path = Path(path)
        source = str(path)
        suffix = path.suffix.lower()
        if suffix not in _YAML_SUFFIXES + _JSON_SUFFIXES:
            raise ConfigError(f"{source}: capability file must end in .yaml, .yml or .json")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{source}: cannot read capability file: {e}") from e
        try:
            data = _load_yaml(text) if suffix in _YAML_SUFFIXES else _load_json(text)
        except (yaml.YAMLError, ValueError) as e:
            raise ConfigError(f"{source}: not valid {'YAML' if suffix in _YAML_SUFFIXES else 'JSON'}: {e}") from e
        return cls.from_mapping(data, source=source)

    @classmethod
    def from_mapping(cls, data: object, *, source: str = "<inline>") -> CapabilityResolver:
        """Build from already-parsed config (`{"capabilities": {...}}`).

        Raises:
            ConfigError: listing every problem, each naming `source`, capability and field.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: the top level must be a mapping with a 'capabilities' key")
        unknown = sorted(str(k) for k in data if k not in ("capabilities", "limits"))
        if unknown:
            raise ConfigError(f"{source}: unknown top-level keys {unknown} (only 'capabilities' and 'limits')")
        table = data.get("capabilities")
        if not isinstance(table, Mapping) or not table:
            raise ConfigError(f"{source}: 'capabilities' must be a non-empty mapping of name -> fields")
        limits, problems = parse_limits(data.get("limits"), source=source)
        specs: dict[str, CapabilitySpec] = {}
        for name, fields in table.items():
            spec = _parse_capability(name, fields, problems=problems, source=source)
            if spec is not None:
                specs[name] = spec
        if problems:
            raise ConfigError("invalid capability config:\n" + "\n".join(problems))
        return cls(specs, source=source, limits=limits)

    @classmethod
    def from_settings(cls, settings: Settings) -> CapabilityResolver:
        """The file named by `K8S_DISPATCH_CAPABILITIES`, else the demo capabilities.

        Without an object store, `archiveLogs` keeps no log: said once here for `onFailure` (the
        default, which must not make a store compulsory), refused for an explicit `always`, whose
        author counts on every log being kept.

        Raises:
            ConfigError: also when a capability's results go to an object store, or its logs always
                do, and none is configured.
        """
        resolver = demo_resolver() if settings.capabilities is None else cls.from_file(settings.capabilities)
        specs = resolver._specs.values()
        if settings.object_store_endpoint is None:
            for needing, what in (
                (sorted(s.name for s in specs if s.results_in_object_store), f"results: {RESULTS_OBJECT_STORE}"),
                (sorted(s.name for s in specs if s.archive_logs == ARCHIVE_LOGS_ALWAYS), "archiveLogs: always"),
            ):
                if needing:
                    raise ConfigError(
                        f"{resolver.source}: capabilities {needing} have {what}, "
                        "but no object store is configured (K8S_DISPATCH_OBJECT_STORE_ENDPOINT)"
                    )
            if any(s.archive_logs == ARCHIVE_LOGS_ON_FAILURE for s in specs):
                log.info("archiveLogs: onFailure keeps no log: no object store is configured; logs go with their Pods")
        return resolver.with_default_namespace(settings.namespace)

    def with_default_namespace(self, namespace: str) -> CapabilityResolver:
        """The same table, with `namespace` for the capabilities that name none."""
        return type(self)(self._specs, source=self.source, default_namespace=namespace, limits=self.limits)

    def spec(self, capability: str) -> CapabilitySpec:
        """Raises: UnknownCapability."""
        try:
            return self._specs[capability]
        except KeyError:
            known = ", ".join(sorted(self._specs))
            raise UnknownCapability(f"unknown capability {capability!r} (known in {self.source}: {known})") from None

    def worker_for(self, capability: str) -> WorkerName:
        """Raises: UnknownCapability."""
        return self.spec(capability).worker_name

    def namespace_for(self, capability: str) -> str | None:
        """Where the capability's Jobs go now (None: it names none and there is no default):
        what `store.dispatches.schedule` records in the dispatch, fixed from then on.

        Raises: UnknownCapability.
        """
        return self.spec(capability).namespace or self.default_namespace

    def capabilities(self) -> frozenset[CapabilityName]:
        return frozenset(CapabilityName(name) for name in self._specs)

    def workers(self) -> tuple[Worker, ...]:
        """Each worker named in the config with the capabilities it serves, sorted by name."""
        served: dict[WorkerName, set[CapabilityName]] = {}
        for spec in self._specs.values():
            served.setdefault(spec.worker_name, set()).add(spec.name)
        return tuple(Worker(name, frozenset(caps)) for name, caps in sorted(served.items()))

    def namespaces(self, default: str) -> frozenset[str]:
        """Every namespace a Job may be created in: what to list when polling."""
        return frozenset(spec.namespace or default for spec in self._specs.values())

    def __contains__(self, capability: object) -> bool:
        return capability in self._specs

    def __repr__(self) -> str:
        return f"CapabilityResolver(source={self.source!r}, capabilities={sorted(self._specs)})"


# --- parsing one capability ------------------------------------------------------------


class _Problems:
    """Collects `file: capability: field: why` lines for one capability."""

    def __init__(self, lines: list[str], *, source: str, name: object) -> None:
        self.lines, self.source, self.name = lines, source, name
        self.count = 0

    def add(self, field_name: str, why: str) -> None:
        self.count += 1
        self.lines.append(f"{self.source}: capability {self.name!r}: field {field_name!r}: {why}")


def _parse_capability(name: object, fields: object, *, problems: list[str], source: str) -> CapabilitySpec | None:
    report = _Problems(problems, source=source, name=name)
    if not is_capability_name(name):
        report.add("name", "must be 1..128 letters, digits and -_.:/, starting and ending with a letter or digit")
    if not isinstance(fields, Mapping):
        report.add("(all)", f"must be a mapping of fields, not {_kind(fields)}")
        return None
    for key in fields:
        if key not in _FIELDS:
            report.add(str(key), f"unknown field (known: {', '.join(_FIELDS)})")
    for key in _REQUIRED:
        if key not in fields:
            report.add(key, "is required")

    def text(key: str, *, optional: bool = False) -> Any:
        value = fields.get(key)
        if value is None and (optional or key not in fields):
            return None
        if not isinstance(value, str):
            report.add(key, f"must be a string, not {_kind(value)}")
            return None
        return value

    def strings(key: str) -> tuple[str, ...]:
        value = fields.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            report.add(key, "must be a list of strings (quote numbers)")
            return ()
        return tuple(value)

    def string_map(key: str) -> Mapping[str, str]:
        value = fields.get(key, {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            report.add(key, "must be a mapping of strings to strings (quote numbers and booleans)")
            return EMPTY
        return MappingProxyType(dict(value))

    def integer(key: str, default: int | None) -> int | None:
        if key not in fields:
            return default
        value = fields[key]
        if value is None and key in _NULLABLE:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            report.add(key, f"must be an integer, not {_kind(value)}")
            return default
        return value

    def exit_codes(key: str) -> tuple[int, ...]:
        value = fields.get(key, [])
        if not isinstance(value, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in value):
            report.add(key, "must be a list of integer exit codes")
            return ()
        return tuple(value)

    worker = text("worker")
    image = text("image")
    spec = CapabilitySpec(
        name=CapabilityName(str(name)),
        worker_name=WorkerName(worker or ""),
        image=image or "",
        command=strings("command"),
        args=strings("args"),
        env=string_map("env"),
        resources=_resources(fields.get("resources", {}), report),
        namespace=text("namespace", optional=True),
        active_deadline_seconds=integer("activeDeadlineSeconds", DEFAULT_ACTIVE_DEADLINE_S),
        backoff_limit=integer("backoffLimit", DEFAULT_BACKOFF_LIMIT) or 0,
        labels=string_map("labels"),
        annotations=string_map("annotations"),
        run_as_user=integer("runAsUser", None),
        run_as_group=integer("runAsGroup", None),
        security_overrides=string_map("securityOverrides"),
        queue_timeout_seconds=integer("queueTimeoutSeconds", None),
        start_timeout_seconds=integer("startTimeoutSeconds", DEFAULT_START_TIMEOUT_S) or 0,
        image_pull_timeout_seconds=integer("imagePullTimeoutSeconds", DEFAULT_IMAGE_PULL_TIMEOUT_S) or 0,
        config_error_timeout_seconds=integer("configErrorTimeoutSeconds", DEFAULT_CONFIG_ERROR_TIMEOUT_S) or 0,
        retry_on_exit_codes=exit_codes("retryOnExitCodes"),
        fail_on_exit_codes=exit_codes("failOnExitCodes"),
        max_disruptions=integer("maxDisruptions", DEFAULT_MAX_DISRUPTIONS) or 0,
        queue=text("queue", optional=True),
        results=text("results", optional=True) or RESULTS_TERMINATION_MESSAGE,
        max_result_bytes=integer("maxResultBytes", DEFAULT_MAX_RESULT_BYTES) or 0,
        archive_logs=text("archiveLogs", optional=True) or ARCHIVE_LOGS_ON_FAILURE,
    )
    if report.count:
        return None  # value checks on half-parsed fields would only repeat the type errors
    for fld, why in [*spec_problems(spec), *clock_problems(spec), *results_problems(spec)]:
        report.add(fld, why)
    if "maxResultBytes" in fields and not spec.results_in_object_store:
        report.add("maxResultBytes", f"applies to results: {RESULTS_OBJECT_STORE} only")
    return None if report.count else spec


def results_problems(spec: CapabilitySpec) -> list[tuple[str, str]]:
    """What is wrong with where the spec's results and logs go: (config field name, why) pairs."""
    problems = []
    if spec.results not in RESULTS_KINDS:
        problems.append(("results", f"{spec.results!r} is not one of {', '.join(RESULTS_KINDS)}"))
    size = spec.max_result_bytes
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_RESULT_BYTES_LIMIT:
        problems.append(("maxResultBytes", f"{size!r} is not a size in bytes from 1 to {MAX_RESULT_BYTES_LIMIT}"))
    if spec.archive_logs not in ARCHIVE_LOGS_KINDS:
        problems.append(("archiveLogs", f"{spec.archive_logs!r} is not one of {', '.join(ARCHIVE_LOGS_KINDS)}"))
    return problems


def clock_problems(spec: CapabilitySpec) -> list[tuple[str, str]]:
    """What is wrong with the spec's clocks: (config field name, why) pairs. Each is a whole
    number of seconds, at least 1 (a zero would fail every dispatch before it could start)."""
    problems = []
    for fld, attribute in _CLOCKS.items():
        value = getattr(spec, attribute)
        if value is None and fld in _NULLABLE:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT32:
            problems.append((fld, f"{value!r} is not a positive integer (seconds)"))
    return problems


def _resources(value: object, report: _Problems) -> Mapping[str, Mapping[str, str]]:
    """Resource quantities as strings; plain numbers are accepted, as Kubernetes does."""
    if not isinstance(value, Mapping):
        report.add("resources", f"must be a mapping with 'requests' and/or 'limits', not {_kind(value)}")
        return EMPTY
    out: dict[str, Mapping[str, str]] = {}
    for kind, amounts in value.items():
        if not isinstance(amounts, Mapping):
            report.add("resources", f"{kind!r} must map resource names to quantities, not {_kind(amounts)}")
            continue
        converted: dict[str, str] = {}
        for resource, quantity in amounts.items():
            if isinstance(quantity, bool) or not isinstance(quantity, (str, int, float)):
                report.add("resources", f"{kind}: {resource!r}: {quantity!r} is not a quantity (like 100m, 64Mi, 2)")
            else:
                converted[str(resource)] = str(quantity)
        out[str(kind)] = MappingProxyType(converted)
    return MappingProxyType(out)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _load_json(text: str) -> object:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"duplicate keys {duplicates}")
        return dict(pairs)

    return json.loads(text, object_pairs_hook=no_duplicates)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> object:
    return yaml.load(text, Loader=_UniqueKeyLoader)


# --- the demo capabilities -------------------------------------------------------------

DEMO_IMAGE = "k8s-dispatch:latest"
DEMO_FUNCTIONS = {
    "demo.wordcount": ("demo-text", "k8s_dispatch.demo.functions:wordcount"),
    "demo.sha256": ("demo-text", "k8s_dispatch.demo.functions:sha256"),
    "demo.primes": ("demo-math", "k8s_dispatch.demo.functions:primes"),
}
# The demo capability whose result goes to the object store: only in `demo_config(object_store=True)`,
# since a capability with `results: objectStore` is refused where no store is configured, and the
# demo capabilities are the default table (`from_settings` without a capabilities file).
DEMO_STORED_FUNCTIONS = {
    "demo.report": ("demo-files", "k8s_dispatch.demo.functions:report"),
}
DEMO_MAX_RESULT_BYTES = 64 * (1 << 20)


def demo_config(*, image: str = DEMO_IMAGE, python: str = "python", object_store: bool = False) -> dict[str, Any]:
    """The demo capabilities as config data: extend it and pass it to `from_mapping`.

    `python` is the interpreter the container runs: "python" in the project's image; in
    localcluster's exec mode, `sys.executable` so the Job's process finds this package.
    `object_store` adds `DEMO_STORED_FUNCTIONS` (`results: objectStore`), for settings that
    configure a store (`k8s-dispatch demo` configures a local directory one).
    """
    functions = DEMO_FUNCTIONS | (DEMO_STORED_FUNCTIONS if object_store else {})
    capabilities: dict[str, Any] = {
        name: {
            "worker": worker,
            "image": image,
            "command": [python, "-m", "k8s_dispatch.container.runner"],
            "args": [function],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
            "activeDeadlineSeconds": 120,
            "backoffLimit": 0,
        }
        for name, (worker, function) in functions.items()
    }
    if object_store:
        for name in DEMO_STORED_FUNCTIONS:
            capabilities[name] |= {"results": RESULTS_OBJECT_STORE, "maxResultBytes": DEMO_MAX_RESULT_BYTES}
    return {"capabilities": capabilities}


def demo_resolver(*, image: str = DEMO_IMAGE, python: str = "python") -> CapabilityResolver:
    """Three capabilities doing small, checkable work (see `demo/functions.py`)."""
    return CapabilityResolver.from_mapping(demo_config(image=image, python=python), source="<demo>")
