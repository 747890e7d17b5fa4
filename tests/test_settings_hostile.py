"""Hostile values for the settings of both trainer integrations, each refused with a typed
:class:`~dynstate.DynstateError` that names the setting, at start-up, with the store unchanged.

verl: :func:`dynstate.verl.settings.check_settings` (what ``python -m dynstate.verl.main_ppo``
runs before Ray starts; its ``main`` turns a ``DynstateError`` into one line, anything else into
Hydra's traceback) on configs built with ``OmegaConf.create``. TRL: ``DynstateGRPOTrainer``'s
constructor with the example's tiny model (tests/test_trl.py's helpers, no download).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from dynstate import DynstateError, InvalidDataError


def _check(dynstate: Any, **data: Any) -> Any:
    from dynstate.verl.settings import check_settings

    section = {"train_batch_size": 4, "dynstate": dynstate, **data}
    return check_settings(OmegaConf.create({"data": section}))


def _refused(key: str, dynstate: Any, **data: Any) -> str:
    """The message of the InvalidDataError ``check_settings`` raises; it names ``key``."""
    try:
        settings = _check(dynstate, **data)
    except DynstateError as exc:
        assert isinstance(exc, InvalidDataError), repr(exc)
        assert key in str(exc), str(exc)
        return str(exc)
    except Exception as exc:  # the defect: another type escapes
        pytest.fail(f"{type(exc).__name__} instead of InvalidDataError naming {key}: {exc}")
    pytest.fail(f"accepted: {settings!r}")


# -- verl: data.dynstate.* ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["key=abc", [1, 2], True, 5], ids=["str", "list", "bool", "int"])
def test_storage_options_that_is_not_a_mapping_is_refused_naming_the_key(value: Any) -> None:
    """data.dynstate.storage_options must be a mapping: anything else is an InvalidDataError
    naming data.dynstate.storage_options before Ray starts (not dict()'s ValueError/TypeError)."""
    _refused("data.dynstate.storage_options", {"url": "/x", "storage_options": value})


def test_dynstate_section_given_as_a_string_is_refused_naming_the_key() -> None:
    """``+data.dynstate=/path/to/store`` (the URL given as the section) is an InvalidDataError
    naming data.dynstate, as a list there already is."""
    _refused("data.dynstate", "/path/to/store")


@pytest.mark.parametrize("value", [True, [1], {"a": 1}], ids=["bool", "list", "dict"])
def test_url_that_is_not_a_string_is_refused_naming_the_key(value: Any) -> None:
    """data.dynstate.url is a string: True, a list or a mapping is refused naming the key (as
    Store.open refuses it), not turned into a store at a folder named 'True' or '[1]'."""
    _refused("data.dynstate.url", {"url": value})


@pytest.mark.parametrize("value", [True, [1], {"a": 1}, 5], ids=["bool", "list", "dict", "int"])
def test_checkpoint_mirror_that_is_not_a_url_string_is_refused_before_ray(value: Any) -> None:
    """data.dynstate.checkpoint_mirror is a URL string or null: anything else is refused before
    Ray starts, not accepted and then a TypeError from open_location when the first checkpoint
    is mirrored, after a step has trained."""
    _refused("data.dynstate.checkpoint_mirror", {"url": "/x", "checkpoint_mirror": value})


def test_checkpoint_mirror_of_a_protocol_nothing_serves_is_refused_before_ray() -> None:
    """A mirror URL whose protocol no filesystem serves (a typo: ``s4://``) is refused by
    check_settings, not accepted and then refused at the first push, a step into the run."""
    message = _refused(
        "data.dynstate.checkpoint_mirror", {"url": "/x", "checkpoint_mirror": "s4://b/ckpt"}
    )
    assert "s4://" in message, message


def test_checkpoint_mirror_of_a_known_protocol_is_accepted() -> None:
    settings = _check({"url": "/x", "checkpoint_mirror": "s3://bucket/ckpt"})
    assert settings is not None and settings.checkpoint_mirror == "s3://bucket/ckpt"


def test_lag_beyond_what_a_sampler_state_holds_is_refused_before_ray() -> None:
    """A lag the sampler refuses (out of [1, 2**40)) is refused by check_settings naming
    data.dynstate.lag, not accepted there and refused in the Ray actor as 'lag=... is out of
    range'."""
    _refused("data.dynstate.lag", {"url": "/x", "mode": "mix", "lag": 2**40})


def test_an_interpolation_that_does_not_resolve_is_refused_naming_the_key() -> None:
    """An interpolation in data.dynstate that does not resolve is an InvalidDataError naming
    data.dynstate.url, not omegaconf's InterpolationResolutionError."""
    _refused("data.dynstate.url", {"url": "${oc.env:DYNSTATE_TEST_SURELY_UNSET_VARIABLE}"})


# -- verl: the data keys the dynstate train set reads --------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train_batch_size", "abc"),
        ("train_batch_size", [4]),
        ("train_batch_size", math.nan),
        ("train_batch_size", math.inf),
        ("train_batch_size", -4),
        ("train_batch_size", 2.5),
        ("train_batch_size", True),
        ("gen_batch_size", "abc"),
        ("gen_batch_size", math.nan),
        ("gen_batch_size", -4),
        ("gen_batch_size", 2.5),
        ("seed", "abc"),
        ("seed", math.inf),
        ("seed", 2.5),
        ("seed", True),
    ],
)
def test_batch_size_and_seed_of_the_wrong_type_are_refused_naming_the_key(
    key: str, value: Any
) -> None:
    """data.train_batch_size, data.gen_batch_size and data.seed, which the dynstate sampler is
    built from, are refused naming the key when they are not ints (positive, for the batch
    sizes): not int()'s ValueError/TypeError/OverflowError, and not silently truncated (2.5 ->
    2, True -> 1) or kept negative for the sampler to refuse in the Ray actor."""
    _refused(f"data.{key}", {"url": "/x"}, **{key: value})


