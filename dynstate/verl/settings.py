"""The ``data.dynstate`` section of verl's config, read and checked in one place.

Both trainers build their dynstate train set from :class:`Settings`; nothing else calls
``config.get`` on the section. Unknown keys are refused naming the allowed ones (a typo would
otherwise train with a default), and so is ``data.sampler.class_path``/``class_name``, verl
<= 0.5's curriculum sampler, which verl 0.9 no longer reads: ``data.dynstate.select`` replaces
it. ``select`` is turned into a :mod:`dynstate.loading.selection` policy here, so a bad policy
is refused when verl builds the dataset, before any step.

:func:`check_settings` runs the same reading in ``python -m dynstate.verl.main_ppo``'s driver,
before Ray starts, together with mix mode's ``lag`` against the train loader's prefetch depth
(:func:`check_lag`, which the trainers call again on the loader verl built): a typo costs
seconds, not a Ray cluster's start-up and a traceback from its actor.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import InvalidDataError
from ..loading.selection import FunctionPolicy, Policy, as_policy
from ..loading.state import MODES
from ..storage import check_protocol, redact

# mix mode's lag bound, as the sampler's state allows it (loading/state.py)
MAX_LAG = 2**40
# verl 0.9.1 builds both trainers' train loaders without a prefetch_factor: torch's default
PREFETCH_FACTOR = 2

SECTION_KEYS = (
    "url",
    "storage_options",
    "mode",
    "fresh_share",
    "lag",
    "on_generator_error",
    "checkpoint_mirror",
    "select",
    "surplus",
    "max_carry",
)

# data.dynstate.surplus: what group filtering (algorithm.filter_groups) does with accepted
# groups beyond a full batch (dynstate.DynamicSampling's surplus)
SURPLUS_MODES = ("carry", "drop")

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
    surplus: str = "carry"
    max_carry: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        """``config`` is verl's ``data`` section."""
        check_data_config(config)
        section = config.get("dynstate")
        plain = {} if section is None else _plain(section)
        # unknown keys first: a misspelt url is named as the typo, not as a missing url
        unknown = sorted(set(plain) - set(SECTION_KEYS))
        if unknown:
            raise InvalidDataError(
                f"data.dynstate.{unknown[0]} is not a dynstate setting; the keys of "
                f"data.dynstate are {', '.join(SECTION_KEYS)} (see docs/verl.md)"
            )
        if not plain.get("url"):
            raise InvalidDataError(
                "data.dynstate.url is not set; add e.g. +data.dynstate.url=/path/to/store (or "
                "s3://bucket/run) so DynstateRLDataset knows where the training data lives"
            )
        if not isinstance(plain["url"], str):
            raise InvalidDataError(
                "data.dynstate.url must be a string such as /path/to/store or s3://bucket/run, "
                f"not {plain['url']!r}"
            )
        options = plain.get("storage_options") or {}
        if not isinstance(options, dict):
            raise InvalidDataError(
                "data.dynstate.storage_options must be a mapping of the store's options (e.g. "
                f"{{endpoint_url: ...}}), not {options!r}"
            )
        mirror = plain.get("checkpoint_mirror")
        if mirror is not None and not isinstance(mirror, str):
            raise InvalidDataError(
                "data.dynstate.checkpoint_mirror must be a URL such as "
                f"s3://bucket/run-checkpoints (or null for none), not {mirror!r}"
            )
        if mirror:  # refused now, not at the first push, a step into the run
            check_protocol(mirror, f"data.dynstate.checkpoint_mirror={redact(mirror)}")
        mode, fresh_share, lag = _mix_settings(plain)
        on_error = plain.get("on_generator_error", "raise")
        if on_error not in ("raise", "skip"):
            raise InvalidDataError(
                f"data.dynstate.on_generator_error must be 'raise' or 'skip', not {on_error!r}"
            )
        surplus = plain.get("surplus", "carry")
        if surplus not in SURPLUS_MODES:
            raise InvalidDataError(
                f"data.dynstate.surplus must be 'carry' or 'drop', not {surplus!r} (what "
                "algorithm.filter_groups does with accepted groups beyond a full batch: train "
                "them first at the next step, or record them as dropped)"
            )
        max_carry = plain.get("max_carry")
        if max_carry is not None and (
            isinstance(max_carry, bool) or not isinstance(max_carry, int) or max_carry < 0
        ):
            raise InvalidDataError(
                f"data.dynstate.max_carry must be an int >= 0 or null, not {max_carry!r}"
            )
        return cls(
            url=plain["url"],
            storage_options={str(k): v for k, v in options.items()},
            mode=mode,
            fresh_share=fresh_share,
            lag=lag,
            on_generator_error=on_error,
            # verl's own keys the sampler is built from, read as strictly as dynstate's
            batch_size=_data_int(config, "gen_batch_size", zero_is_unset=True)
            or _data_int(config, "train_batch_size", zero_is_unset=True)
            or 1,
            shuffle=_data_bool(config, "shuffle", True),
            seed=_data_int(config, "seed", least=-(2**63)) or 0,
            checkpoint_mirror=mirror,
            select=select_policy(plain.get("select")),
            surplus=str(surplus),
            max_carry=max_carry,
        )


