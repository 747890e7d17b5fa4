"""Which failures of a remote operation are worth repeating, and how long to wait.

Retries happen in one place, :meth:`dynstate.storage.base.Storage._call`, on top of the
retries botocore and s3fs do themselves. Permanent failures (missing object, lost exclusive
create, denied, bad parameters) are never repeated.
"""

from __future__ import annotations

import errno
import random
import sys

from ..errors import CorruptStoreError
from .errors import BAD_REQUEST, BUSY_CODES, CLIENT_LIBRARIES, CREDENTIALS, cause_chain, row_of

_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)


def backoff(attempt: int, base_s: float, cap_s: float) -> float:
    """Exponential backoff with full jitter: a uniform draw below ``base * 2**attempt``."""
    return random.uniform(0, min(cap_s, base_s * 2**attempt))


def is_client_library_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in CLIENT_LIBRARIES


def is_transient(exc: BaseException) -> bool:
    """Whether a failed remote operation may succeed if repeated: 5xx and throttling replies,
    dropped or reset connections, timeouts, bodies cut short. Never a missing object, a lost
    exclusive create, a denied request or any other 4xx."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, CorruptStoreError)):
        return False
    for link in cause_chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = response["Error"].get("Code", "")
            # 501: the backend does not implement the request (e.g. a conditional header).
            return (status >= 500 and status != 501) or status == 429 or code in BUSY_CODES
    # asyncio's TimeoutError is the builtin from Python 3.11; before, its own class, which
    # can only have been raised where asyncio was imported (its import costs a CLI ~20 ms).
    asyncio = sys.modules.get("asyncio")
    timeouts = (TimeoutError, asyncio.TimeoutError) if asyncio is not None else (TimeoutError,)
    for link in cause_chain(exc):
        if isinstance(link, (ConnectionError, *timeouts)):
            return True
        if is_client_library_error(link):
            # What is left of botocore/aiohttp/urllib3 errors without a reply is transport:
            # closed connections, short bodies, unparsable (cut) replies, timeouts. The
            # client-error table tells the exceptions: missing or refused credentials, requests
            # refused before they were sent (parameters, configuration).
            return row_of(link)[0] not in (CREDENTIALS, BAD_REQUEST)
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS
