"""The client-error table: what a failure of a filesystem or its client libraries (botocore,
aiobotocore, aiohttp, urllib3, s3fs, fsspec, obstore) means, as a :mod:`dynstate.errors` type whose
message names the URL and what to do.

Every storage call outside this package's boundaries (:meth:`Storage._call
<dynstate.storage.base.Storage._call>` for stores, :class:`~dynstate.storage.locations.Location`
for export targets and checkpoint mirrors) runs through :func:`translate`, and nothing else in
the package matches a client library's exception. Classes are matched by identity
(``isinstance`` against the libraries' own classes, looked up only when the library is already
imported: an exception of a library nobody imported cannot exist), S3 replies by their error
code, most specific row first; the cause chain is searched too, because s3fs turns a botocore
``ClientError`` into a builtin ``OSError`` whose ``__cause__`` still says what S3 answered.
Every message goes through the location's scrubber (:mod:`.credentials`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DynstateError, InvalidDataError, StorageError, StoreNotFoundError

#: Packages whose exceptions are the client libraries' (matched by origin in the last row).
CLIENT_LIBRARIES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "s3fs", "fsspec", "obstore")

# S3 error codes (and bare HTTP statuses) by meaning, with Azure's (obstore quotes both).
_REFUSED_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "Forbidden",
        "403",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "InvalidSecurity",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
    }
)
# Neither obstore nor botocore signs by the service's clock: a host clock over 15 minutes
# off is refused, and only fixing it helps (never retried).
_SKEWED_CODES = frozenset({"RequestTimeTooSkewed", "RequestExpired"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_NO_KEY_CODES = frozenset({"NoSuchKey", "404", "NotFound", "BlobNotFound"})
#: S3 codes of a busy or throttling service (retried, see :mod:`.retry`)
BUSY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestLimitExceeded",
        "ServerBusy",
        "OperationTimedOut",
    }
)


@dataclass(frozen=True)
class Service:
    """How a message names an object store's service, credentials and endpoint setting."""

    name: str
    credentials: str  # what to set
    endpoint: str  # how the endpoint is configured


S3 = Service(
    "S3",
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or the storage options "
    "key=... and secret=...",
    "AWS_ENDPOINT_URL or the endpoint_url storage option",
)
# gs:// and az:// are served by obstore, which reads these settings (docs/object-stores.md)
GCS = Service(
    "Google Cloud Storage",
    "GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT), or the storage option "
    "service_account (or service_account_key)",
    "the storage option base_url (or GOOGLE_BASE_URL)",
)
AZURE = Service(
    "Azure Blob Storage",
    "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or a SAS token), or the storage "
    "options account_name and account_key (or sas_token)",
    "the storage option endpoint (or AZURE_STORAGE_ENDPOINT)",
)


# a read-only store served over http(s):// (fsspec's HTTP filesystem): no endpoint setting
HTTP = Service(
    "the HTTP server",
    "the storage option client_kwargs={'headers': {...}} (fsspec's HTTP filesystem)",
    "the URL's host and port",
)


def service_of(url: str) -> Service:
    """The service a location's URL names (S3 for every scheme but gs://, az:// and
    http(s)://)."""
    if url.startswith(("gs://", "gcs://")):
        return GCS
    if url.startswith(("az://", "abfs://", "abfss://")):
        return AZURE
    if url.startswith(("http://", "https://")):
        return HTTP
    return S3


@dataclass(frozen=True)
class Row:
    """One line of the table: the exceptions it takes and the error they become."""

    name: str
    error: type[DynstateError]
    template: str  # fields: what, url, path, tries, kind, detail, code


