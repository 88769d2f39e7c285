"""A map's item inputs packed in one object (pure), so that each Pod reads its own item alone and
checks it alone against the few bytes its Job carries. The create step packs (`artifacts.inputs`),
the runner reads; both sides import this module, which needs nothing but the standard library.

Layout (version 1) for `n` items in completion-index order:
  bytes [16*j, 16*j + 16): item j's entry, the start and length of its record (big-endian u64 each);
  a record: the item's Merkle audit path (32-byte hashes, leaf to root), then its canonical JSON.

The Job carries the tree's root, `n` and the object's size. The tree is RFC 6962's (leaf =
SHA-256(0x00 || j as u64 || item), node = SHA-256(0x01 || left || right); an odd node at the end
of a level rises unpaired), so a Pod recomputes the root from its own record alone. The entry is
not trusted: a wrong range, other bytes, another index's record or a short object hash to
another root. A tree because the root is 32 bytes however many items there are: a table of
per-item digests would be 32 bytes per item in every Pod (3.2 MB at 100,000 items), or read whole
by each; the path costs 32 bytes per level (17 at 100,000 items) in the object, once per item.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

VERSION = 1
ENTRY_BYTES = 16
HASH_BYTES = 32
_ENTRY = struct.Struct(">QQ")
_INDEX = struct.Struct(">Q")


@dataclass(frozen=True)
class Packed:
    data: bytes
    root: str  # hex SHA-256
    count: int


def leaf_hash(index: int, item: bytes) -> bytes:
    """The leaf of completion index `index`: the item bound to its place, so that one index's
    record never passes for another's."""
    return hashlib.sha256(b"\x00" + _INDEX.pack(index) + item).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _levels(leaves: list[bytes]) -> list[list[bytes]]:
    """The tree's levels, leaves first and the root's last (an odd last node rises unpaired)."""
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def pack(items: Sequence[bytes]) -> Packed:
    """`items` (each item's canonical JSON, in completion-index order) as one object.

    Raises:
        ValueError: no items.
    """
    if not items:
        raise ValueError("a map packs at least one item")
    levels = _levels([leaf_hash(j, item) for j, item in enumerate(items)])
    count = len(items)
    records = [b"".join(_path(levels, j)) + item for j, item in enumerate(items)]
    entries = bytearray()
    start = ENTRY_BYTES * count
    for record in records:
        entries += _ENTRY.pack(start, len(record))
        start += len(record)
    return Packed(data=bytes(entries) + b"".join(records), root=levels[-1][0].hex(), count=count)


def _path(levels: list[list[bytes]], index: int) -> list[bytes]:
    path: list[bytes] = []
    for level in levels[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            path.append(level[sibling])
        index //= 2
    return path


def path_length(index: int, count: int) -> int:
    """How many hashes the audit path of `index` in a tree of `count` leaves holds."""
    length = 0
    while count > 1:
        if index ^ 1 < count:
            length += 1
        index //= 2
        count = (count + 1) // 2
    return length


def entry_range(index: int) -> tuple[int, int]:
    """The first byte and the length of item `index`'s entry."""
    return ENTRY_BYTES * index, ENTRY_BYTES


def parse_entry(entry: bytes) -> tuple[int, int]:
    """(start, length) of a record, from its entry's 16 bytes. Raises: ValueError: not 16 bytes."""
    start, length = _ENTRY.unpack(entry)
    return int(start), int(length)


def item_of_record(index: int, count: int, record: bytes, root: str) -> bytes | None:
    """Item `index`'s canonical JSON, if `record` is its record in the tree whose root is `root`
    (hex); None for any other bytes."""
    if not 0 <= index < count:
        return None
    size = HASH_BYTES * path_length(index, count)
    if len(record) < size:
        return None
    item = record[size:]
    node = leaf_hash(index, item)
    position, width, at = index, count, 0
    while width > 1:
        sibling = position ^ 1
        if sibling < width:
            other = record[at : at + HASH_BYTES]
            at += HASH_BYTES
            node = node_hash(other, node) if position & 1 else node_hash(node, other)
        position //= 2
        width = (width + 1) // 2
    return item if node.hex() == root else None
