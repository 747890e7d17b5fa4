"""dynstate: versioned, crash-safe data state for RL runs whose training data grows while
they train. Everything public is importable from here; all other modules are private."""

from typing import TYPE_CHECKING

from ._version import __version__
from .errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CommitConflictError,
    ConcurrencyUnsupportedError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    LeaseExpiredError,
    MissingDependencyError,
    MissingShardError,
    RoundFailedError,
    RoundTimeoutError,
    RowOutOfRangeError,
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

# Everything but the errors loads on first use: pyarrow and fsspec take ~0.2 s to import and
# the loader classes import torch (~2 s), and `import dynstate` (the `dynstate --help` path)
# should cost none of it. Name -> module that defines it.
_LAZY = {
    "Commit": "records.manifest",
    "ShardRef": "records.manifest",
    "Snapshot": "snapshot",
    "Staged": "snapshot",
    "Store": "store",
    "VersionedDataset": "loading.dataset",
    "VersionedSampler": "loading.sampler",
    "DifficultyPools": "loading.selection",
    "FunctionPolicy": "loading.selection",
    "Learnability": "loading.selection",
    "PassRateBand": "loading.selection",
    "DynamicSampling": "loading.consumption",
    "FilterRule": "loading.consumption",
    "StdThreshold": "loading.consumption",
    "StepBatch": "loading.consumption",
    "ZeroVariance": "loading.consumption",
    "consumption_records": "loading.consumption",
    "lineage": "rewind",
    "rollback": "rewind",
    "version_at_step": "rewind",
    "decode_index": "loading.dataset",
    "encode_index": "loading.dataset",
    "find_sampler_state": "loading.state",
    "load_loader_state": "loading.checkpoint",
    "collect_garbage": "maintenance.gc",
    "compact": "maintenance.compact",
    "export": "maintenance.export",
    "verify_store": "maintenance.verify",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these
    from .loading.checkpoint import load_loader_state
    from .loading.consumption import (
        DynamicSampling,
        FilterRule,
        StdThreshold,
        StepBatch,
        ZeroVariance,
        consumption_records,
    )
    from .loading.dataset import VersionedDataset, decode_index, encode_index
    from .loading.sampler import VersionedSampler
    from .loading.selection import DifficultyPools, FunctionPolicy, Learnability, PassRateBand
    from .loading.state import find_sampler_state
    from .maintenance.compact import compact
    from .maintenance.export import export
    from .maintenance.gc import collect_garbage
    from .maintenance.verify import verify_store
    from .records.manifest import Commit, ShardRef
    from .rewind import lineage, rollback, version_at_step
    from .snapshot import Snapshot, Staged
    from .store import Store


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dynstate' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "Commit",
    "CommitConflictError",
    "ConcurrencyUnsupportedError",
    "CorruptStoreError",
    "DifficultyPools",
    "DynamicSampling",
    "DynstateError",
    "FilterRule",
    "FunctionPolicy",
    "InvalidDataError",
    "Learnability",
    "LeaseExpiredError",
    "MissingDependencyError",
    "MissingShardError",
    "PassRateBand",
    "RoundFailedError",
    "RoundTimeoutError",
    "RowOutOfRangeError",
    "SchemaMismatchError",
    "ShardRef",
    "Snapshot",
    "Staged",
    "StateMismatchError",
    "StdThreshold",
    "StepBatch",
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
    "ZeroVariance",
    "__version__",
    "collect_garbage",
    "compact",
    "consumption_records",
    "decode_index",
    "encode_index",
    "export",
    "find_sampler_state",
    "lineage",
    "load_loader_state",
    "rollback",
    "verify_store",
    "version_at_step",
]
