"""Faults the reference engine (examples/engine) must refuse by name, shared by the CPU (tests/test_engine.py) and
GPU (tests/test_engine_gpu.py) tests."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def refuses_a_lost_block(engine: Any, prompt: list[int]) -> list[list[Any]]:
    """Generate 3 tokens of ``prompt`` while, from the second step on, the tables the engine reads lack the
    request's first block (-1), which every query of a model with no window sees: the step must be refused by
    name before attention reads. Returns the request ids of each ``read_tables`` call."""
    tables, calls = engine.read_tables, []

    def without_first_block(rids: list) -> list:
        calls.append(rids)
        return [np.where(np.arange(t.shape[1]) == 0, -1, t) if len(calls) > 1 else t for t in tables(rids)]

    engine.read_tables = without_first_block
    with pytest.raises(RuntimeError, match="^layer 0: a query of request 'a' sees a token in a block its table "
                                           "no longer holds$"):
        engine.generate({"a": prompt}, 3)
    return calls
