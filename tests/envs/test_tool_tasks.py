"""The generated tool tasks (examples/tool_tasks): the splits share no instance, every family's
reference solution scores 1 and an idle agent 0 through the real sandbox and Harbor verifier,
and the verifier cannot be pointed at its own expected values."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rl360.envs.api import open_sandbox
from rl360.envs.harbor import HarborEnv
from rl360.envs.tasks import iter_tasks

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2] / "examples" / "tool_tasks"


def _module(name: str):  # type: ignore[no-untyped-def]
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, ROOT / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tool-tasks")
    gen = _module("generate")
    gen.generate(out, list(_module("families").FAMILIES), n_train=6, n_heldout=3, seed=7)
    return out


def test_splits_are_disjoint_and_deterministic(tmp_path: Path) -> None:
    fams = _module("families")
    gen = _module("generate")
    gen.generate(tmp_path / "a", list(fams.FAMILIES), n_train=40, n_heldout=20, seed=1)
    gen.generate(tmp_path / "b", list(fams.FAMILIES), n_train=40, n_heldout=20, seed=1)

    def keys(root: Path, split: str) -> set[str]:
        out = set()
        for task in (root / split).glob("*/*"):
            files = sorted((p.relative_to(task / "environment" / "files").as_posix(), p.read_text())
                           for p in (task / "environment" / "files").rglob("*") if p.is_file())
            out.add(json.dumps([task.parent.name, (task / "instruction.md").read_text(), files]))
        return out

    train, held = keys(tmp_path / "a", "train"), keys(tmp_path / "a", "heldout")
    assert len(train) == 40 * len(fams.FAMILIES) and len(held) == 20 * len(fams.FAMILIES)
    assert not train & held
    assert keys(tmp_path / "b", "train") == train  # same arguments, same tasks
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert set(manifest["tasks"]["heldout"]) == set(fams.FAMILIES)


def test_tasks_load_with_their_family_as_domain(generated: Path) -> None:
    tasks = list(iter_tasks(generated / "heldout"))
    fams = _module("families").FAMILIES
    assert len(tasks) == 3 * len(fams)
    assert {t.data["domain"] for t in tasks} == set(fams)
    assert all(t.kind == "harbor" and t.data["has_solution"] for t in tasks)


async def test_reference_scores_one_and_idle_zero(bwrap_backend, generated: Path) -> None:
    tasks = list(iter_tasks(generated / "train"))
    by_family: dict[str, list] = {}
    for t in tasks:
        by_family.setdefault(t.data["domain"], []).append(t)
    for family, ts in sorted(by_family.items()):
        for task in ts[:2]:
            env = HarborEnv()
            async with open_sandbox(env, task, bwrap_backend) as sandbox:
                await env.setup(task, sandbox)
                idle = await env.verify()
                assert idle.value == 0.0, (family, task.id, idle.info)
                res = await env.run_solution()
                assert res.ok, (family, task.id, res)
                done = await env.verify()
                assert done.value == 1.0, (family, task.id, done.info)


async def test_a_symlink_to_the_expected_values_scores_zero(bwrap_backend,
                                                            generated: Path) -> None:
    """answer.txt pointing at /tests/expected.json (filled in before the verifier runs) would
    hand a number check its own value: the verifier reads regular files only."""
    task = next(t for t in iter_tasks(generated / "train") if t.data["domain"] == "count_lines")
    env = HarborEnv()
    async with open_sandbox(env, task, bwrap_backend) as sandbox:
        await env.setup(task, sandbox)
        await sandbox.exec("ln -s /tests/expected.json answer.txt", timeout=10)
        assert (await env.verify()).value == 0.0


def test_warm_start_chats_hold_no_family_job_or_task_file(generated: Path) -> None:
    """The generic warm start teaches the call format only: none of its commands does a
    family's job, and no file of any generated instance appears in it."""
    chats = _module("warmstart").format_chats(2000, seed=0)
    commands = [json.loads(tc["function"]["arguments"])["command"]
                for c in chats for m in c["messages"] for tc in m.get("tool_calls") or ()]
    family_tools = {"wc", "grep", "cut", "mv", "cp", "rm", "sed", "awk", "python", "python3"}
    for cmd in commands:
        words = cmd.replace(">", " ").replace("|", " ").split()
        assert not family_tools & set(words) or cmd == "python3 --version", cmd
    text = json.dumps(chats)
    names = {p.name for p in generated.rglob("environment/files/*") if p.is_file()}
    assert names and not [n for n in names if n in text]
