"""The ``data.dynstate`` section of verl's config, read and checked in one place.

Both trainers build their dynstate train set from :class:`Settings`; nothing else calls
``config.get`` on the section. Unknown keys are refused naming the allowed ones (a typo would
otherwise train with a default), and so is ``data.sampler.class_path``/``class_name``, verl
<= 0.5's curriculum sampler, which verl 0.9 no longer reads: ``data.dynstate.select`` replaces
it. ``select`` is turned into a :mod:`dynstate.loading.selection` policy here, so a bad policy
is refused when verl builds the dataset, before any step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from ..errors import InvalidDataError
from ..loading.selection import FunctionPolicy, Policy, as_policy

SECTION_KEYS = (
    "url",
    "storage_options",
    "mode",
    "fresh_share",
    "lag",
    "on_generator_error",
    "checkpoint_mirror",
    "select",
)

# data.dynstate.select: the policy's name and the parameters each one takes
SELECT_KEYS: dict[str, tuple[str, ...]] = {
    "band": ("lo", "hi", "untried"),
    "learnability": ("floor", "neutral"),
    "pools": ("bounds", "names", "shares", "unseen"),
    "function": ("function", "params", "uses_step"),
}
_FUNCTION_KEYS = ("params", "uses_step")  # with policy: package.module:fn or /path/file.py:fn


@dataclass(frozen=True)
class Settings:
    """The ``data.dynstate`` section, read in one place."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    mode: str = "epoch"
    fresh_share: float = 0.25
    lag: int = 1
    on_generator_error: str = "raise"
    batch_size: int = 1
    shuffle: bool = True
    seed: int = 0
    checkpoint_mirror: str | None = None
    select: Policy | None = None

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        """``config`` is verl's ``data`` section."""
        check_data_config(config)
        section = config.get("dynstate")
        if section is None or not section.get("url"):
            raise InvalidDataError(
                "data.dynstate.url is not set; add e.g. +data.dynstate.url=/path/to/store (or "
                "s3://bucket/run) so DynstateRLDataset knows where the training data lives"
            )
        plain = _plain(section)
        unknown = sorted(set(plain) - set(SECTION_KEYS))
        if unknown:
            raise InvalidDataError(
                f"data.dynstate.{unknown[0]} is not a dynstate setting; the keys of "
                f"data.dynstate are {', '.join(SECTION_KEYS)} (see docs/verl.md)"
            )
        on_error = plain.get("on_generator_error", "raise")
        if on_error not in ("raise", "skip"):
            raise InvalidDataError(
                f"data.dynstate.on_generator_error must be 'raise' or 'skip', not {on_error!r}"
            )
        return cls(
            url=str(plain["url"]),
            storage_options=dict(plain.get("storage_options") or {}),
            mode=plain.get("mode", "epoch"),
            fresh_share=float(plain.get("fresh_share", 0.25)),
            lag=int(plain.get("lag", 1)),
            on_generator_error=on_error,
            batch_size=int(config.get("gen_batch_size") or config.get("train_batch_size") or 1),
            shuffle=bool(config.get("shuffle", True)),
            seed=int(config.get("seed") or 0),
            checkpoint_mirror=plain.get("checkpoint_mirror"),
            select=select_policy(plain.get("select")),
        )


def _plain(section: Any) -> dict[str, Any]:
    if OmegaConf.is_config(section):
        out = OmegaConf.to_container(section, resolve=True)
    else:
        out = dict(section)
    if not isinstance(out, dict):
        raise InvalidDataError(f"data.dynstate must be a mapping, not {type(out).__name__}")
    return {str(k): v for k, v in out.items()}


