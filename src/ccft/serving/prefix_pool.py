"""``PrefixPool``: a pool tier under each replica's ``PrefixKVStore``, shared by every replica (issue 36).

A replica whose prefix store misses a block looks in the pool before prefilling it, and a finished
prefill publishes the blocks it computed, so a session that moves to another replica (load, a dead
replica) costs a fetch instead of a prefill, and N replicas hold one pooled copy of a context every
session shares (docs/serving.md, "Prefix pool"; docs/deploy.md, "A prefix pool across replicas").

Two layers:

- a **backend** (``BlockPool``) stores opaque values by string key on an existing engine:
  ``RedisBlockPool`` (redis-py; a Redis server that outlives the serving cluster, evicted by its own
  ``maxmemory-policy``), ``RayBlockPool`` (Ray's object store inside one Ray cluster: each block is
  put once, owned by a small named directory actor that maps ``key → ObjectRef`` and evicts least
  recently used entries past ``capacity_bytes``; Ray's reference counting frees an evicted block once no
  reader holds it) and ``MemoryBlockPool`` (a dict in this process, for tests and single-process use);
- the **tier** (``PrefixPool``) turns blocks into values and back, and owns every fault rule.

Identity (K5). A block is named by its ``ccft.serving.block_keys.BlockId``, the store's own identity. The
key of a block is ``FORMAT``, the dtype, a hash of the producer (the base fingerprint in shared mode, a
decoder's key in the no-share baseline) and the block's chain hash (which already covers the producer,
the dtype, the block size and every token up to the block's end). The value repeats producer, dtype,
block size, index and token ids in its header and a fetch compares all of them with what the reader
asked for, so one producer's K/V is never served to another and K/V of a stale base (another
fingerprint) never hits.

Integrity. A value is ``MAGIC | XXH3-128(body) | body`` with ``body = header length (4 bytes,
little-endian) | JSON header | k bytes | v bytes``. A value whose digest, length or header does not
match is a miss (the block is prefilled again) and counts as an error (``corrupt`` / ``mismatch``).
The digest detects truncation and corruption, not tampering (XXH3 is not a cryptographic hash: keep the
backend on a network the replicas alone reach). It replaced BLAKE2b-256 (``ccft-kv1``), which took ~0.8
ms per 720 KiB block on a 2-core CPU, more than the fetch itself; XXH3-128 takes ~0.08 ms.

Fetching a chain. A lookup asks for the rest of a chain at once (``BlockPool.get_chain``: Redis, pipelined
GETs, ``FETCH_CHUNK`` keys per round trip; Ray, one directory call for the refs and one ``ray.get`` of the
blocks, read from the object store's shared memory without a copy), so a moved session's context costs a
few round trips, not one per block. A fetched value is not copied: its payload starts at a multiple of
``PAYLOAD_ALIGN`` bytes and the block's tensors view it (``decode_block``). The background publisher likewise
puts what is queued (up to ``PUBLISH_BATCH`` blocks) with one ``contains_many`` and one ``put_many``.

Faults. A backend that is down or slow (a connection error, or no answer within ``timeout_s``: the
backends pass it to redis-py's socket timeouts and ``ray.get``) makes the call a miss; the pool is then
skipped for ``retry_after_s`` seconds (every lookup is a local prefill, no request waits on it), one
warning is logged per outage and ``errors["unavailable"]`` counts it. Nothing in the pool can change an
answer: a hit carries the K/V a local prefill would have computed (within fp32 rounding, as a store hit).

One scheduler thread calls the tier (``/metrics`` only reads its counters); with ``background=True``
(what ``ccft serve`` uses) blocks are published by a thread of the tier, so a prefill does not wait for
the pool, and the counters are updated under a lock; a scheduler step hands its blocks to that thread when
it returns (``PrefixPool.deferred``), so publishing does not compete with the step's own first tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import warnings
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
import xxhash

from ccft.core.errors import ConfigError
from ccft.serving.block_keys import BlockId, producer_hash

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "FETCH_CHUNK",
    "PAYLOAD_ALIGN",
    "PUBLISH_BATCH",
    "BlockPool",
    "MemoryBlockPool",
    "RedisBlockPool",
    "RayBlockPool",
    "PoolUnavailableError",
    "PrefixPool",
    "encode_block",
    "decode_block",
    "pool_from_spec",
    "check_pool_spec",
]

#: wire format of a pooled block (part of every key: another format never hits)
FORMAT = "ccft-kv2-native"
MAGIC = b"CCFTKV2\n"
_DIGEST = 16
#: a value's payload starts at a multiple of this many bytes (``encode_block``): it can be viewed in place
PAYLOAD_ALIGN = 64
#: keys per round trip when a lookup fetches the rest of a chain (``BlockPool.get_chain``)
FETCH_CHUNK = 16
#: the most queued blocks the background publisher puts in one ``contains_many`` + ``put_many``
PUBLISH_BATCH = 16
#: the Ray directory actor's name and namespace (one per Ray cluster)
RAY_DIRECTORY = "ccft-prefix-pool"
RAY_NAMESPACE = "ccft"


class PoolUnavailableError(RuntimeError):
    """A backend could not answer (down, unreachable, or slower than its timeout)."""


# ------------------------------------------------------------------------------------------ values
def _digest(body) -> bytes:
    return xxhash.xxh3_128_digest(body)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _header(block: BlockId) -> dict:
    """The identity fields of a value's JSON header, in header order (``encode_block`` writes them and then
    ``shape``; ``decode_block`` compares each with the reader's)."""
    return {
        "format": FORMAT,
        "producer": block.producer,
        "dtype": str(block.dtype),
        "block_tokens": block.block_tokens,
        "index": block.index,
        "tokens": list(block.tokens),
    }


