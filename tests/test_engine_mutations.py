"""The engine's proof (examples/engine/check.py) fails for each planted bug: the oracle shares none of them.

Each mutation is applied to the source of a copy of examples/engine; the copy's check.py then runs the smallest
configuration that exercises the bug and must print a FAIL line for it and exit 1, with the blocks whose contents
differ from the reference's. Three of them change no logit (attention over all-visible keys ignores their order,
and a block read before its new owner writes it reads right): only the cache comparison sees them.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("paddle")
ENGINE = Path(__file__).resolve().parents[1] / "examples" / "engine"


class Mutation(NamedTuple):
    file: str
    edits: tuple[tuple[str, str], ...]  # (text, its replacement), each found exactly once
    only: str  # check.py --only: the configurations run
    hidden: bool  # every token and logit still matches: only the cache comparison sees it


SWAP = "table[:, [0, 1]] = table[:, [1, 0]]"
RUN = "    def _run(self, work: list[tuple[Sequence, int, int]], tables: list[np.ndarray]) -> None:\n"
DOC = '        """One forward over every item\'s new tokens; sample where an item reached the end of its tokens."""\n'

MUTATIONS = {
    # The step's tables name a request's first two blocks the other way round, for writes and reads alike.
    "two blocks swapped in a table": Mutation("engine.py", (
        (RUN + DOC, RUN + DOC + "        for table in tables:\n"
                                "            if table is not None and table.shape[1] > 1:\n"
                                f"                {SWAP}\n"),), "uniform", True),
    # A request that hit the prefix cache reads its first two hit blocks the other way round.
    "two blocks swapped in a prefix hit's blocks": Mutation("engine.py", (
        ("            stats.hit += s.computed\n",
         "            stats.hit += s.computed\n            s.hit = s.computed\n"),
        (RUN + DOC, RUN + DOC + "        for (s, _, _), table in zip(work, tables):\n"
                                "            hit = getattr(s, 'hit', 0)\n"
                                "            if table is not None and hit >= 2 * self.spec.block_size:\n"
                                f"                {SWAP}\n"),), "uniform", True),
    # A request is freed before its last step, which still reads and writes the blocks it held; a request
    # admitted in the same step may take them and write after it read.
    "a request freed before its last step": Mutation("engine.py", (
        ("                work.append((s, s.scheduled, s.scheduled + 1))\n",
         "                work.append((s, s.scheduled, s.scheduled + 1))\n"
         "                if len(s.generated) + 1 >= s.max_new_tokens:\n"
         "                    early = self.__dict__.setdefault('early', {})\n"
         "                    early[s.rid] = np.array(self.cache.table(s.rid))\n"
         "                    self.cache.free(s.rid)\n"),
        ("            return [np.array(self.cache.table(rid)) for rid in rids]\n",
         "            early = self.__dict__.get('early', {})\n"
         "            return [early[rid] if rid in early else np.array(self.cache.table(rid))\n"
         "                    for rid in rids]\n"),
        ("                self.cache.free(s.rid)\n"
         "                self.running.remove(s)\n                self.finished",
         "                if self.__dict__.get('early', {}).pop(s.rid, None) is None:\n"
         "                    self.cache.free(s.rid)\n"
         "                self.running.remove(s)\n                self.finished"),
    ), "preemption (blocks", True),
    "visible: window W-1": Mutation("model.py", (
        ("(q_pos[:, None] - k_pos[None, :] < config.window)",
         "(q_pos[:, None] - k_pos[None, :] < config.window - 1)"),
    ), "window on every layer", False),
    "visible: sink dropped": Mutation("model.py", (
        ("near = (q_pos[:, None] - k_pos[None, :] < config.window) | (k_pos[None, :] < config.sink)",
         "near = q_pos[:, None] - k_pos[None, :] < config.window"),), "head-wise SWA (FastDeploy", False),
    # Query head h reads kv head h % kv_heads instead of h // (q_heads / kv_heads).
    "GQA head mapping interleaved": Mutation("model.py", (
        ("group = ops.permute(q.reshape([n, hkv, hq // hkv, d]), [1, 2, 0, 3])",
         "group = ops.permute(q.reshape([n, hq // hkv, hkv, d]), [2, 1, 0, 3])"),
        ("return ops.permute(out, [2, 0, 1, 3]).reshape([n, hq, v.shape[-1]])",
         "return ops.permute(out, [2, 1, 0, 3]).reshape([n, hq, v.shape[-1]])"),), "uniform", False),
    "RoPE base 500000": Mutation("model.py", (
        ("    theta: float = 10000.0\n", "    theta: float = 500000.0\n"),), "uniform", False),
    "fp8 scale divisor 240": Mutation("model.py", (
        ("FP8_MAX = 448.0", "FP8_MAX = 240.0"),), "block_wise_fp8 (float8", False),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_proof_fails_for_a_planted_bug(name: str, tmp_path: Path) -> None:
    mutation = MUTATIONS[name]
    engine = tmp_path / "engine"
    shutil.copytree(ENGINE, engine, ignore=shutil.ignore_patterns("__pycache__"))
    source = engine / mutation.file
    text = source.read_text()
    for old, new in mutation.edits:
        assert text.count(old) == 1, f"{mutation.file} no longer holds the text this mutation edits: {old!r}"
        text = text.replace(old, new)
    source.write_text(text)
    out = subprocess.run([sys.executable, str(engine / "check.py"), "--only", mutation.only], capture_output=True,
                         text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert lines and any(line.startswith("FAIL") for line in lines), out.stdout + out.stderr[-3000:]
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "     cache: request" in out.stdout, out.stdout
    if mutation.hidden:
        assert all(" 8/8 match;" in line for line in lines), out.stdout
