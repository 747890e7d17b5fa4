"""The commit log of a store (:class:`Log`) and the leases that protect staged files
(:class:`Leases`). Everything that writes or walks commit records goes through here."""

from .catalog import Catalog, checkpoint_bytes
from .commits import MAX_COMMIT_ATTEMPTS, Log
from .leases import DEFAULT_TTL_S, LEASE_DIR, Leases, lease_of, shard_path
from .survey import LeaseState, survey
from .tags import Tags

__all__ = [
    "DEFAULT_TTL_S",
    "LEASE_DIR",
    "MAX_COMMIT_ATTEMPTS",
    "Catalog",
    "LeaseState",
    "Leases",
    "Log",
    "Tags",
    "checkpoint_bytes",
    "lease_of",
    "shard_path",
    "survey",
]
