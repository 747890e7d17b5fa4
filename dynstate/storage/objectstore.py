"""Object stores through fsspec: s3fs for the ``s3://`` stores obstore does not serve
(:mod:`.s3config` says which; a process forked after obstore ran), and any other fsspec
scheme. Conditional PUTs, retries, and a read-back that resolves creates whose reply was
lost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidDataError
from ..threads import ProcessPool
from .base import Storage
from .connect import check_shapes
from .credentials import guard_loggers, split_userinfo


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
        super().__init__(url, storage_options)
        # The client libraries log request headers at DEBUG level; keep our secrets out.
        guard_loggers(self._scrubber._secrets)
        s3 = self.url.split("://", 1)[0].lower() in ("s3", "s3a")
        # s3fs sends a HEAD before every GET to split large objects into parallel ranges, and
        # on a missing key that HEAD is followed by a LIST; one plain GET is a third the cost.
        self._read_kwargs = {"max_concurrency": 1} if s3 else {}
        self._exclusive_ok = None  # probed before the first write

    def _with_defaults(self, options: dict[str, Any]) -> dict[str, Any]:
        """S3 options with dynstate's defaults where the caller set none: botocore's standard
        retry mode (5xx, throttling, connection errors) and no listing cache (other writers)."""
        if self.url.split("://", 1)[0] not in ("s3", "s3a"):
            return options
        check_shapes(options)  # before they are read here
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        options["config_kwargs"] = config
        options.setdefault("use_listings_cache", False)
        return options

    def _cat(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel), **self._read_kwargs)

    def read_many(self, rels: Sequence[str]) -> list[bytes | None]:
        """:meth:`try_read` of each of ``rels`` on a pool of threads, so that n small objects
        cost about one round trip instead of n. Each read keeps its own retries and error
        translation (the one boundary, :meth:`_call`); the first error raises."""
        if len(rels) < 2 or _READS.owns_current_thread():
            return [self.try_read(rel) for rel in rels]
        return list(_READS.executor(self.max_parallel_reads).map(self.try_read, rels))

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
