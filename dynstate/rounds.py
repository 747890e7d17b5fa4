"""What a round may be: conversion of user input to Arrow, and the schema policy (the first
round fixes the schema; later rounds must match, or add nullable columns when allowed)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from . import manifest as m
from .errors import DynstateError, InvalidDataError, SchemaMismatchError


def check_meta(meta: dict[str, Any] | None, url: str) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidDataError(f"meta for {url} must be a dict, not {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidDataError(
            f"meta for {url} must be JSON-serializable (str, numbers, lists, dicts): {exc}"
        ) from exc


def to_table(data: Any, url: str) -> pa.Table:
    """The round ``data`` as a pyarrow Table, or InvalidDataError."""
    try:
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        if isinstance(data, list):
            if not all(isinstance(row, dict) for row in data):
                raise InvalidDataError(f"a round for {url} given as a list must hold dicts")
            return pa.Table.from_pylist(data)
        module = type(data).__module__.split(".")[0]
        if module == "pandas":
            return pa.Table.from_pandas(data, preserve_index=False)
        if module == "datasets":
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
                    f"new column {name} for {url} must be nullable (earlier rows have no value)"
                )
            new_schema = new_schema.append(f.with_metadata(None))
    try:
        out = table.select(new_schema.names).cast(new_schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
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
