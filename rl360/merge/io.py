"""Streaming access to HF-format safetensors checkpoints: read one tensor at a time, write
output shards tensor by tensor.

A checkpoint directory holds `model.safetensors.index.json` plus its shards, or a single
`model.safetensors`. Reading parses each shard's header once and then reads a tensor's bytes
straight into a fresh tensor (`pread`), so nothing but the tensors in use stays resident (an
mmap, as `safe_open` uses, leaves every page it touched in the process RSS until it closes);
`reader="safetensors"` reads through `safetensors.safe_open` instead, for comparison. Writing
knows every shard's header up front (names, dtypes and shapes come from the plan), writes it
first, then appends each tensor's bytes as it is produced.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl360.merge.errors import MergeError

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
            "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}  # fmt: skip
FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
NAME_OF = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def torch_dtype(code: str) -> torch.dtype:
    import torch

    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
             "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
             "BOOL": torch.bool}  # fmt: skip
    return table[code]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header dict, byte offset of the data section) of one safetensors file."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MergeError(f"{path}: not a readable safetensors file ({e})") from None
    return header, 8 + n


class Checkpoint:
    """An HF model directory, read one tensor at a time."""

    def __init__(self, path: str | Path, label: str = "checkpoint", reader: str = "pread") -> None:
        self.path = Path(path)
        self.label = label
        self.reader = reader
        self._fds: dict[str, int] = {}
        self._handles: dict[str, Any] = {}
        if not self.path.is_dir():
            raise MergeError(f"{label} {self.path}: not a directory")
        if (self.path / INDEX).is_file():
            try:
                weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise MergeError(f"{label} {self.path / INDEX}: bad index ({e})") from None
            files = list(dict.fromkeys(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise MergeError(f"{label} {self.path}: no {INDEX} or {SINGLE}")
        self.infos: dict[str, TensorInfo] = {}
        for file in files:
            fpath = self.path / file
            if not fpath.is_file():
                raise MergeError(
                    f"{label} {self.path}: shard {file} listed in the index is missing"
                )
            header, data = read_header(fpath)
            entries = sorted(
                ((k, v) for k, v in header.items() if k != "__metadata__"),
                key=lambda kv: kv[1]["data_offsets"][0],
            )
            for name, meta in entries:
                if weight_map is not None and weight_map.get(name) != file:
                    continue
                start, end = meta["data_offsets"]
                self.infos[name] = TensorInfo(
                    name, meta["dtype"], tuple(meta["shape"]), file, data + start, end - start
                )
        if weight_map is not None and (missing := set(weight_map) - set(self.infos)):
            raise MergeError(
                f"{label} {self.path}: tensor {sorted(missing)[0]} is in the index but not in its shard"
            )

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name` as stored (its own dtype), in a fresh buffer or in the first bytes
        of `out` (a 1-D uint8 tensor at least that large, reused by the caller)."""
        import torch

        info = self.infos[name]
        if self.reader == "safetensors":
            value = self._safe_open(info.file).get_tensor(name)
            if out is None:
                return value
            return out[: info.nbytes].view(value.dtype).view(value.shape).copy_(value)
        buf = torch.empty(info.nbytes, dtype=torch.uint8) if out is None else out[: info.nbytes]
        self.read_bytes(name, 0, buf.numpy())
        return buf.view(torch_dtype(info.dtype)).reshape(info.shape)

    def read_bytes(self, name: str, start: int, out: Any) -> None:
        """Bytes [start, start + len(out)) of tensor `name`'s data into the writable buffer
        `out` (pread: releases the GIL, so a reader thread overlaps it with compute)."""
        info = self.infos[name]
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(self.path / info.file, os.O_RDONLY)
        view, done = memoryview(out).cast("B"), 0
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], info.offset + start + done)
            if got <= 0:
                raise MergeError(
                    f"{self.label} {self.path / info.file}: truncated at tensor {name}"
                )
            done += got

    def _safe_open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles.clear()  # one open mmap per checkpoint at a time
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._handles.clear()


class ShardWriter:
    """Writes one safetensors file whose entries (name, dtype code, shape) are known up front."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        pos = 0
        self._expect: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, code, shape in entries:
            n = ITEMSIZE[code]
            for s in shape:
                n *= s
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
            self._expect.append((name, code, shape, n))
            pos += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = path
        self.size = 8 + len(blob) + pos
        self._next = 0
        self._f = path.open("wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor whole."""
        want, _, shape, _ = self._expect[self._next]
        if tuple(tensor.shape) != shape:
            raise RuntimeError(f"{self.path.name}: {want} should have shape {list(shape)}")
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write the next tensor as consecutive pieces of its flattened data."""
        import torch

        want, code, _, n = self._expect[self._next]
        if name != want:
            raise RuntimeError(f"{self.path.name}: expected {want} next, got {name}")
        dtype, done = torch_dtype(code), 0
        for part in parts:
            if part.dtype != dtype:
                raise RuntimeError(f"{self.path.name}: {name} should be {code}, got {part.dtype}")
            data = part.contiguous().reshape(-1).view(torch.uint8).numpy()
            self._f.write(memoryview(data))
            done += data.nbytes
        if done != n:
            raise RuntimeError(f"{self.path.name}: {name} got {done} bytes, expected {n}")
        self._next += 1

    def abort(self) -> None:
        """Close and delete a shard left incomplete by an error."""
        self._f.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._f.close()
        if self._next != len(self._expect):
            raise RuntimeError(
                f"{self.path.name}: {len(self._expect) - self._next} tensors never written"
            )


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".ckpt")


def copy_side_files(base: Path, out_dir: Path, out_dtype: str | None) -> list[str]:
    """Copy config, tokenizer and other non-weight files of the base; set config.json's dtype
    to the output dtype when every float tensor of the output has that one dtype."""

    copied = []
    for src in sorted(base.iterdir()):
        if not src.is_file() or src.name.endswith(WEIGHT_SUFFIXES) or src.name == INDEX:
            continue
        if src.name == "config.json" and out_dtype is not None:
            cfg = json.loads(src.read_text())
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = out_dtype
            (out_dir / src.name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src, out_dir / src.name)
        copied.append(src.name)
    return copied