# The rows, most specific first. The fields: ``what`` the operation ("read"), ``url`` the
# location, ``path`` the object, ``tries`` " after N attempts" or "", ``kind`` the exception's
# class name, ``detail`` its scrubbed text, ``code`` the S3 error code.
CREDENTIALS = Row(
    "credentials missing",
    StorageError,
    "no {service} credentials found for {url}; set {credentials} ({kind}: {detail})",
)
REFUSED = Row(
    "credentials refused",
    StorageError,
    "{service} refused the credentials for {url} ({code}, trying to {what} {path}); check "
    "{credentials}, and the bucket's permissions",
)
NO_BUCKET = Row(
    "bucket missing",
    StoreNotFoundError,
    "the bucket of {url} does not exist; check the bucket name and the endpoint ({endpoint})",
)
NO_KEY = Row("object missing", StoreNotFoundError, "nothing at {path} ({code}); check the URL")
BUSY = Row(
    "service busy or failing",
    StorageError,
    "could not {what} {path}{tries}: the service answered {code} ({detail}); retry later",
)
SKEWED = Row(
    "clock skewed",
    StorageError,
    "could not {what} {path}: {service} refused the request because this host's clock is "
    "more than 15 minutes off its own ({code}); set the host's time (NTP) and retry",
)
ANSWERED = Row(
    "refused by the service",
    StorageError,
    "could not {what} {path}: the service answered {code} ({detail}); check the URL, the "
    "permissions and the storage options",
)
UNTRUSTED = Row(
    "certificate not trusted",
    StorageError,
    "cannot {what} {path}: the TLS certificate of the endpoint of {url} is not trusted "
    "({detail}); set AWS_CA_BUNDLE to the bundle of the authority that signed it, or fix "
    "the endpoint's certificate ({endpoint})",
)
UNREACHABLE = Row(
    "endpoint unreachable",
    StorageError,
    "cannot reach the endpoint of {url} to {what} {path}{tries} ({kind}: {detail}); check "
    "that it is up, and {endpoint}, and retry",
)
BAD_REQUEST = Row(
    "request or configuration invalid",
    InvalidDataError,
    "cannot {what} {path}: the client refused the request before sending it ({kind}: "
    "{detail}); check the URL and the storage options",
)
DENIED = Row(
    "permission denied",
    StorageError,
    "permission denied to {what} {path}; check the credentials and permissions for this location",
)
CLIENT = Row(
    "other client-library failure",
    StorageError,
    "could not {what} {path}{tries}: {kind}: {detail}; retry later",
)
OS = Row(
    "operating-system failure",
    StorageError,
    "could not {what} {path}{tries}: {detail}; check that the location is reachable and retry",
)
OTHER = Row(
    "anything else",
    StorageError,
    "could not {what} {path}{tries}: {kind}: {detail}; check the location and retry",
)


def _module(name: str) -> object | None:
    return sys.modules.get(name)


def _classes(module: str, *names: str) -> tuple[type[BaseException], ...]:
    found = _module(module)
    if found is None:
        return ()
    return tuple(getattr(found, n) for n in names if isinstance(getattr(found, n, None), type))


def _class_rows() -> list[tuple[tuple[type[BaseException], ...], Row]]:
    """(classes, row) for the libraries imported so far, most specific first."""
    boto = "botocore.exceptions"
    rows = [
        (_classes("ssl", "SSLCertVerificationError"), UNTRUSTED),
        (
            _classes(
                boto,
                "NoCredentialsError",
                "PartialCredentialsError",
                "CredentialRetrievalError",
                "ProfileNotFound",
                "NoAuthTokenError",
                "TokenRetrievalError",
                "SSOError",
                "LoginError",
                "RefreshWithMFAUnsupportedError",
                "UnknownCredentialError",
                "UnknownTokenProviderError",
                "MetadataRetrievalError",
                "InfiniteLoopConfigError",
                "ConfigNotFound",
                "ConfigParseError",
            ),
            CREDENTIALS,
        ),
        (
            _classes(boto, "ConnectionError", "HTTPClientError", "IncompleteReadError")
            + _classes(
                "aiohttp", "ClientConnectionError", "ClientPayloadError", "ConnectionTimeoutError"
            )
            + _classes("fsspec.exceptions", "FSTimeoutError")
            + _classes("urllib3.exceptions", "HTTPError"),
            UNREACHABLE,
        ),
        (
            _classes(
                boto,
                "ValidationError",
                "ParamValidationError",
                "MissingParametersError",
                "InvalidDNSNameError",
                "UnknownClientMethodError",
                "BaseEndpointResolverError",
                "EndpointProviderError",
                "UnknownRegionError",
                "UnknownServiceStyle",
                "UnknownSignatureVersionError",
                "UnsupportedSignatureVersionError",
                "InvalidConfigError",
                "InvalidRetryConfigurationError",
                "InvalidS3AddressingStyleError",
                "InvalidEndpointConfigurationError",
                "InvalidProxiesConfigError",
                "InvalidChecksumConfigError",
                "InvalidDefaultsMode",
                "InvalidIMDSEndpointError",
                "InvalidIMDSEndpointModeError",
                "InvalidHostLabelError",
                "InvalidExpressionError",
                "InvalidEndpointDiscoveryConfigurationError",
                "InvalidS3UsEast1RegionalEndpointConfigError",
                "InvalidSTSRegionalEndpointsConfigError",
                "UnsupportedS3ArnError",
                "UnsupportedS3ConfigurationError",
                "UnsupportedS3AccesspointConfigurationError",
                "UnsupportedOutpostResourceError",
                "UnsupportedS3ControlArnError",
                "UnsupportedS3ControlConfigurationError",
                "UnseekableStreamError",
                "OperationNotPageableError",
                # botocore cannot load what the request needs (its data files, a dependency)
                "DataNotFoundError",
                "ApiVersionNotFoundError",
                "MissingDependencyException",
            )
            + _classes("aiohttp", "InvalidURL")
            + _classes("fsspec.exceptions", "BlocksizeMismatchError")
            + _classes(
                "obstore.exceptions",
                "InvalidPathError",
                "UnknownConfigurationKeyError",
                "NotSupportedError",
            ),
            BAD_REQUEST,
        ),
        # The rest of each library: server replies without an S3 code, checksum failures of
        # a body, waiters, data files botocore could not load, warnings raised as errors.
        (
            _classes(boto, "BotoCoreError", "ClientError", "UndefinedModelAttributeError")
            + _classes("aiohttp", "ClientError")
            + _classes("obstore.exceptions", "BaseError"),
            CLIENT,
        ),
    ]
    return [(classes, row) for classes, row in rows if classes]


