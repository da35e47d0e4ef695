"""Safetensors files, memory-mapped and read one tensor at a time (never ``torch.load``).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON naming
each tensor's dtype, shape and ``[begin, end)`` byte range in the data that follows, then the
data::

    | N (u64) | {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]}, ...} | data ... |
                                                                                          ^ offsets count from here

A sharded checkpoint adds ``model.safetensors.index.json`` (``weight_map``: tensor -> file).

:class:`SafetensorsCheckpoint` parses only the headers up front. :meth:`~SafetensorsCheckpoint.tensor`
is a view of the mapped file: nothing is read until the view is, and a slice of it (a
tensor-parallel rank's rows) reads only the pages the slice covers. After the model has copied a
tensor (into its own dtype), :meth:`~SafetensorsCheckpoint.release` drops the mapped pages of its
byte range (``madvise(MADV_DONTNEED)``: they stay in the page cache, but leave this process's
resident set). So loading holds the model plus about one tensor in host memory, not the model
plus the file.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable

import torch

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["INDEX_FILE", "SINGLE_FILE", "SafetensorsCheckpoint", "TensorEntry"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20  # the format's own limit on a header's size

#: safetensors dtype names -> torch (floating weights: anything else is refused when read)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype name, shape and absolute ``[begin, end)`` byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsCheckpoint:
    """The tensors of ``files`` (one, or the shards an index names), read lazily from mapped files.

    A :class:`~tensorrt_llm._torch.models.modeling_llama.WeightSource`. ``close()`` (or the
    ``with`` block) unmaps the files; views handed out must be dropped before.
    """

    def __init__(self, files: Iterable[Path], *, index: dict[str, str] | None = None, source: str = "") -> None:
        self.source = source
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in _read_header(file).items():
                if name in self.entries:
                    raise CheckpointError(f"{file.name}: tensor {name} is also in {self.entries[name].file.name}")
                self.entries[name] = entry
        if index is not None:
            for name, file_name in index.items():
                entry = self.entries.get(name)
                if entry is None:
                    raise CheckpointError(f"{INDEX_FILE}: tensor {name} is in no shard (the index says {file_name})")
                if entry.file.name != file_name:
                    raise CheckpointError(f"{INDEX_FILE}: tensor {name} is in {entry.file.name}, the index says {file_name}")
        self._maps: dict[Path, mmap.mmap] = {}
        self._page = mmap.PAGESIZE

    @classmethod
    def from_directory(cls, directory: Path) -> SafetensorsCheckpoint:
        """The checkpoint's weights: ``model.safetensors``, or the shards ``model.safetensors.index.json``
        names. CheckpointError if neither is there (saying what was there instead)."""
        index_path = directory / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: not a safetensors index ({error!r})") from error
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
            names = sorted(set(weight_map.values()))
            for name in names:
                if Path(name).name != name or name in (".", ".."):
                    raise CheckpointError(f"{index_path}: shard {name!r} is not a file name in the checkpoint's directory")
                if not (directory / name).is_file():
                    raise CheckpointError(f"{index_path}: shard {name} is missing from {directory}")
            return cls([directory / name for name in names], index=weight_map, source=str(directory))
        single = directory / SINGLE_FILE
        if single.is_file():
            return cls([single], source=str(directory))
        raise CheckpointError(_no_weights_message(directory))

    # ---- WeightSource ------------------------------------------------------------------------

    def names(self) -> Collection[str]:
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the mapped bytes of ``name`` (read on first touch)."""
        entry = self.entries[name]
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{entry.file.name}: tensor {name} is stored as {entry.dtype}; weights must be one of"
                                  f" {', '.join(DTYPES)}")
        count = entry.end - entry.begin
        if count == 0:
            return torch.empty(entry.shape, dtype=dtype)
        mapped = self._map(entry.file)
        start, length = self._pages(entry)
        mapped.madvise(mmap.MADV_WILLNEED, start, length)  # read ahead: one large read, not a fault per page
        flat = torch.frombuffer(mapped, dtype=dtype, count=count // dtype.itemsize, offset=entry.begin)
        return flat.view(entry.shape)

    def release(self, name: str) -> None:
        """Drop the mapped pages of ``name`` from this process (they stay in the page cache)."""
        entry = self.entries[name]
        mapped = self._maps.get(entry.file)
        if mapped is not None and entry.end > entry.begin:
            start, length = self._pages(entry)
            mapped.madvise(mmap.MADV_DONTNEED, start, length)

    # ---- files -------------------------------------------------------------------------------

    @property
    def files(self) -> list[Path]:
        return sorted({entry.file for entry in self.entries.values()})

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data on disk (headers excluded)."""
        return sum(entry.end - entry.begin for entry in self.entries.values())

    def _map(self, file: Path) -> mmap.mmap:
        mapped = self._maps.get(file)
        if mapped is None:
            with open(file, "rb") as handle:
                # copy-on-write: a writable buffer for torch.frombuffer; nothing is ever written
                mapped = self._maps[file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        return mapped

    def _pages(self, entry: TensorEntry) -> tuple[int, int]:
        start = entry.begin - entry.begin % self._page
        return start, entry.end - start

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a view still alive: the mapping goes when it does
                logger.debug("a tensor view outlives its checkpoint; its file stays mapped until it is freed")
        self._maps.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_header(file: Path) -> dict[str, TensorEntry]:
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: too short for a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{file}: not a safetensors file (header of {length} bytes in {size})")
            header = json.loads(handle.read(length))
    except OSError as error:
        raise CheckpointError(f"cannot read {file}: {error.strerror}") from error
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: the safetensors header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(n) for n in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{file.name}: tensor {name} has a malformed header entry ({error!r})") from error
        numel = 1
        for n in shape:
            numel *= n
        item = _ITEM_SIZES.get(dtype)
        if item is None:
            raise CheckpointError(f"{file.name}: tensor {name} has an unknown dtype {dtype!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end) or end - begin != numel * item:
            raise CheckpointError(f"{file.name}: tensor {name} ({dtype}, shape {shape}) spans bytes [{begin}, {end}),"
                                  f" not {numel * item}")
        if data_start + end > size:
            raise CheckpointError(f"{file.name}: tensor {name} ends past the end of the file (truncated?)")
        entries[name] = TensorEntry(file, dtype, shape, data_start + begin, data_start + end)
    return entries


def _no_weights_message(directory: Path) -> str:
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
    if pickles:
        return (f"{directory}: the weights are PyTorch pickles ({', '.join(pickles[:4])}), which this engine refuses:"
                " loading a pickle runs whatever code it holds. Convert them to safetensors first (on a machine you"
                " trust: transformers' save_pretrained(..., safe_serialization=True)).")
    return f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}"
