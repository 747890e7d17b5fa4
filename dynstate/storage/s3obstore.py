"""S3 through obstore (the Python binding of Rust's ``object_store``, the client under
delta-rs and Lance): reads (whole, ranged, parallel), listings, stats, the exclusive create
(``PUT`` with ``If-None-Match: *``, obstore's ``mode="create"``), overwrites and deletes on one
client, with one retry path and one error path.

Opt-in for now: ``DYNSTATE_S3_CLIENT=obstore`` selects it for ``s3://`` stores
(:func:`dynstate.storage.open_storage`). It serves the configurations
:func:`dynstate.storage.s3http.config_of` knows completely (explicit keys or the
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` variables, an endpoint or a named region,
botocore's retry and timeout settings); anything else (profiles, SSO, roles, a custom CA
bundle, proxies, other s3fs options) stays on s3fs, as :class:`ObjectStorage` serves it.

obstore's failures are turned here into what the rest of the package already reads: the
builtin ``FileNotFoundError`` / ``FileExistsError`` callers act on, an
:class:`ObjectStoreReply` in botocore's ``ClientError`` shape (S3's code and HTTP status, read
off the reply obstore quotes) for other answers, and the builtin ``ConnectionError`` for
transport failures; so the client-error table (:mod:`.errors`), the retry rules
(:mod:`.retry`) and the scrubber apply unchanged. obstore retries 5xx replies and transport
failures itself (``retries.max_attempts`` of the options, as botocore would), under the
store's own retries (:meth:`Storage._call <dynstate.storage.base.Storage._call>`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import StoreNotFoundError
from .objectstore import _READS, ObjectStorage
from .s3http import S3Config

T = TypeVar("T")

# What obstore quotes of an S3 reply: "... non-2xx status code: 404 Not Found: <?xml ...
# <Code>NoSuchKey</Code><Message>...</Message>"; the Rust debug dump after it says no more.
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_MESSAGE = re.compile(r"<Message>([^<]{0,300})</Message>")
# Failures below HTTP (no reply, or a body cut short): obstore's ``HttpError`` kinds.
_TRANSPORT = re.compile(
    r"HTTP error|error sending request|Http\(|timed out|Timeout|connection|body", re.IGNORECASE
)


class ObjectStoreReply(Exception):
    """A reply of the object store, in the shape of botocore's ``ClientError`` (``response``),
    raised from obstore's own exception."""

    def __init__(self, status: int, code: str, message: str, text: str) -> None:
        self.response = {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }
        self.status = status
        self.code = code
        super().__init__(text)


def _short(exc: BaseException) -> str:
    """obstore's message without the Rust debug dump that follows it."""
    return str(exc).split("\n\nDebug source:", 1)[0].strip()


def reply_of(exc: BaseException) -> ObjectStoreReply | None:
    """The S3 reply an obstore exception quotes, or None when it quotes none."""
    text = str(exc)
    status = _STATUS.search(text)
    if status is None:
        return None
    code = _CODE.search(text)
    message = _MESSAGE.search(text)
    number = int(status.group(1))
    return ObjectStoreReply(
        number,
        code.group(1) if code else str(number),
        message.group(1) if message else "",
        _short(exc),
    )


def as_builtin(exc: BaseException) -> BaseException:
    """What the rest of the package reads in an obstore failure (see the module's docstring):
    the returned exception has ``exc`` (or the reply it quotes) as its cause."""
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    reply = reply_of(exc)
    if isinstance(exc, (AlreadyExistsError, PreconditionError)):
        err: BaseException = FileExistsError(17, _short(exc))
    elif isinstance(exc, FileNotFoundError) or (reply is not None and reply.status == 404):
        err = FileNotFoundError(2, _short(exc))
    elif reply is not None:
        if reply.status == 403:
            err = PermissionError(13, _short(exc))
        else:
            reply.__cause__ = exc
            return reply
    elif _TRANSPORT.search(str(exc)):
        # No cause: the table reads a client library's class before a builtin's, and this
        # is a transport failure whatever library met it.
        return ConnectionError(_short(exc))
    else:
        return exc
    err.__cause__ = reply if reply is not None else exc
    if reply is not None:
        reply.__cause__ = exc
    return err


