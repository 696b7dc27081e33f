"""Task formats: code JSONL (streamed), Harbor task dirs, and up-front refusal of tasks that
cannot run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.envs.api import TaskRefused, open_sandbox
from rl360.envs.harbor import HarborEnv, parse_reward
from rl360.envs.sandbox import SandboxLimits, unavailable_reason
from rl360.envs.tasks import (
    TaskFormatError,
    iter_code_tasks,
    iter_tasks,
    load_harbor_task,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_code_jsonl_fields_and_extras(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {
                "id": "a",
                "instruction": "do a",
                "entry_point": "f",
                "tests": ["assert f() == 1"],
                "reference": "def f():\n    return 1",
                "family": "const",
            },
            "",
            {"id": "b", "prompt": "do b", "tests": "assert True", "solution": "pass"},
        ],
    )
    a, b = list(iter_code_tasks(path))
    assert (a.id, a.prompt, a.kind) == ("a", "do a", "code")
    assert a.data == {
        "family": "const",
        "domain": "const",  # from the family (per-domain metrics)
        "tests": ["assert f() == 1"],
        "entry_point": "f",
        "reference": "def f():\n    return 1",
    }
    assert b.prompt == "do b" and b.data["reference"] == "pass" and b.data["tests"] == "assert True"
    assert b.data["domain"] == tmp_path.name  # no domain/family: the file's directory


def test_code_jsonl_is_streamed_and_errors_name_the_line(tmp_path):
    good = {"id": "ok", "instruction": "x", "tests": ["assert 1"]}
    path = write_jsonl(tmp_path / "t.jsonl", [good, "{broken", good])
    it = iter_code_tasks(path)
    assert next(it).id == "ok"  # the first task arrives before the bad line is read
    with pytest.raises(TaskFormatError, match=r"t\.jsonl:2: not JSON"):
        next(it)
    for bad, msg in [
        ({"id": "x", "tests": ["assert 1"]}, "no instruction"),
        ({"id": "x", "instruction": "i"}, "tests"),
        ({"id": "x", "instruction": "i", "tests": []}, "no tests"),
        ([1, 2], "expected a JSON object"),
    ]:
        with pytest.raises(TaskFormatError, match=msg):
            list(iter_code_tasks(write_jsonl(tmp_path / "bad.jsonl", [bad])))


def make_harbor(root: Path, toml: str) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "instruction.md").write_text("Do the thing.\n")
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (root / "task.toml").write_text(toml)
    return root


def test_harbor_task_toml(tmp_path):
    task = load_harbor_task(
        make_harbor(
            tmp_path / "t1",
            """
