"""The peer baseline of the demo: TRL's `GRPOTrainer` on the demo's code tasks, from
the demo's own warm start, with the demo recipe's settings, timed to the demo's target.

What is compared: wall-clock seconds until the mean reward reaches the target, against `make
demo` (docs/demo.md: the same warm start, `rl360 train recipes/cpu-demo.toml`). The demo's
target is 0.90 mean reward on its 30 code tasks, the same tasks TRL trains on.

The workload, read from the recipe (`--recipe`, default recipes/cpu-demo.toml):
  - policy: `train.init` (runs/cpu-demo-warmstart, made by `rl360 sft recipes/cpu-demo.toml`):
    the tiny Llama-shaped model (0.41M parameters counted, the tied embedding once) with its
    byte-level BPE tokenizer and ChatML template
  - tasks: the code tasks of `train.tasks` (examples/tasks/code.jsonl, 30 tasks). A prompt is
    the chat the rl360 code env sends for the first turn (its system prompt when the recipe sets
    one, then the instruction), rendered by the tokenizer's chat template; the bench checks that
    TRL's prompt ids equal rl360's renderer's (rl360.policies.chat) for every task
  - a step: `train.groups_per_batch` (30) prompts x `train.group_size` (8) completions = 240,
    temperature / top_p / top_k / max_tokens from `train.sampling` (1.0 / 1 / off / 64); a
    completion ends at <|im_end|> or <|endoftext|>, the engine's stop tokens
  - the dataset is the tasks repeated lcm(tasks, groups_per_batch) / tasks times (the 30 tasks
    once, at 30 groups a batch): TRL's sampler shuffles it each epoch, so a step holds every
    task once
  - reward: the rl360 code env's grading, run bare: `extract_code` (the last ```python block)
    and the task's tests from rl360.envs.code, each test run with the solution in one plain
    `python -I -S` subprocess per distinct (task, code) of the step (no sandbox, no isolated
    runner: what a user would write; identical completions are graded once per step), graded
    by the env's own reward function (tests passed / total; the format penalty when the recipe
    sets one, 0 in the demo); the subprocesses run on `--workers` threads (default: the cores)
  - training: one Adam step per batch (AdamW, weight decay 0, betas, eps and grad clip 1.0 from
    `[trainer]`; lr `--lr`, default 1e-3: TRL's GRPO is synchronous, and 1e-3 is the demo's
    best on-policy rate, where the recipe's 7e-4 is tuned for its asynchronous run), rl360's
    schedule passed to the trainer (lr x step / 5 over steps 1-5, then constant; TRL's stock
    "constant_with_warmup" starts at 0), micro-batches of `trainer.micro_batch_size` (60), beta 0
    (no KL, no reference model), GRPO advantages (group mean, group std), loss_type "dapo":
    TRL's token mean over the whole batch, rl360's `token-mean` reducer; clip 0.2 / 0.28 (it
    never acts: one step per batch); fp32 on the CPU; torch's default threads (all cores)

Per step it prints the step's wall seconds, the seconds since the bench started, the mean
reward, the share of completions passing every test, the distinct completions graded and the
grading seconds. At the end: the first step with mean reward >= `--target` and the first
trailing `--window`-step mean >= it, in seconds since the bench started (imports, model load
and trainer set-up included, as `make demo`'s elapsed_s includes Ray's start-up) and since the
first step began; the median step. The run stops `--after-target` steps after the first
trailing-window mean at the target (so both figures are in), at `--max-steps` or after the step
that crosses `--max-seconds` (20 minutes, the demo's budget).

    make bench-trl                        # the side venv .venv-trl + the warm start if missing
    flock /tmp/rl360-bench.lock .venv-trl/bin/python bench/trl_grpo.py [--max-steps 3]

Runs from `.venv-trl` (TRL is kept out of the main venv). Last line: {"bench": "trl_grpo",
"s_per_step": ..., "first_step_at_target": ..., "seconds_to_target": ..., "target": 0.9, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rl360.envs.code import CodeEnv, extract_code, test_units  # noqa: E402
from rl360.envs.registry import params_for  # noqa: E402
from rl360.envs.tasks import iter_tasks  # noqa: E402
from rl360.recipe import Recipe, load  # noqa: E402
from rl360.rewards import RewardContext  # noqa: E402
from rl360.types import Message, Task  # noqa: E402

# One test run: the solution and then the test, in a fresh namespace, under a per-test alarm;
# one "<nonce> <i> <0|1>" line per test on a copy of stdout taken before any solution runs.
GRADER = r"""
import json, os, signal, sys
spec = json.loads(sys.stdin.read())
out = os.dup(1)
def on_alarm(signum, frame):
    raise TimeoutError("per-test time limit")
