"""Label and field selectors: parsing the query-string syntax and matching objects (pure).

Grammar and semantics follow k8s.io/apimachinery/pkg/labels and /fields: `a=b`, `a==b`,
`a!=b` (matches when the key is absent), `a in (x,y)`, `a notin (x,y)`, `a`, `!a`, `a>1`,
`a<1`; and `metadata.name=x` / `!=` for fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeGuard

from k8s_dispatch.demo.localcluster.names import label_value as is_label_value
from k8s_dispatch.demo.localcluster.names import qualified_name as is_qualified_name


class SelectorError(ValueError):
    """The selector text is malformed or names something unsupported."""


class Op(Enum):
    EQUALS = "="
    NOT_EQUALS = "!="
    IN = "in"
    NOT_IN = "notin"
    EXISTS = "exists"
    DOES_NOT_EXIST = "!"
    GREATER = "gt"
    LESS = "lt"


@dataclass(frozen=True)
class Requirement:
    key: str
    op: Op
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.op
        if op is Op.EXISTS:
            return self.key in labels
        if op is Op.DOES_NOT_EXIST:
            return self.key not in labels
        if op is Op.EQUALS or op is Op.IN:
            return self.key in labels and labels[self.key] in self.values
        if op is Op.NOT_EQUALS or op is Op.NOT_IN:
            return self.key not in labels or labels[self.key] not in self.values
        if self.key not in labels:
            return False
        try:
            have = int(labels[self.key])
        except ValueError:
            return False
        (bound,) = self.values
        return have > int(bound) if op is Op.GREATER else have < int(bound)


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.requirements

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


EVERYTHING = LabelSelector()
_SPECIAL = set("!=(),<> \t\n")


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in " \t\n":
            i += 1
        elif c in "=!":
            if text[i + 1 : i + 2] == "=":
                out.append(c + "=")
                i += 2
            else:
                out.append(c)
                i += 1
        elif c in "(),<>":
            out.append(c)
            i += 1
        else:
            j = i
            while j < len(text) and text[j] not in _SPECIAL:
                j += 1
            out.append(text[i:j])
            i = j
    return out


def _is_word(tok: str | None) -> TypeGuard[str]:
    return tok is not None and tok[0] not in _SPECIAL


def _check_key(key: str) -> str:
    if not is_qualified_name(key):
        raise SelectorError(f"invalid label key {key!r}: must be a qualified name")
    return key


def _check_value(value: str) -> str:
    if not is_label_value(value):
        raise SelectorError(f"invalid label value: {value!r}: must be a valid label value")
    return value


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse `labelSelector`; raises SelectorError on bad syntax, keys or values."""
    if not text or not text.strip():
        return EVERYTHING
    toks = _tokens(text)
    pos = 0
    reqs: list[Requirement] = []

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str | None:
        nonlocal pos
        tok = peek()
        pos += 1
        return tok

    while True:
        tok = take()
        if tok == "!":
            key = take()
            if not _is_word(key):
                raise SelectorError(f"found {key!r}, expected: identifier after '!'")
            reqs.append(Requirement(_check_key(key), Op.DOES_NOT_EXIST))
        elif _is_word(tok):
            key = _check_key(tok)
            op_tok = peek()
            if op_tok is None or op_tok == ",":
                reqs.append(Requirement(key, Op.EXISTS))
            elif op_tok in ("=", "==", "!="):
                take()
                value = peek()
                if _is_word(value):
                    take()
                else:
                    value = ""
                op = Op.NOT_EQUALS if op_tok == "!=" else Op.EQUALS
                reqs.append(Requirement(key, op, frozenset({_check_value(value)})))
            elif op_tok in ("in", "notin"):
                take()
                if take() != "(":
                    raise SelectorError(f"expected '(' after {op_tok!r}")
                values: set[str] = set()
                expect_value = True
                while True:
                    t = take()
                    if t is None:
                        raise SelectorError("unterminated value set")
                    if t == ")":
                        if expect_value and values:
                            values.add("")
                        break
                    if t == ",":
                        if expect_value:
                            values.add("")
                        expect_value = True
                        continue
                    if not _is_word(t) or not expect_value:
                        raise SelectorError(f"found {t!r} in value set")
                    values.add(_check_value(t))
                    expect_value = False
                if not values:
                    raise SelectorError(f"for '{op_tok}' operator, values set can't be empty")
                reqs.append(Requirement(key, Op.IN if op_tok == "in" else Op.NOT_IN, frozenset(values)))
            elif op_tok in ("<", ">"):
                take()
                bound = take() or ""
                try:
                    int(bound)
                except ValueError:
                    raise SelectorError(f"for {op_tok!r} operator, the value must be an integer") from None
                reqs.append(Requirement(key, Op.LESS if op_tok == "<" else Op.GREATER, frozenset({bound})))
            else:
                raise SelectorError(f"found {op_tok!r}, expected: operator after key {key!r}")
        else:
            raise SelectorError(f"found {tok!r}, expected: !, identifier, or 'end of string'")
        nxt = take()
        if nxt is None:
            break
        if nxt != ",":
            raise SelectorError(f"found {nxt!r}, expected: ',' or 'end of string'")
    return LabelSelector(tuple(reqs))


