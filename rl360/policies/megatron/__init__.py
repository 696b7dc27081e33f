"""The megatron-core trainer backend (`trainer.backend = "megatron"`).

- `convert`: HF <-> megatron-core state dicts for Llama- and Qwen2-family models (pure torch,
  no megatron import).
- `model`: a megatron-core `GPTModel` (local layer spec) built from an HF config, and the
  parallel state (TP/PP/CP/EP) it runs in.
- `cpu_shims`: the few patches that let megatron-core 0.16 run on a CPU-only machine.
- `trainer`: `MegatronTrainer`, the `TorchTrainer` interface over a `GPTModel`.

Only `model`, `cpu_shims` and `trainer` import megatron-core (the optional `megatron` extra).
"""
