"""A C_base store: the base's prompt-prefix K/V for a dataset, precomputed once, memory-mapped in training.

``ccft precompute RECIPE`` (or ``base_cache_store: DIR`` in a recipe) writes, for every distinct prefix
``prompt[:n-k]`` of the data, its per-layer K/V to sharded safetensors::

    DIR/manifest.json            format, base fingerprint, dtype, shapes, and per shard: bytes, sha256, keys
    DIR/shard-00000.safetensors  "<key>.k", "<key>.v": (layers, kv_heads, n - k, head_dim) per prefix

An entry's key is a hash of the base fingerprint, the dtype and the prefix token ids, so a store can
only ever answer for the base and the exact ids it was computed from (K5). Training opens the shards
with ``safetensors.safe_open`` (memory-mapped: only the rows of a batch are read) and assembles the
same left-padded ``BaseCache`` the trainer would have prefilled.

Size: ``layers × 2 × kv_heads × head_dim × prefix tokens × dtype bytes`` (``estimate_bytes``); SmolLM2-135M
in fp32 is 30 × 2 × 3 × 64 × 4 = 46 080 bytes (45 KiB) per prefix token. ``precompute`` prints the
estimate first and refuses (``StoreError``) when it would not fit the free disk space.
Integrity: a store built for another base / dtype / model shape is stale and rebuilt; a shard whose
size or sha256 differs from the manifest, or that is missing or unreadable, is corrupt and its entries
are recomputed; entries the data needs but the store lacks are computed and appended.

Break-even (docs/training.md): precomputing costs one no-grad prefill pass plus the write; each later
epoch replaces the prefill (2·P FLOPs per prefix token) by a read, so the store pays for itself from the
second epoch when reads are cheaper than the prefill — on small datasets, whose store fits the page cache
and disk.

Shape notation: l layers, h KV heads, n prefix length of one row, d head dim, b batch, p longest prefix.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ccft.core.errors import CacheMutatedError, CCFTError, FingerprintMismatchError
from ccft.core.io import atomic_write_file, atomic_write_text
from ccft.core.tokens import pad_token_id

FORMAT = "ccft-cbase-1"
MANIFEST = "manifest.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class StoreError(CCFTError, RuntimeError):
    """The C_base store cannot be used or written (no disk space, unreadable folder)."""


# ------------------------------------------------------------------ sizes and keys


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only transformer config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(kv), int(head_dim)


def bytes_per_token(config, dtype: torch.dtype) -> int:
    """``layers × 2 × kv_heads × head_dim × dtype bytes``: the C_base footprint of one prefix token."""
    layers, kv, head_dim = kv_shape(config)
    return layers * 2 * kv * head_dim * torch.empty((), dtype=dtype).element_size()


def estimate_bytes(config, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of C_base for ``tokens`` prefix tokens (tensor data; headers and manifest are extra)."""
    return bytes_per_token(config, dtype) * int(tokens)


