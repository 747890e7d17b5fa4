"""The loader's batches as the sampler counts them: the batch size and ``drop_last`` its steps
are counted in, given by the user (``VersionedSampler(batch_size=...)``), taken from the loader by
:meth:`VersionedSampler.check_loader`, or taken from a loaded state; and the checks that keep the
sampler's step the loader's step.

The epoch rule ("epoch ``e + 1`` pins the round of the step before it") needs the loader's
steps. A DataLoader built with ``sampler=`` and ``batch_size=`` tells its sampler nothing, so
the sampler never guesses them: they come through one of those three channels, or the rules that
need them raise :class:`~dynstate.errors.InvalidDataError` naming ``batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidDataError, StateMismatchError

__all__ = ["Batching", "check_lag"]


@dataclass(frozen=True)
class Batching:
    """The batches steps are counted in. ``size`` None: not known (yet)."""

    size: int | None
    drop_last: bool
    given: bool  # the user passed batch_size: the loader must agree, never teach
    asked_drop: bool = False  # the user's drop_last when no batch_size was given

    @classmethod
    def of(cls, batch_size: int | None, drop_last: bool) -> Batching:
        given = batch_size is not None
        return cls(batch_size, drop_last, given, drop_last)

    def meet(self, size: int, drop: bool, url: str) -> Batching:
        """The batching after meeting a loader that batches ``size`` (``drop``): learned if
        unknown; a loader that contradicts what is given or counted is refused."""
        if self.given:
            if size != self.size:
                raise InvalidDataError(
                    f"the loader's batch_size is {size} but the VersionedSampler for {url} "
                    f"counts steps of {self.size}; pass the loader's batch_size to both"
                )
            if drop and not self.drop_last:
                raise InvalidDataError(
                    "the loader drops the partial last batch (drop_last=True) but the "
                    f"VersionedSampler for {url} has drop_last=False and counts it as a step; "
                    "pass drop_last=True to both"
                )
            return self
        drop = drop or self.asked_drop
        if self.size is None:
            return replace(self, size=size, drop_last=drop)
        if (size, drop) != (self.size, self.drop_last):
            raise StateMismatchError(
                f"the sampler state for {url} counts steps of batch_size={self.size} "
                f"(drop_last={self.drop_last}), but the loader now batches {size} "
                f"(drop_last={drop}); resume with the loader's batch_size and drop_last as "
                "they were"
            )
        return self

    def adopt(self, size: int | None, drop: bool, url: str) -> Batching:
        """The batching after loading a state whose steps were counted in ``size`` (None: not
        counted). A sampler built without ``batch_size`` takes them on (a loader met later is
        checked at its first draw); one built with them compares them before this."""
        if self.given or size is None:
            return self
        if self.size is not None and (size, drop) != (self.size, self.drop_last):
            raise StateMismatchError(
                f"the sampler state for {url} counts steps of batch_size={size} "
                f"(drop_last={drop}), but the loader batches {self.size} "
                f"(drop_last={self.drop_last}); resume with the loader's batch_size and "
                "drop_last as they were"
            )
        return replace(self, size=size, drop_last=drop)


def check_lag(lag: int, loader: Any, url: str) -> None:
    """Mix mode's ``lag`` must exceed ``loader``'s prefetch depth, and batches come in order."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    factor = int(getattr(loader, "prefetch_factor", None) or 0) if workers else 0
    if workers and not getattr(loader, "in_order", True):
        raise InvalidDataError(
            f"mix mode over {url} needs batches in order; build the loader with in_order=True"
        )
    if lag < workers * factor + 1:
        raise InvalidDataError(
            f"lag={lag} is too small for num_workers={workers} and "
            f"prefetch_factor={factor}: the loader asks for batch t while step "
            f"t - {workers * factor} trains, so the round it waits for cannot exist "
            f"yet; use lag >= {workers * factor + 1} (num_workers * prefetch_factor + 1)"
        )
