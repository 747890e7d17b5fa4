"""The commit log of a store (:class:`Log`) and the leases that protect staged files
(:class:`Leases`). Everything that writes or walks commit records goes through here."""

from .commits import MAX_COMMIT_ATTEMPTS, Log, checkpoint_bytes
from .leases import (
    DEFAULT_TTL_S,
    LEASE_DIR,
    Leases,
    LeaseState,
    lease_of,
    shard_path,
    survey,
)
from .tags import Tags

__all__ = [
    "DEFAULT_TTL_S",
    "LEASE_DIR",
    "MAX_COMMIT_ATTEMPTS",
    "LeaseState",
    "Leases",
    "Log",
    "Tags",
    "checkpoint_bytes",
    "lease_of",
    "shard_path",
    "survey",
]
