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
    edits: tuple[tuple[str, str, str], ...]  # (file, text, its replacement), each text found exactly once
    only: str  # check.py --only: the configurations run
    hidden: bool  # every token and logit still matches: only the cache comparison sees it


SWAP = "table[:, [0, 1]] = table[:, [1, 0]]"
RUN = "    def run(self, work: list[Scheduled], tables: list[np.ndarray | None]) -> None:\n"
DOC = '        """One forward over the step\'s work, each request reading its table; then what it sampled."""\n'
FINISH = "                self.cache.free(s.rid)\n                self.running.remove(s)\n                self.finished"

MUTATIONS = {
    # The step's tables name a request's first two blocks the other way round, for writes and reads alike.
    "two blocks swapped in a table": Mutation((
        ("engine.py", RUN + DOC, RUN + DOC + "        for table in tables:\n"
                                             "            if table is not None and table.shape[1] > 1:\n"
                                             f"                {SWAP}\n"),), "uniform", True),
    # A request that hit the prefix cache reads its first two hit blocks the other way round.
    "two blocks swapped in a prefix hit's blocks": Mutation((
        ("scheduler.py", "            stats.hit += s.computed\n",
         "            stats.hit += s.computed\n            s.hit = s.computed\n"),
        ("engine.py", RUN + DOC, RUN + DOC + "        for w, table in zip(work, tables):\n"
                                             "            hit = getattr(w.seq, 'hit', 0)\n"
                                             "            if table is not None and hit >= 2 * self.spec.block_size:\n"
                                             f"                {SWAP}\n"),), "uniform", True),
    # A request is freed before its last step, which still reads and writes the blocks it held; a request
    # admitted in the same step may take them and write after it read.
    "a request freed before its last step": Mutation((
        ("scheduler.py", "                work.append(Scheduled(s, s.scheduled, s.scheduled + 1))\n",
         "                work.append(Scheduled(s, s.scheduled, s.scheduled + 1))\n"
         "                if len(s.generated) + 1 >= s.max_new_tokens:\n"
         "                    s.early = np.array(self.cache.table(s.rid))\n"
         "                    self.cache.free(s.rid)\n"),
        ("engine.py", "            return [np.array(self.cache.table(rid)) for rid in rids]\n",
         "            early = {s.rid: s.early for s in self.running if hasattr(s, 'early')}\n"
         "            return [early[rid] if rid in early else np.array(self.cache.table(rid))\n"
         "                    for rid in rids]\n"),
        ("scheduler.py", FINISH,
         "                if not hasattr(s, 'early'):\n"
         "                    self.cache.free(s.rid)\n"
         "                self.running.remove(s)\n                self.finished"),
    ), "preemption (blocks", True),
    "visible: window W-1": Mutation((
        ("model.py", "(q_pos[:, None] - k_pos[None, :] < config.window)",
         "(q_pos[:, None] - k_pos[None, :] < config.window - 1)"),
    ), "window on every layer", False),
    "visible: sink dropped": Mutation((
        ("model.py", "near = (q_pos[:, None] - k_pos[None, :] < config.window) | (k_pos[None, :] < config.sink)",
         "near = q_pos[:, None] - k_pos[None, :] < config.window"),), "head-wise SWA (FastDeploy", False),
    # Query head h reads kv head h % kv_heads instead of h // (q_heads / kv_heads).
    "GQA head mapping interleaved": Mutation((
        ("model.py", "group = ops.permute(q.reshape([n, hkv, hq // hkv, d]), [1, 2, 0, 3])",
         "group = ops.permute(q.reshape([n, hq // hkv, hkv, d]), [2, 1, 0, 3])"),
        ("model.py", "return ops.permute(out, [2, 0, 1, 3]).reshape([n, hq, v.shape[-1]])",
         "return ops.permute(out, [2, 1, 0, 3]).reshape([n, hq, v.shape[-1]])"),), "uniform", False),
    "RoPE base 500000": Mutation((
        ("model.py", "    theta: float = 10000.0\n", "    theta: float = 500000.0\n"),), "uniform", False),
    "fp8 scale divisor 240": Mutation((
        ("model.py", "FP8_MAX = 448.0", "FP8_MAX = 240.0"),), "block_wise_fp8 (float8", False),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_proof_fails_for_a_planted_bug(name: str, tmp_path: Path) -> None:
    mutation = MUTATIONS[name]
    engine = tmp_path / "engine"
    shutil.copytree(ENGINE, engine, ignore=shutil.ignore_patterns("__pycache__"))
    for file, old, new in mutation.edits:
        source = engine / file
        text = source.read_text()
        assert text.count(old) == 1, f"{file} no longer holds the text this mutation edits: {old!r}"
        source.write_text(text.replace(old, new))
    out = subprocess.run([sys.executable, str(engine / "check.py"), "--only", mutation.only], capture_output=True,
                         text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert lines and any(line.startswith("FAIL") for line in lines), out.stdout + out.stderr[-3000:]
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "     cache: request" in out.stdout, out.stdout
    if mutation.hidden:
        assert all(" 8/8 match;" in line for line in lines), out.stdout
