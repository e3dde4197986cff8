"""`make demo`: a small checkpoint in Hugging Face's format generating through a real `kvcache serve`.

    python examples/engine/demo.py          # (make demo)

It writes a tiny Mistral checkpoint (``config.json`` and ``model.safetensors``,
random weights from a fixed seed: ``checkpoints.py``) and a prompts file, then
runs ``generate.py --daemon`` on them: a ``kvcache serve`` started for the run
schedules every step, its window row giving blocks back as decoding moves on,
and the second wave of prompts finds the first wave's prefixes cached. Each
step prints what it computed and what it found cached. The end compares every
prompt's tokens with ``reference.py``, a numpy decoder with no cache that
shares no code with the engine.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint  # noqa: E402
import checkpoints  # noqa: E402
from reference import Reference  # noqa: E402

ARCHITECTURE = "mistral"
MAX_NEW_TOKENS = 12


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """Eight prompts sharing a 40-token system prompt: four, then each of them grown (the second wave)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 40).tolist()
    first = [system + rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(8, 40, 4)]
    return first + [p + rng.integers(0, vocab, 9).tolist() for p in first]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as tmp:
        folder = checkpoints.write(ARCHITECTURE, Path(tmp) / ARCHITECTURE)
        config, weights = checkpoint.load(folder)
        wanted = prompts(config.vocab)
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(wanted))
        print(f"wrote {ARCHITECTURE} ({', '.join(p.name for p in sorted(folder.iterdir()))}) and "
              f"{len(wanted)} prompts; running generate.py --daemon", flush=True)
        command = [sys.executable, str(HERE / "generate.py"), "--model", str(folder), "--prompts", str(prompts_file),
                   "--max-new-tokens", str(MAX_NEW_TOKENS), "--daemon", "--num-blocks", "48", "--json"]
        print("$ " + " ".join(["python", "examples/engine/generate.py", *command[2:]]), flush=True)
        run = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        lines = []
        for line in run.stdout:
            lines.append(line)
            if not line.startswith("["):
                print(line, end="", flush=True)
        if run.wait() != 0 or not lines:
            print(f"generate.py failed (exit code {run.returncode})", file=sys.stderr)
            return 1
    got = json.loads(lines[-1])
    reference = Reference(config.hf_config(), weights)
    same = [tokens == reference.generate(prompt, MAX_NEW_TOKENS)[0] for prompt, tokens in zip(wanted, got)]
    print(f"generated tokens equal a numpy decoder's with no cache (reference.py): {sum(same)} of {len(same)} prompts")
    for i in range(3):
        print(f"  prompt {i} ({len(wanted[i])} tokens): {got[i]}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
