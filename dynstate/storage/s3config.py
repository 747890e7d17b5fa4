"""What an ``s3://`` store's storage options and environment say, read without botocore: the
endpoint, the region, the credentials, the retries and timeouts (:class:`S3Config`).

obstore (:mod:`.s3obstore`) serves a store only where :func:`config_of` reads its
configuration completely, so that it never connects with credentials, an endpoint or a region
other than those s3fs would have used. :func:`config_of` returns ``None`` -- and the store goes
through s3fs, reads and writes (:class:`~dynstate.storage.objectstore.ObjectStorage`) -- for
anything else: credentials from a profile, SSO, a role or instance metadata (only explicit
options and the ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``
variables are read, and not when ``AWS_PROFILE`` names a profile); an AWS endpoint whose region
is not named in the options, the environment or the AWS config file; a default profile in that
file that says more than a region; proxies, ``anon``, or any storage option,
``client_kwargs`` or ``config_kwargs`` key beyond the few below. ``DYNSTATE_S3_CLIENT=s3fs``
sends every store through s3fs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

#: Storage options read here (s3fs's names); any other sends the store to s3fs.
KNOWN_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "use_listings_cache",
        "listings_expiry_time",
        "skip_instance_cache",
    }
)
_CLIENT_KWARGS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)
_CONFIG_KWARGS = frozenset({"retries", "connect_timeout", "read_timeout", "region_name", "s3"})
# What would make botocore connect or authenticate differently from obstore.
_FOREIGN_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)
# What obstore reads from the environment on its own (and botocore does not) that would
# change where it connects, how it signs, or what it writes: another endpoint, a session
# token under another name, conditional-put or checksum modes, requester-pays, server-side
# encryption. (Its credential sources -- roles, web identity, container and instance
# metadata -- are never used: the keys are always passed.)
OBSTORE_ONLY_ENV = (
    "AWS_ENDPOINT",
    "AWS_TOKEN",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_S3_EXPRESS",
    "AWS_SKIP_SIGNATURE",
    "AWS_UNSIGNED_PAYLOAD",
    "AWS_CHECKSUM_ALGORITHM",
    "AWS_CONDITIONAL_PUT",
    "AWS_REQUEST_PAYER",
    "AWS_SERVER_SIDE_ENCRYPTION",
    "AWS_SSE_KMS_KEY_ID",
    "AWS_SSE_BUCKET_KEY_ENABLED",
    "AWS_SSE_CUSTOMER_KEY_BASE64",
)
# What the default profile of the AWS config file may hold while obstore serves: its region
# (read) and the CLI's output format; anything else (an endpoint, an addressing style, a CA
# bundle, a role, a retry mode...) changes how botocore connects.
_PROFILE_KEYS = frozenset({"region", "output"})
#: botocore's defaults (seconds, attempts in all)
DEFAULT_CONNECT_TIMEOUT_S = 60.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_ATTEMPTS = 3


@dataclass(frozen=True)
class S3Config:
    """Where and as whom to read: everything a signed request needs."""

    scheme: str  # "http" or "https"
    host: str  # host[:port] of the endpoint
    path_style: bool  # /bucket/key, or the bucket in the host name (AWS's own endpoints)
    region: str
    key: str
    secret: str
    token: str | None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    attempts: int = DEFAULT_ATTEMPTS
    ca_bundle: str | None = None  # AWS_CA_BUNDLE, trusted with the system's root certificates

    def __repr__(self) -> str:  # never the secret
        return f"S3Config({self.scheme}://{self.host}, region={self.region})"


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def config_of(url: str, options: dict[str, Any], env: Any = None) -> S3Config | None:
    """The client configuration for ``url`` with storage ``options``, or None where s3fs
    must serve it (see the module's docstring)."""
    env = os.environ if env is None else env
    if env.get("DYNSTATE_S3_CLIENT", "").lower() == "s3fs":
        return None
    if root_of(url) is None:
        return None
    if not set(options) <= KNOWN_OPTIONS or any(
        env.get(name) for name in (*_FOREIGN_ENV, *OBSTORE_ONLY_ENV)
    ):
        return None
    client = options.get("client_kwargs") or {}
    config = options.get("config_kwargs") or {}
    if not isinstance(client, dict) or not isinstance(config, dict):
        return None
    if not set(client) <= _CLIENT_KWARGS or not set(config) <= _CONFIG_KWARGS:
        return None
    # Credentials: explicit options, else the environment (botocore's order); never a
    # profile, a role or instance metadata.
    key = _str(options.get("key")) or _str(client.get("aws_access_key_id"))
    secret = _str(options.get("secret")) or _str(client.get("aws_secret_access_key"))
    token = _str(options.get("token")) or _str(client.get("aws_session_token"))
    if key is None and secret is None and token is None:
        key, secret = _str(env.get("AWS_ACCESS_KEY_ID")), _str(env.get("AWS_SECRET_ACCESS_KEY"))
        token = _str(env.get("AWS_SESSION_TOKEN"))
    if key is None or secret is None:
        return None  # none, or a partial pair: s3fs finds others or reports it
    endpoint = (
        _str(options.get("endpoint_url"))
        or _str(client.get("endpoint_url"))
        or _str(env.get("AWS_ENDPOINT_URL_S3"))
        or _str(env.get("AWS_ENDPOINT_URL"))
    )
    region = (
        _str(client.get("region_name"))
        or _str(config.get("region_name"))
        or _str(env.get("AWS_REGION"))
        or _str(env.get("AWS_DEFAULT_REGION"))
    )
    profile = _default_profile(env)
    if profile is None or not set(profile) <= _PROFILE_KEYS:
        return None  # the config file says more than a region: botocore would follow it
    region = region or _str(profile.get("region"))
    if region is None:
        if endpoint is None:
            return None  # for s3fs to discover
        region = "us-east-1"  # botocore's for an endpoint of one's own
    # botocore's addressing style: path-style is what obstore sends to an endpoint of one's
    # own (MinIO's docs ask for it), "auto" what it sends anywhere; any other S3 setting
    # (virtual hosts on one's own endpoint, payload signing, accelerate...) is s3fs's.
    s3 = config.get("s3") or {}
    style = s3.get("addressing_style", "auto") if isinstance(s3, dict) else None
    if not isinstance(s3, dict) or set(s3) - {"addressing_style"}:
        return None
    if style not in ("auto", "path") or (style == "path" and endpoint is None):
        return None
    if endpoint is None:
        scheme, host, path_style = "https", f"s3.{region}.amazonaws.com", False
    else:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
            return None
        scheme, host, path_style = parts.scheme, parts.netloc, True
    try:
        retries = config.get("retries") or {}
        attempts = int(retries.get("max_attempts", DEFAULT_ATTEMPTS - 1)) + 1
        connect = float(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S))
        read = float(config.get("read_timeout", DEFAULT_READ_TIMEOUT_S))
    except (TypeError, ValueError, AttributeError):
        return None  # s3fs reports the bad configuration
    if not isinstance(retries, dict) or attempts < 1 or connect <= 0 or read <= 0:
        return None
    ca_bundle = _str(env.get("AWS_CA_BUNDLE"))
    return S3Config(
        scheme, host, path_style, region, key, secret, token, connect, read, attempts, ca_bundle
    )


def root_of(url: str) -> str | None:
    """``bucket/prefix`` of an ``s3://`` URL, as s3fs's ``url_to_fs`` gives it; None for a
    URL whose form s3fs would read otherwise (a query, a fragment, an empty segment)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a"):
        return None
    root = rest.rstrip("/")
    if not root or any(c in root for c in "?#") or "" in root.split("/"):
        return None
    return root


def _default_profile(env: Any) -> dict[str, str] | None:
    """The default profile's settings in the AWS config file (``{}`` without one), or None
    where the file cannot be read as botocore reads it."""
    import configparser

    path = env.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    if not os.path.exists(path):
        return {}
    parser = configparser.RawConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    found: dict[str, str] = {}
    for section in ("default", "profile default"):  # botocore reads both
        if parser.has_section(section):
            found.update(parser.items(section))
    return found
