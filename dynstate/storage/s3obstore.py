"""Object stores through obstore (the Python binding of Rust's ``object_store``, the client
under delta-rs and Lance): S3, Google Cloud Storage and Azure Blob Storage, each with reads
(whole, ranged, parallel), listings, stats, the exclusive create (obstore's ``mode="create"``:
S3's ``If-None-Match: *``, GCS's ``x-goog-if-generation-match: 0``, Azure's
``If-None-Match: *``), overwrites and deletes on one client, with one retry path and one error
path.

``gs://bucket/prefix`` and ``az://container/prefix`` are always served here (see
:data:`CLOUD_SCHEMES`; their options are obstore's own configuration keys, checked by obstore,
and obstore reads the ``GOOGLE_*`` / ``AZURE_*`` environment variables itself).

``s3://`` stores are served here where :func:`dynstate.storage.s3config.config_of` reads
their configuration completely (explicit keys or the ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` variables, an endpoint or a named region, botocore's retry and
timeout settings, ``AWS_CA_BUNDLE``); anything else (profiles, SSO, roles, proxies, other
s3fs options, ``DYNSTATE_S3_CLIENT=s3fs``) goes through s3fs, as :class:`ObjectStorage`
serves it, and so does a process forked after its parent used obstore (see
:data:`_RUNTIME_PID`). A bucket in another region than the one named is read there, as
botocore does: the region S3 names in its refusal, or in ``x-amz-bucket-region``.

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

import dataclasses
import importlib.util
import logging
import os
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from ..errors import InvalidDataError, StorageError, StoreNotFoundError
from .errors import STANDALONE
from .objectstore import _READS, ObjectStorage
from .s3config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    S3Config,
    config_of,
    root_of,
)

if TYPE_CHECKING:
    from obstore.store import ClientConfig

T = TypeVar("T")
log = logging.getLogger("dynstate")

# What obstore quotes of an S3 reply: "... non-2xx status code: 404 Not Found: <?xml ...
# <Code>NoSuchKey</Code><Message>...</Message>"; the Rust debug dump after it says no more.
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_MESSAGE = re.compile(r"<Message>([^<]{0,300})</Message>")
_REGION = re.compile(r"<Region>([a-z0-9-]{1,32})</Region>")
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


def bucket_region(config: S3Config, bucket: str) -> str | None:
    """The region S3 names for ``bucket`` in ``x-amz-bucket-region``, asked with an unsigned
    HEAD of the bucket (S3 names it whatever it answers: 200, 301 or 403); None if it names
    none or cannot be reached."""
    import ssl
    import urllib.error
    import urllib.request

    if config.path_style:
        url = f"{config.scheme}://{config.host}/{bucket}"
    else:
        url = f"https://s3.{config.region}.amazonaws.com/{bucket}"
    context = ssl.create_default_context(cafile=config.ca_bundle) if url[:5] == "https" else None
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=config.connect_timeout, context=context) as r:
            return r.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as exc:
        return exc.headers.get("x-amz-bucket-region")
    except (OSError, ValueError):
        return None


def untrusted_certificate(config: S3Config) -> BaseException | None:
    """Why the endpoint's TLS certificate is not trusted (``ssl``'s verification error, with
    ``AWS_CA_BUNDLE`` added to the trust store as for obstore), or None if it is trusted,
    the endpoint is plain HTTP, or it cannot be reached. obstore reports a refused
    certificate as "error sending request", as it reports a dropped connection; one
    handshake after such a failure tells the two apart, so that a certificate is reported
    as one and not retried."""
    import socket
    import ssl

    if config.scheme != "https":
        return None
    context = ssl.create_default_context(cafile=config.ca_bundle)
    try:
        endpoint = urlsplit(f"https://{config.host}")
        host, port = endpoint.hostname or "", endpoint.port or 443
        with (
            socket.create_connection((host, port), timeout=config.connect_timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return None
    except ssl.SSLCertVerificationError as exc:
        return exc
    except (OSError, ValueError):
        return None


def _run(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:
        err = as_builtin(exc)
        if err is exc:
            raise
    # Outside the handler, so that obstore's exception is not also the context: the cause
    # as_builtin set (if any) is the chain the table reads, and no exception a caller is
    # handling (a lost exclusive create's 412) is read as this one's.
    setattr(err, STANDALONE, True)
    raise err


def store_of(config: S3Config, bucket: str) -> Any:
    """An ``obstore.store.S3Store`` of ``bucket`` with ``config`` (:mod:`.s3config`'s reading
    of the storage options: nothing else decides the endpoint, the region or the
    credentials)."""
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
    client: ClientConfig = {
        "allow_http": config.scheme == "http",
        "connect_timeout": timedelta(seconds=config.connect_timeout),
        "timeout": timedelta(seconds=config.read_timeout),
        # S3 closes a connection idle for about 20 s; dropping it first spares a request
        # sent on a closed connection (then retried, below).
        "pool_idle_timeout": timedelta(seconds=15),
    }
    if config.scheme == "http":
        # A plain-HTTP endpoint (a local MinIO, a test server) never speaks TLS, and building
        # the trust store reads every system root certificate (~5 ms, a tenth of a cold
        # open on loopback). Only a redirect of the endpoint's own to HTTPS would use this,
        # and that redirect is itself as unauthenticated as the rest of plain HTTP.
        client["allow_invalid_certificates"] = True
    elif config.ca_bundle:  # AWS_CA_BUNDLE, as botocore reads it (added to the trusted roots)
        with open(config.ca_bundle, "rb") as f:
            client["root_certificate"] = f.read()
    return S3Store(
        bucket,
        client_options=client,
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


#: URL schemes served by obstore whatever the environment says, and the service each names.
#: The forms are fsspec's (gcsfs, adlfs), which obstore's ``from_url`` reads the same way.
CLOUD_SCHEMES = {"gs": "Google Cloud Storage", "az": "Azure Blob Storage"}
# Where the endpoint may be set besides the options (obstore reads these variables itself):
# an http:// one is a local emulator, which obstore refuses unless allow_http is set.
_ENDPOINT_ENV = {
    "gs": ("GOOGLE_BASE_URL",),
    "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
}


class _UnparsedKeyError(StorageError):
    """A listing obstore refused whole over one key it cannot parse (:meth:`list`)."""


def cloud_root(url: str) -> str | None:
    """``bucket/prefix`` of a ``gs://`` or ``az://`` URL; None for another scheme or a URL
    whose form is not one store root (a query, a fragment, an empty segment)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLOUD_SCHEMES:
        return None
    root = rest.rstrip("/")
    if not root or any(c in root for c in "?#@") or "" in root.split("/"):
        return None
    return root