def encode_block(block: BlockId, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """One block as a pool value (module docstring, "Integrity").

    Args:
        block: the block's identity (its fields but ``chain_key`` go into the header).
        k, v: ``(L, h, block_tokens, d)`` in ``block.dtype``, any device.
    Returns:
        ``MAGIC | XXH3-128(body) | body``; ``2 * k.numel() * k.element_size()`` payload bytes, starting at an
        offset that is a multiple of ``PAYLOAD_ALIGN`` (the JSON header is padded with spaces), so a reader
        can view them in place.
    """
    header = json.dumps({**_header(block), "shape": list(k.shape)}, separators=(",", ":")).encode()
    header += b" " * (-(len(MAGIC) + _DIGEST + 4 + len(header)) % PAYLOAD_ALIGN)  # JSON allows the spaces
    body = len(header).to_bytes(4, "little") + header + _tensor_bytes(k) + _tensor_bytes(v)
    return MAGIC + _digest(body) + body


def decode_block(
    value, block: BlockId, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of a pool value, checked against the identity the reader asks for.

    Args:
        value: the value, any bytes-like object (``bytes``, a ``memoryview``, a uint8 numpy array read from
            shared memory).
        block: the block the reader asks for (every field but ``chain_key`` is compared with the header).
        device: where the tensors are put.
    Returns:
        ``k, v``: ``(L, h, block_tokens, d)`` in ``block.dtype`` on ``device``. On the CPU, when the payload's
        address is a multiple of the dtype's size (always for values ``encode_block`` wrote, read as
        ``bytes`` or from Ray's object store), they are views of ``value`` itself: no copy, and ``value``
        stays alive while they do. They must not be written in place (the store only reads its blocks).
        Otherwise (another device, a misaligned value) they are views of one new buffer, copied once.
    Raises:
        ValueError: the value is truncated or its digest does not match (message starts ``corrupt``), or
            its header names another producer, dtype, block size, index, tokens or format (``mismatch``).
    """
    head = len(MAGIC) + _DIGEST
    value = memoryview(value).cast("B")
    if len(value) < head + 4 or bytes(value[: len(MAGIC)]) != MAGIC:
        raise ValueError("corrupt: no ccft block header")
    body = value[head:]
    if _digest(body) != bytes(value[len(MAGIC) : head]):
        raise ValueError("corrupt: checksum mismatch")
    hlen = int.from_bytes(body[:4], "little")
    try:
        h = json.loads(bytes(body[4 : 4 + hlen]))
    except ValueError as e:
        raise ValueError(f"corrupt: unreadable header ({e})") from e
    for name, expected in _header(block).items():
        if h.get(name) != expected:
            raise ValueError(f"mismatch: the block's {name} differs from the reader's")
    dtype = block.dtype
    shape = [int(x) for x in h["shape"]]
    if len(shape) != 4 or shape[2] != block.block_tokens:
        raise ValueError(f"mismatch: block shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = torch.Size(shape).numel() * itemsize
    payload = body[4 + hlen :]
    if len(payload) != 2 * n:
        raise ValueError(f"corrupt: {len(payload)} payload bytes, expected {2 * n}")
    arr = np.frombuffer(payload, dtype=np.uint8)
    if torch.device(device).type == "cpu" and arr.ctypes.data % itemsize == 0:
        with warnings.catch_warnings():  # torch warns once that the (read-only) value is not writable
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(arr)  # a view: the value is never copied (nor written)
    else:
        raw = torch.empty(2 * n, dtype=torch.uint8)
        raw.numpy()[:] = arr  # the one copy (the value may be read-only)
    k = raw[:n].view(dtype).reshape(shape).to(device)
    v = raw[n:].view(dtype).reshape(shape).to(device)
    return k, v


# ---------------------------------------------------------------------------------------- backends
class BlockPool:
    """A backend: values (bytes) by key (str). ``get`` of an absent key is None; ``put`` of a present key
    keeps the stored value. Every method raises ``PoolUnavailableError`` when the backend cannot answer.
    A value read back may be any bytes-like object (``RayBlockPool``: a read-only uint8 numpy array)."""

    name = "pool"

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def get_chain(self, keys: Sequence[str]) -> list:
        """The values of the longest prefix of ``keys`` that is present, in order (fewer than ``keys`` when
        one is absent; what follows an absent key is not returned). Backends override it to fetch in
        fewer round trips; this one calls ``get`` key by key."""
        out = []
        for key in keys:
            value = self.get(key)
            if value is None:
                break
            out.append(value)
        return out

    def put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key (backends override it to ask in one round trip)."""
        return [self.contains(key) for key in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """``put`` of each ``(key, value)`` (backends override it to write in one round trip)."""
        for key, value in items:
            self.put(key, value)

    def stats(self) -> dict:
        """Backend-side figures (what this backend can tell cheaply); a plain dict."""
        return {"backend": self.name}


class MemoryBlockPool(BlockPool):
    """A dict in this process, least recently used values evicted past ``capacity_bytes`` (None: unbounded).
    Thread-safe (several stores of one process may share it)."""

    name = "memory"

    def __init__(self, capacity_bytes: int | None = None):
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.evicted = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            if key in self._values:
                return
            self._values[key] = bytes(value)
            self.bytes_in_use += len(value)
            cap = self.capacity_bytes
            while cap is not None and self.bytes_in_use > cap and self._values:
                _, old = self._values.popitem(last=False)
                self.bytes_in_use -= len(old)
                self.evicted += 1

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._values

    def stats(self) -> dict:
        with self._lock:
            return {
                "backend": self.name,
                "blocks": len(self._values),
                "bytes_in_use": self.bytes_in_use,
                "evicted_blocks": self.evicted,
            }


class RedisBlockPool(BlockPool):
    """A Redis server (redis-py) at ``url`` (``redis://HOST:PORT[/DB]``); values under ``ccft:`` keys.

    Eviction is the server's (run it with ``--maxmemory`` and ``--maxmemory-policy allkeys-lru``).

    Args:
        url: the server's URL. timeout_s: socket connect / read timeout (a slower answer is a failure).
        client: a ready ``redis.Redis`` (e.g. ``fakeredis.FakeRedis`` in tests) instead of ``url``.
    Raises:
        ConfigError: redis-py is not installed (the ``pool`` extra).
    """

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379", timeout_s: float = 0.5, client=None):
        try:
            import redis
        except ImportError as e:
            raise ConfigError(
                "--prefix-pool redis://... needs redis-py (the `pool` extra): pip install 'ccft[pool]'"
            ) from e
        self._errors = (redis.exceptions.RedisError, OSError)
        self.url = url
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=float(timeout_s), socket_connect_timeout=float(timeout_s)
        )

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as e:
            raise PoolUnavailableError(f"redis at {self.url}: {type(e).__name__}: {e}") from e

    def get(self, key: str) -> bytes | None:
        return self._call(self.client.get, "ccft:" + key)

    def get_chain(self, keys: Sequence[str]) -> list:
        """Pipelined GETs, ``FETCH_CHUNK`` keys per round trip (one huge MGET reply is slower to parse),
        until a chunk holds an absent key."""

        def chunk(part):
            pipe = self.client.pipeline(transaction=False)
            for key in part:
                pipe.get("ccft:" + key)
            return pipe.execute()

        out = []
        for s in range(0, len(keys), FETCH_CHUNK):
            for value in self._call(chunk, keys[s : s + FETCH_CHUNK]):
                if value is None:
                    return out
                out.append(value)
        return out

    def put(self, key: str, value: bytes) -> None:
        self._call(lambda: self.client.set("ccft:" + key, value, nx=True))

    def contains(self, key: str) -> bool:
        return bool(self._call(self.client.exists, "ccft:" + key))

    def _pipelined(self, calls) -> list:
        def run():
            pipe = self.client.pipeline(transaction=False)
            for fn, args, kwargs in calls(pipe):
                fn(*args, **kwargs)
            return pipe.execute()

        return self._call(run)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Pipelined EXISTS (one round trip)."""
        return [bool(x) for x in self._pipelined(lambda p: [(p.exists, ("ccft:" + k,), {}) for k in keys])]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Pipelined ``SET NX`` (one round trip)."""
        self._pipelined(lambda p: [(p.set, ("ccft:" + k, v), {"nx": True}) for k, v in items])


class _RayDirectory:
    """The Ray actor behind ``RayBlockPool``: ``key → [ObjectRef]`` in LRU order, evicted past a byte
    capacity. It puts every block into the object store itself, so it owns them and a block outlives the
    replica that published it (Ray ≥ 2.56 has no ``ray.put(_owner=)``); dropping an entry drops the
    pool's reference, and Ray frees the object once no reader holds one."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self.entries: OrderedDict[str, tuple[list, int]] = OrderedDict()
        self.bytes_in_use = 0
        self.evicted = 0

    def lookup(self, key: str):
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]  # [ref]: a list, so Ray hands the ref over instead of the value

    def lookup_chain(self, keys: list[str]) -> list:
        """The refs of the longest present prefix of ``keys`` (a list of refs: handed over, not resolved)."""
        refs = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            self.entries.move_to_end(key)
            refs.append(entry[0][0])
        return refs

    def register(self, key: str, value: bytes) -> bool:
        import ray

        if key in self.entries:
            return False
        # this actor owns the object; a numpy array is read back from shared memory without a copy
        self.entries[key] = ([ray.put(np.frombuffer(value, dtype=np.uint8))], len(value))
        self.bytes_in_use += len(value)
        while self.bytes_in_use > self.capacity_bytes and self.entries:
            _, (_, old) = self.entries.popitem(last=False)
            self.bytes_in_use -= old
            self.evicted += 1
        return True

    def contains(self, key: str) -> bool:
        return key in self.entries

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [key in self.entries for key in keys]

    def register_many(self, items: list) -> int:
        """``register`` of each ``(key, value)``; the number put."""
        return sum(self.register(key, value) for key, value in items)

    def stats(self) -> dict:
        return {
            "blocks": len(self.entries),
            "bytes_in_use": self.bytes_in_use,
            "evicted_blocks": self.evicted,
        }


class RayBlockPool(BlockPool):
    """Ray's object store in the Ray cluster this process is connected to (``ray.init`` done), through the
    named directory actor ``RAY_DIRECTORY`` (created by the first replica, detached, ``num_cpus=0``).

    Args:
        capacity_bytes: bytes of blocks the directory keeps (LRU past it), used when it creates it.
        timeout_s: the longest wait for the directory or a block (``ray.get(timeout=)``).
        ready_timeout_s: the longest wait, here, for the directory actor to start (a warning after it).
    """

    name = "ray"

    def __init__(self, capacity_bytes: int = 1 << 30, timeout_s: float = 0.5, ready_timeout_s: float = 60.0):
        import ray

        self._ray = ray
        self.timeout_s = float(timeout_s)
        self.directory = (
            ray.remote(_RayDirectory)
            .options(
                name=RAY_DIRECTORY,
                namespace=RAY_NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
            )
            .remote(int(capacity_bytes))
        )
        try:  # the first replica starts the actor (seconds): wait here, not in a request's lookup
            ray.get(self.directory.contains.remote(""), timeout=max(self.timeout_s, float(ready_timeout_s)))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            log.warning("prefix pool (ray): the directory actor is not ready (%s); lookups may miss", e)

    def _get(self, ref):
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            raise PoolUnavailableError(f"ray pool: {type(e).__name__}: {e}") from e

    def get(self, key: str) -> bytes | None:
        refs = self._get(self.directory.lookup.remote(key))
        return None if refs is None else self._get(refs[0])

    def get_chain(self, keys: Sequence[str]) -> list:
        """One directory call for the refs, one ``ray.get`` for the blocks (zero-copy numpy arrays)."""
        refs = self._get(self.directory.lookup_chain.remote(list(keys)))
        return list(self._get(refs)) if refs else []

    def put(self, key: str, value: bytes) -> None:
        if self.contains(key):
            return
        self._get(self.directory.register.remote(key, bytes(value)))

    def contains(self, key: str) -> bool:
        return bool(self._get(self.directory.contains.remote(key)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One directory call."""
        return [bool(x) for x in self._get(self.directory.contains_many.remote(list(keys)))]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """One directory call (present keys keep their value)."""
        if items:
            self._get(self.directory.register_many.remote([(k, bytes(v)) for k, v in items]))

    def stats(self) -> dict:
        try:
            return {"backend": self.name, **self._get(self.directory.stats.remote())}
        except PoolUnavailableError:
            return {"backend": self.name}


# ---------------------------------------------------------------------------------------------- tier
class PrefixPool:
    """The pool tier of a ``PrefixKVStore`` (``PrefixKVStore(pool=...)``): keys, values, faults, counters.

    Args:
        backend: a ``BlockPool``.
        retry_after_s: after a backend failure, seconds during which the pool is skipped (no request
            waits on a pool known to be down).
        device: where fetched blocks are put (the engine's device).
        background: publish from a thread of this tier (the prefill that computed the blocks does not
            wait for the pool; ``flush`` waits); False: ``publish`` puts the block before it returns.
        max_pending_bytes: ``background``: the most bytes of blocks queued (more are dropped).
    Counters (``stats()``): ``hit_blocks`` (usable blocks fetched), ``miss_blocks`` (fetches whose chain
    ended before the last block asked for: at most one per fetch), ``fetched_bytes``, ``fetch_seconds``
    (sum over fetches, hits and misses) and ``fetches`` (backend calls: one per lookup that reached the pool),
    ``published_blocks`` / ``published_bytes`` (blocks this tier put), ``publish_seconds`` (sum over every
    publish tried, the check for a present block included), ``present_blocks`` (publishes the pool
    already held), ``dropped_blocks`` / ``pending_bytes`` (background: blocks dropped, the queue full;
    bytes queued), ``skipped`` (lookups and publishes not tried: the pool was down), ``errors`` by kind
    (``unavailable``, ``corrupt``, ``mismatch``), ``up``.
    """

    def __init__(
        self,
        backend: BlockPool,
        *,
        retry_after_s: float = 5.0,
        device: torch.device | str = "cpu",
        background: bool = False,
        max_pending_bytes: int = 256 << 20,
    ):
        self.backend = backend
        self.retry_after_s = float(retry_after_s)
        self.device = torch.device(device)
        self.down_until = 0.0
        self.hit_blocks = self.miss_blocks = self.fetched_bytes = self.fetches = 0
        self.published_blocks = self.published_bytes = self.present_blocks = self.skipped = 0
        self.dropped_blocks = self.pending_bytes = 0
        self.fetch_seconds = self.publish_seconds = 0.0
        self.errors = {"unavailable": 0, "corrupt": 0, "mismatch": 0}
        self.max_pending_bytes = int(max_pending_bytes)
        self._warned = False
        self._lock = threading.Lock()  # counters and the down state, shared with the publisher thread
        self._queue: queue.Queue | None = queue.Queue() if background else None
        self._thread: threading.Thread | None = None
        self._deferring = 0  # depth of ``deferred()`` blocks (the scheduler's thread)
        self._held: list = []  # ``(nbytes, item)`` published inside them, queued when the outermost exits

    def _add(self, name: str, n: float = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    @staticmethod
    def key(block: BlockId) -> str:
        """The pool key of a block: format, dtype, producer hash, chain hash (module docstring)."""
        who = producer_hash(block.producer, 16)
        return f"{FORMAT}:{str(block.dtype).removeprefix('torch.')}:{who}:{block.chain_key.hex()}"

    @property
    def up(self) -> bool:
        """False while the pool is skipped after a failure."""
        return time.monotonic() >= self.down_until

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.errors["unavailable"] += 1
            self.down_until = time.monotonic() + self.retry_after_s
            first, self._warned = not self._warned, True
        if first:
            log.warning(
                "prefix pool (%s) unavailable, serving with local prefill; retried every %.0f s: %s",
                self.backend.name,
                self.retry_after_s,
                e,
            )

    def _recovered(self) -> None:
        with self._lock:
            was, self._warned = self._warned, False
        if was:
            log.warning("prefix pool (%s) reachable again", self.backend.name)

    def fetch_chain(self, blocks: Sequence[BlockId]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Consecutive blocks of a chain from the pool, as far as the pool holds them, in one backend call
        (``BlockPool.get_chain``).

        Args:
            blocks: the blocks wanted, in chain order (indices ``i, i + 1, ..``).
        Returns:
            ``[(k, v), ...]``, each ``(L, h, block_tokens, d)`` on ``device``: the longest usable prefix of
            the blocks asked for (empty: a miss, a pool that is down, or a bad first value). A value that
            fails its checks (counted as ``corrupt`` / ``mismatch``) ends the chain there.
        Counters: one ``fetches`` per call; ``hit_blocks`` per block returned; one ``miss_blocks`` when the
        chain ends before the last block asked for.
        """
        if not blocks:
            return []
        if not self.up:
            self._add("skipped")
            return []
        t0 = time.perf_counter()
        keys = [self.key(b) for b in blocks]
        try:
            values = self.backend.get_chain(keys)
        except PoolUnavailableError as e:
            self.fetch_seconds += time.perf_counter() - t0
            self.fetches += 1
            self._failed(e)
            return []
        self._recovered()
        out = []
        for j, value in enumerate(values):
            try:
                kv = decode_block(value, blocks[j], self.device)
            except ValueError as e:
                kind = "mismatch" if str(e).startswith("mismatch") else "corrupt"
                self.errors[kind] += 1
                log.warning(
                    "prefix pool: block %s ignored (%s); it is prefilled again", blocks[j].chain_key.hex(), e
                )
                break
            out.append(kv)
            self.fetched_bytes += len(memoryview(value).cast("B"))
        self.fetch_seconds += time.perf_counter() - t0
        self.fetches += 1
        self.hit_blocks += len(out)
        if len(out) < len(blocks):
            self.miss_blocks += 1
        return out

    def publish(self, block: BlockId, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Put a block into the pool unless it holds it already (never raises).

        ``k``, ``v``: ``(L, h, block_tokens, d)`` in ``block.dtype``, any device.

        With ``background`` the block is queued for this tier's publisher thread (``k``/``v`` must not be
        written afterwards: a store's blocks never are) and True is returned; a block that would take the
        queue past ``max_pending_bytes`` is dropped (``dropped_blocks``; the next prefill of it publishes
        it). Inline, False when it was not put (present, or the pool is down).
        """
        if not self.up:
            self._add("skipped")
            return False
        item = (block, k, v)
        if self._queue is None:
            return self._publish(*item)
        nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        with self._lock:
            if self.pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped_blocks += 1
                return False
            self.pending_bytes += nbytes
            if self._deferring:
                self._held.append((nbytes, item))
                return True
        self._enqueue([(nbytes, item)])
        return True

    def _enqueue(self, entries: list) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._publisher, name="ccft-prefix-pool", daemon=True)
            self._thread.start()
        for entry in entries:
            self._queue.put(entry)

    @contextlib.contextmanager
    def deferred(self):
        """Blocks published inside this block reach the publisher thread when it exits (the outermost one,
        when nested), not at once: the work they computed for finishes first, with the cores to itself.

        ``ccft.serving.Scheduler.step`` runs inside one, so a step's prefill publishes its blocks after
        the step has delivered its tokens (the first tokens of the requests it prefilled included), while
        the next step runs (docs/serving.md, "Prefix pool"). The queue's byte limit applies at ``publish``.
        No effect inline (``background=False``: ``publish`` puts before it returns).
        """
        if self._queue is None:
            yield
            return
        with self._lock:
            self._deferring += 1
        try:
            yield
        finally:
            held = []
            with self._lock:
                self._deferring -= 1
                if not self._deferring:
                    held, self._held = self._held, []
            if held:
                self._enqueue(held)

    def _publisher(self) -> None:
        while True:  # a block, then whatever else is queued (up to PUBLISH_BATCH): one round trip or two
            batch = [self._queue.get()]
            while len(batch) < PUBLISH_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if self.up:
                    self._publish_many([item for _, item in batch])
                else:
                    self._add("skipped", len(batch))
            except Exception as e:  # noqa: BLE001 - a publish must never take the thread down
                log.warning("prefix pool: blocks were not published: %s: %s", type(e).__name__, e)
            finally:
                for nbytes, _ in batch:
                    self._add("pending_bytes", -nbytes)
                    self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is published (or given up); no-op inline. Blocks held by a
        ``deferred()`` block that has not exited yet are not queued, so not waited for."""
        if self._queue is not None:
            self._queue.join()

    def _publish(self, block: BlockId, k: torch.Tensor, v: torch.Tensor) -> bool:
        return self._publish_many([(block, k, v)]) == 1

    def _publish_many(self, items: Sequence[tuple[BlockId, torch.Tensor, torch.Tensor]]) -> int:
        """Put the blocks ``(block, k, v)`` the pool lacks (one ``contains_many`` and one ``put_many``); the
        number put."""
        keys = [self.key(block) for block, _, _ in items]
        t0 = time.perf_counter()
        try:
            present = self.backend.contains_many(keys)
            values = [
                (key, encode_block(*item))
                for key, item, there in zip(keys, items, present, strict=True)
                if not there
            ]
            if values:
                self.backend.put_many(values)
        except PoolUnavailableError as e:
            self._failed(e)
            return 0
        finally:
            self._add("publish_seconds", time.perf_counter() - t0)
        self._recovered()
        with self._lock:
            self.present_blocks += len(items) - len(values)
            self.published_blocks += len(values)
            self.published_bytes += sum(len(v) for _, v in values)
        return len(values)

    def stats(self) -> dict:
        """The counters (class docstring) and the backend's name; a plain dict (JSON-ready)."""
        return {
            "backend": self.backend.name,
            "up": self.up,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "fetches": self.fetches,
            "fetch_seconds": self.fetch_seconds,
            "fetched_bytes": self.fetched_bytes,
            "published_blocks": self.published_blocks,
            "published_bytes": self.published_bytes,
            "publish_seconds": self.publish_seconds,
            "present_blocks": self.present_blocks,
            "dropped_blocks": self.dropped_blocks,
            "pending_bytes": self.pending_bytes,
            "skipped": self.skipped,
            "errors": dict(self.errors),
        }


# ----------------------------------------------------------------------------------------- config
def check_pool_spec(spec: str | None, timeout_s: float = 0.5) -> str | None:
    """Validate ``--prefix-pool`` (and ``--prefix-pool-timeout-ms``) without connecting: None / ``""`` (no
    pool), ``ray`` or a ``redis://HOST:PORT[/DB]`` URL; returns the backend name (or None).

    Raises:
        ConfigError: anything else, a timeout ≤ 0, or ``redis://`` without redis-py installed (names the
            extra).
    """
    if not spec:
        return None
    spec = str(spec).strip()
    if not float(timeout_s) > 0:
        raise ConfigError(
            f"--prefix-pool-timeout-ms {float(timeout_s) * 1000:g}: use a positive number of milliseconds "
            "(a pool slower than that is skipped and the request prefills locally)"
        )
    if spec == "ray":
        return spec
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"--prefix-pool {spec}: redis-py is not installed; pip install 'ccft[pool]' "
                "(or drop the option)"
            ) from e
        return "redis"
    raise ConfigError(
        f"--prefix-pool {spec!r}: use redis://HOST:PORT[/DB] (a Redis server) or ray (Ray's object store, "
        "with --replicas N)"
    )


def pool_from_spec(
    spec: str,
    *,
    timeout_s: float = 0.5,
    capacity_bytes: int = 1 << 30,
    device: torch.device | str = "cpu",
    background: bool = False,
) -> PrefixPool:
    """The ``PrefixPool`` of a ``--prefix-pool`` value (``check_pool_spec``); redis-py connects at the first
    fetch or publish, the Ray backend finds or creates its directory actor now.

    Args:
        timeout_s: a backend answer slower than this is a failure (the request prefills locally).
        capacity_bytes: ``ray``: bytes of blocks the directory keeps (LRU past it).
        device: where fetched blocks are put (the engine's device).
        background: publish from a thread (``PrefixPool``).
    Raises:
        ConfigError: as ``check_pool_spec``; no ``spec``.
    """
    kind = check_pool_spec(spec, timeout_s)
    if kind is None:
        raise ConfigError("no --prefix-pool given")
    if kind == "redis":
        backend: BlockPool = RedisBlockPool(spec, timeout_s=timeout_s)
    else:
        backend = RayBlockPool(capacity_bytes, timeout_s=timeout_s)
    return PrefixPool(backend, device=device, background=background)
