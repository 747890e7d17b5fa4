"""What a round may be: conversion of user input to Arrow, and the schema policy (the first
round fixes the schema; later rounds must match, or add nullable columns when allowed).

Everything here runs before a round writes anything, so a refused round leaves the store as it
was. The limits below keep one bad round from poisoning every later read of the store:

- column values nest at most :data:`MAX_NESTING` levels (lists, structs, maps); Parquet readers
  refuse schemas much deeper than that, and Arrow's type inference needs memory quadratic in
  the depth;
- ``meta`` nests at most :data:`MAX_META_DEPTH` levels and encodes to at most
  :data:`MAX_META_BYTES` bytes of JSON; it is read back with every commit record.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import manifest as m
from .errors import DynstateError, InvalidDataError, SchemaMismatchError

MAX_NESTING = 32
MAX_META_DEPTH = 32
MAX_META_BYTES = 2**20

SUPPORTED_TYPES = (
    "str, binary, bool, ints, floats, decimals, dates, times, timestamps, durations, "
    "and lists, structs and maps of those"
)


# -- meta ------------------------------------------------------------------------------------


def check_meta(meta: dict[str, Any] | None, url: str) -> dict[str, Any]:
    """``meta`` as it will be stored (plain JSON types), or InvalidDataError."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidDataError(f"meta for {url} must be a dict, not {type(meta).__name__}")
    _check_meta_value(meta, url, "meta", MAX_META_DEPTH)
    try:
        text = json.dumps(meta, allow_nan=False, ensure_ascii=False)
        size = len(text.encode())
    except (TypeError, ValueError, OverflowError) as exc:
        # UnicodeEncodeError (a lone surrogate) is a ValueError
        hint = "; convert numpy values with .item()" if "numpy" in str(exc) else ""
        raise InvalidDataError(
            f"meta for {url} must be JSON-serializable (str, numbers, lists, dicts): {exc}{hint}"
        ) from exc
    if size > MAX_META_BYTES:
        raise InvalidDataError(
            f"meta for {url} is {size:,} bytes of JSON, over the limit of {MAX_META_BYTES:,}; "
            "store large values as columns of the round or as files beside the store"
        )
    return json.loads(text)


