"""Helpers for the merge tests: the spec's shared vectors and small HF-style safetensors
checkpoints written with the official safetensors writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TAUS = [
    [0.4, 0.0, 0.0, 0.2, 0.0, -0.1],
    [0.2, 0.3, 5e-6, -0.6, 0.0, 0.0],
    [0.0, 0.0, 0.1, 0.1, 0.05, 0.0],
]


def write_checkpoint(
    path: Path, tensors: dict[str, torch.Tensor], shards: int = 1, config: dict | None = None
) -> Path:
    """Save `tensors` as model.safetensors (shards=1) or as `shards` files plus an index,
    with the official safetensors writer, and a config.json / tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(
                {k: tensors[k].contiguous() for k in part}, str(path / file), {"format": "pt"}
            )
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = {"model_type": "toy", "torch_dtype": "bfloat16"} if config is None else config
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 8}')
    return path