@pytest.mark.parametrize("value", ["false", "no", [0]], ids=["false", "no", "list"])
def test_shuffle_that_is_not_a_bool_is_refused_naming_the_key(value: Any) -> None:
    """data.shuffle is a bool (the sampler refuses anything else): the string 'false' is
    refused naming data.shuffle, not read as bool('false') == True."""
    _refused("data.shuffle", {"url": "/x"}, shuffle=value)


def test_datagen_file_that_does_not_exist_is_refused_naming_the_key() -> None:
    """A data.datagen.path that names no file is an InvalidDataError naming data.datagen.path,
    not verl's FileNotFoundError from load_extern_object."""
    from dynstate.verl.generator import load_generator

    config = OmegaConf.create({"path": "/no/such/dir/my_generator.py", "name": "MyGenerator"})
    with pytest.raises(DynstateError, match=re.escape("data.datagen")):
        load_generator(config)


# -- TRL: DynstateGRPOTrainer's own arguments ----------------------------------------------------


@pytest.fixture(scope="module")
def example() -> Any:
    pytest.importorskip("trl")
    from test_trl import _example

    return _example()


def _new_trainer(example: Any, tmp_path: Path, **over: Any) -> Any:
    from test_trl import _new_store, _trainer

    store = _new_store(example, tmp_path / "store")
    try:
        return _trainer(example, store, tmp_path / "out", **over)
    finally:
        assert store.refresh() == 1  # nothing written


def _generator_class() -> type:
    from dynstate.generators import DynstateGenerator

    class Gen(DynstateGenerator):
        def generate(self, batch: Any, step: int, dataset: Any) -> Any:
            return []

    return Gen


class _NotCallable:
    generate = 5


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["str", "class", "generate_not_callable"])
def test_generator_without_a_generate_method_is_refused_at_construction(
    example, tmp_path: Path, kind: str
) -> None:
    """DynstateGRPOTrainer(generator=...) must be an object with a callable generate() (as
    verl's data.datagen is checked): a string, a generator class instead of an instance, or a
    non-callable generate is an InvalidDataError naming generator when the trainer is built, not
    an AttributeError/TypeError after the first optimizer step."""
    generator = {
        "str": "my_generator",
        "class": _generator_class(),
        "generate_not_callable": _NotCallable(),
    }[kind]
    with pytest.raises(InvalidDataError, match="generator"):
        _new_trainer(example, tmp_path, generator=generator)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_filter_groups_gen_prompts_true_is_refused_naming_gen_prompts(
    example, tmp_path: Path
) -> None:
    """FilterGroups(gen_prompts=True) is refused naming filter_groups' gen_prompts (as 0, -1 or
    2.0 are), not as the sampler's 'batch_size must be a positive int', a setting the user
    never gave."""
    from dynstate.trl import FilterGroups

    with pytest.raises(InvalidDataError, match="gen_prompts"):
        _new_trainer(example, tmp_path, filter_groups=FilterGroups(gen_prompts=True))


def test_pool_names_given_as_one_string_are_refused() -> None:
    """Pool names are a list: the str "abc" would make three pools named a, b and c."""
    from dynstate.loading.selection import as_policy

    with pytest.raises(InvalidDataError, match="pool names"):
        as_policy({"policy": "pools", "bounds": [0.3, 0.7], "names": "abc", "shares": [1, 1, 1],
                   "unseen": "a"})  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("seed", ["7", 2.0, True], ids=["str", "float", "bool"])
def test_a_sampler_seed_that_is_not_an_int_is_refused_naming_sampler_seed(
    example, tmp_path: Path, seed: Any
) -> None:
    """DynstateGRPOTrainer(sampler_seed=...) is an int or None, refused naming sampler_seed
    (not the sampler's own "seed") when the trainer is made."""
    with pytest.raises(InvalidDataError, match="sampler_seed"):
        _new_trainer(example, tmp_path, sampler_seed=seed)
