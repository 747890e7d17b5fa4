"""What a round may be: its input as Arrow (converted by :func:`dynstate.records.inputs.to_arrow`,
the one converter) and the schema policy (the first round fixes the schema; later rounds
must match, or add nullable columns when allowed).

Everything here runs before a round writes anything, so a refused round leaves the store as it
was. What its columns may hold is checked in :mod:`dynstate.records.columns`. ``meta`` nests at most
:data:`MAX_META_DEPTH` levels and encodes to at most :data:`MAX_META_BYTES` bytes of JSON: it
is read back with every commit record; its integers are within the bound every reader
applies (:func:`dynstate.records.codec.check_int`), whatever this process's int string limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidDataError, SchemaMismatchError
from . import manifest as m
from .columns import check_required, check_table, promote_schema
from .inputs import plain_json, to_arrow

MAX_META_DEPTH = 32
MAX_META_BYTES = 2**20
# The meta key under which a trainer integration's round commit names the selection policy
# in force (its ``{"policy", "params"}`` identity), so that a step's story can name it.
SELECT_META = "select"


# -- meta ------------------------------------------------------------------------------------


def check_meta(meta: dict[str, Any] | None, url: str) -> dict[str, Any]:
    """``meta`` as it will be stored (plain JSON types; tuples become lists), or
    InvalidDataError."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidDataError(f"meta for {url} must be a dict, not {type(meta).__name__}")
    step = meta.get("step")
    if step is not None and type(step) is not int:
        # every reader counts only an int as a step (log/steps.py own_step): a round of step
        # 1.0 or "1" would read as one of the step before it, and a rollback would keep it
        raise InvalidDataError(
            f"meta['step'] for {url} is {step!r}; a training step is an int — pass "
            "int(step), or leave 'step' out for a round of no step"
        )
    return plain_json(
        meta,
        f"meta for {url}",
        "meta",
        depth=MAX_META_DEPTH,
        max_bytes=MAX_META_BYTES,
        advice="store large values as columns of the round or as files beside the store",
        tuples=True,
    )


# -- rounds ----------------------------------------------------------------------------------


def to_table(data: Any, url: str) -> pa.Table:
    """The round ``data`` as a pyarrow Table that dynstate can store and read back, or
    InvalidDataError; its dictionary and view columns as they are stored
    (:func:`storable`)."""
    return check_table(storable(to_arrow(data, url)), url)


def storable(table: pa.Table) -> pa.Table:
    """``table`` with the types Parquet would not give back as they are, cast to what it
    does (:func:`_storable`); unchanged if the cast is refused (the checks then name it)."""
    table = _untyped_categoricals(table)
    schema = pa.schema(
        [f.with_type(_storable(f.type)) for f in table.schema], metadata=table.schema.metadata
    )
    if schema.equals(table.schema):
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError):
        return table


def _untyped_categoricals(table: pa.Table) -> pa.Table:
    """``table`` with each dictionary column that holds no value and no category, and would be
    stored as its values, made a column of nulls. pandas gives a ``Categorical`` of only
    ``None`` the categories ``float64`` whatever the column is meant to hold; as a null column
    it takes its type from the first round that has values, as an all-``None`` object column
    does, instead of fixing ``double`` and refusing every later round of labels."""
    for i, field in enumerate(table.schema):
        column = table.column(i)
        if (
            pa.types.is_dictionary(field.type)
            and not pa.types.is_dictionary(_storable(field.type))
            and column.null_count == len(column)
            and all(len(chunk.dictionary) == 0 for chunk in column.chunks)
        ):
            table = table.set_column(i, field.with_type(pa.null()), pa.nulls(len(column)))
    return table


