"""The reference engine generating through a real `kvcache serve`, with its prefix hits and cache usage as it goes.

    python examples/engine/demo.py          # (make demo)

A Gemma-shaped model (sliding-window layers and full ones, seeded weights)
serves three waves of prompts that share a system prompt; the daemon keeps a
row per layer group, the window row giving blocks back as decoding moves on.
Each step prints what it computed and what it found cached; the end compares
every request with a dense model that recomputes attention with no cache.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check import Case, serving  # noqa: E402
from engine import daemon_engine  # noqa: E402
from model import Model, ModelConfig, dense_generate  # noqa: E402

CASE = Case(model=ModelConfig(num_layers=6, window=16, sink=4, window_layers=(0, 1, 3, 4)), block_size=8,
            chunk=48, daemon=("--num-blocks", "80"))


def main() -> int:
    rng = np.random.default_rng(1)
    system = rng.integers(0, CASE.model.vocab, 40).tolist()  # every request starts with the same 40 tokens
    waves = [{f"w{w}-{i}": system + rng.integers(0, CASE.model.vocab, int(n)).tolist()
              for i, n in enumerate(rng.integers(8, 40, 4))} for w in range(3)]
    model = Model(CASE.model)
    print(f"model: {CASE.model.num_layers} layers, windows of {CASE.model.window} tokens (sink {CASE.model.sink}) on "
          f"layers {list(CASE.model.window_layers or ())}, the others full")
    with serving(CASE) as endpoints:
        engine = daemon_engine(model, endpoints["both"], block_size=CASE.block_size, chunk=CASE.chunk)
        rows = engine.cache.info()["rows"]
        print("daemon rows: " + "; ".join(f"{r['kind']} layers {r['layers']} ({r['num_blocks']} blocks)" for r in rows))
        start, outputs = time.perf_counter(), {}
        try:
            for w, wave in enumerate(waves):
                for rid, prompt in wave.items():
                    engine.add(rid, prompt, 12)
                while engine.waiting or engine.running:
                    stats = engine.step()
                    usage = engine.cache.usage.per_row
                    print(f"wave {w} step {len(engine.stats):3d}: {len(engine.running)} running, "
                          f"{len(engine.waiting)} waiting | computed {stats.computed:3d} tokens, {stats.hit:3d} "
                          f"found cached | usage " + ", ".join(f"{r['kind']} {u:4.0%}" for r, u in zip(rows, usage)))
                outputs.update({rid: engine.finished.pop(rid) for rid in wave})
            prompts = {rid: p for wave in waves for rid, p in wave.items()}
            hit = sum(s.hit for s in engine.stats)
            total = sum(len(p) for p in prompts.values())
            print(f"{len(prompts)} requests in {time.perf_counter() - start:.1f} s; prefix hits {hit} of {total} "
                  f"prompt tokens ({hit / total:.0%}); {engine.cache.stats()['recycled_blocks']} window blocks given back")
        finally:
            engine.close()
    same = [outputs[rid].generated == dense_generate(model, p, 12)[0] for rid, p in prompts.items()]
    print(f"generated tokens equal a dense model's with no cache: {sum(same)} of {len(same)} requests")
    for rid in list(prompts)[:3]:
        print(f"  {rid}: {outputs[rid].generated}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
