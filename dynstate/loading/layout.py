"""Rank and step math of the sampler: how many slots of an epoch a step takes, how many
indices each rank gets, and how an epoch ends. Pure functions of the layout, no state.

A step hands out ``per_rank * replicas`` slots of the epoch; rank ``r`` takes every
``replicas``-th slot from the ``r``-th on (torch's ``DistributedSampler`` interleaving). At the
end of an epoch, fewer slots than a step takes are dropped (``drop_last``) or served with rows
repeated from the start of the epoch, so that every rank gets as many.
"""

from __future__ import annotations

__all__ = ["epoch_steps", "share", "step_shape"]


def step_shape(left: int, per_rank: int, replicas: int, drop_last: bool) -> tuple[int, int] | None:
    """(slots, indices per rank) of the next step with ``left`` slots of the epoch to go;
    None when the epoch is over."""
    if left <= 0:
        return None
    full = per_rank * replicas
    if left >= full:
        return full, per_rank
    if drop_last:
        return None
    return left, -(-left // replicas)


def share(rows: int, per_rank: int, replicas: int, drop_last: bool) -> int:
    """Indices one rank gets from an epoch of ``rows`` rows."""
    steps, left = divmod(rows, per_rank * replicas)
    if drop_last or left == 0:
        return steps * per_rank
    return steps * per_rank + -(-left // replicas)


def epoch_steps(rows: int, per_rank: int, replicas: int, drop_last: bool) -> int:
    """Steps of an epoch of ``rows`` rows."""
    steps, left = divmod(rows, per_rank * replicas)
    return steps + (1 if left and not drop_last else 0)