def _storable(t: pa.DataType) -> pa.DataType:
    """The type a column of type ``t`` is stored as:

    * a dictionary of strings or bytes keeps its encoding, with ``int32`` indices (``int64``
      from 64-bit or ``uint32`` ones): the first round fixes the schema, and a pandas
      ``Categorical`` of a few values comes with ``int8`` indices, which would refuse every
      later round of more than 128 distinct values;
    * a dictionary of anything else is stored as its values: Parquet gives those back
      decoded, and Arrow has no cast back to a dictionary of numbers, so the version could
      not be read;
    * ``string_view`` and ``binary_view`` are stored as ``string`` and ``binary``: Arrow's
      ``take`` has no kernel for views, so no batch of them could be read;
    * another package's extension type (Ray's tensors) is stored as its storage type."""
    if isinstance(t, pa.BaseExtensionType) and not type(t).__module__.startswith("pyarrow"):
        # Another package's extension type (Ray's tensors): a reader without that package
        # would see another schema than one with it, and a round it fits could then make the
        # version unreadable where the package is loaded. Stored as its storage type; Arrow's
        # own (canonical) extension types keep theirs.
        return _storable(t.storage_type)
    if pa.types.is_dictionary(t):
        values = _storable(t.value_type)
        if not (
            pa.types.is_string(values)
            or pa.types.is_large_string(values)
            or pa.types.is_binary(values)
            or pa.types.is_large_binary(values)
        ):
            return values
        wide = t.index_type.bit_width == 64 or t.index_type == pa.uint32()
        return pa.dictionary(pa.int64() if wide else pa.int32(), values, t.ordered)
    if pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        make = pa.list_ if pa.types.is_list(t) else pa.large_list
        return make(t.value_field.with_type(_storable(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_storable(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_storable(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(
            t.key_field.with_type(_storable(t.key_type)),
            t.item_field.with_type(_storable(t.item_type)),
            t.keys_sorted,
        )
    return t


# -- later rounds ----------------------------------------------------------------------------


def conform_round(
    table: pa.Table, schema: pa.Schema, allow_new_columns: bool, url: str, version: int
) -> tuple[pa.Table, pa.Schema]:
    """Reorder and cast a round to the store's schema, or SchemaMismatchError naming columns.
    A column stored as null (all None so far) takes the type this round brings."""
    schema = promote_schema(schema, table.schema)
    names = set(table.column_names)
    expected = {f.name: f for f in schema}
    bad = [
        f.name
        for f in schema
        if f.name not in names or not same_type(table.schema.field(f.name).type, f.type)
    ]
    extra = [n for n in table.column_names if n not in expected]
    if bad or (extra and not allow_new_columns):
        raise SchemaMismatchError(
            f"round does not match the schema of {url} at version {version}: "
            + m.describe_schema_diff(schema, table.schema, same_type)
            + "; convert the round to the store's columns"
            + ("" if bad or not extra else ", or pass allow_new_columns=True")
        )
    new_schema = schema
    if extra:
        for name in extra:
            f = table.schema.field(name)
            if not f.nullable:
                raise SchemaMismatchError(
                    f"new column {name} for {url} at version {version} must be nullable "
                    "(earlier rows have no value); declare its field nullable"
                )
            new_schema = new_schema.append(f.with_metadata(None))
    out = table.select(new_schema.names)
    # Nulls where the schema says non-nullable are named before the cast (which would say
    # less) where the round has the schema's layout; a round that only fits it (fields in
    # another order or left out) is checked once cast to it.
    laid_out = all(_alike(f.type, g.type) for f, g in zip(out.schema, new_schema, strict=True))
    if laid_out:
        check_required(out, new_schema, url, version)
    try:
        out = out.cast(new_schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as exc:
        raise SchemaMismatchError(
            f"round does not fit the schema of {url} at version {version}: "
            f"{_failing_column(out, new_schema)}{exc}" + _narrow_dictionaries(new_schema)
        ) from exc
    if not laid_out:
        check_required(out, new_schema, url, version)
    _check_exact(table, out, url, version)
    return out, new_schema


def merge_parts(schemas: Sequence[pa.Schema], url: str) -> pa.Schema:
    """The schema of a round whose parts were staged with ``schemas`` (each checked against
    the head when it was staged, or its own on a new store): they may differ where every read
    gives each part's shards the merged type by a cast that cannot fail or change a value —
    column order, a column of nulls (all None so far) in some parts and typed in others, the
    string kinds (``string``, ``large_string``, a dictionary of them; the binary kinds
    likewise), a nullable column some parts lack (read as nulls there, as in an older shard).
    The first part's types and order win. Anything else is SchemaMismatchError naming the
    columns (reads conform each shard to the version's schema by name,
    :func:`conform`)."""
    merged = schemas[0]
    for other in schemas[1:]:
        fields = []
        for f in merged:
            if f.name not in other.names:
                if not f.nullable:
                    raise _parts_differ(url, merged, other, f"a part lacks required {f.name}")
                fields.append(f)
                continue
            g = other.field(f.name)
            t = _merged_type(f.type, g.type)
            if t is None:
                raise _parts_differ(url, merged, other, None)
            fields.append(f.with_type(t).with_nullable(f.nullable or g.nullable))
        for g in other:
            if g.name not in merged.names:
                if not g.nullable:
                    raise _parts_differ(url, merged, other, f"only some parts have {g.name}")
                fields.append(g)
        merged = pa.schema(fields)
    return merged


def _merged_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    for kind in (_is_text, _is_bytes):
        if kind(a) and kind(b):
            return a
    return None


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_bytes(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _parts_differ(
    url: str, merged: pa.Schema, other: pa.Schema, why: str | None
) -> SchemaMismatchError:
    detail = why if why is not None else m.describe_schema_diff(merged, other)
    return SchemaMismatchError(
        f"staged parts for {url} have schemas no one version can hold ({detail}); stage "
        "every part of a round with the same column types"
    )


def _check_exact(given: pa.Table, stored: pa.Table, url: str, version: int) -> None:
    """SchemaMismatchError naming the column where the cast into a float column narrower than
    the round's (float32, float16: from a ``datasets`` ``Value("float32")`` first round) changed
    a value: Arrow's safe cast checks an int into float32 or float64 but neither a float into a
    narrower float (0.1 would be stored as 0.10000000149011612, 1e300 as inf) nor an int into
    float16."""
    for field in stored.schema:
        if field.name not in given.column_names or not _narrow_float(field.type):
            continue
        before = given.column(field.name)
        if before.type == field.type:
            continue
        after = stored.column(field.name)
        try:
            same = _same_values(before.combine_chunks(), after.cast(before.type).combine_chunks())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            same = False  # inf or out of range on the way back
        if not same:
            raise SchemaMismatchError(
                f"round does not fit the schema of {url} at version {version}: column "
                f"{field.name} is stored as {field.type}, which would change values of the "
                f"round's {before.type} (a float rounded or past its range); cast the round "
                f"to {field.type} yourself if that precision is meant"
            )


def _narrow_float(t: pa.DataType) -> bool:
    """Whether ``t`` holds a float narrower than float64 anywhere."""
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return True
    if pa.types.is_dictionary(t):
        return _narrow_float(t.value_type)
    return any(_narrow_float(t.field(i).type) for i in range(getattr(t, "num_fields", 0)))


def _same_values(a: pa.Array, b: pa.Array) -> bool:
    """Whether ``a`` and ``b`` (one type, one layout) hold the same values, NaN equal to NaN
    and -0.0 told from 0.0."""
    if not a.is_null().equals(b.is_null()):
        return False
    t = a.type
    if pa.types.is_floating(t):
        x = np.asarray(pc.fill_null(a, 0).to_numpy(zero_copy_only=False), dtype=np.float64)
        y = np.asarray(pc.fill_null(b, 0).to_numpy(zero_copy_only=False), dtype=np.float64)
        same = (x == y) & (np.signbit(x) == np.signbit(y))
        return bool(np.all(same | (np.isnan(x) & np.isnan(y))))
    if _is_list(t) or pa.types.is_map(t):
        return _same_values(a.flatten(), b.flatten())
    if pa.types.is_struct(t):
        return all(_same_values(a.field(i), b.field(i)) for i in range(t.num_fields))
    return a.equals(b)


def _failing_column(table: pa.Table, schema: pa.Schema) -> str:
    """``"column NAME (TYPE into STORED): "`` for the first column of ``table`` whose safe
    cast to ``schema`` fails (the cast of a whole table does not say which)."""
    for column, field in zip(table.columns, schema, strict=True):
        try:
            column.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError):
            return f"column {field.name} ({column.type} into {field.type}): "
    return ""


def _narrow_dictionaries(schema: pa.Schema) -> str:
    """What to do where the cast failed on a dictionary column stored with narrow indices (a
    store whose first round a release before this one wrote from a pandas Categorical)."""
    narrow = [
        (f.name, f.type.index_type)
        for f in schema
        if pa.types.is_dictionary(f.type) and f.type.index_type.bit_width < 32
    ]
    if not narrow:
        return ""
    said = ", ".join(f"{name} ({index} indices)" for name, index in narrow)
    return (
        f"; the store's dictionary column(s) {said} hold at most "
        f"{min(2 ** (i.bit_width - 1) for _, i in narrow)} distinct values per round (the "
        "first round fixed their index width): split the round, or copy the rows into a new "
        "store, whose dictionary columns get 32-bit indices"
    )


def _alike(a: pa.DataType, b: pa.DataType) -> bool:
    """The same layout: equal but for 64-bit offsets or views, or a top-level null."""
    return a == b or pa.types.is_null(a) or _plain(a) == _plain(b)


def _plain(t: pa.DataType) -> pa.DataType:
    """``t`` with 64-bit-offset variants replaced by the plain ones (pandas 3 and datasets
    produce large_string where pyarrow produces string; the values are the same)."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t) or pa.types.is_list_view(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_plain(f.type)) for f in t])
    return t


_LISTS = (pa.types.is_list, pa.types.is_large_list, pa.types.is_list_view,
          pa.types.is_large_list_view, pa.types.is_fixed_size_list)  # fmt: skip


def _is_list(t: pa.DataType) -> bool:
    return any(test(t) for test in _LISTS)


def same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether a round's column of type ``a`` fits a stored column of type ``b``: every value
    ``a`` can hold, the safe cast :func:`conform_round` makes turns into the same value of
    ``b`` or refuses (an int past the range, a float that is not an int). So a type is no
    artifact of how the first round was built: a null anywhere (``[]``, ``[None]``,
    ``{"x": None}`` in every row of a round), struct fields by name in any order and any
    subset (a field the store lacks is refused: the cast would drop it), an int into an int
    or a float, a float into a float (into a narrower one only where every value stays the
    same: :func:`_check_exact`), a dictionary by its values, a decimal into a decimal, a
    timestamp into one of the same time zone, a duration, time or date into another unit
    (the safe cast refuses a value with digits past the stored scale or unit, or out of its
    range)."""
    if _alike(a, b):
        return True
    for kind in (pa.types.is_decimal, pa.types.is_duration, pa.types.is_time, pa.types.is_date):
        if kind(a) and kind(b):
            return True
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return a.tz == b.tz
    if pa.types.is_dictionary(a):
        return same_type(a.value_type, b)
    if pa.types.is_dictionary(b):
        return same_type(a, b.value_type)
    if _is_list(a) and _is_list(b) and not pa.types.is_fixed_size_list(b):
        return same_type(a.value_type, b.value_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        stored = {f.name: f.type for f in b}
        return len(stored) == b.num_fields and all(
            f.name in stored and same_type(f.type, stored[f.name]) for f in a
        )
    if pa.types.is_integer(a):
        return pa.types.is_integer(b) or pa.types.is_floating(b)
    return pa.types.is_floating(a) and pa.types.is_floating(b)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A shard read back, shaped like its version's schema (older shards lack new columns)."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    columns = [
        _column(table, f) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _column(table: pa.Table, field: pa.Field) -> pa.ChunkedArray:
    # a shard written while its column was null, read at a version that gave it a type
    column = table.column(field.name)
    return column if column.type == field.type else column.cast(field.type)
