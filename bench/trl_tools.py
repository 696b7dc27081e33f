"""The peer baseline of the real-model tool-use run: TRL's `GRPOTrainer` (CPU, no vLLM) trains
SmolLM2-135M-Instruct on the same Harbor tool tasks, from the same warm start, with the
settings of recipes/smollm2-tools.toml, multi-turn, with a real bash tool.

What TRL 1.16 can run: multi-turn tool use. `GRPOTrainer(environment_factory=...)` gives every
rollout its own environment instance, whose public methods are the tools: the trainer samples a
turn, parses its tool calls, runs them, appends the results as tool messages (concatenating token
ids, no re-tokenization) and samples the next turn, up to `max_tool_calling_iterations`; tool
tokens are masked out of the loss. So no single-turn stand-in is needed: TRL runs the families
themselves. What it does not ship is a parser for SmolLM2's call syntax (`add_response_schema`
knows Qwen, Llama 3, GLM, GPT-OSS, Gemma 4 ...), so the bench gives the tokenizer RL360's own
parser (`ChatRenderer.parse_assistant`: the `<tool_call>[...]</tool_call>` list, a bare object,
several spans) and both sides accept exactly the same calls.

The workload, read from the recipe (`--recipe`, default recipes/smollm2-tools.toml):
  - policy: `train.init` (the generic tool-format warm start `rl360 sft` writes); `--model`
    overrides it (e.g. `smollm2`, the released model, for a dry run before the warm start exists)
  - tasks: the Harbor tasks of `train.tasks` (examples/tool_tasks/generate.py writes them), one
    dataset row each; TRL's sampler draws `train.groups_per_batch` of them per step and samples
    `train.group_size` rollouts of each
  - a prompt is what RL360's Harbor env sends: the recipe's system prompt ({workdir} = the task's
    work dir, /app), the task's instruction, and the `bash` tool's spec exactly as RL360 sends it,
    rendered by the recipe's chat template (`model.chat_template`). TRL would derive the tool's
    schema from the Python method's docstring; the bench hands TRL RL360's spec instead and checks
    that TRL's prompt ids equal RL360's renderer's for every task
  - turns: `train.sampling.max_tokens` new tokens per turn (`generation_kwargs`), at most
    `env.max_turns` turns (TRL's `max_tool_calling_iterations` = max_turns - 1); TRL's
    `max_completion_length` bounds all turns plus the tool results together, set to
    `model.max_model_len` minus the longest prompt (RL360's context bound); temperature / top_p /
    top_k from `train.sampling`; a turn ends at <|im_end|> or <|endoftext|> (the engine's stops)
  - the bash tool: each rollout gets a fresh temporary copy of the task's environment/files/,
    bound at the task's work dir (/app) in a bubblewrap sandbox per command (no network, its own
    pid namespace, read-only system dirs, a private /tmp, /bin/sh -c as RL360 runs it; CPU seconds
    and file size capped by rlimits, the wall time by `env.limits.timeout`): a plain subprocess in
    a namespace, not RL360's sandbox (no cgroup memory cap, no warm exec server, no clean room).
    Arguments are checked and results formatted by RL360's own tool code (rl360.envs.tools: exit
    code, [stderr], the head/tail clip at `max_output_chars`), so the model reads the same text.
    TRL runs the rollouts' tool calls one after another (RL360's env actors run them
    concurrently); RL360's stop after `env.max_consecutive_tool_failures` failing calls has no
    TRL counterpart
  - reward: the task's own verifier (tests/test.sh -> check.py against tests/expected.json), run
    after the last turn in the same kind of sandbox with the episode's work dir at /app, tests/
    at /tests and a fresh /logs; reward = /logs/verifier/reward.txt (none written: 0), graded on
    `--workers` threads
  - training: G = `train.group_size`, `train.groups_per_batch` groups per optimizer step, lr and
    warm-up from `[trainer]` (rl360's schedule: lr x step / warmup_steps, then constant), AdamW with
    `[trainer]`'s betas, eps, weight decay and grad clip, micro-batches of
    `trainer.micro_batch_size`, beta = `trainer.loss.kl_coef`, loss_type "dapo" (token mean over
    the batch: rl360's token-mean reducer), GRPO advantages; `[trainer.lora]` maps to a peft
    LoraConfig (rank, alpha, dropout, target modules; the adapters alone train), without it every
    weight trains, as in the recipe; fp32 (bf16 autocast when `trainer.dtype` is bfloat16); torch
    threads `--threads` (2)
  - not mapped: `train.filter_zero_variance` and `train.oversampling` (RL360 drops a group whose
    rewards are all equal and samples another, so each step trains on groups with signal; TRL
    1.16 has no such filter: such a group stays in the batch with zero advantage, its tokens in
    the token mean; `zero_variance_frac` in metrics.jsonl is their share of the step), and
    RL360's asynchrony (`train.max_staleness`): TRL samples, then trains, one after the other

Per step it prints and appends to <out>/metrics.jsonl (the keys `rl360 plot` reads: step,
elapsed_s = seconds since the bench started, imports, model load and TRL's set-up included,
reward_mean) the pass rate, turns and tool calls per episode, the share ending with a final
answer, and where the step's seconds went (generation with tool calls, grading, training). At the
end it saves the policy (a LoRA adapter merged into its base) as a model dir, <out>/model, and
runs RL360's held-out evaluation on it, `rl360 eval <recipe> --model <out>/model` (main venv,
run name = <out>'s name, so eval_summary.json lands beside metrics.jsonl), the same measurement
as RL360's own before/after figures.

    make bench-trl-tools                  # venvs, tasks and warm start if missing; then this
    .venv-trl/bin/python bench/trl_tools.py --max-steps 2 --no-eval     # a short check
    .venv/bin/rl360 plot runs/smollm2-tools runs/trl-tools-s0 --labels RL360,TRL \\
        --out runs/trl-tools-s0/reward_vs_time.png                       # both on one plot

Last line: {"bench": "trl_tools", "steps": ..., "s_per_step": ..., "heldout_pass@1": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trl_tools_env import (  # noqa: E402
    FILE_CAP_MB,
    BashEpisode,
    EpisodeLimits,
    Verifier,
    bwrap_unavailable,
    use_rl360_parser,
)

from rl360.envs.registry import params_for  # noqa: E402
from rl360.envs.tasks import iter_tasks  # noqa: E402
from rl360.envs.tools import BUILTIN_TOOLS  # noqa: E402
from rl360.recipe import LoraSection, Recipe, load  # noqa: E402
from rl360.types import Message, Task  # noqa: E402


class BenchError(RuntimeError):
    """The recipe asks for something this baseline cannot run the same way."""


@dataclass
class Workload:
    recipe: Recipe
    model_dir: Path
    tasks: list[Task]
    system_prompt: str | None
    max_output_chars: int
    tool_spec: dict[str, Any]  # the bash tool as RL360's renderer hands it to the template
    lora: LoraSection | None


def load_workload(recipe_path: str, model: str | None, overrides: list[str]) -> Workload:
    from rl360.policies.loading import resolve_model_path

    try:
        recipe = load(recipe_path, Recipe, overrides)
    except (OSError, ValueError) as e:
        raise BenchError(f"recipe {recipe_path}: {e}") from None
    tr, trainer = recipe.train, recipe.trainer
    if trainer.minibatches != 1 or trainer.epochs != 1:
        raise BenchError("the bench runs one optimizer step per batch (trainer.minibatches = "
                         "trainer.epochs = 1)")
    if trainer.loss.name != "ppo" or trainer.loss.reducer != "token-mean":
        raise BenchError("the bench maps trainer.loss = ppo with the token-mean reducer only")
    if trainer.advantage not in ("grpo", "drgrpo"):
        raise BenchError(f"trainer.advantage {trainer.advantage!r}: only grpo / drgrpo map to TRL")
    if recipe.env.env not in ("", "harbor") or recipe.env.agent_fn:
        raise BenchError("the bench runs the built-in agent loop on the harbor env only")
    params = params_for(recipe.env.env, recipe.env.params, "harbor")
    unknown = sorted(set(params) - {"system_prompt", "tools", "max_output_chars"})
    if unknown:
        raise BenchError(f"env.params.harbor {unknown}: the bench maps system_prompt, tools and "
                         f"max_output_chars only")
    if list(params.get("tools") or ["bash"]) != ["bash"]:
        raise BenchError(f"env.params.harbor.tools = {params['tools']}: the bench has bash only")
    tasks = [t for p in tr.tasks for t in iter_tasks(ROOT / p) if t.kind == "harbor"]
    if not tasks:
        raise BenchError(f"no Harbor tasks in train.tasks {tr.tasks} (write them with "
                         f"python examples/tool_tasks/generate.py --out runs/tool-tasks)")
    for t in tasks:
        if t.data.get("docker_image") or t.data.get("has_dockerfile"):
            raise BenchError(f"task {t.id}: needs its own container image")
    name = model or tr.init or recipe.model.path
    local = ROOT / name
    try:
        model_dir = local if (local / "config.json").is_file() else resolve_model_path(name)
    except Exception as e:  # ModelNotFound and friends: one line, naming the model
        raise BenchError(f"{e} (make the warm start first: .venv/bin/rl360 sft {recipe_path})"
                         ) from None
    spec = BUILTIN_TOOLS["bash"].spec
    tool_spec = {"type": spec.type, "function": {"name": spec.function.name,
                                                 "description": spec.function.description,
                                                 "parameters": spec.function.parameters}}
    from rl360.envs.harbor import SYSTEM_PROMPT

    lora = trainer.lora if trainer.lora is not None and trainer.lora.enabled else None
    return Workload(recipe, Path(model_dir), tasks, params.get("system_prompt", SYSTEM_PROMPT),
                    int(params.get("max_output_chars", 8000)), tool_spec, lora)


def first_turn(task: Task, work: Workload) -> list[dict[str, str]]:
    """The messages RL360's Harbor env sends for the task's first turn (HarborEnv.setup)."""
    msgs = []
    if work.system_prompt:
        workdir = str(task.data.get("workdir") or "/app")
        msgs.append({"role": "system", "content": work.system_prompt.format(workdir=workdir)})
    msgs.append({"role": "user", "content": task.prompt})
    return msgs


# ----------------------------------------------------------------------------- logging


@dataclass
class StepRow:
    step: int
    elapsed_s: float
    step_s: float
    reward_mean: float
    pass_rate: float
    turns_mean: float
    tool_calls_mean: float
    final_answer_rate: float
    rollout_s: float  # generation with the tool calls, up to the grading
    verify_s: float
    train_s: float  # after grading: the loss, backward and optimizer step
    logs: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "logs"}
        for src, dst in (("completions/mean_length", "completion_tokens_mean"),
                         ("completions/clipped_ratio", "clipped_ratio"), ("loss", "loss"),
                         ("frac_reward_zero_std", "zero_variance_frac"),
                         ("grad_norm", "grad_norm"), ("entropy", "entropy"),
                         ("learning_rate", "lr")):
            if src in self.logs:
                d[dst] = self.logs[src]
        return d


def make_callback(verifier: Verifier, t_start: float, args: argparse.Namespace,
                  rows: list[StepRow], metrics: Path, say: Callable[[str], None]) -> Any:
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t_step = 0.0
            self.pending: StepRow | None = None

        def on_step_begin(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t_step = time.monotonic()

        def on_step_end(self, args_: Any, state: Any, control: Any, **kw: Any) -> Any:
            now = time.monotonic()
            b = verifier.last
            assert b is not None
            n = len(b.rewards)
            self.pending = StepRow(
                step=state.global_step, elapsed_s=now - t_start, step_s=now - self.t_step,
                reward_mean=statistics.fmean(b.rewards),
                pass_rate=sum(r >= 1.0 for r in b.rewards) / n,
                turns_mean=statistics.fmean(b.turns), tool_calls_mean=statistics.fmean(b.tool_calls),
                final_answer_rate=sum(b.final_answer) / n,
                rollout_s=max(0.0, b.t_begin - self.t_step), verify_s=b.t_end - b.t_begin,
                train_s=now - b.t_end)
            if args.max_steps and state.global_step >= args.max_steps:
                control.should_training_stop = True
            if args.max_seconds and now - t_start >= args.max_seconds:
                control.should_training_stop = True
            return control

        def on_log(self, args_: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kw: Any) -> None:
            r, self.pending = self.pending, None
            if r is None:
                return
            r.logs = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
            rows.append(r)
            with open(metrics, "a") as f:
                f.write(json.dumps(r.record()) + "\n")
            say(f"step {r.step:4d}  reward {r.reward_mean:.3f}  pass {r.pass_rate:.3f}  "
                f"turns {r.turns_mean:.2f}  calls {r.tool_calls_mean:.2f}  "
                f"final {r.final_answer_rate:.2f}  "
                f"tokens {r.logs.get('completions/mean_length', float('nan')):5.1f}  "
                f"rollout {r.rollout_s:6.1f}s  verify {r.verify_s:4.1f}s  "
                f"train {r.train_s:6.1f}s  step {r.step_s:6.1f}s  {r.elapsed_s:7.1f}s")

    return StepLog()


def shown(path: Path) -> Path:
    """`path` relative to the repository where it lies inside it, else as given."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def rl360_prompts(rows: list[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """Every row's first prompt as RL360's renderer makes it (what its engine is sent)."""
    from rl360.policies.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    tools = [BUILTIN_TOOLS["bash"].spec]
    return [renderer.render([Message(role=m["role"], content=m["content"]) for m in r["prompt"]],
                            tools, True) for r in rows]


def longest_prompt(rows: list[dict[str, Any]], tokenizer: Any) -> int:
    return max(len(ids) for ids in rl360_prompts(rows, tokenizer))


def check_prompts(trainer: Any, rows: list[dict[str, Any]], tokenizer: Any) -> int:
    """TRL's prompt ids (its own `_tokenize_prompts`, with the tool list it renders) against
    RL360's renderer for every task; returns the longest prompt."""
    trainer._batch_environments = [None] * len(rows)
    theirs, _, _ = trainer._tokenize_prompts([r["prompt"] for r in rows])
    for row, ids, ours in zip(rows, theirs, rl360_prompts(rows, tokenizer), strict=True):
        if list(ids) != ours:
            raise BenchError(f"task {row['task_id']}: TRL's prompt ids differ from RL360's render")
    return max(len(ids) for ids in theirs)