def entry_key(fingerprint: str, dtype: torch.dtype, prefix_ids: Sequence[int]) -> str:
    """Store key of one prefix: hash of base fingerprint, dtype and the exact token ids."""
    h = hashlib.sha256()
    h.update(f"{fingerprint}|{DTYPE_NAMES.get(dtype, str(dtype))}|".encode())
    h.update(torch.as_tensor(list(prefix_ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:40]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(path: str | Path, need: int, what: str = "C_base") -> None:
    """Refuse (``StoreError``) when ``need`` bytes, plus 5 % and 64 MiB of headroom (safetensors headers,
    the manifest, file-system slack), would not fit the free disk space at folder ``path`` (or, when it does
    not exist yet, at its nearest existing parent: nothing is created)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need * 1.05 + (64 << 20) > free:
        raise StoreError(
            f"{what} needs ≈ {human(need)} but only {human(free)} is free at {path}; free space, "
            "choose another folder, use fewer rows or a shorter max_length, or train without a "
            "store (the prefill is computed on the fly)"
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def prefixes_of(examples: Iterable, handoff_tokens: int) -> list[tuple[int, ...]]:
    """Distinct ``prompt[:n-k]`` of tokenised examples, in first-seen order."""
    seen: dict[tuple[int, ...], None] = {}
    for e in examples:
        seen.setdefault(tuple(e.prompt_ids[:-handoff_tokens]), None)
    return list(seen)


# ------------------------------------------------------------------ the store


@dataclass
class StoreReport:
    """What ``precompute`` found and did."""

    path: str
    prefixes: int = 0
    tokens: int = 0
    estimate_bytes: int = 0
    reused: int = 0
    computed: int = 0
    corrupt_shards: list[str] = field(default_factory=list)
    stale: str | None = None
    shards: int = 0
    seconds: float = 0.0
    bytes_on_disk: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class CacheStore:
    """An opened C_base store (read side): memory-mapped shards, lookups by prefix ids.

    Args:
        path: the store folder (``ccft precompute``).
        verify: ``"sha256"`` (default) checks each shard's size and sha256 against the manifest when it is
            first opened, ``"size"`` only its size.
    Raises:
        StoreError: the folder has no valid manifest.
    """

    def __init__(self, path: str | Path, *, verify: str = "sha256"):
        self.path = Path(path)
        self.verify = verify
        mf = self.path / MANIFEST
        try:
            self.manifest = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(
                f"{self.path} is not a C_base store ({MANIFEST} unreadable: {e}); "
                "create it with `ccft precompute RECIPE`"
            ) from None
        if self.manifest.get("format") != FORMAT:
            raise StoreError(f"{mf}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.fingerprint = self.manifest["fingerprint"]
        self.dtype = getattr(torch, self.manifest["dtype"])
        self.index = {key: name for name, info in self.manifest["shards"].items() for key in info["keys"]}
        self._handles: dict[str, object] = {}
        self.hits = 0
        self.misses = 0

    def check_reader(self, base) -> None:
        """Refuse (``FingerprintMismatchError``) a ``ccft.Base`` that did not compute this store, or that
        computes in another dtype (docs/design.md, "C_base", K5): its entries would be another model's K/V."""
        if base.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"C_base store {self.path} was computed by base {self.fingerprint} but the run's base is "
                f"{base.fingerprint}; run `ccft precompute RECIPE` with this base (it rebuilds the store)"
            )
        if base.dtype != self.dtype:
            raise FingerprintMismatchError(
                f"C_base store {self.path} holds {self.dtype} K/V but the run's base computes in "
                f"{base.dtype}; run `ccft precompute RECIPE` with the run's dtype (it rebuilds the store)"
            )

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def _open(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            from safetensors import safe_open

            if check_shards(self.path, {"shards": {name: self.manifest["shards"][name]}}, verify=self.verify):
                raise CacheMutatedError(
                    f"C_base store shard {self.path / name} is missing or changed since it was written "
                    f"(size, sha256 or keys differ from {MANIFEST}); C_base is a constant. Run `ccft "
                    "precompute RECIPE` to recompute its entries"
                )
            handle = safe_open(str(self.path / name), framework="pt", device="cpu")  # mmap
            self._handles[name] = handle
        return handle

    def get(self, prefix_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(keys, values)`` of one prefix, each ``(l, h, n, d)``, or None when the store lacks it."""
        key = entry_key(self.fingerprint, self.dtype, prefix_ids)
        name = self.index.get(key)
        if name is None:
            return None
        f = self._open(name)
        return f.get_tensor(f"{key}.k"), f.get_tensor(f"{key}.v")

    def batch_cache(
        self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, tail_ids: torch.Tensor, *, base
    ):
        """The ``BaseCache`` of a collated batch from stored entries, or None if any row is missing.

        Args:
            prefix_ids, prefix_mask: ``(b, p)`` left-padded, as ``ccft.train.data.Collator`` makes them.
            tail_ids: ``(b, k)`` the handoff tokens.
            base: the ``ccft.Base`` the trainer uses; its fingerprint and dtype must match the store's.
        Returns:
            ``BaseCache`` with keys/values ``(b, h, p, d)`` per layer (producer ``base``), or None.
        Raises:
            FingerprintMismatchError: the store was computed by another base or in another dtype (K5).
            CacheMutatedError: a shard the batch reads changed on disk since it was written.
        """
        from ccft.core.cache import BaseCache

        self.check_reader(base)
        b, p = prefix_ids.shape
        lengths = prefix_mask.sum(-1).tolist()
        rows = []
        for i in range(b):
            ids = prefix_ids[i, p - lengths[i] :].tolist()
            kv = self.get(ids)
            if kv is None:
                self.misses += 1
                return None
            rows.append(kv)
        self.hits += 1
        layers, heads, _, dim = rows[0][0].shape
        device = prefix_ids.device
        ks = torch.zeros((layers, b, heads, p, dim), dtype=self.dtype, device=device)
        vs = torch.zeros_like(ks)
        for i, (k, v) in enumerate(rows):
            n = lengths[i]
            ks[:, i, :, p - n :] = k
            vs[:, i, :, p - n :] = v
        return BaseCache.from_tensors(
            tuple(ks.unbind(0)),
            tuple(vs.unbind(0)),
            prefix_mask,
            tail_ids,
            tail_ids.shape[1],
            self.fingerprint,
            "base",
        )

    def close(self) -> None:
        self._handles.clear()


# ------------------------------------------------------------------ writing / checking


def _read_manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
        return m if m.get("format") == FORMAT else None
    except (OSError, ValueError):
        return None


def _write_manifest(path: Path, manifest: dict) -> None:
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=1))


def check_shards(path: Path, manifest: dict, *, verify: str = "sha256") -> list[str]:
    """Names of shards that are missing, of the wrong size, fail their sha256 (``verify="sha256"``) or
    cannot be opened."""
    bad = []
    for name, info in manifest.get("shards", {}).items():
        f = path / name
        try:
            if not f.is_file() or f.stat().st_size != info["bytes"]:
                bad.append(name)
                continue
            if verify == "sha256" and _sha256(f) != info["sha256"]:
                bad.append(name)
                continue
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                missing = [k for k in info["keys"] if f"{k}.k" not in h.keys()]
            if missing:
                bad.append(name)
        except Exception:  # noqa: BLE001 - any unreadable shard is corrupt
            bad.append(name)
    return bad


def _stale_reason(manifest: dict, base) -> str | None:
    layers, kv, head_dim = kv_shape(base.config)
    want = {
        "fingerprint": base.fingerprint,
        "dtype": DTYPE_NAMES.get(base.dtype, str(base.dtype)),
        "layers": layers,
        "kv_heads": kv,
        "head_dim": head_dim,
    }
    for k, v in want.items():
        if manifest.get(k) != v:
            return f"{k} {manifest.get(k)!r} != {v!r}"
    return None


def precompute(
    base,
    examples: Sequence,
    path: str | Path,
    *,
    handoff_tokens: int = 1,
    batch_size: int = 8,
    shard_bytes: int = 256 << 20,
    verify: str = "sha256",
    check_disk: bool = True,
    log=print,
) -> StoreReport:
    """Make ``path`` hold C_base for every prefix of ``examples`` (tokenised rows); return what was done.

    Prints the size estimate first; refuses with StoreError when the missing entries would not fit the
    free disk space. Reuses valid entries; rebuilds a stale store; recomputes corrupt shards' entries.
    """
    from ccft.core.cache import prefill

    start = time.time()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    report = StoreReport(path=str(path))
    prefixes = prefixes_of(examples, handoff_tokens)
    report.prefixes = len(prefixes)
    report.tokens = sum(len(p) for p in prefixes)
    report.estimate_bytes = estimate_bytes(base.config, base.dtype, report.tokens)
    layers, kv, head_dim = kv_shape(base.config)
    log(
        f"[ccft] C_base store {path}: {len(prefixes)} prefixes, {report.tokens} tokens × "
        f"{bytes_per_token(base.config, base.dtype)} B/token ({layers} layers × 2 × {kv} kv heads × "
        f"{head_dim} head dim × {torch.empty((), dtype=base.dtype).element_size()} B) ≈ "
        f"{human(report.estimate_bytes)}"
    )

    manifest = _read_manifest(path)
    if manifest is not None:
        report.stale = _stale_reason(manifest, base)
        if report.stale:
            log(f"[ccft] C_base store is stale ({report.stale}); rebuilding it")
            for name in manifest.get("shards", {}):
                (path / name).unlink(missing_ok=True)
            manifest = None
    if manifest is None:
        manifest = {
            "format": FORMAT,
            "fingerprint": base.fingerprint,
            "dtype": DTYPE_NAMES.get(base.dtype, str(base.dtype)),
            "layers": layers,
            "kv_heads": kv,
            "head_dim": head_dim,
            "shards": {},
        }
    else:
        report.corrupt_shards = check_shards(path, manifest, verify=verify)
        for name in report.corrupt_shards:
            log(f"[ccft] C_base shard {name} is corrupt or missing; its entries will be recomputed")
            (path / name).unlink(missing_ok=True)
            del manifest["shards"][name]

    have = {k for info in manifest["shards"].values() for k in info["keys"]}
    todo = [p for p in prefixes if entry_key(base.fingerprint, base.dtype, p) not in have]
    report.reused = len(prefixes) - len(todo)
    need = estimate_bytes(base.config, base.dtype, sum(len(p) for p in todo))
    if check_disk and todo:
        check_free_space(path, need, f"C_base for {len(todo)} prefixes")
    if todo:
        log(f"[ccft] computing C_base for {len(todo)} prefixes ({human(need)}); reusing {report.reused}")
    _write_manifest(path, manifest)

    next_id = 1 + max([int(n.split("-")[1].split(".")[0]) for n in manifest["shards"]] or [-1])
    pending: dict[str, torch.Tensor] = {}
    pending_keys: list[str] = []
    pending_bytes = 0

    def flush():
        nonlocal next_id, pending, pending_keys, pending_bytes
        if not pending:
            return
        from safetensors.torch import save_file

        name = f"shard-{next_id:05d}.safetensors"
        next_id += 1
        atomic_write_file(
            path / name,
            lambda tmp: save_file(pending, tmp, metadata={"format": FORMAT, "fingerprint": base.fingerprint}),
        )
        manifest["shards"][name] = {
            "bytes": (path / name).stat().st_size,
            "sha256": _sha256(path / name),
            "keys": pending_keys,
        }
        _write_manifest(path, manifest)  # after every shard: an interrupted run keeps what it finished
        pending, pending_keys, pending_bytes = {}, [], 0

    # Sort by length so batches pad little; one left-padded prefill per batch (positions per row).
    order = sorted(todo, key=len)
    pad = pad_token_id(base.tokenizer)
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        # ``prefill`` runs prompt[:-1]: give it prefix + one dummy handoff token.
        with torch.no_grad(), base.base_weights() as model:
            cache = prefill(
                model,
                [list(c) + [pad] for c in chunk],
                handoff_tokens=1,
                pad_token_id=pad,
                fingerprint=base.fingerprint,
            )
        width = cache.attention_mask.shape[1]
        for i, c in enumerate(chunk):
            n = len(c)
            key = entry_key(base.fingerprint, base.dtype, c)
            k = torch.stack([t[i, :, width - n :] for t in cache.keys]).contiguous().cpu()
            v = torch.stack([t[i, :, width - n :] for t in cache.values]).contiguous().cpu()
            pending[f"{key}.k"], pending[f"{key}.v"] = k, v
            pending_keys.append(key)
            pending_bytes += 2 * k.numel() * k.element_size()
        report.computed += len(chunk)
        if pending_bytes >= shard_bytes:
            flush()
    flush()
    report.shards = len(manifest["shards"])
    report.bytes_on_disk = sum(info["bytes"] for info in manifest["shards"].values())
    report.seconds = time.time() - start
    log(
        f"[ccft] C_base store ready: {report.reused} reused, {report.computed} computed, "
        f"{len(report.corrupt_shards)} corrupt shard(s) replaced, {report.shards} shard(s), "
        f"{human(report.bytes_on_disk)} on disk, {report.seconds:.1f}s"
    )
    return report


def open_store_for_training(
    path: str | Path, base, train_set, *, handoff_tokens: int, eval_set=None, verify: str = "sha256"
) -> CacheStore:
    """Bring the store at ``path`` up to date for the run's rows (``precompute``) and open it."""
    examples = list(train_set.examples) + (list(eval_set.examples) if eval_set is not None else [])

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    precompute(base, examples, path, handoff_tokens=handoff_tokens, verify=verify, log=log)
    store = CacheStore(path, verify=verify)
    store.check_reader(base)
    return store


__all__ = [
    "CacheStore",
    "StoreError",
    "StoreReport",
    "precompute",
    "open_store_for_training",
    "estimate_bytes",
    "bytes_per_token",
    "entry_key",
    "kv_shape",
    "check_shards",
    "check_free_space",
]