signal.signal(signal.SIGALRM, on_alarm)
for i, test in enumerate(spec["tests"]):
    ok = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, spec["timeout"])
        scope = {"__name__": "__main__"}
        exec(compile(spec["solution"], "<solution>", "exec"), scope)
        exec(compile(test, "<test>", "exec"), scope)
        ok = 1
    except BaseException:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    os.write(out, f"{spec['nonce']} {i} {ok}\n".encode())
"""


class BenchError(RuntimeError):
    """The recipe asks for something this baseline cannot run the same way."""


@dataclass
class Workload:
    recipe: Recipe
    model_dir: Path
    tasks: list[Task]
    env_params: dict[str, Any]
    system_prompt: str | None
    reward_fn: Any  # the code env's reward function (rl360.rewards.Guarded)
    per_test_timeout_s: float


def load_workload(recipe_path: str, model: str | None) -> Workload:
    recipe = load(recipe_path, Recipe)
    tr, trainer = recipe.train, recipe.trainer
    if trainer.minibatches != 1 or trainer.epochs != 1:
        raise BenchError("the bench runs one optimizer step per batch (trainer.minibatches = "
                         "trainer.epochs = 1)")
    if trainer.loss.name != "ppo" or trainer.loss.reducer != "token-mean":
        raise BenchError("the bench maps trainer.loss = ppo with the token-mean reducer only")
    if trainer.advantage not in ("grpo", "drgrpo"):
        raise BenchError(f"trainer.advantage {trainer.advantage!r}: only grpo / drgrpo map to TRL")
    if recipe.env.env not in ("", "code"):
        raise BenchError(f"env.env {recipe.env.env!r}: the bench runs the code env only")
    params = params_for(recipe.env.env, recipe.env.params, "code")
    env = CodeEnv(**params)
    if env.use_tools:
        raise BenchError("env.params.code.tools = true: the bench runs single-turn code tasks")
    tasks = [t for p in tr.tasks for t in iter_tasks(ROOT / p) if t.kind == "code"]
    if not tasks:
        raise BenchError(f"no code tasks in train.tasks {tr.tasks}")
    model_dir = ROOT / (model or tr.init or recipe.model.path)
    if not (model_dir / "config.json").is_file():
        raise BenchError(f"{model_dir} is not a model directory: make the warm start first "
                         f"(.venv/bin/rl360 sft {recipe_path})")
    return Workload(recipe, model_dir, tasks, params, env.system_prompt, env.reward_fn,
                    env.per_test_timeout_s)


def first_turn(task: Task, env_params: dict[str, Any]) -> list[Message]:
    """The messages the code env sends for the task's first turn (CodeEnv.setup; with tools
    off it touches no sandbox)."""
    env = CodeEnv(**env_params)
    return asyncio.run(env.setup(task, None)).messages  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- grading


def run_tests(code: str, tests: list[str], timeout_s: float, cwd: str) -> int:
    """How many of `tests` pass with `code`, in one bare python subprocess."""
    nonce = secrets.token_hex(8)
    spec = json.dumps({"nonce": nonce, "solution": code, "tests": tests, "timeout": timeout_s})
    try:
        res = subprocess.run(
            [sys.executable, "-I", "-S", "-c", GRADER], input=spec.encode(),
            capture_output=True, cwd=cwd, timeout=(timeout_s + 1.0) * len(tests) + 5.0,
            start_new_session=True,
        )
        stdout = res.stdout
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout or b""
    passed: set[int] = set()
    for line in stdout.decode(errors="replace").splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and parts[2] == "1":
            passed.add(int(parts[1]))
    return len({i for i in passed if i < len(tests)})


@dataclass
class StepGrades:
    rewards: list[float]
    all_pass: list[float]
    distinct: int
    seconds: float


class Grader:
    """The reward function given to GRPOTrainer: one bare subprocess per distinct (task, code)
    of a call (a call is one step's completions), graded by the code env's reward."""

    __name__ = "code_tests"  # TRL names reward functions by __name__

    def __init__(self, work: Workload, workers: int) -> None:
        self.tasks = {t.id: t for t in work.tasks}
        self.reward_fn = work.reward_fn
        self.timeout_s = work.per_test_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.tmp = tempfile.TemporaryDirectory(prefix="trl-grpo-grading-")
        self.last: StepGrades | None = None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],
                 task_id: Sequence[str], **_: Any) -> list[float]:
        t0 = time.monotonic()
        answers = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        codes = [extract_code(a) for a in answers]
        keys = sorted({(tid, code) for tid, code in zip(task_id, codes, strict=True)
                       if code is not None}, key=lambda k: (k[0], k[1] or ""))
        futures = {k: self.pool.submit(run_tests, k[1], test_units(self.tasks[k[0]]),
                                       self.timeout_s, self.tmp.name) for k in keys}
        passed = {k: f.result() for k, f in futures.items()}
        rewards, all_pass = [], []
        for tid, answer, code in zip(task_id, answers, codes, strict=True):
            task = self.tasks[tid]
            total = len(test_units(task))
            n = passed[(tid, code)] if code is not None else 0
            ctx = RewardContext(answer=answer, reference=task.data.get("answer"),
                                tests_passed=n, tests_total=total, malformed_tool_calls=0,
                                has_final_answer=True, format_ok=code is not None, task=task)
            rewards.append(float(self.reward_fn(ctx).value))
            all_pass.append(1.0 if total and n == total else 0.0)
        self.last = StepGrades(rewards, all_pass, len(keys), time.monotonic() - t0)
        return rewards


# ----------------------------------------------------------------------------- the run


@dataclass
class StepRow:
    step: int
    step_s: float
    elapsed_s: float  # since the bench started
    train_s: float  # since the first step began
    reward: float
    pass_rate: float
    distinct: int
    grade_s: float
    logs: dict[str, float] = field(default_factory=dict)


def trailing_mean(rows: list[StepRow], i: int, window: int) -> float | None:
    if i + 1 < window:
        return None
    return statistics.fmean(r.reward for r in rows[i + 1 - window : i + 1])


def first_at(rows: list[StepRow], target: float, window: int) -> tuple[StepRow | None,
                                                                       StepRow | None]:
    """(the first step with reward >= target, the first step whose trailing window-step mean
    is >= target)."""
    single = next((r for r in rows if r.reward >= target), None)
    mean = next((r for i, r in enumerate(rows)
                 if (m := trailing_mean(rows, i, window)) is not None and m >= target), None)
    return single, mean


def make_callback(grader: Grader, t_start: float, args: argparse.Namespace,
                  rows: list[StepRow], say: Callable[[str], None]) -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t_train: float | None = None
            self.t_prev = 0.0

        def on_train_begin(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t_train = self.t_prev = time.monotonic()

        def on_step_end(self, args_: Any, state: Any, control: Any, **kw: Any) -> Any:
            now = time.monotonic()
            g = grader.last
            assert g is not None and self.t_train is not None
            rows.append(StepRow(step=state.global_step, step_s=now - self.t_prev,
                                elapsed_s=now - t_start, train_s=now - self.t_train,
                                reward=statistics.fmean(g.rewards),
                                pass_rate=statistics.fmean(g.all_pass), distinct=g.distinct,
                                grade_s=g.seconds))
            self.t_prev = now
            _, mean = first_at(rows, args.target, args.window)  # (a step at the target precedes it)
            if mean is not None and state.global_step >= mean.step + args.after_target:
                control.should_training_stop = True
            if args.max_steps and state.global_step >= args.max_steps:
                control.should_training_stop = True
            if args.max_seconds and now - t_start >= args.max_seconds:
                control.should_training_stop = True
            return control

        def on_log(self, args_: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kw: Any) -> None:
            if not rows or rows[-1].logs or not logs:
                return
            r = rows[-1]
            r.logs = {k: float(v) for k, v in logs.items() if isinstance(v, int | float)}
            mean10 = trailing_mean(rows, len(rows) - 1, args.window)
            say(f"step {r.step:4d}  reward {r.reward:.3f}  pass {r.pass_rate:.3f}  "
                f"{args.window}-step mean {'  -  ' if mean10 is None else f'{mean10:.3f}'}  "
                f"len {r.logs.get('completions/mean_length', float('nan')):5.1f}  "
                f"entropy {r.logs.get('entropy', float('nan')):.3f}  "
                f"graded {r.distinct:3d} in {r.grade_s:4.2f}s  "
                f"step {r.step_s:5.2f}s  {r.elapsed_s:7.1f}s")

    return StepTimer()


def check_prompts(tokenizer: Any, work: Workload, prompt_of: dict[str, list[dict[str, str]]]
                  ) -> int:
    """Every task's prompt ids as TRL makes them (apply_chat_template, tokenized) against
    rl360's renderer (what the session ledger sends the engine); returns the longest prompt."""
    from rl360.policies.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    longest = 0
    for task in work.tasks:
        ours = renderer.render(first_turn(task, work.env_params), None, True)
        theirs = tokenizer.apply_chat_template([prompt_of[task.id]], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"][0]
        if list(theirs) != ours:
            raise BenchError(f"task {task.id}: TRL's prompt ids differ from rl360's render")
        longest = max(longest, len(ours))
    return longest


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/cpu-demo.toml")
    p.add_argument("--model", default=None, help="the policy (default: the recipe's train.init)")
    p.add_argument("--target", type=float, default=0.90,
                   help="mean reward on the code tasks (the demo's target)")
    p.add_argument("--window", type=int, default=10, help="steps of the trailing mean")
    p.add_argument("--after-target", type=int, default=10,
                   help="stop this many steps after the first trailing-window mean at the target")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="learning rate (default 1e-3, the demo's best on-policy rate; 0: the recipe's)")
    p.add_argument("--max-steps", type=int, default=0, help="0: no cap")
    p.add_argument("--max-seconds", type=float, default=1200.0,
                   help="stop after the step that crosses it (counted from the bench's start)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="threads running grading subprocesses")
    p.add_argument("--out", default="runs/trl-grpo", help="TRL's output_dir and steps.jsonl")
    args = p.parse_args(argv)

    work = load_workload(args.recipe, args.model)
    rc = work.recipe
    tr, trainer_cfg, sampling = rc.train, rc.trainer, rc.train.sampling
    lr = args.lr or trainer_cfg.lr

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's gradient_checkpointing
    torch.manual_seed(rc.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(work.model_dir)
    model = AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=torch.float32)
    # the engine's stop tokens: the template's end of turn plus the other EOS ids it knows
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
            if t in tokenizer.get_vocab()]
    model.generation_config.eos_token_id = stop

    prompt_of = {t.id: [{"role": m.role, "content": m.content or ""}
                        for m in first_turn(t, work.env_params)] for t in work.tasks}
    longest_prompt = check_prompts(tokenizer, work, prompt_of)
    gpb = tr.groups_per_batch
    repeats = math.lcm(len(work.tasks), gpb) // len(work.tasks)
    rows_data = [{"prompt": prompt_of[t.id], "task_id": t.id}
                 for _ in range(repeats) for t in work.tasks]
    dataset = datasets.Dataset.from_list(rows_data)

    batch = gpb * tr.group_size
    micro = math.gcd(trainer_cfg.micro_batch_size, batch)
    loss = trainer_cfg.loss
    config = GRPOConfig(
        output_dir=str(ROOT / args.out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # one optimizer step per batch
        num_generations=tr.group_size,
        max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        learning_rate=lr,  # the optimizer and schedule are passed in (below)
        max_grad_norm=trainer_cfg.grad_clip,
        beta=loss.kl_coef,
        entropy_coef=loss.entropy_coef,
        epsilon=loss.eps_low,
        epsilon_high=loss.eps_high,
        num_iterations=1,
        loss_type="dapo",  # token mean over the whole batch = rl360's token-mean reducer
        scale_rewards="group" if trainer_cfg.advantage == "grpo" else "none",
        bf16=False,
        fp16=False,
        gradient_checkpointing=trainer_cfg.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.max_steps or 1_000_000,  # the callback stops the run
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=rc.run.seed,
        data_seed=rc.run.seed,
    )
    # rl360's optimizer and schedule (policies/trainer_torch.py): AdamW, lr x (s + 1) / warm-up
    # over the first steps, then constant. The stock "constant_with_warmup" starts at lr 0, so it
    # would reach full lr one step later.
    optimizer = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad], lr=lr,
        betas=trainer_cfg.betas, eps=trainer_cfg.adam_eps,
        weight_decay=trainer_cfg.weight_decay, foreach=True)
    warm = trainer_cfg.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    grader = Grader(work, args.workers)
    rows: list[StepRow] = []

    def say(line: str) -> None:
        print(line, flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    say(f"trl_grpo: TRL {trl.__version__} GRPOTrainer, transformers {transformers.__version__}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads, "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}), {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}")
    say(f"  policy {work.model_dir.relative_to(ROOT) if work.model_dir.is_relative_to(ROOT) else work.model_dir}"
        f": {type(model).__name__}, {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    say(f"  tasks: {len(work.tasks)} code tasks of {tr.tasks} x {repeats} = {len(dataset)} rows; "
        f"prompts up to {longest_prompt} tokens (equal to rl360's render: checked); system "
        f"prompt: {work.system_prompt!r}")
    say(f"  a step: {gpb} prompts x {tr.group_size} = {batch} completions, temperature "
        f"{sampling.temperature:g}, top_p {sampling.top_p:g}, top_k {sampling.top_k} (0 = off), "
        f"max {sampling.max_tokens} new tokens, stop ids {stop}")
    say(f"  training: lr {lr:g}, {warm} warm-up steps (lr/{warm} at step 1) then "
        f"constant, AdamW (weight decay {trainer_cfg.weight_decay:g}), grad clip "
        f"{trainer_cfg.grad_clip:g}, {batch // micro} micro-batches of {micro}, one optimizer "
        f"step per batch, beta {loss.kl_coef:g}, loss_type dapo, scale_rewards "
        f"{config.scale_rewards}")
    say(f"  reward: code env grading, {work.env_params or 'default params'}; bare python "
        f"subprocess per distinct (task, code) per step, {args.workers} threads")
    say(f"  target {args.target:g} (one step and trailing {args.window}-step mean); stop "
        f"{args.after_target} steps after the {args.window}-step mean reaches it, at "
        f"{args.max_steps or 'no'} step cap or {args.max_seconds:g}s")

    trl_trainer = GRPOTrainer(model=model, reward_funcs=grader, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              optimizers=(optimizer, schedule))
    trl_trainer.remove_callback(PrinterCallback)
    trl_trainer.add_callback(make_callback(grader, t_start, args, rows, say))
    t_setup = time.monotonic() - t_start
    say(f"set-up (imports, model, trainer) {t_setup:.1f}s")
    trl_trainer.train()
    grader.pool.shutdown()

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "steps.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r.__dict__) + "\n")
    single, mean = first_at(rows, args.target, args.window)
    median = statistics.median(r.step_s for r in rows) if rows else float("nan")
    median_late = (statistics.median(r.step_s for r in rows[2:]) if len(rows) > 2 else median)

    def at(r: StepRow | None) -> str:
        return "never" if r is None else (f"step {r.step}, {r.elapsed_s:.0f} s into the run "
                                          f"({r.train_s:.0f} s after the first step began)")

    say("")
    say(f"| | TRL {trl.__version__} GRPOTrainer (same settings as `make demo`) |")
    say("|---|---|")
    if rows:
        say(f"| mean reward at step 1 ({len(work.tasks)} code tasks, {gpb} prompts x "
            f"{tr.group_size}) | {rows[0].reward:.3f} |")
    say(f"| first step with mean reward >= {args.target:g} | {at(single)} |")
    say(f"| first {args.window}-step mean >= {args.target:g} | {at(mean)} |")
    say(f"| steps run | {len(rows)}, {median:.2f} s each (median; {median_late:.2f} s without the "
        f"first 2), set-up {t_setup:.1f} s; load {os.getloadavg()[0]:.2f} at the end |")
    if rows:
        say(f"| mean reward, last step / best | {rows[-1].reward:.3f} / "
            f"{max(r.reward for r in rows):.3f} |")
    result = {
        "bench": "trl_grpo",
        "s_per_step": round(median, 3),
        "first_step_at_target": single.step if single else None,
        "seconds_to_target": round(single.elapsed_s, 1) if single else None,
        "train_seconds_to_target": round(single.train_s, 1) if single else None,
        "first_window_mean_step": mean.step if mean else None,
        "seconds_to_window_mean": round(mean.elapsed_s, 1) if mean else None,
        "window": args.window,
        "target": args.target,
        "reward_step1": round(rows[0].reward, 4) if rows else None,
        "reward_last": round(rows[-1].reward, 4) if rows else None,
        "steps": len(rows),
        "setup_s": round(t_setup, 1),
        "load_end": round(os.getloadavg()[0], 2),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "loss_type": "dapo",
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