def from_label_selector_object(selector: Mapping[str, Any] | None) -> LabelSelector:
    """A metav1.LabelSelector (matchLabels + matchExpressions) as requirements. None selects nothing
    the way Kubernetes treats a nil selector for controllers; {} selects everything."""
    if selector is None:
        return LabelSelector((Requirement("", Op.IN, frozenset()),))
    reqs = [Requirement(k, Op.EQUALS, frozenset({v})) for k, v in (selector.get("matchLabels") or {}).items()]
    ops = {"In": Op.IN, "NotIn": Op.NOT_IN, "Exists": Op.EXISTS, "DoesNotExist": Op.DOES_NOT_EXIST}
    for expr in selector.get("matchExpressions") or []:
        op = ops.get(expr.get("operator", ""))
        if op is None:
            raise SelectorError(f"{expr.get('operator')!r} is not a valid label selector operator")
        reqs.append(Requirement(expr.get("key", ""), op, frozenset(expr.get("values") or ())))
    return LabelSelector(tuple(reqs))


def format_label_selector(selector: Mapping[str, Any]) -> str:
    """matchLabels/matchExpressions as selector text (kubectl prints it; `logs job/x` sends it)."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, key, values = expr.get("operator"), expr.get("key"), ",".join(sorted(expr.get("values") or []))
        parts.append(
            {
                "In": f"{key} in ({values})",
                "NotIn": f"{key} notin ({values})",
                "Exists": f"{key}",
                "DoesNotExist": f"!{key}",
            }[op]
        )
    return ",".join(parts)


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negate: bool

    def matches(self, fields: Mapping[str, str]) -> bool:
        return (fields.get(self.field, "") == self.value) != self.negate


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, cur, i = [], [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if c == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            if text[i + 1] not in "\\,=":
                raise SelectorError(f"invalid field selector: invalid escape sequence: \\{text[i + 1]}")
            out.append(text[i + 1])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def parse_field_selector(text: str | None, supported: frozenset[str] | set[str]) -> tuple[FieldRequirement, ...]:
    """Parse `fieldSelector`; raises SelectorError for bad syntax or an unsupported field."""
    if not text or not text.strip():
        return ()
    reqs = []
    for part in _split_unescaped(text, ","):
        if not part:
            continue
        for op, negate in (("!=", True), ("==", False), ("=", False)):  # noqa: B007 - read after the break
            idx = part.find(op)
            if idx > 0:
                name, value = part[:idx].strip(), _unescape(part[idx + len(op) :])
                break
        else:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        if name not in supported:
            raise SelectorError(f"field label not supported: {name}")
        reqs.append(FieldRequirement(name, value, negate))
    return tuple(reqs)


def fields_match(reqs: tuple[FieldRequirement, ...], fields: Mapping[str, str]) -> bool:
    return all(r.matches(fields) for r in reqs)