def _mix_settings(plain: dict[str, Any]) -> tuple[str, float, int]:
    """``mode``, ``fresh_share`` and ``lag``, refused here naming their keys (the sampler would
    refuse them too, but only once the trainer builds it)."""
    mode = plain.get("mode", "epoch")
    if mode not in MODES:
        raise InvalidDataError(
            f"data.dynstate.mode must be one of {', '.join(MODES)}, not {mode!r} (epoch: each "
            "epoch trains one version; mix: fresh rows join within data.dynstate.lag steps)"
        )
    share = plain.get("fresh_share", 0.25)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise InvalidDataError(
            f"data.dynstate.fresh_share must be a number in (0, 1], not {share!r}"
        )
    lag = plain.get("lag", 1)
    if isinstance(lag, bool) or not isinstance(lag, int) or not 1 <= lag < MAX_LAG:
        raise InvalidDataError(
            f"data.dynstate.lag must be an int in [1, 2**40), not {lag!r} (the steps a fresh "
            "row waits before it may be drawn)"
        )
    return str(mode), float(share), lag


def _data_int(config: Any, key: str, *, least: int = 1, zero_is_unset: bool = False) -> int | None:
    """verl's ``data.<key>`` as an int (None when unset; also 0 with ``zero_is_unset``, a batch
    size's "as train_batch_size"), refused naming the key otherwise (``2.5``, ``True``,
    ``"abc"``)."""
    value = config.get(key, None)
    if value is None or (zero_is_unset and value == 0 and type(value) is int):
        return None
    if type(value) is not int or value < least:
        raise InvalidDataError(f"data.{key} must be an int >= {least}, not {value!r}")
    return value


def _data_bool(config: Any, key: str, default: bool) -> bool:
    """verl's ``data.<key>`` as a bool: ``"false"`` is not True."""
    value = config.get(key, None)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidDataError(f"data.{key} must be true or false, not {value!r}")
    return value


def _plain(section: Any) -> dict[str, Any]:
    try:
        out = (
            OmegaConf.to_container(section, resolve=True)
            if OmegaConf.is_config(section)
            else section
        )
    except OmegaConfBaseException as exc:  # ${oc.env:UNSET}, a missing key's ${...}
        key = getattr(exc, "full_key", None) or "data.dynstate"
        raise InvalidDataError(
            f"{key} does not resolve: {getattr(exc, 'msg', exc)}; set what it refers to, or "
            "give the value itself"
        ) from None
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
        close = difflib.get_close_matches(kind, SELECT_KEYS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise InvalidDataError(
            f"data.dynstate.select.policy={kind} names no policy; {hint}pick {names}"
        )
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


def check_lag(lag: int, workers: int, factor: int) -> None:
    """Mix mode's ``lag`` against a train loader of ``workers`` workers prefetching ``factor``
    batches each, said in the config keys a verl user sets."""
    depth = workers * factor if workers else 0
    if lag < depth + 1:
        raise InvalidDataError(
            f"data.dynstate.lag={lag} is too small for "
            f"data.dataloader_num_workers={workers}: verl's train loader prepares "
            f"{depth} batches ahead (num_workers * prefetch_factor {factor}), so the batch of "
            f"step t is drawn while step t - {depth} trains, and the round of step t - lag "
            f"it waits for cannot exist yet; set data.dynstate.lag={depth + 1} or more, or "
            "lower data.dataloader_num_workers (lag 1 works without workers)"
        )


def uses_dynstate(data: Any) -> bool:
    """Whether verl's ``data`` config builds a dynstate train set (or configures one)."""
    custom = data.get("custom_cls", None)
    name = custom.get("name", None) if custom is not None and hasattr(custom, "get") else None
    return name == "DynstateRLDataset" or data.get("dynstate", None) is not None


def check_settings(config: Any) -> Settings | None:
    """Check verl's whole ``config`` as the trainers will, without Ray: the ``data`` keys a
    dynstate train set would ignore, every ``data.dynstate`` setting (the selection policy
    built as the train set builds it) and, in mix mode, ``lag`` against verl's train loader
    (``data.dataloader_num_workers`` workers, torch's prefetch factor). Returns the settings,
    or None when the config builds no dynstate train set. Raises
    :class:`~dynstate.InvalidDataError` with the messages the trainer would give."""
    data = config.data
    check_data_config(data)
    if not uses_dynstate(data):
        return None
    settings = Settings.from_config(data)
    if settings.mode == "mix":
        workers = data.get("dataloader_num_workers", 0) or 0
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise InvalidDataError(
                f"data.dataloader_num_workers must be an int >= 0, not {workers!r}"
            )
        check_lag(settings.lag, workers, PREFETCH_FACTOR)
    return settings