def _check_meta_value(value: Any, url: str, where: str, budget: int) -> None:
    """Refuse what JSON would change or cannot hold, before json.dumps can recurse into it."""
    if isinstance(value, (dict, list, tuple)) and budget == 0:
        where = where if len(where) <= 60 else where[:57] + "..."
        raise InvalidDataError(
            f"meta for {url} nests deeper than {MAX_META_DEPTH} levels (at {where}); flatten it"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                # JSON would turn 1 into "1" silently, and {1: a, "1": b} into a duplicate key
                raise InvalidDataError(
                    f"meta for {url} has a key {key!r} of type {type(key).__name__} at {where}; "
                    "meta keys must be str"
                )
            _check_meta_value(item, url, f"{where}[{key!r}]", budget - 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_meta_value(item, url, f"{where}[{i}]", budget - 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidDataError(
            f"meta for {url} holds {value} at {where}, which JSON cannot hold; use None or a string"
        )


# -- rounds ----------------------------------------------------------------------------------


def to_table(data: Any, url: str) -> pa.Table:
    """The round ``data`` as a pyarrow Table that dynstate can store and read back, or
    InvalidDataError."""
    return check_table(_convert(data, url), url)


def _convert(data: Any, url: str) -> pa.Table:
    try:
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        if isinstance(data, list):
            if not all(isinstance(row, dict) for row in data):
                raise InvalidDataError(f"a round for {url} given as a list must hold dicts")
            first = data[0].keys() if data else None
            ragged = False
            for i, row in enumerate(data):
                _check_row_depth(row, url, i)
                ragged = ragged or row.keys() != first
            if ragged:
                # from_pylist takes the columns from the first row only and silently drops
                # keys that appear later; a key a row lacks is a null there.
                names = list(dict.fromkeys(key for row in data for key in row))
                table = pa.Table.from_pydict({n: [row.get(n) for row in data] for n in names})
            else:
                table = pa.Table.from_pylist(data)
            _check_has_columns(len(data), table, url)
            return table
        module = type(data).__module__.split(".")[0]
        kind = type(data).__name__
        if module == "pandas" and kind == "DataFrame":
            named = [str(name) for name in data.index.names if name is not None]
            if named:
                # A named index (set_index("id")) is data; preserve_index=False would drop it.
                _check_names(named + [str(name) for name in data.columns], url)
                data = data.reset_index()
            _check_names([str(name) for name in data.columns], url)
            for pos, name in enumerate(data.columns):
                column = data.iloc[:, pos]
                if column.dtype == object:
                    for i, value in enumerate(column):
                        _check_row_depth({name: value}, url, i)
            table = pa.Table.from_pandas(data, preserve_index=False)
            _check_has_columns(len(data), table, url)
            return table
        if module == "datasets" and kind == "Dataset":
            if getattr(data, "_indices", None) is not None:
                data = data.flatten_indices()
            return pa.table(data.data.table)
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
        TypeError,
        ValueError,
    ) as exc:
        if isinstance(exc, DynstateError):
            raise
        raise InvalidDataError(
            f"cannot store this round in {url}: Arrow cannot hold its values ({exc}); make "
            "each column one type (str, int, float, bool, lists or dicts of those)"
        ) from exc
    raise InvalidDataError(
        f"cannot append a {type(data).__name__} to {url}; pass a pyarrow Table, a list of "
        "dicts, a pandas DataFrame or a datasets.Dataset"
    )


def _check_has_columns(rows: int, table: pa.Table, url: str) -> None:
    # Arrow counts no rows in a table without columns: the rows would vanish in silence.
    if rows and table.num_columns == 0:
        raise InvalidDataError(
            f"the {rows} rows of this round for {url} have no columns (empty dicts, or a frame "
            "without columns); give the rows their values, or append an empty round"
        )


def _nesting_ok(value: Any, budget: int) -> bool:
    # Exact types, not isinstance: this runs over every value of a round and must stay cheap.
    t = type(value)
    if t is dict:
        value = value.values()
    elif t is not list and t is not tuple:
        return True
    if budget == 0:
        return False
    for item in value:
        ti = type(item)
        if (ti is dict or ti is list or ti is tuple) and not _nesting_ok(item, budget - 1):
            return False
    return True


def _check_row_depth(row: dict[str, Any], url: str, index: int) -> None:
    # Checked before Arrow infers types: its inference of a 5,000-deep value needs gigabytes.
    for name, value in row.items():
        t = type(value)  # inlined scalar test: this runs for every value of a round
        if (t is dict or t is list or t is tuple) and not _nesting_ok(value, MAX_NESTING):
            raise InvalidDataError(
                f"row {index} of this round for {url} nests column {name!r} deeper than "
                f"{MAX_NESTING} levels; flatten it or store it as a JSON string"
            )


def check_table(table: pa.Table, url: str) -> pa.Table:
    """``table`` if every column has a name, a type dynstate can store and read back, and no
    nulls where its field says non-nullable; InvalidDataError/SchemaMismatchError otherwise."""
    _check_names(table.column_names, url)
    for field in table.schema:
        problem = _type_problem(field.type, 1)
        if problem is not None:
            raise InvalidDataError(
                f"column {field.name!r} of this round for {url} has type {field.type}: "
                f"{problem}; dynstate stores {SUPPORTED_TYPES}"
            )
    error = _parquet_roundtrip(table.schema)
    if error is not None:
        raise InvalidDataError(
            f"this round for {url} has a schema Parquet cannot store and read back ({error}); "
            f"dynstate stores {SUPPORTED_TYPES}"
        )
    _check_required(table, table.schema, url, None)
    return _stable_schema(table, url)


def _stable_schema(table: pa.Table, url: str) -> pa.Table:
    """``table`` relabelled, if need be, so that its schema reads back from the store's schema
    file with the fingerprint it was written under (Arrow IPC drops the field names of map
    keys and items, which would make every later read fail the fingerprint check)."""
    schema = m.normalize_schema(table.schema)
    fingerprint = m.schema_fingerprint(schema)
    back = _ipc_roundtrip(schema)
    if m.schema_fingerprint(back) == fingerprint:
        return table
    try:
        relabelled = table.cast(back)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError):
        relabelled = None
    stable = relabelled is not None and m.schema_fingerprint(
        _ipc_roundtrip(m.normalize_schema(relabelled.schema))
    ) == m.schema_fingerprint(relabelled.schema)
    if not stable:
        changed = [
            f.name
            for f, g in zip(schema, back, strict=True)
            if m.schema_fingerprint(pa.schema([f])) != m.schema_fingerprint(pa.schema([g]))
        ]
        raise InvalidDataError(
            f"columns {', '.join(changed)} of this round for {url} have types that do not "
            f"read back as written from Arrow's schema format; dynstate stores {SUPPORTED_TYPES}"
        )
    return relabelled


def _ipc_roundtrip(schema: pa.Schema) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(schema.serialize().to_pybytes()))


def _check_names(names: list[str], url: str) -> None:
    # A table with two columns of one name writes fine, but no reader can select either.
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise InvalidDataError(
            f"this round for {url} has duplicate column names: {', '.join(map(repr, dups))}; "
            "give every column its own name"
        )
    if "" in names:
        raise InvalidDataError(
            f"this round for {url} has a column with an empty name; name every column"
        )


