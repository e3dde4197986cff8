"""A request as the engine keeps it: its tokens so far and how far its K and V are computed."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request: its tokens so far (prompt, then sampled ones) and how many of them have K and V in the cache.
    Compared by identity: the scheduler's queues find and remove one request, never an equal one.

    Positions, as a step sees them::

        0          computed     scheduled       covered
        |--cached---|--this step--|--reserved ahead--|
    """

    rid: Any
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    eos: int | None = None  # a token that ends the request when sampled (None: it runs to max_new_tokens)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # what each sampled token came from
    computed: int = 0  # tokens whose K and V are written
    scheduled: int = 0  # tokens computed, or being computed this step
    covered: int = 0  # positions the request's table covers (past ``scheduled`` with blocks reserved ahead)
    preemptions: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def done(self) -> bool:
        """Whether it has sampled all it may: ``max_new_tokens``, or its ``eos``."""
        return len(self.generated) >= self.max_new_tokens or (bool(self.generated) and self.tokens[-1] == self.eos)