[agent]
timeout_sec = 30
[verifier]
timeout_sec = 20.0
env = { MODE = "strict" }
[environment]
cpus = 2
memory = "2G"
storage_mb = 512
allow_internet = true
""",
        )
    )
    d = task.data
    assert task.id == "t1" and task.kind == "harbor" and task.prompt == "Do the thing.\n"
    assert (d["agent_timeout_sec"], d["verifier_timeout_sec"], d["cpus"]) == (30.0, 20.0, 2.0)
    assert (d["memory_mb"], d["storage_mb"], d["network_mode"]) == (2048, 512, "public")
    assert d["verifier_env"] == {"MODE": "strict"} and not d["has_solution"]
    spec = HarborEnv().sandbox_spec(task, SandboxLimits())
    assert spec.limits.memory_mb == 2048 and spec.limits.disk_mb == 512 and spec.limits.network
    assert spec.workdir == "/app" and "/logs" in spec.scratch_dirs


def test_harbor_errors_are_clear(tmp_path):
    with pytest.raises(TaskFormatError, match=r"missing instruction.md"):
        load_harbor_task(tmp_path)
    bad = make_harbor(tmp_path / "bad", "[agent]\ntimeout_sec = -1\n")
    with pytest.raises(TaskFormatError, match="timeout_sec must be a positive number"):
        load_harbor_task(bad)
    net = make_harbor(tmp_path / "net", '[environment]\nnetwork_mode = "everything"\n')
    with pytest.raises(TaskFormatError, match="network_mode"):
        load_harbor_task(net)


def test_task_needing_own_image_is_refused_without_docker(tmp_path):
    task = load_harbor_task(
        make_harbor(tmp_path / "img", '[environment]\ndocker_image = "acme/box:1"\n')
    )
    if unavailable_reason("docker") is None:
        pytest.skip("a Docker engine runs here; the task would run")
    with pytest.raises(TaskRefused, match=r"'img'.*acme/box:1"):
        open_sandbox(HarborEnv(), task)
    allow = load_harbor_task(
        make_harbor(tmp_path / "allow", '[environment]\nnetwork_mode = "allowlist"\n')
    )
    with pytest.raises(TaskRefused, match="'allow' needs allowlist"):
        open_sandbox(HarborEnv(), allow)
    plain = load_harbor_task(make_harbor(tmp_path / "plain", ""))
    with pytest.raises(TaskRefused, match="'plain' cannot run on the process sandbox"):
        open_sandbox(HarborEnv(), plain, backend="process")


def test_parse_reward_files():
    assert parse_reward("0.75\n", "txt").value == 0.75
    r = parse_reward('{"passed": 3, "total": 4}', "json")
    assert r.value == pytest.approx(3.5) and r.components == {"passed": 3.0, "total": 4.0}
    assert parse_reward('{"reward": 0.5, "style": 1}', "json").value == 0.5
    with pytest.raises(Exception, match="not hold a number"):
        parse_reward("pass", "txt")
    with pytest.raises(Exception, match="not a number"):
        parse_reward('{"reward": "high"}', "json")


def test_demo_tasks_load():
    tasks = list(iter_tasks(EXAMPLES))
    assert len(tasks) == 30 and all(t.kind == "code" for t in tasks)
    assert len({t.data["family"] for t in tasks}) >= 10
    for t in tasks:
        assert t.prompt.startswith(f"Write a Python function {t.data['entry_point']}(")
        assert 3 <= len(t.data["tests"]) <= 4
        ref = t.data["reference"]
        assert ref.startswith(f"def {t.data['entry_point']}(") and ref.count("\n") == 1
    assert len({t.id for t in tasks}) == 30


def test_showcase_harbor_tasks_load():
    tasks = list(iter_tasks(EXAMPLES.parent / "harbor"))
    assert tasks and all(t.kind == "harbor" and t.data["has_solution"] for t in tasks)


def test_a_task_dockerfile_is_built_where_docker_runs_else_refused_up_front(tmp_path):
    """A Harbor task with environment/Dockerfile asks the docker backend to build that folder;
    with no Docker engine it is refused in one line (the start-up task check, before any
    rollout, refuses it through the same backend choice)."""
    from rl360.envs.api import choose_backend

    root = make_harbor(tmp_path / "built", "")
    (root / "environment").mkdir()
    (root / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\n")
    task = load_harbor_task(root)
    spec = HarborEnv().sandbox_spec(task, SandboxLimits())
    assert spec.backends == ["docker"] and spec.build == str(root.resolve() / "environment")
    if unavailable_reason("docker") is None:
        pytest.skip("a Docker engine runs here; the task would run")
    with pytest.raises(TaskRefused, match="no Docker engine") as err:
        choose_backend(spec, "auto", task)
    assert "\n" not in str(err.value) and "'built'" in str(err.value)
    with pytest.raises(TaskRefused, match="needs its own container"):
        open_sandbox(HarborEnv(), task)


def test_reward_range_in_every_format(tmp_path):
    assert load_harbor_task(make_harbor(tmp_path / "d", "")).data["reward_range"] == [0.0, 1.0]
    t = load_harbor_task(make_harbor(tmp_path / "r", "[verifier]\nreward_range = [-1, 5]\n"))
    assert t.data["reward_range"] == [-1.0, 5.0]
    for bad in ("[1, 0]", "[0]", '["a", 1]', "[0, inf]"):
        root = make_harbor(tmp_path / f"bad{len(list(tmp_path.iterdir()))}",
                           f"[verifier]\nreward_range = {bad}\n")
        with pytest.raises(TaskFormatError, match=r"\[verifier\]: reward_range must be"):
            load_harbor_task(root)
    code = {"id": "c", "prompt": "p", "tests": ["assert True"], "reward_range": [0, 10]}
    [task] = iter_code_tasks(write_jsonl(tmp_path / "c.jsonl", [code]))
    assert task.data["reward_range"] == [0.0, 10.0]
    with pytest.raises(TaskFormatError, match=r"c2.jsonl:1.*reward_range"):
        list(iter_code_tasks(write_jsonl(tmp_path / "c2.jsonl", [{**code, "reward_range": 1}])))
