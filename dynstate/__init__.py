"""dynstate: versioned, crash-safe data state for RL runs whose training data grows while
they train. Everything public is importable from here; all other modules are private."""

from ._version import __version__
from .dataset import VersionedDataset, decode_index, encode_index
from .errors import (
    ChecksumMismatchError,
    CommitConflictError,
    ConcurrencyUnsupportedError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    MissingDependencyError,
    MissingShardError,
    RoundFailedError,
    SchemaMismatchError,
    StateMismatchError,
    StorageError,
    StoreExistsError,
    StoreNotFoundError,
    UnsafePathError,
    UnsupportedFormatError,
    VersionCollectedError,
    VersionNotFoundError,
)
from .manifest import Commit, ShardRef
from .resume import lineage, rollback, version_at_step
from .sampler import VersionedSampler, find_sampler_state
from .snapshot import Snapshot, Staged
from .store import Store

__all__ = [
    "ChecksumMismatchError",
    "Commit",
    "CommitConflictError",
    "ConcurrencyUnsupportedError",
    "CorruptStoreError",
    "DynstateError",
    "InvalidDataError",
    "MissingDependencyError",
    "MissingShardError",
    "RoundFailedError",
    "SchemaMismatchError",
    "ShardRef",
    "Snapshot",
    "Staged",
    "StateMismatchError",
    "StorageError",
    "Store",
    "StoreExistsError",
    "StoreNotFoundError",
    "UnsafePathError",
    "UnsupportedFormatError",
    "VersionCollectedError",
    "VersionNotFoundError",
    "VersionedDataset",
    "VersionedSampler",
    "__version__",
    "decode_index",
    "encode_index",
    "find_sampler_state",
    "lineage",
    "rollback",
    "version_at_step",
]
