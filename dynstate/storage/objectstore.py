"""Object stores through fsspec (S3 via s3fs, and others): conditional PUTs, retries, and a
read-back that resolves creates whose reply was lost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidDataError
from ..threads import ProcessPool
from .base import Storage
from .credentials import guard_loggers, split_userinfo
from .s3http import S3Config, S3Reader, config_of, root_of


class ObjectStorage(Storage):
    """A store root in a bucket. Operations are retried on transient failures (see
    :func:`dynstate.storage.retry.is_transient`) with exponential backoff and full jitter,
    on top of the retries botocore and s3fs do themselves; permanent ones never are."""

    retry_attempts = 5
    #: Small reads issued together by :meth:`read_many` (each a GET of a few hundred bytes,
    #: so the round trip is the whole cost).
    max_parallel_reads = 16
    concurrent_reads = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if split_userinfo(url)[1] is not None:
            from .credentials import redact

            raise InvalidDataError(
                f"{redact(url)} has credentials in the URL; pass them as storage options "
                "(key=..., secret=...) or in the environment (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY), never in the URL"
            )
        self._config: S3Config | None = None
        super().__init__(url, storage_options)
        # The client libraries log request headers at DEBUG level; keep our secrets out.
        guard_loggers(self._scrubber._secrets)
        s3 = self.url.split("://", 1)[0].lower() in ("s3", "s3a")
        # s3fs sends a HEAD before every GET to split large objects into parallel ranges, and
        # on a missing key that HEAD is followed by a LIST; one plain GET is a third the cost.
        self._read_kwargs = {"max_concurrency": 1} if s3 else {}
        self._exclusive_ok = None  # probed before the first write
        # Reads through the standard library's HTTP client where its configuration is fully
        # known (s3http's docstring says when): no aiobotocore import, client set-up or
        # per-request hooks for a command that only reads. Writes go through s3fs, built on
        # the first of them.
        self._reader = S3Reader(self._config) if self._config is not None else None

    def _check_options(self) -> None:
        self._config = config_of(self.url, self.storage_options)
        if self._config is None:
            super()._check_options()
        # else every option is one s3http knows, all of them s3fs's own: nothing to refuse,
        # and no need to import s3fs and aiobotocore to inspect their signatures

    def _locate(self) -> str:
        root = root_of(self.url) if self._config is not None else None
        return super()._locate() if root is None else root

    def _with_defaults(self, options: dict[str, Any]) -> dict[str, Any]:
        """S3 options with dynstate's defaults where the caller set none: botocore's standard
        retry mode (5xx, throttling, connection errors) and no listing cache (other writers)."""
        if self.url.split("://", 1)[0] not in ("s3", "s3a"):
            return options
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        options["config_kwargs"] = config
        options.setdefault("use_listings_cache", False)
        return options

    def _cat(self, rel: str) -> bytes:
        if self._reader is not None:
            return self._reader.get(self.path(rel))
        return self.fs.cat_file(self.path(rel), **self._read_kwargs)

    def _cat_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        reader = self._reader
        if reader is None:
            return super()._cat_ranges(ranges)
        if len(ranges) < 2 or _READS.owns_current_thread():
            return [reader.get(self.path(rel), start, end) for rel, start, end in ranges]
        return list(
            _READS.executor(self.max_parallel_reads).map(
                lambda r: reader.get(self.path(r[0]), r[1], r[2]), ranges
            )
        )

    def read_many(self, rels: Sequence[str]) -> list[bytes | None]:
        """:meth:`try_read` of each of ``rels`` on a pool of threads, so that n small objects
        cost about one round trip instead of n. Each read keeps its own retries and error
        translation (the one boundary, :meth:`_call`); the first error raises."""
        if len(rels) < 2 or _READS.owns_current_thread():
            return [self.try_read(rel) for rel in rels]
        return list(_READS.executor(self.max_parallel_reads).map(self.try_read, rels))

    def exists(self, rel: str) -> bool:
        reader = self._reader
        if reader is None or not rel:  # the root: a prefix, for s3fs to tell
            return super().exists(rel)
        try:
            self._call("check", rel, lambda: reader.info(self.path(rel)))
        except FileNotFoundError:
            return False
        return True

    def size(self, rel: str) -> int:
        reader = self._reader
        if reader is None:
            return super().size(rel)
        return int(self._call("stat", rel, lambda: reader.info(self.path(rel))["size"]))

    def modified(self, rel: str) -> float | None:
        reader = self._reader
        if reader is None:
            return super().modified(rel)
        return self._call("stat", rel, lambda: reader.info(self.path(rel))["mtime"])

    def list(self, rel_dir: str) -> list[str]:
        reader = self._reader
        if reader is None:
            return super().list(rel_dir)
        entries = self._call("list", rel_dir, lambda: reader.ls(self.path(rel_dir)))
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        self._await_ready()
        # s3fs sends If-None-Match: * and turns the 412 into FileExistsError.
        self.fs.pipe_file(self.path(rel), data, mode="create")

    def _landed(self, rel: str, data: bytes) -> bool:
        # An earlier attempt (ours, or botocore's own retry) may have landed with its reply
        # lost; the retry then meets our own object. Only identical bytes are ours (records
        # carry unique shard names and timestamps), anything else lost a race.
        return self.try_read(rel) == bytes(data)


# This process's read threads: one pool per process, whose threads' starts would otherwise
# cost a batch of small reads more than the reads.
_READS = ProcessPool("dynstate-read")
