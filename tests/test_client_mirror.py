"""The client's one-pass mirror update of a decode step (``_tables.mirror_step``) against a plain numpy model."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import _tables
from kvcache.client import _Mirror


def _wire(values: np.ndarray) -> np.ndarray:
    """An int32 array as the protocol decodes it: read-only, at an odd byte offset of its message."""
    raw = b"\x00" * 3 + values.astype("<i4").tobytes()
    return np.frombuffer(raw, dtype="<i4", offset=3).reshape(values.shape)


def _step(mirror: _Mirror, reqs: list, lens: list[int], changes: list[tuple[int, list[int], np.ndarray]]):
    """Call mirror_step with a reply: ``changes`` lists (request position, columns, values [rows, len(columns)])."""
    rows = next(iter(mirror.views.values())).shape[0] if mirror.views else 1
    index = np.array([j for j, _, _ in changes], dtype=np.int32)
    sizes = [len(c) for _, c, _ in changes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    cols = np.array([c for _, cs, _ in changes for c in cs], dtype=np.int32)
    vals = np.concatenate([v for _, _, v in changes], axis=1) if changes else np.zeros((rows, 0), np.int32)
    return _tables.mirror_step(reqs, _wire(np.array(lens)), _wire(index), _wire(offsets), _wire(cols),
                               _wire(vals), mirror.views, mirror._buffers)


def _snapshot(mirror: _Mirror) -> dict:
    return {req: (view.copy(), mirror._buffers[req][0].copy()) for req, view in mirror.views.items()}


@st.composite
def decode_replies(draw):
    """A mirror of a few tables and a decode step's reply: usual (new last columns, window columns given back, or
    both), or not in one of the ways that send it elsewhere (a refusal, a table not mirrored, a request changed
    twice, a table narrower than its view)."""
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, 8))
    widths = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    mirror = _Mirror()
    for j, width in enumerate(widths):
        mirror.put(f"r{j}", np.arange(rows * width, dtype=np.int32).reshape(rows, width) + 100 * j)
    changed = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n)))
    lens = list(widths)
    changes = []
    for j in changed:
        lens[j] = widths[j] + 1
        changes.append((j, [widths[j]], (7000 + 10 * j + np.arange(rows, dtype=np.int32))[:, None]))
    reqs = [f"r{j}" for j in range(n)]
    twist = draw(st.sampled_from(["none", "refused", "unmirrored", "two_columns", "duplicate", "inner_column",
                                  "given_back", "shrink"]))
    if twist == "refused":
        lens[draw(st.integers(0, n - 1))] = -1
    elif twist == "unmirrored":
        reqs.append("stranger")
        lens.append(4)
    elif twist == "two_columns" and changes:
        j, cs, v = changes[0]
        lens[j] += 1
        changes[0] = (j, [cs[0], cs[0] + 1], np.concatenate([v, v], axis=1))
    elif twist == "duplicate" and changes:
        j = changes[0][0]
        other = (j + 1) % n
        if other not in changed:
            reqs[other] = reqs[j]
            lens[other] = lens[j]
            changes.append((other, [widths[j]], np.full((rows, 1), 9, dtype=np.int32)))
            changes.sort(key=lambda c: c[0])
        else:
            twist = "none"
    elif twist == "inner_column" and changes:
        j, _, v = changes[0]
        if widths[j] > 1:
            changes[0] = (j, [0], v)
        else:
            twist = "none"
    elif twist == "given_back":  # a window's columns emptied (-1), in a table that may also gain a column
        j = draw(st.integers(0, n - 1))
        given = sorted(draw(st.sets(st.integers(0, widths[j] - 1), min_size=1, max_size=widths[j])))
        opened = [lens[j] - 1] if j in changed else []
        values = np.full((rows, len(given)), -1, dtype=np.int32)
        rest = [c for c in changes if c[0] != j]
        extra = [v for k, _, v in changes if k == j]
        changes = sorted(rest + [(j, given + opened, np.concatenate([values, *extra], axis=1))], key=lambda c: c[0])
    elif twist == "shrink" and changes:
        j, cs, v = changes[0]
        if widths[j] > 1:
            lens[j] = widths[j] - 1
            changes[0] = (j, [0], v)
        else:
            twist = "none"
    else:
        twist = "none"
    return mirror, reqs, lens, changes, twist


@settings(max_examples=300, deadline=None)
@given(decode_replies())
def test_mirror_step_applies_a_usual_reply_and_leaves_any_other_untouched(case):
    mirror, reqs, lens, changes, twist = case
    before = _snapshot(mirror)
    out = _step(mirror, reqs, lens, changes)
    if twist in ("refused", "unmirrored", "duplicate", "shrink"):
        assert out is None
        after = _snapshot(mirror)
        assert after.keys() == before.keys()
        for req in before:
            assert np.array_equal(after[req][0], before[req][0]) and np.array_equal(after[req][1], before[req][1])
        return
    # A buffer with no room left is the one usual-looking reply that still goes to the general path.
    full = any(lens[j] > mirror._buffers[reqs[j]][0].shape[1] for j, _, _ in changes)
    if full:
        assert out is None
        return
    assert out is not None and len(out) == len(reqs)
    model = _Mirror()  # the general path's result: each change applied by _Mirror.apply
    for req, (view, _) in before.items():
        model.put(req, view)
    for j, cs, v in changes:
        model.apply(reqs[j], lens[j], np.array(cs, dtype=np.int64), v)
    for j, req in enumerate(reqs):
        assert out[j] is mirror.views[req]
        assert not out[j].flags.writeable
        assert np.array_equal(out[j], model.views[req]), req


def test_mirror_step_refuses_arrays_of_another_width_without_changing_anything():
    mirror = _Mirror()
    mirror.put("a", np.array([[1, 2]], dtype=np.int32))
    before = mirror.views["a"]
    out = _tables.mirror_step(["a"], np.array([3], dtype=np.int64), np.array([0], np.int32), np.array([0, 1], np.int32),
                              np.array([2], np.int32), np.array([[5]], np.int32), mirror.views, mirror._buffers)
    assert out is None and mirror.views["a"] is before and before.shape == (1, 2)


def test_mirror_step_fills_a_buffer_to_its_last_column_then_leaves_growing_to_the_general_path():
    mirror = _Mirror()
    mirror.put("a", np.zeros((2, 7), dtype=np.int32))
    capacity = mirror._buffers["a"][0].shape[1]
    assert capacity == 8
    out = _step(mirror, ["a"], [8], [(0, [7], np.array([[5], [6]], dtype=np.int32))])
    assert out is not None and out[0].shape == (2, 8) and out[0][:, 7].tolist() == [5, 6]
    full = _snapshot(mirror)
    assert _step(mirror, ["a"], [9], [(0, [8], np.array([[1], [2]], dtype=np.int32))]) is None
    assert np.array_equal(mirror.views["a"], full["a"][0]) and mirror._buffers["a"][0].shape[1] == capacity