def save_policy(trainer: Any, work: Workload, out: Path) -> Path:
    """The trained policy as a plain model dir (a LoRA adapter saved beside it, then merged into
    its base), with the start's tokenizer files."""
    model = trainer.model
    if work.lora is not None:
        model.save_pretrained(out / "adapter")
        model = model.merge_and_unload()
    dest = out / "model"
    if dest.exists():
        shutil.rmtree(dest)
    model.save_pretrained(dest, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json"):
        if (work.model_dir / name).is_file():
            shutil.copyfile(work.model_dir / name, dest / name)
    return dest


def run_eval(rl360: Path, recipe: str, overrides: list[str], model: Path, out: Path,
             say: Callable[[str], None]) -> dict[str, Any] | None:
    """`rl360 eval <recipe> --model <model>` into <out>/eval_summary.json; its overall row."""
    sets = [*overrides, f"run.name={out.name}", f"run.out_dir={out.parent}"]
    cmd = [str(rl360), "eval", recipe, "--model", str(model),
           *(a for kv in sets for a in ("--set", kv))]
    say(f"held-out eval: {' '.join(cmd)}")
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc != 0:
        say(f"rl360 eval exited {rc}")
        return None
    summary = json.loads((out / "eval_summary.json").read_text())
    return {**summary["overall"], "eval_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/smollm2-tools.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, as rl360 --set (passed to the eval too)")
    p.add_argument("--model", default=None,
                   help="the policy (default: the recipe's train.init); a dir or 'smollm2'")
    p.add_argument("--seed", type=int, default=None, help="default: the recipe's run.seed")
    p.add_argument("--max-steps", type=int, default=0, help="default: the recipe's train.steps")
    p.add_argument("--max-seconds", type=float, default=-1.0,
                   help="stop after the step that crosses it, counted from the bench's start "
                        "(default: the recipe's train.max_minutes; 0: no limit)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--workers", type=int, default=2, help="threads running the verifiers")
    p.add_argument("--out", default=None, help="default: runs/trl-tools-s<seed>")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out rl360 eval")
    p.add_argument("--rl360", default=str(ROOT / ".venv" / "bin" / "rl360"),
                   help="the rl360 command that runs the held-out eval")
    args = p.parse_args(argv)

    why = bwrap_unavailable()
    if why:
        raise BenchError(f"the bash tool and the verifier run in bubblewrap: {why}")
    work = load_workload(args.recipe, args.model, args.overrides)
    rc = work.recipe
    tr, trainer_cfg, sampling, env_cfg = rc.train, rc.trainer, rc.train.sampling, rc.env
    seed = rc.run.seed if args.seed is None else args.seed
    args.max_steps = args.max_steps or tr.steps
    if args.max_seconds < 0:
        args.max_seconds = tr.max_minutes * 60
    out = ROOT / (args.out or f"runs/trl-tools-s{seed}")
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.write_text("")

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's notice
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl360.policies.loading import load_tokenizer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(str(work.model_dir), rc.model.chat_template)
    use_rl360_parser(tokenizer)
    dtype = torch.float32
    model = AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=dtype)
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
            if t in tokenizer.get_vocab()]
    stop += [i for i in sampling.stop_token_ids if i not in stop]  # the recipe's extra stops
    model.generation_config.eos_token_id = stop
    lora = work.lora
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.targets), task_type="CAUSAL_LM"))

    BashEpisode.limits = EpisodeLimits(
        exec_timeout_s=env_cfg.limits.timeout, cpu_s=env_cfg.limits.cpu_seconds,
        max_output_chars=work.max_output_chars,
        max_tool_output_chars=env_cfg.max_tool_output_chars,
        tool_spec=BUILTIN_TOOLS["bash"].spec)
    rows_data = [{"prompt": first_turn(t, work), "task_id": t.id, "task_dir": t.data["path"],
                  "workdir": str(t.data.get("workdir") or "/app"),
                  "storage_mb": int(t.data.get("storage_mb") or FILE_CAP_MB)}
                 for t in work.tasks]
    dataset = datasets.Dataset.from_list(rows_data)
    timeout_of = {t.id: min(env_cfg.verify_timeout_s, t.data.get("verifier_timeout_sec") or 600.0)
                  for t in work.tasks}
    verifier = Verifier(timeout_of, stop, args.workers)

    gpb, g = tr.groups_per_batch, tr.group_size
    batch = gpb * g
    micro = math.gcd(trainer_cfg.micro_batch_size, batch)
    loss = trainer_cfg.loss
    max_len = rc.model.max_model_len
    longest = longest_prompt(rows_data, tokenizer)
    if longest + sampling.max_tokens > max_len:
        raise BenchError(f"a prompt of {longest} tokens leaves no room for a turn of "
                         f"{sampling.max_tokens} tokens in model.max_model_len {max_len}")
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # one optimizer step per gpb x G rollouts
        num_generations=g,
        max_completion_length=max_len - longest,  # all turns + tool results, after the prompt
        max_tool_calling_iterations=env_cfg.max_turns - 1,
        generation_kwargs={"max_new_tokens": sampling.max_tokens},  # per turn
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        learning_rate=trainer_cfg.lr,
        max_grad_norm=trainer_cfg.grad_clip,
        beta=loss.kl_coef,
        entropy_coef=loss.entropy_coef,
        epsilon=loss.eps_low,
        epsilon_high=loss.eps_high,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group" if trainer_cfg.advantage == "grpo" else "none",
        bf16=trainer_cfg.dtype == "bfloat16",
        fp16=False,
        gradient_checkpointing=trainer_cfg.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
    )
    # rl360's optimizer and schedule (policies/trainer_torch.py): AdamW over the trainable
    # weights (the adapters alone with LoRA), lr x (s + 1) / warm-up, then constant
    optimizer = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad], lr=trainer_cfg.lr,
        betas=trainer_cfg.betas, eps=trainer_cfg.adam_eps,
        weight_decay=trainer_cfg.weight_decay, foreach=True)
    warm = trainer_cfg.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    trl_trainer = GRPOTrainer(model=model, reward_funcs=verifier, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              optimizers=(optimizer, schedule), environment_factory=BashEpisode)
    # RL360's bash spec in the prompt instead of one TRL derives from the method's docstring
    # (TRL 1.16 keeps the per-environment tool list in `_env_tools`; checked just below)
    if not isinstance(getattr(trl_trainer, "_env_tools", None), dict):
        raise BenchError(f"TRL {trl.__version__}: no _env_tools; the bench is written for 1.16")
    trl_trainer._env_tools = {None: [work.tool_spec]}
    if check_prompts(trl_trainer, rows_data, tokenizer) != longest:
        raise BenchError("the longest prompt differs between TRL and RL360")
    trl_trainer.remove_callback(PrinterCallback)
    rows: list[StepRow] = []

    def say(line: str) -> None:
        print(line, flush=True)

    trl_trainer.add_callback(make_callback(verifier, t_start, args, rows, metrics, say))
    n_params = sum(q.numel() for q in model.parameters())
    n_train = sum(q.numel() for q in model.parameters() if q.requires_grad)
    families = sorted({str(t.data.get("domain")) for t in work.tasks})
    rel = shown(work.model_dir)
    say(f"trl_tools: TRL {trl.__version__} GRPOTrainer (environment_factory, multi-turn), "
        f"transformers {transformers.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, {'cuda' if torch.cuda.is_available() else 'cpu'}), "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    say(f"  policy {rel}: {type(model).__name__}, {n_params / 1e6:.1f}M parameters, "
        f"{n_train / 1e6:.2f}M trained ("
        + (f"LoRA rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, targets "
           f"{','.join(lora.targets)}" if lora else "every weight") + ")")
    say(f"  tasks: {len(work.tasks)} Harbor tasks of {tr.tasks} ({len(families)} families); "
        f"prompts up to {longest} tokens (equal to RL360's render: checked); chat template "
        f"{rc.model.chat_template}; tool bash (RL360's spec), parser RL360's")
    say(f"  a step: {gpb} tasks x G {g} = {batch} episodes, <= {env_cfg.max_turns} turns of "
        f"<= {sampling.max_tokens} tokens, <= {max_len - longest} tokens after the prompt "
        f"(turns + tool results, max_model_len {max_len}), temperature "
        f"{sampling.temperature:g}, top_p {sampling.top_p:g}, top_k {sampling.top_k}, "
        f"stop ids {stop}")
    say(f"  training: lr {trainer_cfg.lr:g}, {warm} warm-up steps then constant, AdamW, grad "
        f"clip {trainer_cfg.grad_clip:g}, {batch // micro} micro-batches of {micro}, beta "
        f"{loss.kl_coef:g}, loss_type dapo, scale_rewards {config.scale_rewards}, "
        f"{'bf16 autocast' if config.bf16 else 'fp32'}, seed {seed}")
    if tr.filter_zero_variance:
        say("  not mapped: train.filter_zero_variance (TRL 1.16 has no such filter: a group whose "
            "rewards are all equal stays in the batch with zero advantage, its tokens in the "
            "token mean)" + (" and train.oversampling (RL360 samples more groups to keep "
                             f"{gpb} with signal a step)" if tr.oversampling else ""))
    say(f"  sandbox: bwrap per command at the task's work dir, {env_cfg.limits.timeout:g}s a "
        f"command, tool output clipped at {work.max_output_chars} chars; verifier: the task's "
        f"tests/test.sh, {args.workers} threads")
    say(f"  stop at step {args.max_steps} or after {args.max_seconds:g}s (0: none); out {out}")
    t_setup = time.monotonic() - t_start
    say(f"set-up (imports, model, trainer) {t_setup:.1f}s")
    # a kill ends the run through the `finally` below, so the episodes' temp dirs go too
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        trl_trainer.train()
    finally:
        verifier.pool.shutdown()
        for envs in getattr(trl_trainer, "_environment_pool", {}).values():
            for e in envs:
                e._cleanup()
    t_train = time.monotonic() - t_start
    model_dir = save_policy(trl_trainer, work, out)
    say(f"saved the policy to {model_dir}")
    heldout = None if args.no_eval else run_eval(Path(args.rl360), args.recipe, args.overrides,
                                                 model_dir, out, say)

    median = statistics.median(r.step_s for r in rows) if rows else float("nan")
    last = rows[-10:]
    result = {
        "bench": "trl_tools",
        "steps": len(rows),
        "s_per_step": round(median, 2),
        "setup_s": round(t_setup, 1),
        "train_end_s": round(t_train, 1),
        "reward_step1": round(rows[0].reward_mean, 4) if rows else None,
        "reward_last10": round(statistics.fmean(r.reward_mean for r in last), 4) if rows else None,
        "heldout_pass@1": None if heldout is None else round(heldout["pass@1"], 4),
        "heldout_mean_reward": None if heldout is None else round(heldout["mean_reward"], 4),
        "heldout_episodes": None if heldout is None else heldout["episodes"],
        "model": str(rel),
        "tasks": len(work.tasks),
        "group_size": g,
        "groups_per_batch": gpb,
        "lr": trainer_cfg.lr,
        "lora_rank": lora.rank if lora else None,
        "max_tokens": sampling.max_tokens,
        "max_turns": env_cfg.max_turns,
        "threads": args.threads,
        "seed": seed,
        "metrics": str(shown(metrics)),
        "load_end": round(os.getloadavg()[0], 2),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"trl_tools: {e}", file=sys.stderr)
        sys.exit(2)
