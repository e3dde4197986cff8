"""The step's one-pass C helpers (``_tables.join_runs``, ``_tables.lookup_ids``, ``_tables.bounds``) against plain
Python models."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.prefix import as_token_array
from kvcache.client import Batch
from kvcache.protocol import ProtocolError, check_tokens

DTYPES = [np.int32, np.uint32, np.int64, np.uint64, np.int16, np.float32]


def _part(data: st.DataObject, dtype: type) -> np.ndarray:
    values = data.draw(st.lists(st.integers(0, 30_000), max_size=5))
    return np.array(values, dtype=dtype)


@settings(max_examples=200)
@given(st.data())
def test_join_runs_equals_concatenate_and_lengths_or_declines(data: st.DataObject) -> None:
    dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=6))
    parts = [_part(data, dt) for dt in dtypes]
    if data.draw(st.booleans()):  # sometimes a part that is not 1-D C-contiguous
        k = data.draw(st.integers(0, len(parts) - 1))
        parts[k] = np.zeros(6, dtype=dtypes[k])[::2] if data.draw(st.booleans()) else np.zeros((2, 2), dtype=dtypes[k])
    joined = _tables.join_runs(parts)
    usual = all(p.ndim == 1 and p.flags.c_contiguous and p.dtype == parts[0].dtype for p in parts)
    if not usual:
        assert joined is None
        return
    assert joined is not None
    tokens = np.frombuffer(joined[0], dtype=parts[0].dtype)
    assert tokens.tolist() == np.concatenate(parts).tolist()
    assert np.frombuffer(joined[1], dtype=np.int32).tolist() == [len(p) for p in parts]


def test_join_runs_reads_array_heads_with_this_numpy() -> None:
    """The fast path's layout check passes with the installed numpy (else every step would export 256 buffers),
    and it joins a decode step's shape (views of one array) as numpy would."""
    assert _tables.reads_array_heads()
    step = np.arange(512, dtype=np.int32).reshape(256, 2)[:, :1]  # 256 one-token views, as a scheduler's loop makes
    parts = list(step)
    tokens, lengths = _tables.join_runs(parts)
    assert np.frombuffer(tokens, dtype=np.int32).tolist() == list(range(0, 512, 2))
    assert np.frombuffer(lengths, dtype=np.int32).tolist() == [1] * 256


def test_join_runs_declines_what_is_not_an_array() -> None:
    assert _tables.join_runs([b"abcd", b"efgh"]) is None
    assert _tables.join_runs([np.zeros(2, np.int32), [1, 2]]) is None
    assert _tables.join_runs([]) == (b"", b"")


ids = st.one_of(st.integers(-5, 40), st.sampled_from(["a", "b", "zz"]), st.just(True), st.just(2.0), st.just(b"a"))


def _first_bad(mapping: dict, keys: list, exclude: dict | None) -> int:
    for j, key in enumerate(keys):
        if type(key) not in (int, str) or key not in mapping or (exclude is not None and key in exclude):
            return j
    return -1


@settings(max_examples=300)
@given(st.dictionaries(st.one_of(st.integers(-5, 40), st.sampled_from(["a", "b"])), st.integers(0, 10**6), max_size=30),
       st.lists(ids, max_size=30), st.one_of(st.none(), st.dictionaries(ids, st.booleans(), max_size=5)),
       st.booleans())
def test_lookup_ids_names_the_first_id_that_fails_and_writes_the_values(
        mapping: dict, keys: list, exclude: dict | None, with_out: bool) -> None:
    out = np.full(len(keys), -7, dtype=np.intp) if with_out else None
    bad = _tables.lookup_ids(mapping, keys, out, exclude)
    assert bad == _first_bad(mapping, keys, exclude)
    if out is not None:
        done = len(keys) if bad < 0 else bad
        assert out[:done].tolist() == [mapping[k] for k in keys[:done]]


def test_lookup_ids_rejects_an_out_buffer_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="out needs"):
        _tables.lookup_ids({1: 2}, [1, 1], np.empty(1, dtype=np.intp), None)


def test_extend_many_with_ids_of_any_hashable_type_still_works_and_names_an_unknown_one() -> None:
    """The manager's C lookup takes int and str ids; any other hashable id goes the Python way."""
    m = KVCacheManager(num_blocks=64, block_size=4)
    for rid in (("t", 1), "s", 7):
        assert m.admit(rid, [1, 2, 3]) is not None
    tables = m.extend_many([("t", 1), "s", 7], [4, 5, 6], [1, 1, 1])
    assert all(t is not None and t.shape[1] == 1 for t in tables)
    with pytest.raises(KVCacheError, match="'nope' is not admitted"):
        m.extend_many(["s", "nope"], [1, 2], [1, 1])
    assert m.num_tokens("s") == 4  # the failed call changed nothing


class _NoClient:
    pass