def _type_problem(t: pa.DataType, depth: int) -> str | None:
    """Why a column of type ``t`` cannot be stored, or None."""
    if depth > MAX_NESTING:
        return f"it nests deeper than {MAX_NESTING} levels"
    if pa.types.is_union(t):
        return "union types are not supported (Parquet has none); use one type per column"
    if pa.types.is_interval(t):
        return "interval types are not supported; use a duration or three int columns"
    if isinstance(t, pa.RunEndEncodedType):
        return "run-end encoded columns are not supported; pass the decoded values"
    if isinstance(t, pa.ExtensionType):
        return _type_problem(t.storage_type, depth)
    if pa.types.is_dictionary(t):
        return _type_problem(t.value_type, depth)
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return "a struct without fields cannot be stored; drop the column or add a field"
        names = [t.field(i).name for i in range(t.num_fields)]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            return f"its struct has duplicate field names ({', '.join(map(repr, dups))})"
        children = [t.field(i).type for i in range(t.num_fields)]
    elif pa.types.is_map(t):
        children = [t.key_type, t.item_type]
    elif (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    ):
        children = [t.value_type]
    else:
        return None
    for child in children:
        problem = _type_problem(child, depth + 1)
        if problem is not None:
            return problem
    return None


@functools.lru_cache(maxsize=64)
def _parquet_roundtrip(schema: pa.Schema) -> str | None:
    """Why Parquet cannot write and read back a table of ``schema``, or None. A safety net
    under :func:`_type_problem` for whatever pyarrow refuses that it does not name."""
    try:
        sink = pa.BufferOutputStream()
        pq.write_table(schema.empty_table(), sink)
        pq.read_table(pa.BufferReader(sink.getvalue()))
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _check_required(table: pa.Table, schema: pa.Schema, url: str, version: int | None) -> None:
    """Refuse nulls in fields ``schema`` declares non-nullable, as the Parquet writer would
    (with a bare ArrowInvalid) or a cast (with a bare ValueError); ``table`` has ``schema``'s
    structure."""
    for field in schema:
        if not _has_required(field):
            continue
        for chunk in table.column(field.name).chunks:
            path = _null_in_required(chunk, field, field.name)
            if path is not None:
                at = f" at version {version}" if version is not None else ""
                raise InvalidDataError(
                    f"column {path} of {url}{at} is non-nullable, but this round has nulls in "
                    "it (a null parent counts); fill them, or make the field nullable in the "
                    "first round's schema"
                )


def _has_required(field: pa.Field) -> bool:
    if not field.nullable:
        return True
    children = _child_fields(field.type)
    return any(_has_required(child) for child in children)


def _child_fields(t: pa.DataType) -> list[pa.Field]:
    if pa.types.is_struct(t):
        return [t.field(i) for i in range(t.num_fields)]
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [t.value_field]
    if pa.types.is_map(t):
        return [t.item_field]
    return []


def _first_required(field: pa.Field, path: str) -> str | None:
    if not field.nullable:
        return path
    for child in _child_fields(field.type):
        sep = "." if pa.types.is_struct(field.type) else ""
        found = _first_required(child, f"{path}{sep}{child.name}" if sep else f"{path}[]")
        if found is not None:
            return found
    return None


def _null_in_required(array: pa.Array, field: pa.Field, path: str) -> str | None:
    """The path of a non-nullable field whose values hold a null, or None. Like the Parquet
    writer, this looks at each child array as stored, so a null parent does not excuse a null
    child."""
    if not field.nullable and array.null_count:
        return path
    t = field.type
    if pa.types.is_null(array.type):
        # An all-None column of a later round: the cast makes every child null.
        return _first_required(field, path) if len(array) else None
    if pa.types.is_struct(t):
        parts = [
            (array.field(i), t.field(i), f"{path}.{t.field(i).name}") for i in range(t.num_fields)
        ]
    elif pa.types.is_fixed_size_list(t):
        parts = [(array.flatten(), t.value_field, f"{path}[]")]
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        # .values/.items are the whole child, not this (maybe sliced) array's part of it
        start, end = array.offsets[0].as_py(), array.offsets[-1].as_py()
        child = array.items if pa.types.is_map(t) else array.values
        child_field = t.item_field if pa.types.is_map(t) else t.value_field
        parts = [(child.slice(start, end - start), child_field, f"{path}[]")]
    else:
        return None
    for child, child_field, child_path in parts:
        if _has_required(child_field):
            found = _null_in_required(child, child_field, child_path)
            if found is not None:
                return found
    return None


# -- later rounds ----------------------------------------------------------------------------


def conform_round(
    table: pa.Table, schema: pa.Schema, allow_new_columns: bool, url: str, version: int
) -> tuple[pa.Table, pa.Schema]:
    """Reorder and cast a round to the store's schema, or SchemaMismatchError naming columns."""
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
            + m.describe_schema_diff(schema, table.schema)
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
    _check_required(out, new_schema, url, version)
    try:
        out = out.cast(new_schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as exc:
        raise SchemaMismatchError(
            f"round does not fit the schema of {url} at version {version}: {exc}"
        ) from exc
    return out, new_schema


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


def same_type(a: pa.DataType, b: pa.DataType) -> bool:
    # an all-None column of a list-of-dicts round arrives as type null: it fits any column
    return a == b or pa.types.is_null(a) or _plain(a) == _plain(b)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A shard read back, shaped like its version's schema (older shards lack new columns)."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    columns = [
        table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)