def select_policy(select: Any) -> Policy | None:
    """The policy of ``data.dynstate.select`` (a plain dict, or None for none):
    ``{policy: band, lo:, hi:, untried:}``, ``{policy: learnability, floor:, neutral:}``,
    ``{policy: pools, bounds:, names:, shares:, unseen:}``, or a function ``fn(stats, step)``:
    ``{policy: package.module:fn}`` or ``{policy: /path/to/file.py:fn}``, with ``params`` and
    ``uses_step``. Keys a policy does not take are refused, naming the ones it does."""
    if select is None:
        return None
    if not isinstance(select, dict):
        raise InvalidDataError(
            f"data.dynstate.select must be a mapping such as {{policy: learnability}}, not "
            f"{select!r}; e.g. +data.dynstate.select.policy=learnability"
        )
    args = {str(k): v for k, v in select.items()}
    kind = args.get("policy")
    names = "band, learnability, pools, or a function: package.module:fn or /path/to/file.py:fn"
    if not isinstance(kind, str) or not kind:
        raise InvalidDataError(
            f"data.dynstate.select.policy is not set; pick {names} "
            "(e.g. +data.dynstate.select.policy=learnability)"
        )
    function = kind != "function" and ":" in kind
    allowed = _FUNCTION_KEYS if function else SELECT_KEYS.get(kind)
    if allowed is None:
        raise InvalidDataError(f"data.dynstate.select.policy={kind} names no policy; pick {names}")
    extra = sorted(set(args) - {"policy", *allowed})
    if extra:
        why = ""
        if "lag" in extra:
            why = (
                " (which statistics a step draws by follows data.dynstate.mode: in mix mode "
                "the round of step s - data.dynstate.lag, in epoch mode the version the epoch "
                "pinned; set data.dynstate.lag)"
            )
        raise InvalidDataError(
            f"data.dynstate.select.{extra[0]} is not a setting of policy {kind}{why}; "
            f"it takes {', '.join(allowed)}"
        )
    try:
        return _function_policy(kind, args) if function else as_policy(args)
    except InvalidDataError as exc:
        raise InvalidDataError(f"data.dynstate.select (policy {kind}): {exc}") from exc


def _function_policy(spec: str, args: dict[str, Any]) -> Policy | None:
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise InvalidDataError(
            f"data.dynstate.select.policy={spec} is not package.module:function or "
            "/path/to/file.py:function"
        )
    if module.endswith(".py"):
        from verl.utils.import_utils import load_extern_object

        if not os.path.exists(module):
            raise InvalidDataError(
                f"data.dynstate.select.policy={spec}: no file {module}; give the policy's file "
                "as an absolute path, or an importable package.module:function"
            )
        try:
            fn = load_extern_object(module, attr)
        except (AttributeError, ImportError) as exc:
            raise InvalidDataError(f"cannot load selection policy {spec}: {exc}") from exc
        # the file's folder may differ between machines: the state names the file alone
        name = f"{os.path.basename(module)}:{attr}"
        return FunctionPolicy(
            fn,
            name=name,
            params=args.get("params"),
            uses_step=bool(args.get("uses_step", True)),
        )
    return as_policy({**args, "policy": "function", "function": spec})


def check_data_config(config: Any) -> None:
    """Refuse ``data`` settings that a dynstate train set would otherwise silently ignore."""
    sampler = config.get("sampler", None)
    if sampler is None or not hasattr(sampler, "get"):
        return
    keys = {k: sampler.get(k, None) for k in ("class_path", "class_name")}
    keys = {k: v for k, v in keys.items() if v}
    if keys:
        named = ", ".join(f"data.sampler.{k}={v}" for k, v in keys.items())
        raise InvalidDataError(
            f"{named} is not supported with a dynstate train set: it is verl <= 0.5's curriculum "
            "sampler, which verl 0.9 no longer reads, and dynstate installs its own sampler, so "
            "the run would train without your curriculum; remove the data.sampler keys and "
            "select tasks with data.dynstate.select instead — policy band (lo, hi, untried), "
            "learnability (floor, neutral), pools (bounds, names, shares, unseen) or your own "
            "function (policy=package.module:fn, params, uses_step), e.g. "
            "+data.dynstate.select.policy=learnability; see docs/verl.md, 'Selecting tasks'"
        )