def _run(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:
        err = as_builtin(exc)
        if err is exc:
            raise
    # Outside the handler, so that obstore's exception is not also the context: the cause
    # as_builtin set (if any) is the chain the table reads.
    raise err


def store_of(config: S3Config, bucket: str) -> Any:
    """An ``obstore.store.S3Store`` of ``bucket`` with ``config`` (s3http's reading of the
    storage options: nothing else decides the endpoint, the region or the credentials)."""
    from obstore.store import S3Store

    kwargs: dict[str, Any] = {
        "region": config.region,
        "access_key_id": config.key,
        "secret_access_key": config.secret,
    }
    if config.token:
        kwargs["session_token"] = config.token
    if config.path_style:  # an endpoint of one's own: path-style requests, as botocore's
        kwargs["endpoint"] = f"{config.scheme}://{config.host}"
    else:
        kwargs["virtual_hosted_style_request"] = "." not in bucket
    # One DELETE per object, as dynstate deletes them: the bulk API (POST ?delete) is not on
    # every S3-compatible store, and would cost a request per object all the same.
    kwargs["disable_bulk_delete"] = True
    return S3Store(
        bucket,
        client_options={
            "allow_http": config.scheme == "http",
            "connect_timeout": timedelta(seconds=config.connect_timeout),
            "timeout": timedelta(seconds=config.read_timeout),
        },
        retry_config={
            "max_retries": max(0, config.attempts - 1),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
            "retry_timeout": timedelta(seconds=60),
        },
        **kwargs,
    )


# The process whose obstore runtime has started. obstore's Tokio runtime does not survive a
# fork: in a child forked after the parent used obstore, every call (through a new store
# too) waits forever on threads that were not copied (obstore 0.12.1, seen with DataLoader
# workers). Such a child reads through s3http and writes through s3fs instead.
_RUNTIME_PID: int | None = None


class ObstoreStorage(ObjectStorage):
    """An ``s3://`` store on obstore where its configuration is fully known; otherwise the
    s3fs store :class:`ObjectStorage` is (writes, reads and all)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        # (self._reader, s3http's, reads where obstore cannot: a forked child, see above)
        self._store_pid = -1
        self._s3: Any = None
        if self._config is not None and _inherits_session_token(self.storage_options):
            # obstore reads AWS_SESSION_TOKEN from the environment and cannot be told not
            # to: explicit keys without a token would be sent with it. s3fs serves these.
            self._config = None
        bucket, _, prefix = self.root.partition("/")
        self._bucket = bucket
        self._prefix = prefix

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_s3"] = None
        state["_store_pid"] = -1
        return state

    @property
    def obstore(self) -> Any:
        """The ``S3Store``, built on first use and again in a forked child (its connection
        pool and runtime do not survive a fork)."""
        global _RUNTIME_PID
        if self._s3 is None or self._store_pid != os.getpid():
            assert self._config is not None
            self._s3 = store_of(self._config, self._bucket)
            self._store_pid = os.getpid()
        if _RUNTIME_PID is None:
            _RUNTIME_PID = os.getpid()
        return self._s3

    @property
    def served(self) -> bool:
        """Whether obstore serves this store in this process (else s3http reads and s3fs
        writes, as for :class:`ObjectStorage`): its configuration is known, and obstore's
        runtime was not started by a process this one was forked from."""
        return self._config is not None and _RUNTIME_PID in (None, os.getpid())

    def _key(self, rel: str) -> str:
        return "/".join(p for p in (self._prefix, rel) if p)

    # -- reads -----------------------------------------------------------------------------

    def _cat(self, rel: str) -> bytes:
        if not self.served:
            return super()._cat(rel)
        import obstore

        return _run(lambda: bytes(obstore.get(self.obstore, self._key(rel)).bytes()))

    def _get_range(self, rel: str, start: int, end: int) -> bytes:
        import obstore

        if end <= start:
            return b""
        try:
            return _run(
                lambda: bytes(obstore.get_range(self.obstore, self._key(rel), start=start, end=end))
            )
        except ObjectStoreReply as exc:
            if exc.status == 416:  # the range starts past the end, as a slice would
                return b""
            raise

    def _cat_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        if not self.served:
            return super()._cat_ranges(ranges)
        if len(ranges) < 2 or _READS.owns_current_thread():
            return [self._get_range(*r) for r in ranges]
        return list(
            _READS.executor(self.max_parallel_reads).map(lambda r: self._get_range(*r), ranges)
        )

    def _head(self, rel: str) -> Any:  # obstore.ObjectMeta
        import obstore

        return _run(lambda: obstore.head(self.obstore, self._key(rel)))

    def exists(self, rel: str) -> bool:
        if not self.served or not rel:  # the root: a prefix, for s3fs to tell
            return super().exists(rel)
        try:
            self._call("check", rel, lambda: self._head(rel))
        except FileNotFoundError:
            return False
        return True

    def size(self, rel: str) -> int:
        if not self.served:
            return super().size(rel)
        return int(self._call("stat", rel, lambda: self._head(rel))["size"])

    def modified(self, rel: str) -> float | None:
        if not self.served:
            return super().modified(rel)
        stamp = self._call("stat", rel, lambda: self._head(rel)).get("last_modified")
        return None if stamp is None else float(stamp.timestamp())

    def list(self, rel_dir: str) -> list[str]:
        if not self.served:
            return super().list(rel_dir)
        import obstore

        prefix = self._key(rel_dir)

        def listing() -> Any:
            return obstore.list_with_delimiter(self.obstore, prefix or None)

        try:
            found = self._call("list", rel_dir, lambda: _run(listing))
        except StoreNotFoundError:
            raise  # a missing bucket (a FileNotFoundError too), as s3http reports it
        except FileNotFoundError:
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
        names += [o["path"].rsplit("/", 1)[-1] for o in found["objects"] if o["path"] != prefix]
        return sorted(n for n in names if n)

    # -- writes ----------------------------------------------------------------------------

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        if not self.served:
            return super()._create(rel, data, durable)
        import obstore

        self._await_ready()
        _run(lambda: obstore.put(self.obstore, self._key(rel), data, mode="create"))

    def _put(self, rel: str, data: bytes, durable: bool) -> None:
        if not self.served:
            return super()._put(rel, data, durable)
        import obstore

        _run(lambda: obstore.put(self.obstore, self._key(rel), data))

    def delete(self, rel: str) -> None:
        if not self.served:
            return super().delete(rel)
        import obstore

        try:
            self._call(
                "delete", rel, lambda: _run(lambda: obstore.delete(self.obstore, self._key(rel)))
            )
        except FileNotFoundError:
            pass


def _inherits_session_token(options: dict[str, Any]) -> bool:
    explicit = options.get("key") or (options.get("client_kwargs") or {}).get("aws_access_key_id")
    token = options.get("token") or (options.get("client_kwargs") or {}).get("aws_session_token")
    return bool(explicit and not token and os.environ.get("AWS_SESSION_TOKEN"))