def test_a_batch_run_of_mixed_token_dtypes_travels_as_numpy_would_concatenate_it() -> None:
    batch = Batch(_NoClient())  # type: ignore[arg-type]
    batch.extend("a", np.array([1, 2], dtype=np.int32))
    batch.extend("b", np.array([3_000_000_000], dtype=np.uint32))  # would read negative as int32
    batch._end_run()
    op = batch._wire[0]
    assert op["tokens"].tolist() == [1, 2, 3_000_000_000]
    assert op["counts"].tolist() == [2, 1]
    same = Batch(_NoClient())  # type: ignore[arg-type]
    same.extend("a", np.array([5], dtype=np.int32))
    same.extend("b", np.array([6, 7], dtype=np.int32))
    same._end_run()
    assert same._wire[0]["tokens"].dtype == np.int32
    assert same._wire[0]["tokens"].tolist() == [5, 6, 7] and same._wire[0]["counts"].tolist() == [1, 2]


def test_batch_extend_takes_every_call_form_and_keeps_op_order() -> None:
    """Batch.extend is RunCollector's (C) for plain calls; keywords, num_computed_tokens and token lists take
    the Python path; each returns the batch, and the ops keep their order."""
    batch = Batch(_NoClient())  # type: ignore[arg-type]
    tokens = np.array([1], dtype=np.int64)
    assert batch.extend("a", tokens) is batch
    assert batch.extend("b", [2, 3]).extend(request_id="c", tokens=np.array([4], dtype=np.int64)) is batch
    assert batch.extend("d", [5], num_computed_tokens=1) is batch
    batch.extend("e", np.array([6], dtype=np.int64))
    batch._end_run()
    assert len(batch) == 5
    first, alone, last = batch._wire
    assert first["op"] == "extend_many" and first["reqs"] == ["a", "b", "c"]
    assert first["tokens"].tolist() == [1, 2, 3, 4] and first["counts"].tolist() == [1, 2, 1]
    assert alone == {"op": "extend", "req": "d", "tokens": alone["tokens"], "num_computed": 1}
    assert alone["tokens"].tolist() == [5]
    assert last["op"] == "extend" and last["req"] == "e"  # a run of one goes as a plain extend


def test_batch_extend_refuses_bad_tokens_and_leaves_the_run_as_it_was() -> None:
    batch = Batch(_NoClient())  # type: ignore[arg-type]
    batch.extend("a", np.array([1], dtype=np.int32))
    with pytest.raises(KVCacheError, match="tokens"):
        batch.extend("b", "not tokens")
    with pytest.raises(TypeError, match="tokens"):
        batch.extend("b")
    assert batch._run_reqs == ["a"] and len(batch._run_tokens) == 1
    batch._run_reqs = None  # type: ignore[assignment]
    with pytest.raises(TypeError, match="must be lists"):
        batch.extend("c", np.array([1], dtype=np.int32))


def test_batch_extend_holds_no_reference_after_the_batch_is_gone() -> None:
    import gc
    import sys

    tokens, rid = np.array([1], dtype=np.int32), object()
    before = sys.getrefcount(tokens), sys.getrefcount(rid)
    batch = Batch(_NoClient())  # type: ignore[arg-type]
    batch.extend(rid, tokens)
    assert (sys.getrefcount(tokens), sys.getrefcount(rid)) == (before[0] + 1, before[1] + 1)
    batch.cycle = batch  # a cycle through the instance: freed by the collector, and the run with it
    del batch
    gc.collect()
    assert (sys.getrefcount(tokens), sys.getrefcount(rid)) == before


INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


@settings(max_examples=300)
@given(st.data())
def test_bounds_equals_min_max_sum_or_declines(data: st.DataObject) -> None:
    """One pass gives what min(), max() and sum() give as Python ints; it declines (None) a float, bool, strided or
    2-D array and a sum past int64, which the callers' numpy path answers."""
    dtype = np.dtype(data.draw(st.sampled_from(INT_DTYPES)))
    info = np.iinfo(dtype)
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=40))
    array = np.array(values, dtype=dtype)
    got = _tables.bounds(array)
    exact = sum(values)
    if not values:
        assert got == (0, 0, 0)
    elif exact > 2**63 - 1 or exact < -2**63 or max(values) > 2**63 - 1:
        assert got is None
    else:
        assert got == (min(values), max(values), exact)
    assert _tables.bounds(np.zeros(6, dtype=dtype)[::2]) is None
    assert _tables.bounds(np.zeros((2, 2), dtype=dtype)) is None


@settings(max_examples=300)
@given(st.data())
def test_token_array_is_the_python_conversion_or_declines(data: st.DataObject) -> None:
    """A 1-D contiguous uint32 array comes back as it is, an int32 one of ids >= 0 as its uint32 view (what
    as_token_array's numpy path gives); anything else, a negative id included, is declined (None) and left to it."""
    dtype = np.dtype(data.draw(st.sampled_from(INT_DTYPES)))
    info = np.iinfo(dtype)
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=40))
    array = np.array(values, dtype=dtype)
    got = _tables.token_array(array)
    if dtype == np.uint32:
        assert got is array
    elif dtype == np.int32 and min(values, default=0) >= 0:
        assert got.dtype == np.uint32 and got.base is array and got.tolist() == values
        assert got.tolist() == as_token_array(array.copy()).tolist()
    else:
        assert got is None
    for other in (array[::2] if array.size > 1 else None, array.reshape(1, -1), values, array.astype(np.float64)):
        if other is not None and not (isinstance(other, np.ndarray) and other.ndim == 1 and other.flags.c_contiguous
                                      and other.dtype == array.dtype):
            assert _tables.token_array(other) is None


