"""The one error hierarchy of dynstate.

Every failure a user can cause or meet raises a subclass of :class:`DynstateError`. Several
also inherit a built-in exception so that ordinary ``except`` clauses keep working::

    DynstateError
    ├── StoreNotFoundError        (FileNotFoundError)  no store at the URL
    ├── StoreExistsError          (FileExistsError)    a different store is already there
    ├── VersionNotFoundError      (LookupError)        no such version or tag
    │   └── VersionCollectedError                      removed by garbage collection
    ├── RowOutOfRangeError        (IndexError)         no such row in the version read
    ├── SchemaMismatchError       (ValueError)         round's columns/types differ
    ├── InvalidDataError          (ValueError)         input Arrow cannot hold / wrong type
    ├── CorruptStoreError                              the store's files are not what was committed
    │   ├── ChecksumMismatchError                      bytes differ from the recorded checksum
    │   ├── MissingShardError     (FileNotFoundError)  a committed file is gone
    │   └── UnsafePathError                            a record points outside the store root
    ├── UnsupportedFormatError                         written by a newer dynstate
    ├── CommitConflictError                            lost commit races; outcomes read off-lineage
    ├── LeaseExpiredError                              gc collected staged files before commit
    ├── RoundFailedError                               a part of a multi-worker round failed
    ├── RoundTimeoutError         (TimeoutError)       the round of a step did not appear in time
    ├── ConcurrencyUnsupportedError                    backend cannot create files exclusively
    ├── StateMismatchError        (ValueError)         sampler/dataset state of another store
    ├── CheckpointNotFoundError   (FileNotFoundError)  no checkpoint file at the path given
    ├── StorageError              (OSError)            the filesystem / object store failed
    └── MissingDependencyError    (ImportError)        an optional extra is not installed

Messages follow one template: what failed, the URL and version, what to do.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "ConcurrencyUnsupportedError",
    "CorruptStoreError",
    "DynstateError",
    "InvalidDataError",
    "LeaseExpiredError",
    "MissingDependencyError",
    "MissingShardError",
    "RoundFailedError",
    "RoundTimeoutError",
    "RowOutOfRangeError",
    "SchemaMismatchError",
    "StateMismatchError",
    "StorageError",
    "StoreExistsError",
    "StoreNotFoundError",
    "UnsafePathError",
    "UnsupportedFormatError",
    "VersionCollectedError",
    "VersionNotFoundError",
]


class DynstateError(Exception):
    """Base class of every error dynstate raises."""

    def __str__(self) -> str:
        # LookupError/KeyError would repr() the message; keep it readable.
        return str(self.args[0]) if self.args else ""


class StoreNotFoundError(DynstateError, FileNotFoundError):
    pass


class StoreExistsError(DynstateError, FileExistsError):
    pass


class VersionNotFoundError(DynstateError, LookupError):
    pass


class VersionCollectedError(VersionNotFoundError):
    pass


class RowOutOfRangeError(DynstateError, IndexError):
    pass


class SchemaMismatchError(DynstateError, ValueError):
    pass


class InvalidDataError(DynstateError, ValueError):
    pass


class CorruptStoreError(DynstateError):
    pass


class ChecksumMismatchError(CorruptStoreError):
    pass


class MissingShardError(CorruptStoreError, FileNotFoundError):
    pass


class UnsafePathError(CorruptStoreError):
    pass


class UnsupportedFormatError(DynstateError):
    pass


class CommitConflictError(DynstateError):
    pass


class LeaseExpiredError(DynstateError):
    """Staged files were collected (their lease expired) before they were committed."""


class RoundFailedError(DynstateError):
    """Nothing was committed; ``failures`` maps each failed part's index to its exception."""

    failures: dict[int, BaseException]


class RoundTimeoutError(DynstateError, TimeoutError):
    """The round of a step the sampler waits for was not committed within its timeout."""


class ConcurrencyUnsupportedError(DynstateError):
    pass


class StateMismatchError(DynstateError, ValueError):
    pass


class CheckpointNotFoundError(DynstateError, FileNotFoundError):
    """A training checkpoint (``data.pt``, a ``global_step_N`` folder) is not where it was
    named: the store may be fine, the path is wrong or the file was not written."""


class StorageError(DynstateError, OSError):
    pass


class MissingDependencyError(DynstateError, ImportError):
    pass
