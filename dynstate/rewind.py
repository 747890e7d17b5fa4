"""Rolling a store back to what a checkpoint saw (SPEC §3.6). (Not ``rollback.py``: a module
of that name would shadow the public function ``dynstate.rollback`` once imported.)

A run that crashed after its last checkpoint may have committed rounds the resumed run will
generate again. :func:`rollback` makes the checkpointed state the head again by a new ``reset``
commit; the abandoned versions stay listed and readable until gc.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import InvalidDataError
from .records.codec import whole
from .store import Store

log = logging.getLogger("dynstate")


def lineage(store: Store, version: int | str | None = None) -> list[int]:
    """Versions whose content makes up ``version`` (default: the head), newest first, down to
    the gc floor (:meth:`Store.lineage`, the one walker: appends and compactions lead to their
    parent, a reset to its target; abandoned versions are never on the way)."""
    return list(store.lineage(store.resolve(version)))


def version_at_step(store: Store, step: int) -> int:
    """The newest version in the head's lineage made by a round of ``step`` or earlier.
    Versions without a step (the initial import, resets) belong to the step before them; a
    rollback's reset stands for the step it rolled back to. When gc collected the versions
    that ``step`` needs, :class:`VersionCollectedError` names the oldest kept version. The
    one answer for every caller: :func:`dynstate.log.steps.version_at_step`."""
    return store.steps.version_at(store.resolve(None), _step(store, step))


def _step(store: Store, step: object) -> int:
    """A training step as an int (numpy's integers too): a bool, a fraction or text names no
    step a round has (:class:`InvalidDataError`)."""
    number = whole(step)
    if number is not None:
        return number
    raise InvalidDataError(
        f"a training step of {store.display_url} is a whole number (a round's meta step), not "
        f"{step!r}"
    )


def rollback(
    store: Store,
    *,
    version: int | None = None,
    step: int | None = None,
    keep: bool = False,
    meta: dict[str, Any] | None = None,
) -> int:
    """Make the store's head equal the content a checkpoint saw; returns the head.

    Pass the checkpoint's ``version`` (the head when it was saved), or its training ``step`` to
    keep rounds of steps ``<= step`` and drop later ones. Nothing is committed when the head
    already is that version. ``keep=True`` keeps later rounds (logged, not silent)."""
    if (version is None) == (step is None):
        raise InvalidDataError(f"rollback of {store.display_url} needs exactly one of version/step")
    head = store.latest()
    if step is not None:
        step = _step(store, step)  # the record's rollback_step is a plain int
    target = version_at_step(store, step) if step is not None else store.resolve(version)
    if target == head:
        return head
    if keep:
        log.warning(
            "keeping versions %d..%d of %s committed after the checkpoint (keep=True)",
            target + 1,
            head,
            store.display_url,
        )
        return head
    info: dict[str, Any] = {"rollback_from": head}
    if step is not None:
        info["rollback_step"] = step
    info.update(meta or {})
    new = store.reset(target, meta=info)
    log.info("rolled %s back to version %d as version %d", store.display_url, target, new)
    return new