def _allows_http(scheme: str, config: dict[str, Any]) -> bool:
    if config.get("use_emulator") in (True, "true", "1") or os.environ.get(
        "AZURE_STORAGE_USE_EMULATOR", ""
    ).lower() in ("true", "1"):
        return scheme == "az"
    endpoints = [config.get("endpoint"), config.get("base_url")]
    endpoints += [os.environ.get(name) for name in _ENDPOINT_ENV[scheme]]
    return any(isinstance(e, str) and e.startswith("http://") for e in endpoints)


def cloud_store_of(scheme: str, bucket: str, options: dict[str, Any]) -> Any:
    """An obstore ``GCSStore`` / ``AzureStore`` of ``bucket`` with the storage ``options``
    (obstore's configuration keys, plus ``client_options`` for its HTTP client); obstore
    fills in the rest from the environment and refuses keys it does not know."""
    from obstore.store import AzureStore, GCSStore

    config = {k: v for k, v in options.items() if k != "client_options"}
    client: dict[str, Any] = {
        "allow_http": _allows_http(scheme, config),
        "connect_timeout": timedelta(seconds=DEFAULT_CONNECT_TIMEOUT_S),
        "timeout": timedelta(seconds=DEFAULT_READ_TIMEOUT_S),
    }
    client.update(options.get("client_options") or {})
    retry: Any = {
        "max_retries": 4,
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=60),
    }
    # (the options are checked by obstore at run time, not against its TypedDicts)
    cls: Any = GCSStore if scheme == "gs" else AzureStore
    return cls(bucket, config=config, client_options=client, retry_config=retry)


