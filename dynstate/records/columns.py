"""What a round's columns may be: names, types that Parquet stores and reads back, nesting,
and no nulls where a field says non-nullable. Checked before a round writes anything, so that
no commit can make later reads of the store fail.

Values nest at most :data:`MAX_NESTING` levels (lists, structs, maps): Parquet readers refuse
schemas much deeper than that, and Arrow's type inference needs memory quadratic in the depth,
so Python values are checked before Arrow sees them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InvalidDataError
from . import manifest as m

MAX_NESTING = 32

SUPPORTED_TYPES = (
    "str, binary, bool, ints, floats, decimals, dates, times, timestamps, durations, "
    "and lists, structs and maps of those"
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


def owned_buffer(data: Any) -> pa.Buffer:
    """A copy of ``data`` (bytes, a memoryview, a numpy array) in memory Arrow owns.

    Anything pyarrow reads on its own threads (a Parquet decode with ``use_threads``) must
    not wrap a Python object (``pa.py_buffer``, a ``BufferReader`` over bytes): the thread
    that drops the last reference takes the GIL to release it, and one that does so while
    the interpreter exits is killed inside a C++ destructor — ``terminate called without an
    active exception``, SIGABRT (arrow#34314), seen in ~6 % of short processes on a loaded
    machine. The copy costs ~1 ms per 10 MB, against a decode ~20x that."""
    view = memoryview(data).cast("B")
    out = pa.allocate_buffer(view.nbytes)
    if view.nbytes:
        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(view, dtype=np.uint8)
    return out


def int64_array(values: Any) -> pa.Array:
    """An int64 Arrow array of ``values`` (a numpy array or a list), in memory Arrow owns
    (:func:`owned_buffer`). Not ``pa.array``: its first call in a process imports pandas
    where it is installed (datasets and verl install it), ~0.15 s of a fresh process's
    first batch."""
    data = owned_buffer(np.ascontiguousarray(values, dtype=np.int64))
    return pa.Array.from_buffers(pa.int64(), len(data) // 8, [None, data])


def check_row_depth(row: dict[str, Any], url: str, index: int) -> None:
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
    check_names(table.column_names, url)
    table = _reserved_types(table, url)
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
    check_required(table, table.schema, url, None)
    _check_second_timestamps(table, url)
    return _stable_schema(table, url)


def _check_second_timestamps(table: pa.Table, url: str) -> None:
    """Parquet has no seconds unit: the writer stores timestamp[s] in milliseconds and fails
    with a bare ArrowInvalid, after the round's lease is taken, on a value past ±2.9e8 years."""
    for field in table.schema:
        ms = _in_milliseconds(field.type)
        if ms is None:
            continue
        try:
            table.column(field.name).cast(ms)
        except (pa.ArrowInvalid, OverflowError) as exc:
            raise InvalidDataError(
                f"column {field.name!r} of this round for {url} has a timestamp[s] value that "
                f"Parquet cannot store (it keeps seconds as milliseconds: {exc}); use values "
                "within ±292 million years, or store them as int64"
            ) from exc


def _in_milliseconds(t: pa.DataType) -> pa.DataType | None:
    """``t`` with every timestamp[s] in it as timestamp[ms]; None if it holds none."""
    if pa.types.is_timestamp(t):
        return pa.timestamp("ms", t.tz) if t.unit == "s" else None
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = _in_milliseconds(t.value_type)
        make = pa.list_ if pa.types.is_list(t) else pa.large_list
        return None if item is None else make(t.value_field.with_type(item))
    if pa.types.is_fixed_size_list(t):
        item = _in_milliseconds(t.value_type)
        return None if item is None else pa.list_(t.value_field.with_type(item), t.list_size)
    if pa.types.is_struct(t):
        kinds = [_in_milliseconds(f.type) for f in t]
        if all(k is None for k in kinds):
            return None
        return pa.struct(
            [f if k is None else f.with_type(k) for f, k in zip(t, kinds, strict=True)]
        )
    if pa.types.is_map(t):
        key, item = _in_milliseconds(t.key_type), _in_milliseconds(t.item_type)
        if key is None and item is None:
            return None
        return pa.map_(
            t.key_field.with_type(key or t.key_type), t.item_field.with_type(item or t.item_type)
        )
    return None


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


def check_names(names: list[str], url: str) -> None:
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
    # dynstate's own names (a row's number, ``VersionedDataset(row_column="_dynstate_row")``)
    # stored as data would shadow what the readers add: only the lineage column is data
    ours = sorted(n for n in names if n.startswith(RESERVED_PREFIX) and n not in RESERVED_TYPES)
    if ours:
        raise InvalidDataError(
            f"this round for {url} has column(s) {', '.join(map(repr, ours))}: names beginning "
            f"{RESERVED_PREFIX!r} are dynstate's (a row's number as a reader adds it); drop "
            "them from the rows (a row's sources go in '_dynstate_source')"
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
    if isinstance(t, pa.BaseExtensionType):
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
        pq.write_table(_empty_table(schema), sink)
        back = pq.ParquetFile(pa.BufferReader(sink.getvalue())).read()  # see rowgroups
        # what a read does with a column Parquet gives back as another type (records/rounds
        # conform): a cast Arrow lacks would make every read of the version fail
        for field, got in zip(schema, back.schema, strict=True):
            if got.type != field.type:
                _empty(got.type).cast(field.type)
    except (pa.ArrowException, OSError, ValueError, TypeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _empty_table(schema: pa.Schema) -> pa.Table:
    # Schema.empty_table cannot build some extension arrays (fixed_shape_tensor raises
    # NotImplementedError); built from their storage, they write and read back like any other.
    return pa.Table.from_arrays([_empty(f.type) for f in schema], schema=schema)


def _empty(t: pa.DataType) -> pa.Array:
    if isinstance(t, pa.BaseExtensionType):  # the canonical ones are not ExtensionType
        return pa.ExtensionArray.from_storage(t, _empty(t.storage_type))
    return pa.array([], type=t)


# -- null columns of a first round ------------------------------------------------------------

# Reserved columns whose type dynstate knows: a first round whose values are all None stores
# them with this type, not null (verl's generators write row lineage as list<int64>).
RESERVED_TYPES = {"_dynstate_source": pa.list_(pa.int64())}
# Column names beginning so are dynstate's: none is stored but the reserved ones above.
RESERVED_PREFIX = "_dynstate_"


def has_null_type(t: pa.DataType) -> bool:
    """Whether ``t`` is null or holds null somewhere (``list<null>`` from rows of ``[]``): a
    type a first round gets when it has no values to infer from, which a later round may
    make concrete (see :func:`promote`)."""
    if pa.types.is_null(t):
        return True
    return any(has_null_type(f.type) for f in _child_fields(t))


def promote(stored: pa.DataType, got: pa.DataType) -> pa.DataType | None:
    """The type a column stored as ``stored`` takes when a round brings ``got``: ``got``'s
    type in every place where ``stored`` is null and ``got`` is not; None when ``stored``
    has no null there to make concrete, or the two differ elsewhere (that is a schema
    mismatch, reported by the caller). Stored values (all null there) cast to the result."""
    if pa.types.is_null(stored):
        return None if pa.types.is_null(got) else got
    if pa.types.is_null(got) or not has_null_type(stored):
        return None
    for is_kind, make in (
        (pa.types.is_list, pa.list_),
        (pa.types.is_large_list, pa.large_list),
    ):
        if is_kind(stored) and (pa.types.is_list(got) or pa.types.is_large_list(got)):
            item = promote(stored.value_type, got.value_type)
            if item is None:
                return None
            return make(pa.field(got.value_field.name, item, nullable=True))
    if pa.types.is_struct(stored) and pa.types.is_struct(got):
        # by name, as a round's struct fits a stored one (in any order, any subset); a field
        # the store lacks is the caller's mismatch
        brought = {f.name: f.type for f in got}
        if len(brought) != got.num_fields or not set(brought) <= {f.name for f in stored}:
            return None
        fields, changed = [], False
        for old in stored:
            kind = promote(old.type, brought[old.name]) if old.name in brought else None
            changed = changed or kind is not None
            fields.append(old if kind is None else old.with_type(kind))
        return pa.struct(fields) if changed else None
    return None


def promote_schema(stored: pa.Schema, got: pa.Schema) -> pa.Schema:
    """``stored`` with each column :func:`promote` makes concrete by ``got`` (same names).
    A column keeps its nullability: it was null in every earlier row."""
    out = stored
    for i, field in enumerate(stored):
        if field.name not in got.names or not has_null_type(field.type):
            continue
        kind = promote(field.type, got.field(field.name).type)
        if kind is not None and field.nullable:
            out = out.set(i, field.with_type(kind))
    return out


def _reserved_types(table: pa.Table, url: str) -> pa.Table:
    """The reserved columns in their one type: the lineage column is a list of row numbers
    (``list<int64>``, whatever integer width or null-typed list it came as), and anything
    else there — a bare number, text (``["3"]`` is no row), fractions, dicts, a negative
    row — is refused, naming the column: a later round built by a trainer would not fit."""
    for name, kind in RESERVED_TYPES.items():
        if name not in table.column_names:
            continue
        i = table.column_names.index(name)
        column = table.column(i)
        t = column.type
        rows = (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            pa.types.is_integer(t.value_type) or pa.types.is_null(t.value_type)
        )
        if not (rows or pa.types.is_null(t)):
            raise InvalidDataError(
                f"column {name!r} of this round for {url} is a row's lineage: a list of the "
                f"store's row numbers ({kind}), not {t}; give each row a list of ints, or None"
            )
        try:
            cast = column.cast(kind)  # safe: a uint64 past int64 is refused, not wrapped
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InvalidDataError(
                f"column {name!r} of this round for {url} holds a row number {kind} cannot "
                f"hold ({exc}); row numbers run from 0"
            ) from None
        import pyarrow.compute as pc  # here only: a reader of statistics never imports it

        lowest = pc.min(pc.list_flatten(cast)).as_py()
        if lowest is not None and lowest < 0:
            raise InvalidDataError(
                f"column {name!r} of this round for {url} holds a negative row number "
                f"({lowest}); row numbers run from 0"
            )
        if t != kind:
            table = table.set_column(i, table.field(i).with_type(kind), cast)
    return table


def check_required(table: pa.Table, schema: pa.Schema, url: str, version: int | None) -> None:
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
