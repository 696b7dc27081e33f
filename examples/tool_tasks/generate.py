"""Write Harbor-format tool tasks: a train split and a held-out split that share no instance.

    python examples/tool_tasks/generate.py --out runs/tool-tasks --train 32 --heldout 16

writes `<out>/train/<family>/<task>/` and `<out>/heldout/<family>/<task>/` (per family: that
many instances), each a Harbor task dir (instruction.md, task.toml, environment/files/,
tests/test.sh + check.py + expected.json, solution/solve.sh), and `<out>/manifest.json`. The
family folder is each task's domain in metrics and eval tables. The same arguments write the
same tasks; a held-out instance that equals a train instance is drawn again.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import FAMILIES, Instance, draw

CHECK = Path(__file__).resolve().parent / "check.py"
TASK_TOML = """\
version = "1.0"

[metadata]
family = "{family}"
split = "{split}"

[agent]
timeout_sec = 900.0

[verifier]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 256
storage_mb = 16
network_mode = "no-network"
"""
TEST_SH = """\
#!/bin/bash
mkdir -p /logs/verifier
cd / && exec python3 -I -S /tests/check.py
"""


def write_task(root: Path, name: str, split: str, inst: Instance) -> None:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(inst.instruction + "\n")
    (d / "task.toml").write_text(TASK_TOML.format(family=inst.family, split=split))
    for rel, text in inst.files.items():
        p = d / "environment" / "files" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "tests" / "test.sh").chmod(0o755)
    shutil.copyfile(CHECK, d / "tests" / "check.py")
    (d / "tests" / "expected.json").write_text(json.dumps(inst.expected, indent=1) + "\n")
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\ncd /app\n{inst.solution}\n")
    (d / "solution" / "solve.sh").chmod(0o755)


def generate(out: Path, families: list[str], n_train: int, n_heldout: int,
             seed: int = 0) -> dict[str, dict[str, list[str]]]:
    """Write both splits under `out` (replacing them); returns {split: {family: [task names]}}."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    made: dict[str, dict[str, list[str]]] = {"train": {}, "heldout": {}}
    seen: set[str] = set()
    for split, n, offset in (("train", n_train, 0), ("heldout", n_heldout, 1)):
        if (out / split).exists():
            shutil.rmtree(out / split)
        for fam in families:
            rng = random.Random(f"{seed}:{split}:{offset}:{fam}")
            names: list[str] = []
            tries = 0
            while len(names) < n:
                inst = draw(fam, rng)
                tries += 1
                if inst.key in seen:
                    if tries > 50 * n:
                        raise SystemExit(f"family {fam}: cannot draw {n} distinct instances")
                    continue
                seen.add(inst.key)
                name = f"{fam}-{split}-{len(names):04d}"
                write_task(out / split / fam, name, split, inst)
                names.append(name)
            made[split][fam] = names
    (out / "manifest.json").write_text(json.dumps(
        {"seed": seed, "families": families, "train": n_train, "heldout": n_heldout,
         "tasks": made}, indent=1) + "\n")
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/tool-tasks")
    p.add_argument("--train", type=int, default=32, help="train instances per family")
    p.add_argument("--heldout", type=int, default=16, help="held-out instances per family")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="comma-separated (default: all): " + ", ".join(FAMILIES))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    fams = [f for f in a.families.split(",") if f]
    made = generate(Path(a.out), fams, a.train, a.heldout, a.seed)
    for split, by in made.items():
        print(f"{split}: {sum(map(len, by.values()))} tasks in {len(by)} families -> "
              f"{Path(a.out) / split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
