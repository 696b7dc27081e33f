"""The Slurm launcher: hostlist expansion, the exact commands for a node list, the sbatch file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl360.launch.slurm import (
    SlurmError,
    SlurmOptions,
    assign_roles,
    expand_hostlist,
    node_commands,
    render_sbatch,
)
from rl360.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DENSE = "recipes/gpu-dense-8b.toml"


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[8-11]", ["a1", "b8", "b9", "b10", "b11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[098-101],cpu", ["gpu098", "gpu099", "gpu100", "gpu101", "cpu"]),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "message"),
    [("node[01-03", "unclosed"), ("node]1", "without"), ("n[3-1]", "backwards"),
     ("n[a-b]", "bad range"), ("n1,n1", "listed twice"), ("", "no hosts")],
)
def test_bad_hostlists(spec: str, message: str) -> None:
    with pytest.raises(SlurmError, match=message):
        expand_hostlist(spec)


def test_roles_follow_the_cluster_section() -> None:
    recipe = load_recipe(REPO / DENSE)
    placed = assign_roles(recipe, expand_hostlist("node[01-33]"))
    assert placed[0] == ("node01", "service")
    assert [h for h, r in placed if r == "train"] == [f"node{i:02d}" for i in range(2, 10)]
    assert next(h for h, r in placed if r == "rollout") == "node10" and len(placed) == 33
    with pytest.raises(SlurmError, match=r"needs 33 nodes .* the node list has 30"):
        assign_roles(recipe, expand_hostlist("node[01-30]"))
    with pytest.raises(SlurmError, match="no cluster section"):
        assign_roles(load_recipe(REPO / "recipes" / "cpu-demo.toml"), ["n1"])


def test_dry_run_prints_the_exact_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rl360", "slurm", DENSE, "--nodes", "node[01-33]", "--dry-run",
         "--set", "trainer.lr=2e-6", "--setup", "source /opt/venv/bin/activate"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    lines = out.stdout.splitlines()
    srun = "srun --overlap --nodes=1 --ntasks=1 --cpus-per-task=96 --gpus-per-task=8"
    wait = "python -m rl360.launch.slurm wait --address node01:6379 --timeout 600"
    body = lines[lines.index("source /opt/venv/bin/activate"):]
    assert body == [
        "source /opt/venv/bin/activate",
        "export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token",
        "ray get-auth-token --generate > /dev/null  # ~/.ray/auth_token, shared home",
        f"{srun} -w node01 ray start --head --block --port=6379 --dashboard-host=0.0.0.0 "
        "--dashboard-port=8265 --num-cpus=96 --num-gpus=8 "
        "--resources='{\"rl360_role_service\": 1000}' &",
        f"{wait} --nodes 1",
        *[f"{srun} -w node{i:02d} ray start --block --address=node01:6379 --num-cpus=96 "
          "--num-gpus=8 --resources='{\"rl360_role_train\": 1000}' &" for i in range(2, 10)],
        *[f"{srun} -w node{i:02d} ray start --block --address=node01:6379 --num-cpus=96 "
          "--num-gpus=8 --resources='{\"rl360_role_rollout\": 1000}' &" for i in range(10, 34)],
        f"{wait} --nodes 33",
        'echo "rl360: Ray dashboard http://node01:8265"',
        "RAY_ADDRESS=node01:6379 python -m rl360 train recipes/gpu-dense-8b.toml "
        "--set trainer.lr=2e-6",
    ]
    assert lines[0] == "#!/bin/bash" and "set -euo pipefail" in lines
    assert "#   train      8  node02 node03 node04 node05 node06 node07 node08 node09" in lines
    bash = subprocess.run(["bash", "-n"], input=out.stdout, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr


def test_dry_run_errors_are_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "rl360", "slurm", DENSE, "--nodes", "n[1-3]",
                          "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "rl360 slurm: the recipe's cluster section needs 33 nodes (1 service + 8 train + 24 "
        "rollout), the node list has 3: ask Slurm for --nodes=33 or change cluster.*.nodes"]


def test_sbatch_script(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / DENSE)
    opts = SlurmOptions(setup="source /opt/venv/bin/activate", workdir="/home/me/rl360",
                        auth="disabled")
    text = render_sbatch(recipe, DENSE, ["trainer.lr=2e-6"], opts, "04:00:00", "gpu", "proj")
    for line in ["#SBATCH --nodes=33", "#SBATCH --gpus-per-node=8", "#SBATCH --time=04:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "cd /home/me/rl360",
                 "#SBATCH --output=/shared/rl360/runs/dense-8b/slurm-%j.out"]:
        assert line in text.splitlines()
    assert ("python -m rl360 slurm recipes/gpu-dense-8b.toml --set trainer.lr=2e-6 --nodes "
            '"$SLURM_JOB_NODELIST" --dry-run') in text
    assert "--auth disabled" in text and "{{" not in text
    # every #SBATCH line comes before the first command
    lines = text.splitlines()
    first_cmd = next(i for i, x in enumerate(lines) if x and not x.startswith("#"))
    assert all(i < first_cmd for i, x in enumerate(lines) if x.startswith("#SBATCH"))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # the same lines the job will run, for a node list Slurm may give
    cmds = node_commands(recipe, DENSE, [], expand_hostlist("gpu[100-132]"), opts)
    assert "srun --overlap --nodes=1 --ntasks=1 --cpus-per-task=96 --gpus-per-task=8 -w gpu100 " \
           "ray start --head" in cmds
    assert "ray get-auth-token" not in cmds  # auth disabled


def test_slurm_writes_the_script(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    res = subprocess.run([sys.executable, "-m", "rl360", "slurm", DENSE, "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert f"wrote {out}" in res.stdout and out.read_text().startswith("#!/bin/bash")


def test_container_image_runs_every_command_inside_it() -> None:
    recipe = load_recipe(REPO / DENSE)
    hosts = expand_hostlist("node[01-33]")
    pyxis = SlurmOptions(workdir="/home/me/rl360", container_image="rl360:gpu",
                         container_mounts="/models,/shared:/mnt/shared")
    cmds = node_commands(recipe, DENSE, [], hosts, pyxis).splitlines()
    flags = ("--container-image=rl360:gpu --container-mounts=/home/me/rl360:/home/me/rl360,"
             "/models:/models,/shared:/mnt/shared --container-workdir=/home/me/rl360")
    starts = [c for c in cmds if " ray start " in c]
    assert len(starts) == 33 and all(f"{flags} ray start" in c for c in starts)
    head = f"srun --overlap --nodes=1 --ntasks=1 -w node01 {flags} "
    assert f"{head}python -m rl360.launch.slurm wait --address node01:6379 --timeout 600 " \
           "--nodes 33" in cmds
    assert cmds[-1] == f"RAY_ADDRESS=node01:6379 {head}python -m rl360 train {DENSE}"
    assert any(c.startswith(f"{head}ray get-auth-token") for c in cmds)
    appt = SlurmOptions(workdir="/w", container_image="/img/rl360.sif",
                        container_runtime="apptainer")
    cmds = node_commands(recipe, DENSE, [], hosts, appt).splitlines()
    run = "apptainer exec --nv --bind /w:/w --pwd /w /img/rl360.sif "
    assert all(f"-w node{i:02d} {run}ray start" in c
               for i, c in enumerate((c for c in cmds if " ray start " in c), start=1))
    assert cmds[-1] == f"RAY_ADDRESS=node01:6379 {run}python -m rl360 train {DENSE}"
    # the sbatch script asks for the commands from inside the image too
    text = render_sbatch(recipe, DENSE, [], pyxis)
    assert "--container-image=rl360:gpu" in text and "--container-image rl360:gpu " \
           "--container-runtime pyxis --container-mounts /models,/shared:/mnt/shared" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    with pytest.raises(SlurmError, match="--container-runtime 'docker'"):
        node_commands(recipe, DENSE, [], hosts, SlurmOptions(container_image="x",
                                                             container_runtime="docker"))
