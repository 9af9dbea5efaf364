"""``DiskSpill``: a local disk tier under a ``PrefixKVStore`` for the blocks its budget evicts (issue 36).

When the store evicts an unreferenced block (its budget is full, or the scheduler makes room), the block
is written here instead of being lost, unless it is here already; a lookup whose DRAM chain ends reads
the next blocks of the chain from here, in order, before it asks the pool (``PrefixKVStore``, "Spill").

Format. One file per block, in the shard format of ``ccft precompute`` (``ccft.train.cache_store``,
written by its ``write_shard``): a safetensors file
``DIR/blk-<dtype>-<producer hash>-<chain key>.safetensors`` holding ``"<chain key>.k"`` and
``"<chain key>.v"``, each ``(layers, kv_heads, block_tokens, head_dim)`` in the block's dtype, and the
metadata ``format`` (``ccft.train.cache_store.FORMAT``), ``fingerprint`` (the producer: the base
fingerprint in shared mode, a decoder's key in the no-share baseline), ``cache_format`` (``native``),
``entry`` (``ENTRY``: a prefix-store block, not a precompute prefix), ``dtype``, ``block_tokens``,
``index``, ``tokens`` (JSON list), ``key`` (the chain key, hex) and ``sha256`` (of the K bytes then the
V bytes). There is no manifest: the folder is the index, and the files a previous process left are
reused (oldest first by modification time).

Identity (K5). Every call names a block by the store's identity of it (``ccft.serving.block_keys.BlockId``).
The file name carries its chain key (which covers the producer, the dtype, the block size and every token
up to the block's end), the producer and the dtype, and the metadata every field of it; a read compares
every field of the metadata with the ``BlockId`` the reader asks for, so one producer's K/V is never
served for another and a base with another fingerprint never hits.

Integrity. A file that cannot be read (truncated: safetensors refuses it), whose checksum or shape
differs, or whose metadata names another block is ignored with a warning, counted (``errors["corrupt"]``
or ``errors["mismatch"]``) and deleted; the lookup stops there and the block is prefilled again. Never a
wrong answer.

Capacity. Past ``capacity_bytes`` (file sizes) the least recently used files (written or read) are
deleted. One process per folder: ``DiskSpill`` holds an exclusive lock on ``DIR/.lock``
(``DiskSpill.claim`` picks the first free ``DIR/replica-<i>`` for servers that share a root).

Costs. Writes happen in the thread that evicts (the scheduler's, at admission): one file of
``2 × layers × kv_heads × block_tokens × head_dim × dtype bytes`` plus a small header per block.

Not thread-safe: one scheduler thread calls it (``/metrics`` only reads its counters).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

import torch

from ccft.core.errors import ConfigError
from ccft.serving.block_keys import BlockId, producer_hash
from ccft.train.cache_store import DTYPE_NAMES, FORMAT, write_shard

log = logging.getLogger(__name__)

__all__ = ["DiskSpill", "ENTRY", "LOCK"]

#: the ``entry`` metadata of a spilled block (part of what a read checks)
ENTRY = "ccft-prefix-block-1"
#: the lock file of a spill folder (one process per folder)
LOCK = ".lock"
_PREFIX, _SUFFIX = "blk-", ".safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _metadata(block: BlockId) -> dict[str, str]:
    """The metadata fields of a block's file that name the block (all but ``format``, ``cache_format`` and
    ``sha256``), in the order a read checks them (after ``format``)."""
    return {
        "entry": ENTRY,
        "fingerprint": block.producer,
        "dtype": _dtype_name(block.dtype),
        "block_tokens": str(block.block_tokens),
        "index": str(block.index),
        "tokens": json.dumps(list(block.tokens)),
        "key": block.chain_key.hex(),
    }


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


class DiskSpill:
    """Blocks evicted from a ``PrefixKVStore``'s DRAM, on local disk (module docstring).

    Args:
        directory: the folder (created when missing); this process locks it (``DIR/.lock``).
        capacity_bytes: the most bytes of block files kept (> 0); least recently used files are deleted.
        device: where read blocks are put (the engine's device).
    Counters (``stats()``): ``spilled_blocks`` / ``spilled_bytes`` (files written), ``present_blocks``
    (evicted blocks already on disk: not written again), ``too_large_blocks`` (a block larger than the
    capacity: not written), ``hit_blocks`` / ``miss_blocks`` (reads that found / did not find a usable
    block), ``read_bytes``, ``evicted_blocks`` (files deleted past the capacity), ``errors`` by kind
    (``corrupt``, ``mismatch``: a bad file, deleted; ``io``: a write or read the file system refused),
    ``writes`` / ``write_seconds`` and ``reads`` / ``read_seconds``, ``blocks`` and ``bytes_on_disk``.
    Raises:
        ConfigError: ``capacity_bytes ≤ 0``, a folder that cannot be created or written, or one another
            process holds.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, *, device: torch.device | str = "cpu"):
        if not int(capacity_bytes) > 0:
            raise ConfigError(f"DiskSpill capacity_bytes={capacity_bytes}; use a size in bytes > 0")
        self.directory = Path(directory)
        self.capacity_bytes = int(capacity_bytes)
        self.device = torch.device(device)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / LOCK, "a")
        except OSError as e:
            raise ConfigError(f"prefix spill folder {str(self.directory)!r} cannot be written: {e}") from e
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock.close()
            raise ConfigError(
                f"prefix spill folder {str(self.directory)!r} is used by another process; give each server "
                "its own folder"
            ) from e
        self.spilled_blocks = self.spilled_bytes = self.present_blocks = self.too_large_blocks = 0
        self.hit_blocks = self.miss_blocks = self.read_bytes = self.evicted_blocks = 0
        self.writes = self.reads = 0
        self.write_seconds = self.read_seconds = 0.0
        self.errors = {"corrupt": 0, "mismatch": 0, "io": 0}
        self._files: OrderedDict[str, int] = OrderedDict()  # file name → bytes; LRU first
        self.bytes_on_disk = 0
        self._reopen()

    @classmethod
    def claim(
        cls, root: str | Path, capacity_bytes: int, *, device: torch.device | str = "cpu", slots: int = 256
    ) -> "DiskSpill":
        """The spill of the first free ``root/replica-<i>`` (``i < slots``): for several servers (``ccft serve
        --replicas N``) given one folder; each keeps its own files and ``capacity_bytes``.

        Raises:
            ConfigError: as ``DiskSpill``; every slot is held.
        """
        for i in range(int(slots)):
            path = Path(root) / f"replica-{i}"
            try:
                return cls(path, capacity_bytes, device=device)
            except ConfigError as e:
                if "used by another process" not in str(e):
                    raise
        raise ConfigError(f"prefix spill folder {str(root)!r}: all {slots} replica folders are in use")

    def close(self) -> None:
        """Release the folder's lock (the files stay for the next process)."""
        if not self._lock.closed:
            self._lock.close()

    # ------------------------------------------------------------------ names
    @staticmethod
    def file_name(block: BlockId) -> str:
        """``blk-<dtype>-<producer hash>-<chain key>.safetensors``: the file of a block (module docstring)."""
        who = producer_hash(block.producer, 8)
        return f"{_PREFIX}{_dtype_name(block.dtype)}-{who}-{block.chain_key.hex()}{_SUFFIX}"

    def _reopen(self) -> None:
        """Index the block files a previous process left (oldest first) and delete its temporaries."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith("." + _PREFIX):  # an interrupted atomic write
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.startswith(_PREFIX) and entry.name.endswith(_SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.bytes_on_disk += size
        self._trim()

    def _delete(self, name: str) -> None:
        size = self._files.pop(name, None)
        if size is not None:
            self.bytes_on_disk -= size
        (self.directory / name).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self.bytes_on_disk > self.capacity_bytes and self._files:
            self._delete(next(iter(self._files)))
            self.evicted_blocks += 1

    # ------------------------------------------------------------------ API
    def contains(self, block: BlockId) -> bool:
        """Whether a file for this block is indexed (it is checked only when read)."""
        return self.file_name(block) in self._files

    def put(self, block: BlockId, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write a block unless it is on disk already (then it is only marked recently used); never raises.

        Args:
            block: the block's identity (its file name and metadata).
            k, v: ``(L, h, block_tokens, d)`` in ``block.dtype``, any device (copied to the CPU to be
                written).
        Returns:
            True when a file was written; False when it was present, larger than the capacity, or the write
            failed (``errors["io"]``, with a warning).
        """
        name = self.file_name(block)
        if name in self._files:
            self._files.move_to_end(name)
            self.present_blocks += 1
            return False
        if k.numel() * k.element_size() + v.numel() * v.element_size() > self.capacity_bytes:
            self.too_large_blocks += 1
            return False
        key = block.chain_key.hex()
        k, v = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
        meta = {**_metadata(block), "cache_format": "native", "sha256": _digest(k, v)}
        t0 = time.perf_counter()
        try:
            size = write_shard(self.directory / name, {f"{key}.k": k, f"{key}.v": v}, meta)
        except Exception as e:  # noqa: BLE001 - a full or broken disk must never fail an eviction
            self.errors["io"] += 1
            log.warning(
                "prefix spill: block %s not written to %s: %s: %s", key, self.directory, type(e).__name__, e
            )
            return False
        finally:
            self.write_seconds += time.perf_counter() - t0
            self.writes += 1
        self._files[name] = size
        self.bytes_on_disk += size
        self.spilled_blocks += 1
        self.spilled_bytes += size
        self._trim()
        return True

    def get(self, block: BlockId) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k, v)`` of a block from disk, ``(L, h, block_tokens, d)`` in ``block.dtype`` on ``device``;
        None when absent, or when its file is bad (counted, warned, deleted) or cannot be read
        (``errors["io"]``)."""
        name = self.file_name(block)
        if name not in self._files:
            self.miss_blocks += 1
            return None
        t0 = time.perf_counter()
        try:
            k, v = self._read(self.directory / name, block)
        except (ValueError, OSError) as e:
            kind = (
                "io" if isinstance(e, OSError) else "mismatch" if str(e).startswith("mismatch") else "corrupt"
            )
            self.errors[kind] += 1
            log.warning("prefix spill: block file %s ignored (%s); it is prefilled again", name, e)
            self._delete(name)
            self.miss_blocks += 1
            return None
        finally:
            self.read_seconds += time.perf_counter() - t0
            self.reads += 1
        self._files.move_to_end(name)
        self.hit_blocks += 1
        self.read_bytes += self._files[name]
        return k.to(self.device), v.to(self.device)

    @staticmethod
    def _read(path: Path, block: BlockId) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked tensors of one block file (``ValueError`` ``corrupt: ...`` / ``mismatch: ...``)."""
        from safetensors import safe_open

        key, dtype = block.chain_key.hex(), block.dtype
        if not path.is_file():
            raise FileNotFoundError(f"{path} is gone")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                for field, expected in {"format": FORMAT, **_metadata(block)}.items():
                    if meta.get(field) != expected:
                        raise ValueError(f"mismatch: the block's {field} differs from the reader's")
                if {f"{key}.k", f"{key}.v"} - set(f.keys()):
                    raise ValueError(f"corrupt: no {key}.k / {key}.v tensors")
                k = f.get_tensor(f"{key}.k").clone()  # a copy: safetensors maps the file
                v = f.get_tensor(f"{key}.v").clone()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors refuses a truncated or garbled file
            raise ValueError(f"corrupt: unreadable ({type(e).__name__}: {e})") from e
        if k.dtype != dtype or v.dtype != dtype or k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"mismatch: tensors {k.dtype} {tuple(k.shape)} / {v.dtype} {tuple(v.shape)}")
        if k.shape[2] != block.block_tokens:
            raise ValueError(f"mismatch: block shape {tuple(k.shape)}")
        if _digest(k, v) != meta.get("sha256"):
            raise ValueError("corrupt: checksum mismatch")
        return k, v

    def forget(self, producer: str) -> int:
        """Delete every file written for ``producer`` (``PrefixKVStore.forget``); returns the bytes freed."""
        who = producer_hash(producer, 8)
        freed = 0
        for name in [n for n in self._files if n.split("-")[2:3] == [who]]:
            freed += self._files[name]
            self._delete(name)
        return freed

    def clear(self) -> None:
        """Delete every block file (counters are kept)."""
        for name in list(self._files):
            self._delete(name)

    # ------------------------------------------------------------------ reporting
    def __len__(self) -> int:
        return len(self._files)

    def stats(self) -> dict:
        """The counters (class docstring) and occupancy; a plain dict (JSON-ready)."""
        return {
            "blocks": len(self._files),
            "bytes_on_disk": self.bytes_on_disk,
            "capacity_bytes": self.capacity_bytes,
            "spilled_blocks": self.spilled_blocks,
            "spilled_bytes": self.spilled_bytes,
            "present_blocks": self.present_blocks,
            "too_large_blocks": self.too_large_blocks,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "read_bytes": self.read_bytes,
            "evicted_blocks": self.evicted_blocks,
            "writes": self.writes,
            "write_seconds": self.write_seconds,
            "reads": self.reads,
            "read_seconds": self.read_seconds,
            "errors": dict(self.errors),
        }

    def __repr__(self) -> str:
        return (
            f"DiskSpill({str(self.directory)!r}, blocks={len(self._files)}, "
            f"bytes_on_disk={self.bytes_on_disk}, capacity_bytes={self.capacity_bytes})"
        )