# The process whose obstore runtime has started. obstore's Tokio runtime does not survive a
# fork: in a child forked after the parent used obstore, every call (through a new store
# too) waits forever on threads that were not copied (obstore 0.12.1, seen with DataLoader
# workers). Such a child reads and writes an s3:// store through s3fs instead.
_RUNTIME_PID: int | None = None


class ObstoreStorage(ObjectStorage):
    """A store on obstore: ``gs://`` and ``az://`` always, ``s3://`` where its configuration
    is fully known (otherwise the s3fs store :class:`ObjectStorage` is, writes, reads and
    all)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        scheme = url.split("://", 1)[0].lower()
        self._cloud = scheme if scheme in CLOUD_SCHEMES else None
        self._config: S3Config | None = None  # read by _check_options
        super().__init__(url, storage_options)
        self._store_pid = -1
        self._s3: Any = None
        bucket, _, prefix = self.root.partition("/")
        self._bucket = bucket
        self._prefix = prefix

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_s3"] = None
        state["_store_pid"] = -1
        return state

    def _check_options(self) -> None:
        if self._cloud is None:
            self._config = config_of(self.url, self.storage_options)
            if self._config is not None and importlib.util.find_spec("obstore") is None:
                self._config = None  # an install without the s3 extra's obstore: s3fs's
            if self._config is not None and _inherits_session_token(self.storage_options):
                # obstore reads AWS_SESSION_TOKEN from the environment and cannot be told not
                # to: explicit keys without a token would be sent with it. s3fs serves these.
                self._config = None
            if self._config is None:
                super()._check_options()
            # else every option is one s3config reads, all of them s3fs's own: nothing to
            # refuse, and no need to import s3fs and aiobotocore to inspect their signatures
            return None
        options = self.storage_options
        client = options.get("client_options")
        if client is not None and not isinstance(client, dict):
            raise InvalidDataError(
                f"storage option client_options for {self.display_url} must be a dict of "
                f"obstore's HTTP client options, not {type(client).__name__}"
            )
        try:
            import obstore  # noqa: F401
        except ImportError:
            extra = "gcs" if self._cloud == "gs" else "azure"
            from ..errors import MissingDependencyError

            raise MissingDependencyError(
                f"cannot open {self.display_url}: {self._cloud}:// stores are served by "
                f"obstore, which is not installed; pip install 'dynstate[{extra}]'"
            ) from None
        root = cloud_root(self.url)
        try:  # builds no connection: obstore checks the keys and values here
            cloud_store_of(self._cloud, (root or "bucket").split("/", 1)[0], options)
        except Exception as exc:
            from obstore.exceptions import BaseError

            if not isinstance(exc, (BaseError, ValueError, TypeError)):
                raise
            raise InvalidDataError(
                f"cannot open {self.display_url}: {self.scrub(_short(exc))}; the storage "
                f"options of {self._cloud}:// are obstore's {CLOUD_SCHEMES[self._cloud]} "
                "configuration keys (docs/object-stores.md)"
            ) from None

    def _locate(self) -> str:
        rest = self.url.partition("://")[2]
        dots = any(part in (".", "..") for part in rest.split("?")[0].split("/"))
        if dots or (self._cloud is None and any(c in rest for c in "?#")):
            # s3fs would read a query as an object version (every file of the store one key,
            # which the first delete removes) and store '..' as a key; obstore refuses both
            # on every call, where "retry" would be the advice
            raise InvalidDataError(
                f"{self.display_url}: a store URL has no query, fragment, '.' or '..' path "
                "segment (a query is not shown: it may hold a signature); write "
                f"{self.url.partition('://')[0]}://bucket/prefix"
            )
        if self._cloud is None:
            root = root_of(self.url) if self._config is not None else None
            return super()._locate() if root is None else root
        root = cloud_root(self.url)
        if root is None:
            raise InvalidDataError(
                f"{self.display_url} is not a store URL; write {self._cloud}://"
                f"{'bucket' if self._cloud == 'gs' else 'container'}/prefix, with no "
                "query, fragment, credentials or empty path segment"
            )
        return root

    def _connect(self) -> Any:
        if self._cloud is None:
            return super()._connect()
        # Only a process forked after its parent used obstore gets here (see _RUNTIME_PID):
        # there is no other client for gs:// and az:// to fall back on.
        raise StorageError(
            f"cannot use {self.display_url} in a process forked after its parent used it: "
            "obstore's runtime does not survive a fork; start DataLoader workers with "
            "multiprocessing_context='forkserver' or 'spawn'"
        )

    @property
    def obstore(self) -> Any:
        """The ``S3Store``, built on first use and again in a forked child (its connection
        pool and runtime do not survive a fork)."""
        global _RUNTIME_PID
        if self._s3 is None or self._store_pid != os.getpid():
            if self._cloud is not None:
                self._s3 = cloud_store_of(self._cloud, self._bucket, self.storage_options)
            else:
                assert self._config is not None
                self._s3 = store_of(self._config, self._bucket)
            self._store_pid = os.getpid()
        if _RUNTIME_PID is None:
            _RUNTIME_PID = os.getpid()
        return self._s3

    @property
    def served(self) -> bool:
        """Whether obstore serves this store in this process (else s3fs does, as for
        :class:`ObjectStorage`): its configuration is known, and obstore's
        runtime was not started by a process this one was forked from."""
        known = self._config is not None or self._cloud is not None
        return known and _RUNTIME_PID in (None, os.getpid())

    def _run(self, fn: Callable[[], T]) -> T:
        """:func:`_run`, and once more in the bucket's own region where S3 says the request
        was signed for another, as botocore does (the region is remembered); a connection
        failure that a refused certificate caused is raised as that refusal."""
        # Both follow-ups run outside the handler, so that the reply or the connection error
        # is not also the context of what they raise (the error table reads the chain).
        failed: ConnectionError | None = None
        try:
            return _run(fn)
        except ObjectStoreReply as exc:
            if not self._learn_region(exc):
                raise
        except ConnectionError as exc:
            failed = exc
        if failed is None:
            return _run(fn)  # in the bucket's own region
        untrusted = untrusted_certificate(self._config) if self._config is not None else None
        raise untrusted or failed

    def _learn_region(self, reply: ObjectStoreReply) -> bool:
        """Whether ``reply`` (a 301, or a 400 naming a region) told this bucket's region to
        be another than the one signed for; the store is then rebuilt for that region. A
        reply without a body (to a HEAD) is followed by an unsigned HEAD of the bucket,
        which S3 answers with ``x-amz-bucket-region``."""
        config = self._config
        if self._cloud is not None or config is None or reply.status not in (301, 307, 400):
            return False
        found = _REGION.search(str(reply))
        if found is not None:
            told: str | None = found.group(1)
        elif reply.code in (str(reply.status), "PermanentRedirect"):  # no body, or no region
            told = bucket_region(config, self._bucket)
        else:
            return False  # another 400: not the region's
        if not told or told == config.region:
            return False
        log.info(
            "bucket %s is in region %s, not %s: reading it there", self._bucket, told, config.region
        )
        self._config = dataclasses.replace(config, region=told)
        self._s3 = None
        return True

    def _key(self, rel: str) -> str:
        return "/".join(p for p in (self._prefix, rel) if p)

    # -- reads -----------------------------------------------------------------------------

    def _cat(self, rel: str) -> bytes:
        if not self.served:
            return super()._cat(rel)
        import obstore

        return self._run(lambda: bytes(obstore.get(self.obstore, self._key(rel)).bytes()))

    def _get_range(self, rel: str, start: int, end: int) -> bytes:
        import obstore

        if end <= start:
            return b""

        def get() -> bytes:
            try:
                return bytes(obstore.get_range(self.obstore, self._key(rel), start=start, end=end))
            except Exception as exc:
                # Azure's client checks the range against the length itself and says so
                # without a reply (object_store's InvalidRangeRequest::StartTooLarge)
                if "StartTooLarge" in str(exc):
                    return b""
                raise

        try:
            return self._run(get)
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

        return self._run(lambda: obstore.head(self.obstore, self._key(rel)))

    def exists(self, rel: str) -> bool:
        if self.served and not rel and self._cloud is not None:  # the root: a prefix
            found = self._call("check", rel, lambda: self._list_prefix(""))
            return bool(found["objects"] or found["common_prefixes"])
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
        prefix = self._key(rel_dir)
        try:
            found = self._call("list", rel_dir, lambda: self._list_prefix(rel_dir))
        except StoreNotFoundError:
            raise  # a missing bucket (a FileNotFoundError too), as s3fs reports it
        except FileNotFoundError:
            return []
        except _UnparsedKeyError as exc:
            # Another program's key the client cannot parse (an empty segment: a URL with a
            # trailing slash joined to a name) fails the whole listing in obstore; dynstate's
            # names are plain, so s3fs's listing, which takes any key, answers the same.
            if self._cloud is None:
                return super().list(rel_dir)
            raise StorageError(
                f"cannot list {self.display_url}/{rel_dir}: an object there has a name the "
                f"client cannot parse ({exc}); it is not dynstate's: rename or remove it"
            ) from None
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
        names += [o["path"].rsplit("/", 1)[-1] for o in found["objects"] if o["path"] != prefix]
        return sorted(n for n in names if n)

    def _list_prefix(self, rel_dir: str) -> Any:
        import obstore
        from obstore.exceptions import InvalidPathError

        prefix = self._key(rel_dir)
        try:
            return self._run(lambda: obstore.list_with_delimiter(self.obstore, prefix or None))
        except InvalidPathError as exc:
            raise _UnparsedKeyError(" ".join(str(exc).split())[:300]) from None

    # -- writes ----------------------------------------------------------------------------

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        if not self.served:
            return super()._create(rel, data, durable)
        import obstore

        self._await_ready()
        self._run(lambda: obstore.put(self.obstore, self._key(rel), data, mode="create"))

    def _put(self, rel: str, data: bytes, durable: bool) -> None:
        if not self.served:
            return super()._put(rel, data, durable)
        import obstore

        self._run(lambda: obstore.put(self.obstore, self._key(rel), data))

    def swap(self, rel: str, data: bytes, expected: bytes) -> bool:
        if not self.served:
            return super().swap(rel, data, expected)
        import obstore

        def attempt() -> bool:
            got = self._run(lambda: obstore.get(self.obstore, self._key(rel)))
            current = bytes(got.bytes())
            if current == data:
                return True  # ours, from an earlier try whose reply was lost
            if current != expected:
                return False
            meta = got.meta
            version = {k: meta[k] for k in ("e_tag", "version") if meta.get(k) is not None}
            if not version:  # a store that names no version: no condition to put on the write
                self._put(rel, data, True)
                return True
            try:
                # conditional on the version read: a copy of this request that lands after
                # any later write (the client gave up on it) meets a 412 and changes nothing
                self._run(
                    lambda: obstore.put(self.obstore, self._key(rel), data, mode=version)  # type: ignore[arg-type]
                )
            except FileExistsError:  # the precondition failed: moved since our read
                return (
                    self._run(lambda: bytes(obstore.get(self.obstore, self._key(rel)).bytes()))
                    == data
                )
            return True

        return self._call("write", rel, attempt)

    def delete(self, rel: str) -> None:
        if not self.served:
            return super().delete(rel)
        import obstore

        try:
            self._call(
                "delete",
                rel,
                lambda: self._run(lambda: obstore.delete(self.obstore, self._key(rel))),
            )
        except FileNotFoundError:
            pass


def _inherits_session_token(options: dict[str, Any]) -> bool:
    explicit = options.get("key") or (options.get("client_kwargs") or {}).get("aws_access_key_id")
    token = options.get("token") or (options.get("client_kwargs") or {}).get("aws_session_token")
    return bool(explicit and not token and os.environ.get("AWS_SESSION_TOKEN"))