@settings(max_examples=300)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**30 + 5), st.integers(-5, -1),
                          st.integers(2**32, 2**70), st.booleans(), st.floats(0, 10), st.just(np.int64(7))),
                max_size=60))
def test_token_list_reads_exact_ints_in_range_or_declines(values: list) -> None:
    """A list of exact ints in [0, 2**32) comes back as a new writable uint32 array of them; anything else (bools,
    floats, numpy scalars, ids out of range) is declined (None) for as_token_array's Python path, which converts
    numpy scalars and names the bad value."""
    got = _tables.token_list(values)
    plain = all(type(v) is int and 0 <= v < 2**32 for v in values)
    if plain:
        assert got.dtype == np.uint32 and got.flags.writeable and got.tolist() == values
    else:
        assert got is None
    try:
        expected = np.array(values, dtype=np.uint64) if all(
            not isinstance(v, (bool, float)) and 0 <= v < 2**32 for v in values) else None
    except (OverflowError, ValueError):
        expected = None
    if expected is not None:
        assert as_token_array(values).tolist() == expected.tolist()
    elif any(isinstance(v, float) or (not isinstance(v, bool) and not 0 <= v < 2**32) for v in values):
        with pytest.raises(KVCacheError, match="tokens"):
            as_token_array(values)
    assert _tables.token_list(tuple(values)) is None and _tables.token_list(np.array([1], np.uint32)) is None


@settings(max_examples=300)
@given(st.data())
def test_check_tokens_holds_the_limit_and_the_range_on_its_one_call_path(data: st.DataObject) -> None:
    """check_tokens gives token_array's cases in one C call: the daemon's limit and the id range still hold for
    them, and a refusal names the field; what it accepts is the ids as uint32, lists as arrays."""
    dtype = np.dtype(data.draw(st.sampled_from([np.uint32, np.int32, np.int64])))
    low, high = {np.uint32: (0, 2**32 - 1), np.int32: (-(2**31), 2**31 - 1), np.int64: (-3, 2**32 + 3)}[dtype.type]
    values = data.draw(st.lists(st.integers(low, high), max_size=8))
    limit = data.draw(st.integers(0, 8))
    value = data.draw(st.sampled_from([np.array(values, dtype=dtype), values]))
    fits = len(values) <= limit and all(0 <= v < 2**32 for v in values)
    try:
        tokens = check_tokens(value, "ops[3].tokens", limit)
    except ProtocolError as exc:
        assert not fits and str(exc).startswith("ops[3].tokens: "), str(exc)
    else:
        assert fits and tokens.dtype == np.uint32 and tokens.tolist() == values


def test_bounds_declines_what_is_not_an_integer_array() -> None:
    for value in (np.ones(3), np.ones(3, dtype=bool), [1, 2], 5):
        assert _tables.bounds(value) is None


def test_c_passes_refuse_a_read_only_array_they_write_and_change_nothing() -> None:
    """The C passes read numpy arrays off their heads, but an array they would write that is read-only (or not
    contiguous) is refused as a buffer export refuses it, before anything changes; the same call then works."""
    m = KVCacheManager(64, 4, hash_seed=b"x")
    for rid in range(3):
        m.admit(rid, list(range(10 * rid, 10 * rid + 4)))  # full blocks: the next token opens one
    before = [m.table(r).tolist() for r in range(3)], m._ntok.copy(), m.num_free_blocks.tolist()
    m._ntok.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        m.extend_many_deltas([0, 1, 2], [7, 8, 9], [1, 1, 1])
    with pytest.raises(ValueError, match="read-only"):
        m.admit(3, [1, 2, 3, 4, 5])
    m._ntok.flags.writeable = True
    assert ([m.table(r).tolist() for r in range(3)], m._ntok.copy(), m.num_free_blocks.tolist())[0] == before[0]
    assert np.array_equal(m._ntok, before[1]) and m.num_free_blocks.tolist() == before[2] and 3 not in m
    full = m._ntok
    m._ntok = np.repeat(full, 2)[::2]  # the same values, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        m.extend_many_deltas([0, 1, 2], [7, 8, 9], [1, 1, 1])
    m._ntok = full
    deltas = m.extend_many_deltas([0, 1, 2], [7, 8, 9], [1, 1, 1])
    assert deltas.lens.tolist() == [2, 2, 2] and [m.num_tokens(r) for r in range(3)] == [5, 5, 5]
    m.check_integrity()