def _code(exc: BaseException) -> tuple[str, int] | None:
    """(S3 error code, HTTP status) of a botocore ``ClientError``-shaped exception."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or not isinstance(response.get("Error"), dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return str(response["Error"].get("Code", "") or status or "unknown"), int(status)


#: Set on an exception a client boundary raised whole (its cause, if any, is all of it): the
#: exception a caller was handling when it was raised (a lost exclusive create's 412) is no
#: part of its chain.
STANDALONE = "_dynstate_standalone"


def cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (at most 8 links, no cycle): its cause, else the
    exception being handled when it was raised (but for one raised :data:`STANDALONE`)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        context = None if getattr(current, STANDALONE, False) else current.__context__
        current = current.__cause__ or context
    return seen


def is_client_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) comes from a client library."""
    return any(type(link).__module__.split(".")[0] in CLIENT_LIBRARIES for link in cause_chain(exc))


def row_of(exc: BaseException) -> tuple[Row, str]:
    """The table's row for ``exc`` and the S3 error code it carries ("" if none)."""
    links = cause_chain(exc)
    for link in links:
        code = _code(link)
        if code is not None:
            name, status = code
            if name in _REFUSED_CODES:
                return REFUSED, name
            if name in _NO_BUCKET_CODES:
                return NO_BUCKET, name
            if name in _NO_KEY_CODES:
                return NO_KEY, name
            if name in BUSY_CODES or status >= 500 or status == 429:
                return BUSY, name
            if name in _SKEWED_CODES:
                return SKEWED, name
            return ANSWERED, name
    class_rows = _class_rows()
    for link in links:
        for classes, row in class_rows:
            if isinstance(link, classes):
                return row, ""
    if isinstance(exc, PermissionError):
        return DENIED, ""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return UNREACHABLE, ""
    if any(type(link).__module__.split(".")[0] in CLIENT_LIBRARIES for link in links):
        return CLIENT, ""
    if isinstance(exc, (OSError, RuntimeError, ValueError, TypeError, EOFError)):
        return OS, ""
    return OTHER, ""


def text_of(exc: BaseException) -> str:
    """``str(exc)``, or "" where the class's ``__str__`` itself fails (a client library's
    that needs attributes it was not given)."""
    try:
        return str(exc)
    except Exception:
        return ""


def _text(exc: BaseException) -> str:
    return " ".join(text_of(exc).split()) or type(exc).__name__


def translate(
    exc: BaseException,
    *,
    what: str,
    url: str,
    path: str | None = None,
    scrub: Callable[[str], str],
    attempts: int = 1,
    keep: tuple[type[BaseException], ...] = (),
) -> BaseException:
    """The :mod:`dynstate.errors` type ``exc`` means: ``what`` is the operation ("read"),
    ``url`` the location's printable URL, ``path`` the object's (default: ``url``), ``scrub``
    the location's scrubber. ``exc`` itself comes back when it already is a dynstate error or
    one of ``keep`` (builtins a caller acts on, e.g. ``FileNotFoundError``) — except a
    missing bucket, which callers acting on ``FileNotFoundError`` still catch as one."""
    if isinstance(exc, DynstateError):
        return exc
    if (
        keep
        and isinstance(exc, keep)
        and (exc.__cause__ is None or row_of(exc)[0] is not NO_BUCKET)
    ):
        return exc  # (a local miss has no cause: the common case costs one check)
    row, code = row_of(exc)
    service = service_of(url)
    message = row.template.format(
        service=service.name,
        credentials=service.credentials,
        endpoint=service.endpoint,
        what=what,
        url=url,
        path=path or url,
        tries=f" after {attempts} attempts" if attempts > 1 else "",
        kind=type(exc).__name__,
        detail=_text(exc),
        code=code,
    )
    return row.error(scrub(message))
