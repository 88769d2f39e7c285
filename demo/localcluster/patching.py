"""The three PATCH formats (pure): JSON merge patch (RFC 7386), strategic merge patch (as
apimachinery's strategicpatch, driven by schema.py's merge keys) and JSON patch (RFC 6902).

Each returns a new document and never mutates its inputs; malformed patches raise PatchError.
"""

from __future__ import annotations

import copy
from typing import Any

from k8s_dispatch.demo.localcluster.schema import STRUCTS, T, obj


class PatchError(ValueError):
    """The patch cannot be applied (malformed, failed test, missing path)."""


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# --- strategic merge patch ---------------------------------------------------------------

_DELETE_FROM = "$deleteFromPrimitiveList/"
_SET_ORDER = "$setElementOrder/"


def strategic_merge_patch(target: dict[str, Any], patch: dict[str, Any], kind: str) -> dict[str, Any]:
    if not isinstance(patch, dict):
        raise PatchError("strategic merge patch must be a JSON object")
    merged: dict[str, Any] = _smp_map(target, patch, obj(kind))  # a map patched is a map
    return merged


def _child_type(t: T | None, key: str) -> T | None:
    if t is None or t.kind == "any":
        return None
    if t.kind == "object" and t.struct:
        return STRUCTS[t.struct].get(key)
    if t.kind == "map":
        return t.item
    return None


def _smp_map(target: Any, patch: dict[str, Any], t: T | None) -> Any:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive is not None:
        raise PatchError(f"unknown patch type: {directive}")
    out = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith(_SET_ORDER):
            continue
        if key.startswith(_DELETE_FROM):
            field = key[len(_DELETE_FROM) :]
            if not isinstance(value, list):
                raise PatchError(f"{key} must be a list")
            remove = set(map(_hashable, value))
            if isinstance(out.get(field), list):
                out[field] = [v for v in out[field] if _hashable(v) not in remove]
            continue
        ft = _child_type(t, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(out.get(key), value, ft)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        elif isinstance(value, list):
            out[key] = _smp_list(out.get(key), value, ft)
        else:
            out[key] = value
    if isinstance(retain, list):
        keep = set(retain)
        out = {k: v for k, v in out.items() if k in keep}
    return out


def _hashable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def _smp_list(target: Any, patch: list[Any], t: T | None) -> list[Any]:
    if t is None or t.kind != "array" or not t.merge:
        if any(isinstance(v, dict) and v.get("$patch") == "replace" for v in patch):
            return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and "$patch" in v)]
        return copy.deepcopy(patch)
    current = list(target) if isinstance(target, list) else []
    if t.merge_key is None:  # primitive list with merge strategy: a union
        in_patch = {_hashable(v) for v in patch}
        server_only = [v for v in current if _hashable(v) not in in_patch]
        deduped = list({_hashable(v): v for v in patch}.values())
        return _merge_sorted(server_only, deduped, [_hashable(v) for v in current], _hashable)
    key = t.merge_key
    if any(isinstance(v, dict) and v.get("$patch") == "replace" for v in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and v.get("$patch") == "replace")]
    deleted: set[Any] = set()
    merged: dict[Any, Any] = {}
    for item in patch:
        if not isinstance(item, dict):
            raise PatchError(f"list items merged by {key!r} must be objects")
        if key not in item:
            raise PatchError(f"map: {item} does not contain declared merge key: {key}")
        if item.get("$patch") == "delete":
            deleted.add(_hashable(item[key]))
            merged.pop(_hashable(item[key]), None)
            continue
        k = _hashable(item[key])
        base = merged.get(k) or next((c for c in current if isinstance(c, dict) and _hashable(c.get(key)) == k), {})
        merged[k] = _smp_map(base, item, t.item)
    server_only = [c for c in current if not (isinstance(c, dict) and _hashable(c.get(key)) in deleted | merged.keys())]
    order = [_hashable(c.get(key)) if isinstance(c, dict) else None for c in current]
    return _merge_sorted(server_only, list(merged.values()), order, lambda c: _hashable(c.get(key)))


def _merge_sorted(server_only: list[Any], patched: list[Any], server_order: list[Any], key: Any) -> list[Any]:
    """The server's remaining items and the patch's, interleaved as kube-apiserver's strategic merge
    does: an item the server had keeps its place relative to the server's others; an item new to
    the server goes before the server's next item (so a new finalizer lands first, not last)."""
    position = {k: i for i, k in reversed(list(enumerate(server_order)))}
    out: list[Any] = []
    i = j = 0
    while i < len(server_only) or j < len(patched):
        if i < len(server_only) and j < len(patched):
            li, ri = position.get(key(server_only[i])), position.get(key(patched[j]))
            take_server = li is not None and ri is not None and li < ri
        else:
            take_server = i < len(server_only)
        if take_server:
            out.append(server_only[i])
            i += 1
        else:
            out.append(patched[j])
            j += 1
    return out


# --- JSON patch --------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, dict):
            if p not in cur:
                raise PatchError(f"path /{'/'.join(parts)} does not exist")
            cur = cur[p]
        elif isinstance(cur, list):
            try:
                cur = cur[int(p)]
            except (ValueError, IndexError):
                raise PatchError(f"path /{'/'.join(parts)} does not exist") from None
        else:
            raise PatchError(f"path /{'/'.join(parts)} does not exist")
    return cur, parts[-1]


def _get(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return doc
    parent, last = _parent(doc, parts)
    try:
        return parent[int(last)] if isinstance(parent, list) else parent[last]
    except (KeyError, ValueError, IndexError, TypeError):
        raise PatchError(f"path /{'/'.join(parts)} does not exist") from None


def _remove(doc: Any, parts: list[str]) -> Any:
    parent, last = _parent(doc, parts)
    try:
        return parent.pop(int(last)) if isinstance(parent, list) else parent.pop(last)
    except (KeyError, ValueError, IndexError, TypeError):
        raise PatchError(f"unable to remove nonexistent key: {last}: missing value") from None


def _add(doc: Any, parts: list[str], value: Any, *, replace: bool) -> Any:
    if not parts:
        return value
    parent, last = _parent(doc, parts)
    if isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(value)
            return doc
        try:
            idx = int(last)
        except ValueError:
            raise PatchError(f"invalid array index {last!r}") from None
        if replace:
            if not 0 <= idx < len(parent):
                raise PatchError(f"replace operation does not apply: index {idx} out of range")
            parent[idx] = value
        else:
            if not 0 <= idx <= len(parent):
                raise PatchError(f"add operation does not apply: index {idx} out of range")
            parent.insert(idx, value)
    elif isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(f"replace operation does not apply: doc is missing key: /{'/'.join(parts)}: missing value")
        parent[last] = value
    else:
        raise PatchError(f"path /{'/'.join(parts)} does not exist")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise PatchError("json patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid JSON patch operation: {op!r}")
        kind, parts = op["op"], _pointer(op["path"])
        if kind in ("add", "replace"):
            if "value" not in op:
                raise PatchError(f"{kind} operation needs a value")
            doc = _add(doc, parts, copy.deepcopy(op["value"]), replace=kind == "replace")
        elif kind == "remove":
            _remove(doc, parts)
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = _remove(doc, src) if kind == "move" else copy.deepcopy(_get(doc, src))
            doc = _add(doc, parts, value, replace=False)
        elif kind == "test":
            if _get(doc, parts) != op.get("value"):
                raise PatchError(f"testing value {op['path']} failed")
        else:
            raise PatchError(f"unexpected kind of operation: {kind!r}")
    return doc
