"""What reads need of one version of a store, worked out once per process (:class:`View`):
its shards' offsets, the columns to return, and the blocks of consecutive shards the cache may
join; and the keys decoded shards are cached under (:func:`cache_id`), which the view's block
keys are made of. Its own module so that the dataset, batch assembly and the cache each import
it, and none of them imports another back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidDataError
from ..records import manifest as m
from ..records.manifest import cache_id

if TYPE_CHECKING:
    from ..snapshot import Snapshot

__all__ = ["View", "cache_id"]

Key = tuple[tuple[str, str], str | None]  # a whole shard's key in the cache

# Decoded Arrow bytes per Parquet byte assumed when planning blocks (text compresses ~2-4x);
# an underestimate only makes a block that the cache then declines to form.
_DECODED_PER_PARQUET_BYTE = 3


class View:
    """What reads need of one version, computed once per process: shard offsets (a list for
    one row, numpy for a batch), the schema and which of its columns to return."""

    __slots__ = (
        "block_keys",
        "block_offsets",
        "block_parts",
        "block_starts",
        "blocks",
        "fingerprint",
        "group_starts",
        "names",
        "np_offsets",
        "num_rows",
        "offsets",
        "positions",
        "shards",
        "snap",
        "too_big",
    )

    def __init__(self, snap: Snapshot, columns: list[str] | None, url: str, block_bytes: int):
        self.snap = snap
        self.shards = snap.shards
        self.offsets = list(snap.offsets)
        self.np_offsets = np.asarray(self.offsets, dtype=np.int64)
        self.num_rows = snap.num_rows
        self.fingerprint = snap.commit.schema
        names = tuple(snap.schema.names) if snap.schema is not None else ()
        self.positions: list[int] | None = None  # None: every column, in schema order
        if columns is not None and snap.schema is not None:
            missing = [c for c in columns if c not in names]
            if missing:
                raise InvalidDataError(
                    f"columns {missing} are not in version {snap.version} of {url} "
                    f"(it has {list(names)}); pass columns=None or names it has"
                )
            self.positions = [names.index(c) for c in columns]
            names = tuple(columns)
        self.names = names
        self.too_big: set[int] = set()
        self.group_starts: dict[int, np.ndarray] = {}  # filled by batch.starts_of
        self._plan_blocks(block_bytes)

    def _plan_blocks(self, block_bytes: int) -> None:
        """Split the shards into aligned power-of-two runs ([0, 8), [8, 10), ...) of at most
        ``block_bytes`` (estimated decoded size). The runs depend only on the shards, so a
        version and the next one (one shard appended) share every block but the trailing
        ones, and as a store grows each shard is copied into a larger block about log2(n)
        times in all, not once per version."""
        sizes = [s.bytes * _DECODED_PER_PARQUET_BYTE for s in self.shards]
        blocks, i, n = [], 0, len(self.shards)
        while i < n:
            width = 1
            while (
                i % (width * 2) == 0
                and i + width * 2 <= n
                and sum(sizes[i : i + width * 2]) <= block_bytes
            ):
                width *= 2
            blocks.append((i, i + width))
            i += width
        self.blocks = blocks
        self.block_parts: list[list[tuple[tuple[str, str], str | None]] | None] = [None] * len(
            blocks
        )
        self.block_starts = [self.offsets[lo] for lo, _ in blocks]
        self.block_offsets = np.asarray([*self.block_starts, self.num_rows])
        fp = self.fingerprint if self.snap.schema is not None else None
        # One digest of the parts' checksums: a key of thousands of tiny shards would cost a
        # tuple hash over all of them on every lookup.
        self.block_keys = [
            (
                "block",
                fp,
                m.sha256("".join("".join(cache_id(s)) for s in self.shards[lo:hi]).encode()),
            )
            if hi - lo > 1
            else None
            for lo, hi in blocks
        ]

    def parts(self, block: int) -> list[Key]:
        """The cache keys of a block's shards (kept: asked on every read until it forms)."""
        parts = self.block_parts[block]
        if parts is None:
            lo, hi = self.blocks[block]
            fp = self.fingerprint if self.snap.schema is not None else None
            parts = self.block_parts[block] = [(cache_id(s), fp) for s in self.shards[lo:hi]]
        return parts
