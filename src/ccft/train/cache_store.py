"""A C_base store: the base's prompt-prefix K/V for a dataset, precomputed once, memory-mapped in training.

``ccft precompute RECIPE`` (or ``base_cache_store: DIR`` in a recipe) writes, for every distinct prefix
``prompt[:n-k]`` of the data, its per-layer K/V to sharded safetensors::

    DIR/manifest.json            format, base fingerprint, dtype, shapes, cache_format, and per shard: bytes,
                                 sha256, keys
    DIR/shard-00000.safetensors  "<key>.k", "<key>.v": (layers, kv_heads, n - k, head_dim) per prefix

With ``cache_format: int8`` (``ccft precompute --cache-format int8``) the store holds the compact C_base
(``ccft.core.compact``, issue 35): ``"<key>.k"`` and ``"<key>.v"`` are int8 codes (same shape),
``"<key>.ks"`` the bfloat16 key scales ``(layers, kv_heads, 1, head_dim)`` (per channel), ``"<key>.vs"``
the value scales ``(layers, kv_heads, n - k, 1)`` (per token), made by ``quantize_keys`` and
``quantize_values`` of the prefix's native K/V: the codes and scales ``CompactCache.from_base`` makes of the
same C_base (a row's scales do not depend on the left padding of the batch it is read in). About a quarter
of the native fp32 bytes (``kv_nbytes``). The format is in the manifest, in every shard's metadata and in
every entry's key, so a store answers only readers of its format: a CCFT run on the int8 C_base reads int8
shards (or a native store, quantising on the fly as without a store), a run on the native C_base refuses an
int8 store (``CacheStore.check_format``, a ``ConfigError`` naming the manifest and the fix).

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

from ccft.core.compact import CompactCache, check_cache_format, kv_nbytes, quantize_keys, quantize_values
from ccft.core.errors import CacheMutatedError, CCFTError, ConfigError, FingerprintMismatchError
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


def store_bytes(config, dtype: torch.dtype, lengths: Iterable[int], cache_format: str = "native") -> int:
    """Tensor bytes of C_base for prefixes of ``lengths`` tokens in ``cache_format``: ``estimate_bytes`` for
    ``native``; for ``int8`` the codes and the scales of each prefix (``ccft.core.compact.kv_nbytes``: its key
    scales are per prefix, its value scales per token). Headers and manifest are extra.

    Raises:
        ConfigError: an unknown ``cache_format``.
    """
    lengths = [int(n) for n in lengths]
    if check_cache_format(cache_format) == "native":
        return estimate_bytes(config, dtype, sum(lengths))
    layers, kv, head_dim = kv_shape(config)
    geo = {"layers": layers, "kv_heads": kv, "head_dim": head_dim, "dtype": dtype}
    return sum(kv_nbytes(cache_format, tokens=n, **geo) for n in lengths)


def entry_key(
    fingerprint: str, dtype: torch.dtype, prefix_ids: Sequence[int], cache_format: str = "native"
) -> str:
    """Store key of one prefix: hash of base fingerprint, dtype, the C_base format (only when not ``native``,
    so native keys are those of stores written before formats existed) and the exact token ids."""
    h = hashlib.sha256()
    fmt = "" if cache_format == "native" else f"{cache_format}|"
    h.update(f"{fingerprint}|{DTYPE_NAMES.get(dtype, str(dtype))}|{fmt}".encode())
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
        #: the format of its entries: ``native`` (C_base as computed) or ``int8`` (codes and scales)
        self.cache_format = self.manifest.get("cache_format", "native")
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

    def check_format(self, cache_format: str) -> None:
        """Refuse a reader of ``cache_format`` that this store cannot answer exactly: an ``int8`` store read
        by a run on the native C_base (its native values are not stored). An ``int8`` reader of a native store
        is served: its C_base is quantised as it would be without a store.

        Raises:
            ConfigError: naming the manifest, the two formats and the fix.
        """
        fmt = check_cache_format(cache_format)
        if self.cache_format != "native" and fmt != self.cache_format:
            raise ConfigError(
                f"C_base store {self.path / MANIFEST} holds C_base in cache_format={self.cache_format} but "
                f"the run reads cache_format={fmt}; set cache_format={self.cache_format} in the recipe, or "
                f"give base_cache_store a folder written by `ccft precompute RECIPE --cache-format {fmt}`"
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

    def get(self, prefix_ids: Sequence[int]) -> tuple[torch.Tensor, ...] | None:
        """One prefix's entry, or None when the store lacks it: ``(keys, values)``, each ``(l, h, n, d)``; in
        an ``int8`` store ``(key codes, key scales, value codes, value scales)``, codes int8 ``(l, h, n, d)``,
        scales bfloat16 ``(l, h, 1, d)`` and ``(l, h, n, 1)``."""
        key = entry_key(self.fingerprint, self.dtype, prefix_ids, self.cache_format)
        name = self.index.get(key)
        if name is None:
            return None
        f = self._open(name)
        if self.cache_format == "native":
            return f.get_tensor(f"{key}.k"), f.get_tensor(f"{key}.v")
        return tuple(f.get_tensor(f"{key}.{part}") for part in ("k", "ks", "v", "vs"))

    def batch_cache(
        self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, tail_ids: torch.Tensor, *, base
    ):
        """The ``BaseCache`` of a collated batch from stored entries, or None if any row is missing.

        Args:
            prefix_ids, prefix_mask: ``(b, p)`` left-padded, as ``ccft.train.data.Collator`` makes them.
            tail_ids: ``(b, k)`` the handoff tokens.
            base: the ``ccft.Base`` the trainer uses; its fingerprint and dtype must match the store's.
        Returns:
            ``BaseCache`` with keys/values ``(b, h, p, d)`` per layer (producer ``base``), or None. An
            ``int8`` store returns a ``ccft.core.compact.CompactCache`` instead (codes ``(b, h, p, d)``, key
            scales ``(b, h, 1, d)``, value scales ``(b, h, p, 1)`` per layer; pad slots code 0, scale 1, as
            ``CompactCache.from_base`` gives them), which ``read_cache(cache, "int8")`` dequantises.
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
        if self.cache_format != "native":
            return self._compact_batch(rows, lengths, p, prefix_mask, tail_ids)
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

    def _compact_batch(self, rows, lengths, p: int, prefix_mask, tail_ids) -> CompactCache:
        """A left-padded ``CompactCache`` of stored int8 entries (``batch_cache``)."""
        b = len(rows)
        layers, heads, _, dim = rows[0][0].shape
        device = prefix_mask.device
        kq = torch.zeros((layers, b, heads, p, dim), dtype=torch.int8, device=device)
        vq = torch.zeros_like(kq)
        ks = torch.ones((layers, b, heads, 1, dim), dtype=rows[0][1].dtype, device=device)
        vs = torch.ones((layers, b, heads, p, 1), dtype=rows[0][3].dtype, device=device)
        for i, (k_codes, k_scales, v_codes, v_scales) in enumerate(rows):
            n = lengths[i]
            kq[:, i, :, p - n :] = k_codes
            ks[:, i] = k_scales
            vq[:, i, :, p - n :] = v_codes
            vs[:, i, :, p - n :] = v_scales
        return CompactCache(
            tuple(kq.unbind(0)),
            tuple(ks.unbind(0)),
            tuple(vq.unbind(0)),
            tuple(vs.unbind(0)),
            prefix_mask,
            tail_ids,
            tail_ids.shape[1],
            self.fingerprint,
            "base",
            self.dtype,
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


def write_shard(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write one shard of this format atomically (``ccft.core.io.atomic_write_file``): the safetensors file
    of ``tensors`` (``"<key>.k"``, ``"<key>.v"``, ...: contiguous CPU tensors) with ``metadata`` (str → str)
    and ``"format": FORMAT``. Also the file format of the prefix store's disk tier
    (``ccft.serving.prefix_spill``).

    Returns:
        the file's size in bytes.
    Raises:
        OSError: the folder cannot be written (no space, permissions).
    """
    from safetensors.torch import save_file

    meta = {"format": FORMAT, **{str(k): str(v) for k, v in metadata.items()}}
    path = atomic_write_file(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return path.stat().st_size


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


def _stale_reason(manifest: dict, base, cache_format: str = "native") -> str | None:
    layers, kv, head_dim = kv_shape(base.config)
    want = {
        "fingerprint": base.fingerprint,
        "dtype": DTYPE_NAMES.get(base.dtype, str(base.dtype)),
        "layers": layers,
        "kv_heads": kv,
        "head_dim": head_dim,
        "cache_format": cache_format,
    }
    have = {"cache_format": "native", **manifest}  # a manifest from before formats existed: native
    for k, v in want.items():
        if have.get(k) != v:
            return f"{k} {have.get(k)!r} != {v!r}"
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
    cache_format: str = "native",
) -> StoreReport:
    """Make ``path`` hold C_base for every prefix of ``examples`` (tokenised rows); return what was done.

    Prints the size estimate first; refuses with StoreError when the missing entries would not fit the
    free disk space. Reuses valid entries; rebuilds a stale store (another base, dtype, shape or
    ``cache_format``); recomputes corrupt shards' entries. ``cache_format="int8"`` stores the compact C_base
    (int8 codes and bfloat16 scales of each prefix; module docstring), ``store_bytes`` bytes of tensors.

    Raises:
        ConfigError: an unknown ``cache_format`` (before anything is read or written).
        StoreError: not enough free disk space.
    """
    from ccft.core.cache import prefill

    check_cache_format(cache_format)
    start = time.time()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    report = StoreReport(path=str(path))
    prefixes = prefixes_of(examples, handoff_tokens)
    report.prefixes = len(prefixes)
    report.tokens = sum(len(p) for p in prefixes)
    report.estimate_bytes = store_bytes(base.config, base.dtype, map(len, prefixes), cache_format)
    layers, kv, head_dim = kv_shape(base.config)
    int8 = "" if cache_format == "native" else f", stored as {cache_format} codes and scales"
    log(
        f"[ccft] C_base store {path}: {len(prefixes)} prefixes, {report.tokens} tokens × "
        f"{bytes_per_token(base.config, base.dtype)} B/token ({layers} layers × 2 × {kv} kv heads × "
        f"{head_dim} head dim × {torch.empty((), dtype=base.dtype).element_size()} B){int8} ≈ "
        f"{human(report.estimate_bytes)}"
    )

    manifest = _read_manifest(path)
    if manifest is not None:
        report.stale = _stale_reason(manifest, base, cache_format)
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
            "cache_format": cache_format,
            "shards": {},
        }
    else:
        report.corrupt_shards = check_shards(path, manifest, verify=verify)
        for name in report.corrupt_shards:
            log(f"[ccft] C_base shard {name} is corrupt or missing; its entries will be recomputed")
            (path / name).unlink(missing_ok=True)
            del manifest["shards"][name]

    have = {k for info in manifest["shards"].values() for k in info["keys"]}
    todo = [p for p in prefixes if entry_key(base.fingerprint, base.dtype, p, cache_format) not in have]
    report.reused = len(prefixes) - len(todo)
    need = store_bytes(base.config, base.dtype, map(len, todo), cache_format)
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
        name = f"shard-{next_id:05d}.safetensors"
        next_id += 1
        write_shard(path / name, pending, {"fingerprint": base.fingerprint, "cache_format": cache_format})
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
            key = entry_key(base.fingerprint, base.dtype, c, cache_format)
            k = torch.stack([t[i, :, width - n :] for t in cache.keys]).contiguous().cpu()
            v = torch.stack([t[i, :, width - n :] for t in cache.values]).contiguous().cpu()
            if cache_format == "native":
                entry = {"k": k, "v": v}
            else:  # (l, h, n, d) as a batch of l rows: scales per layer-head-channel / layer-head-token
                (kq, ks), (vq, vs) = quantize_keys(k), quantize_values(v)
                entry = {"k": kq, "ks": ks, "v": vq, "vs": vs}
            for part, t in entry.items():
                pending[f"{key}.{part}"] = t.contiguous()
                pending_bytes += t.numel() * t.element_size()
            pending_keys.append(key)
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


def existing_format(path: str | Path) -> str | None:
    """The ``cache_format`` of the store at ``path`` (``native`` for a manifest from before formats existed),
    or None when ``path`` holds no readable manifest."""
    manifest = _read_manifest(Path(path))
    return None if manifest is None else manifest.get("cache_format", "native")


def open_store_for_training(
    path: str | Path,
    base,
    train_set,
    *,
    handoff_tokens: int,
    eval_set=None,
    verify: str = "sha256",
    cache_format: str = "native",
) -> CacheStore:
    """Bring the store at ``path`` up to date for the run's rows (``precompute``) and open it.

    ``cache_format`` is the format the run reads C_base in: a new store is written in it; an existing native
    store stays native (an ``int8`` run quantises its entries as it would a computed C_base); an existing
    ``int8`` store is refused by a native run (``CacheStore.check_format``) before anything is computed.

    Raises:
        ConfigError: the store's format cannot serve ``cache_format``.
        StoreError, FingerprintMismatchError: as ``precompute`` and ``CacheStore.check_reader``.
    """
    examples = list(train_set.examples) + (list(eval_set.examples) if eval_set is not None else [])

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    have = existing_format(path)
    if have is not None:
        CacheStore(path, verify="size").check_format(cache_format)  # before any shard is rebuilt
    fmt = have or check_cache_format(cache_format)
    precompute(base, examples, path, handoff_tokens=handoff_tokens, verify=verify, log=log, cache_format=fmt)
    store = CacheStore(path, verify=verify)
    store.check_reader(base)
    store.check_format(cache_format)
    return store


__all__ = [
    "CacheStore",
    "StoreError",
    "StoreReport",
    "precompute",
    "open_store_for_training",
    "estimate_bytes",
    "existing_format",
    "store_bytes",
    "bytes_per_token",
    "entry_key",
    "kv_shape",
    "check_shards",
    "check_free_space",
    "write_shard",
    "DTYPE_NAMES",
    "FORMAT",
]
