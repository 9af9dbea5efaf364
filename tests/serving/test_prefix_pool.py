"""The prefix pool under each replica's prefix store (issue 36; ``ccft.serving.prefix_pool``).

Default (no Ray, no Redis server): the value format (round trip, checksum, identity in the header),
keys that keep producers, dtypes, block sizes and formats apart (K5), two stores sharing one pool
(the in-process backend and redis-py over fakeredis), a corrupt or truncated block (a miss, counted,
recomputed), a pool that is down (local prefill, one warning, a metric, the pool tried again later),
and the moved session through two engines and two schedulers sharing a pool: the second serves the
context from the pool without prefilling it and decodes what an offline engine decodes.

Slow: Ray's object store (a local Ray instance: a block put once, the directory's LRU by bytes, a
block that outlives the process that put it) and a real ``redis-server`` on 127.0.0.1 (skipped when
the binary is absent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.serving import PrefixKVStore
from ccft.serving import prefix_pool as P
from ccft.serving.block_keys import BlockId
from ccft.serving.scheduler import Scheduler, ServeRequest
from conftest import make_lora, make_tiny_folder

fakeredis = pytest.importorskip("fakeredis", reason="the test extra installs fakeredis")

L, H, D = 2, 2, 3  # synthetic geometry: layers, KV heads, head dim
NAN = float("nan")
N_NEW = 6


def _kv(n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g).to(dtype), torch.randn(L, H, n, D, generator=g).to(dtype)


def _put(store, producer, tokens, seed=0, dtype=torch.float32):
    k, v = _kv(len(tokens), seed, dtype)
    store.release(store.insert(producer, dtype, tokens, k, v))
    return k, v


def _bid(producer, dtype, block_tokens, index, tokens, chain_key=bytes(16)) -> BlockId:
    """A block's identity (the value format does not carry ``chain_key``: the key does)."""
    return BlockId(chain_key, producer, dtype, block_tokens, index, tokens)


def _redis_pool(server=None, **kw) -> P.PrefixPool:
    return P.PrefixPool(P.RedisBlockPool(client=fakeredis.FakeRedis(server=server)), **kw)


# ------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_value_round_trip_and_checks(dtype):
    k, v = _kv(4, 1, dtype)
    ident = _bid("base-fp", dtype, 4, 2, [5, 6, 7, 8])
    value = P.encode_block(ident, k, v)
    k2, v2 = P.decode_block(value, ident)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)  # bit for bit
    assert len(value) > 2 * k.numel() * k.element_size()
    for bad in (_bid("other-fp", dtype, 4, 2, [5, 6, 7, 8]), _bid("base-fp", dtype, 4, 3, [5, 6, 7, 8])):
        with pytest.raises(ValueError, match="^mismatch"):
            P.decode_block(value, bad)
    with pytest.raises(ValueError, match="^mismatch: the block's tokens"):
        P.decode_block(value, _bid("base-fp", dtype, 4, 2, [5, 6, 7, 9]))
    other = torch.float16 if dtype != torch.float16 else torch.float32
    with pytest.raises(ValueError, match="^mismatch: the block's dtype"):
        P.decode_block(value, _bid("base-fp", other, 4, 2, [5, 6, 7, 8]))
    flipped = bytearray(value)
    flipped[-3] ^= 0x01
    for broken in (bytes(flipped), value[:-5], value[:20], b"", b"x" * 100):
        with pytest.raises(ValueError, match="^corrupt"):
            P.decode_block(broken, ident)
    # the payload starts at a multiple of PAYLOAD_ALIGN, so the tensors view the value: no copy
    ro = np.frombuffer(value, dtype=np.uint8)  # read-only (Ray hands back uint8 arrays over shared memory)
    assert not ro.flags.writeable
    head = len(P.MAGIC) + 16
    payload_at = head + 4 + int.from_bytes(value[head : head + 4], "little")
    assert payload_at % P.PAYLOAD_ALIGN == 0
    for buf in (value, ro):
        k3, v3 = P.decode_block(buf, ident)
        assert torch.equal(k3, k) and torch.equal(v3, v)
        base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        assert k3.data_ptr() == base + payload_at  # a view of the value itself
        assert v3.data_ptr() == base + payload_at + k.numel() * k.element_size()
    # a payload at an address that is not a multiple of the dtype's size: copied once, equal
    if k.element_size() > 1:
        shifted = np.empty(len(value) + 1, dtype=np.uint8)[1:]
        shifted[:] = np.frombuffer(value, dtype=np.uint8)
        k4, v4 = P.decode_block(shifted, ident)
        assert torch.equal(k4, k) and torch.equal(v4, v)
        assert k4.data_ptr() != shifted.ctypes.data + payload_at
        k4.add_(1)  # its own memory: the value is unchanged
        assert torch.equal(P.decode_block(shifted, ident)[0], k)


def test_block_id_keys_and_values_are_unchanged():
    """A ``BlockId`` names a block as the six separate arguments it replaced did: the pool key and the value
    of a fixed block are the ones ``PrefixPool.key(chain_key, producer, dtype)`` and ``encode_block(producer,
    dtype, block_tokens, index, tokens, k, v)`` gave (commit 20eb885), so a pool filled before still hits."""
    block = BlockId(bytearray(range(16)), "base-fp", torch.float32, 4, 2, [5, 6, 7, 8])
    assert block.chain_key == bytes(range(16)) and block.tokens == (5, 6, 7, 8)  # normalised
    assert block == BlockId(bytes(range(16)), "base-fp", torch.float32, 4, 2, (5, 6, 7, 8))
    assert hash(block) == hash(BlockId(bytes(range(16)), "base-fp", torch.float32, 4, 2, range(5, 9)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.index = 3
    assert P.PrefixPool.key(block) == (
        "ccft-kv2-native:float32:c3535cd6986b5e7e4501f15fbeb8ea20:000102030405060708090a0b0c0d0e0f"
    )
    k = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).reshape(2, 2, 4, 3)
    value = P.encode_block(block, k, -k)
    assert len(value) == 576 and (len(value) - 2 * k.numel() * 4) % P.PAYLOAD_ALIGN == 0
    # the value without the header's alignment spaces (and its digest) is the one written before them
    # (sha256 pinned then): the same format, so values already in a pool still decode
    head = len(P.MAGIC) + 16
    hlen = int.from_bytes(value[head : head + 4], "little")
    header = value[head + 4 : head + 4 + hlen]
    assert header.rstrip(b" ") != header
    body = len(header.rstrip(b" ")).to_bytes(4, "little") + header.rstrip(b" ") + value[head + 4 + hlen :]
    before = P.MAGIC + xxhash.xxh3_128_digest(body) + body
    assert len(before) == 549
    assert (
        hashlib.sha256(before).hexdigest()
        == "41d16289e887c915de97e1edcc984f420bbe05bc8484d20d139738067e87f365"
    )
    for old_value in (before, value):
        k2, v2 = P.decode_block(old_value, block)
        assert torch.equal(k2, k) and torch.equal(v2, -k)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_get_chain_returns_the_longest_present_prefix(backend, monkeypatch):
    """``get_chain`` answers in order up to the first absent key (Redis: pipelined in chunks; a chunk size of
    2 makes the chain cross chunk boundaries), and a store's lookup reaches the pool in one call."""
    monkeypatch.setattr(P, "FETCH_CHUNK", 2)
    pool = P.MemoryBlockPool() if backend == "memory" else P.RedisBlockPool(client=fakeredis.FakeRedis())
    for i in (0, 1, 2, 3, 5):
        pool.put(f"key{i}", bytes([i]) * 10)
    assert pool.get_chain([f"key{i}" for i in range(7)]) == [bytes([i]) * 10 for i in range(4)]
    assert pool.get_chain(["key4", "key5"]) == [] and pool.get_chain([]) == []
    assert pool.get_chain(["key5"]) == [bytes([5]) * 10]
    assert pool.contains_many(["key0", "key4", "key5"]) == [True, False, True]
    pool.put_many([("key4", b"four"), ("key5", b"not kept")])  # a present key keeps its value
    assert pool.get_chain(["key4", "key5"]) == [b"four", bytes([5]) * 10]
    shared = P.MemoryBlockPool()
    a, b = PrefixKVStore(4, pool=P.PrefixPool(shared)), PrefixKVStore(4, pool=P.PrefixPool(shared))
    toks = list(range(40))  # 10 blocks
    k, v = _put(a, "fp", toks)
    got = b.match("fp", torch.float32, toks + [1, 2, 3, 4])  # 10 blocks in the pool, the 11th nowhere
    assert len(got) == 10 and b.pool.fetches == 1 and b.pool.hit_blocks == 10 and b.pool.miss_blocks == 1
    assert torch.equal(torch.cat([blk.k for blk in got], dim=2), k)
    assert torch.equal(torch.cat([blk.v for blk in got], dim=2), v)


# --------------------------------------------------------------------------------------- two stores
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_two_stores_share_blocks_through_the_pool(backend):
    """Store A publishes what it inserts; store B continues its (empty) chain from the pool with A's K/V,
    stores the blocks, and its next lookup is local."""
    if backend == "memory":
        shared = P.MemoryBlockPool()
        a, b = PrefixKVStore(4, pool=P.PrefixPool(shared)), PrefixKVStore(4, pool=P.PrefixPool(shared))
    else:
        server = fakeredis.FakeServer()
        a, b = PrefixKVStore(4, pool=_redis_pool(server)), PrefixKVStore(4, pool=_redis_pool(server))
    assert a.pool.backend.name == b.pool.backend.name == backend
    toks = list(range(100, 114))  # 3 full blocks + 2 tokens
    k, v = _put(a, "fp", toks)
    assert a.pool.published_blocks == 3 and a.pool.published_bytes > 3 * 2 * L * H * 4 * D * 4
    got = b.match("fp", torch.float32, toks)
    assert [blk.index for blk in got] == [0, 1, 2] and b.pool_hit_blocks == 3 and b.hit_blocks == 3
    for blk in got:
        s = blk.index * 4
        assert torch.equal(blk.k, k[:, :, s : s + 4]) and torch.equal(blk.v, v[:, :, s : s + 4])
    assert b.pool.stats()["hit_blocks"] == 3 and b.pool.fetched_bytes == a.pool.published_bytes
    assert len(b) == 3 and b.stats()["pool"]["errors"] == {"unavailable": 0, "corrupt": 0, "mismatch": 0}
    b.release(got)
    again = b.match("fp", torch.float32, toks + [1, 2])  # local now; block 3 is in neither place
    assert len(again) == 3 and b.pool_hit_blocks == 3 and b.pool.miss_blocks == 1
    b.release(again)
    # B extends the chain and publishes only the new block; A then finds it in the pool
    ext = toks[:12] + [7, 7, 7, 7]
    _put(b, "fp", ext, seed=3)
    assert b.pool.published_blocks == 1
    got = a.match("fp", torch.float32, ext)
    assert len(got) == 4 and a.pool_hit_blocks == 1
    a.release(got)


def test_pool_blocks_fit_the_budget_without_evicting_the_chain():
    """A store whose budget holds 3 blocks, 2 of a chain local and 2 more in the pool: the third comes from
    the pool, the fourth does not fit (the chain's own blocks, referenced, are never evicted for it)."""
    shared = P.MemoryBlockPool()
    toks = list(range(16))
    _put(PrefixKVStore(4, pool=P.PrefixPool(shared)), "fp", toks)  # all 4 blocks in the pool
    b = PrefixKVStore(4, budget_bytes=3 * 2 * L * H * 4 * D * 4, pool=P.PrefixPool(P.MemoryBlockPool()))
    _put(b, "fp", toks[:8])  # blocks 0-1 local (its own pool is another one)
    b.pool = P.PrefixPool(shared)
    got = b.match("fp", torch.float32, toks)
    assert [blk.index for blk in got] == [0, 1, 2] and all(blk.stored for blk in got)
    assert b.pool_hit_blocks == 1 and b.evicted_blocks == 0 and len(b) == 3
    b.release(got)


def test_background_publishing(monkeypatch):
    """``background=True``: insert returns before the pool has the blocks; ``flush`` waits; a queue past
    ``max_pending_bytes`` drops blocks (counted); a pool that is down is skipped by the thread too."""
    server = fakeredis.FakeServer()
    a = PrefixKVStore(4, pool=_redis_pool(server, background=True))
    toks = list(range(100, 112))
    k, v = _put(a, "fp", toks)
    a.pool.flush()
    st = a.pool.stats()
    assert st["published_blocks"] == 3 and st["pending_bytes"] == 0 and st["dropped_blocks"] == 0
    b = PrefixKVStore(4, pool=_redis_pool(server))
    got = b.match("fp", torch.float32, toks)
    assert len(got) == 3 and torch.equal(got[2].v, v[:, :, 8:12])

    class Gated(P.MemoryBlockPool):  # the publisher thread waits in its first call until the gate opens
        gate = threading.Event()

        def contains(self, key):
            self.gate.wait()
            return super().contains(key)

    block = 2 * L * H * 4 * D * 4
    small = PrefixKVStore(4, pool=P.PrefixPool(Gated(), background=True, max_pending_bytes=2 * block))
    _put(small, "fp2", list(range(40)))  # 10 blocks while the thread is stuck: 2 fit the queue
    st = small.pool.stats()
    assert st["dropped_blocks"] == 8 and st["pending_bytes"] == 2 * block
    Gated.gate.set()
    small.pool.flush()
    assert small.pool.published_blocks == 2 and small.pool.pending_bytes == 0
    server.connected = False
    monkeypatch.setattr(P, "PUBLISH_BATCH", 1)  # one block per put: the first fails, the next two are skipped
    down = PrefixKVStore(4, pool=_redis_pool(server, background=True, retry_after_s=3600.0))
    _put(down, "fp3", list(range(12)))
    down.pool.flush()
    st = down.pool.stats()
    assert st["errors"]["unavailable"] == 1 and st["published_blocks"] == 0 and st["skipped"] == 2


def test_pool_keys_keep_producers_dtypes_block_sizes_and_formats_apart(monkeypatch):
    """K5: a block another producer, dtype, block size or value format wrote is never served."""
    shared = P.MemoryBlockPool()
    a = PrefixKVStore(4, pool=P.PrefixPool(shared))
    toks = list(range(8))
    _put(a, "base-fp", toks)
    _put(a, "base-fp", toks, dtype=torch.bfloat16)
    assert shared.stats()["blocks"] == 4
    for producer, dtype, bt in (
        ("other-fp", torch.float32, 4),  # another base (a stale fingerprint) or a decoder's own key
        ("base-fp+math/1", torch.float32, 4),
        ("base-fp", torch.float16, 4),  # another dtype
        ("base-fp", torch.float32, 2),  # another block size
    ):
        b = PrefixKVStore(bt, pool=P.PrefixPool(shared))
        assert b.match(producer, dtype, toks) == [] and b.pool_hit_blocks == 0 and len(b) == 0
        assert b.pool.miss_blocks == 1 and b.pool.errors == {"unavailable": 0, "corrupt": 0, "mismatch": 0}
    b = PrefixKVStore(4, pool=P.PrefixPool(shared))
    assert len(b.match("base-fp", torch.bfloat16, toks)) == 2  # the same identity does hit
    assert b.blocks()[0].k.dtype == torch.bfloat16
    # another value format: its key differs, so nothing published under it is found now
    current = P.FORMAT
    monkeypatch.setattr(P, "FORMAT", "ccft-kv0-other")
    c = PrefixKVStore(4, pool=P.PrefixPool(shared))
    assert c.match("base-fp", torch.float32, toks) == [] and c.pool.miss_blocks == 1
    # a value whose header names another producer than its key (a forged or mixed-up entry): a mismatch
    monkeypatch.setattr(P, "FORMAT", current)
    k, v = _kv(4, 9)
    d = PrefixKVStore(4, pool=P.PrefixPool(P.MemoryBlockPool()))
    key = d.chain_keys("victim", torch.float32, [1, 2, 3, 4])[0]
    d.pool.backend.put(
        P.PrefixPool.key(_bid("victim", torch.float32, 4, 0, [1, 2, 3, 4], key)),
        P.encode_block(_bid("thief", torch.float32, 4, 0, [1, 2, 3, 4], key), k, v),
    )
    assert d.match("victim", torch.float32, [1, 2, 3, 4]) == [] and d.pool.errors["mismatch"] == 1


def test_corrupt_and_truncated_blocks_are_misses_counted_as_errors(caplog):
    server = fakeredis.FakeServer()
    a, b = PrefixKVStore(4, pool=_redis_pool(server)), PrefixKVStore(4, pool=_redis_pool(server))
    toks = list(range(12))
    k, v = _put(a, "fp", toks)
    client = fakeredis.FakeRedis(server=server)
    keys = a.chain_keys("fp", torch.float32, toks)
    names = [
        "ccft:" + P.PrefixPool.key(_bid("fp", torch.float32, 4, i, toks[4 * i : 4 * i + 4], key))
        for i, key in enumerate(keys)
    ]
    value = client.get(names[1])
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 0x40
    client.set(names[1], bytes(flipped))  # block 1: one bit flipped in its K/V
    client.set(names[2], value[:-7])  # block 2: truncated (and block 1's value, so also a wrong digest)
    with caplog.at_level(logging.WARNING, logger="ccft.serving.prefix_pool"):
        got = b.match("fp", torch.float32, toks)
    assert len(got) == 1 and torch.equal(got[0].k, k[:, :, :4])  # the chain stops at the bad block
    assert b.pool.errors == {"unavailable": 0, "corrupt": 1, "mismatch": 0} and b.pool.miss_blocks == 1
    assert "checksum mismatch" in caplog.text
    b.release(got)


# ------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    path = make_tiny_folder(tmp_path_factory.mktemp("pool_sharp"), tokenizer, seed=3, scale=30.0)
    base = ccft.load_base(str(path))
    return base, {"math": make_lora(base, "math", 1, 4)}


@pytest.fixture(scope="module")
def prompt(gsm8k_rows, tokenizer):
    ids = tokenize_prompt(
        tokenizer, gsm8k_rows[0]["prompt"] + "\n" + gsm8k_rows[1]["prompt"], chat_template=False
    )
    return ids[:40]


def _engine(base, decs):
    return ccft.SharedPrefillEngine(base, decoders=decs, fill=NAN)


def _greedy(eng, h, name):
    return [(g.token_ids, g.finish_reason) for g in eng.generate(h, decoder=name, max_new_tokens=N_NEW)]


def _kv_close(h, ref):
    for i in range(h.engine.num_layers):
        for x, y in ((h.keys(i), ref.keys(i)), (h.values(i), ref.values(i))):
            assert torch.isfinite(x).all()
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_moved_session_is_served_from_the_pool_without_prefill(world, prompt):
    """Engine A prefills a context (its blocks go to the pool); engine B, with an empty store of its own,
    copies all of them from the pool (hit = every full block, B's store counts pool hits) and both decoders
    decode what a plain prefill decodes."""
    base, decs = world
    server = fakeredis.FakeServer()
    ea, eb = _engine(base, decs), _engine(base, decs)
    sa, sb = PrefixKVStore(4, pool=_redis_pool(server)), PrefixKVStore(4, pool=_redis_pool(server))
    p = prompt[:31]  # prefix 30 tokens: 7 full blocks
    ha, hit = ea.prefill_cached(p, sa)
    assert hit == 0 and sa.pool.published_blocks == 7
    hb, hit = eb.prefill_cached(p, sb)
    assert hit == 28 and sb.pool_hit_blocks == 7 and sb.inserted_blocks == 0 and sb.pool.published_blocks == 0
    with eb.prefill([p]) as ref:
        _kv_close(hb, ref)
        for name in ("base", "math"):
            assert _greedy(eb, hb, name) == _greedy(eb, ref, name) == _greedy(ea, ha, name)
    # the session's next turn on B grows the context: the old blocks are local now, the new ones computed
    hb2, hit = eb.prefill_cached(prompt[:40], sb)
    assert hit == 28 and sb.pool_hit_blocks == 7 and sb.pool.miss_blocks == 1  # stops at the first miss
    assert sb.pool.published_blocks == 2
    for h in (ha, hb, hb2):
        h.release()


def test_pool_down_degrades_to_local_prefill(world, prompt, caplog):
    """A Redis pool that is down: every prefill is local with the same outputs, one warning, an
    ``unavailable`` error, lookups skipped while it is down; once it is back it is used again."""
    base, decs = world
    server = fakeredis.FakeServer()
    server.connected = False
    eng = _engine(base, decs)
    store = PrefixKVStore(4, pool=_redis_pool(server, retry_after_s=3600.0))
    p = prompt[:31]
    with caplog.at_level(logging.WARNING, logger="ccft.serving.prefix_pool"):
        h, hit = eng.prefill_cached(p, store)
        assert hit == 0 and store.pool.errors["unavailable"] == 1 and not store.pool.up
        with eng.prefill([p]) as ref:
            _kv_close(h, ref)
            assert _greedy(eng, h, "math") == _greedy(eng, ref, "math")
        h.release()
        h2, hit = eng.prefill_cached(
            prompt[1:31], store
        )  # another prompt: the pool is skipped, not waited on
        h2.release()
        # 7 publishes skipped after the first failure, then 1 lookup + 7 publishes of the second prefill
        assert hit == 0 and store.pool.errors["unavailable"] == 1 and store.pool.skipped == 15
    assert caplog.text.count("unavailable, serving with local prefill") == 1
    server.connected = True
    store.pool.down_until = 0.0  # the retry time has come
    store.clear()
    h3, hit = eng.prefill_cached(
        p, store
    )  # the pool is empty (down while it was published): local, published
    h3.release()
    assert hit == 0 and store.pool.up and store.pool.published_blocks == 7
    fresh = PrefixKVStore(4, pool=_redis_pool(server))
    got = fresh.match(base.fingerprint, torch.float32, p[:-1])
    assert len(got) == 7 and fresh.pool.hit_blocks == 7
    fresh.release(got)


def _requests(prompt):
    ctx = prompt[:33]
    return [
        ServeRequest(d, ctx + prompt[33 : 35 + j], shared_len=len(ctx), max_new_tokens=N_NEW, session_id="s")
        for j, d in enumerate(("base", "math"))
    ]


def _run(sched, reqs):
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * len(tickets)
    return [t.result.token_ids for t in tickets]


def test_two_schedulers_share_a_context_through_the_pool(world, prompt):
    """The moved session through the scheduler: B prefills none of the context's full blocks (the
    scheduler's prefill_tokens and prefix_hit_tokens), its outputs equal A's and an engine with no pool."""
    base, decs = world
    server = fakeredis.FakeServer()
    a = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server)))
    b = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server)))
    plain = Scheduler(_engine(base, decs), store=None)
    want = _run(plain, _requests(prompt))
    assert _run(a, _requests(prompt)) == want
    assert a.counters["prefix_hit_tokens"] == 0 and a.counters["prefill_tokens"] == 32
    assert _run(b, _requests(prompt)) == want
    assert b.counters["prefix_hit_tokens"] == 32 and b.counters["prefill_tokens"] == 0
    assert b.store.pool_hit_blocks == 8 and b.store.pool.stats()["hit_blocks"] == 8


def test_publishing_is_deferred_to_the_end_of_the_scheduler_step(world, prompt):
    """A scheduler step's prefill hands its blocks to the publisher thread only when the step returns:
    while the same step decodes the first tokens, none is queued or put (all are held), then all are; B
    fetches them and answers as an engine with no pool. ``deferred()`` nests and is a no-op inline."""
    base, decs = world
    server = fakeredis.FakeServer()
    a = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server, background=True)))
    pool, seen, decode = a.store.pool, [], a.engine.step

    def watched(*args, **kw):  # the pool's state while the step decodes
        seen.append((len(pool._held), pool._queue.unfinished_tasks, pool.published_blocks))
        return decode(*args, **kw)

    a.engine.step = watched
    tickets = [a.submit(r) for r in _requests(prompt)]
    a.step()  # prefill of the context (8 full blocks) and the first decode step
    assert seen == [(8, 0, 0)] and not pool._held
    a.run_until_idle()
    pool.flush()
    assert pool.published_blocks == 8 and [t.state for t in tickets] == ["done", "done"]
    b = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server)))
    want = _run(Scheduler(_engine(base, decs), store=None), _requests(prompt))
    assert [t.result.token_ids for t in tickets] == want == _run(b, _requests(prompt))
    assert b.counters["prefill_tokens"] == 0 and b.store.pool_hit_blocks == 8

    k, v = _kv(4)
    for background in (True, False):
        p = _redis_pool(fakeredis.FakeServer(), background=background)
        with p.deferred():
            with p.deferred():
                p.publish(_bid("fp", torch.float32, 4, 0, [1, 2, 3, 4]), k, v)
            p.flush()
            assert p.published_blocks == (0 if background else 1)
        p.flush()
        assert p.published_blocks == 1 and not p._held


def test_pool_killed_mid_run_every_request_is_answered(world, prompt):
    """The pool of two schedulers (published in the background, as ``ccft serve`` does) goes down between
    two turns of a session: the next turn's requests on both are answered with the tokens of a scheduler
    without a pool, and the pool's failure is counted, not raised."""
    base, decs = world
    server = fakeredis.FakeServer()
    pools = [_redis_pool(server, background=True, retry_after_s=3600.0) for _ in range(2)]
    a = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=pools[0]))
    b = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=pools[1]))
    plain = Scheduler(_engine(base, decs), store=None)
    turn1 = _requests(prompt)
    ctx2 = prompt[:33] + prompt[5:20]  # the context grows by 15 tokens
    turn2 = [
        ServeRequest(d, ctx2 + prompt[33 : 35 + j], shared_len=48, max_new_tokens=N_NEW, session_id="s")
        for j, d in enumerate(("base", "math"))
    ]
    assert _run(a, turn1) == _run(plain, turn1)
    pools[0].flush()
    server.connected = False  # the pool dies
    want = _run(plain, turn2)
    assert _run(a, turn2) == want and _run(b, turn2) == want
    for pool in pools:
        pool.flush()
    assert pools[1].errors["unavailable"] == 1 and not pools[1].up and pools[1].hit_blocks == 0
    assert pools[0].errors["unavailable"] == 1 and pools[0].published_blocks == 8
    assert b.counters["prefix_hit_tokens"] == 0 and a.counters["prefix_hit_tokens"] == 32  # A's own store


def test_metrics_show_the_pool(world, prompt):
    pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
    from ccft.serving.metrics import ServerMetrics

    base, decs = world
    server = fakeredis.FakeServer()
    a = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server)))
    _run(a, _requests(prompt))
    b = Scheduler(_engine(base, decs), store=PrefixKVStore(4, pool=_redis_pool(server)))
    _run(b, _requests(prompt))
    text = ServerMetrics(b).render().decode()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("ccft_")}
    assert lines["ccft_prefix_pool_hit_blocks_total"] == 8
    assert lines["ccft_prefix_pool_miss_blocks_total"] == 0
    assert (
        lines["ccft_prefix_pool_fetch_seconds_count"] == 1  # one fetch: the 8 blocks of the chain at once
        and lines["ccft_prefix_pool_fetch_seconds_sum"] > 0
    )
    assert lines['ccft_prefix_pool_errors_total{kind="corrupt"}'] == 0
    assert lines["ccft_prefix_pool_fetched_bytes_total"] == b.store.pool.fetched_bytes > 0
    assert lines["ccft_prefix_pool_up"] == 1
    assert "ccft_prefix_pool" not in ServerMetrics(Scheduler(_engine(base, decs))).render().decode()


# -------------------------------------------------------------------------------------------- config
def _serve_args(*argv):
    from ccft.cli.main import build_parser

    return build_parser().parse_args(["serve", "--model", "no/such/model", *argv])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prefix-pool", "127.0.0.1:6379"], r"--prefix-pool '127.0.0.1:6379': use redis://HOST:PORT"),
        (["--prefix-pool", "memory"], r"--prefix-pool 'memory': use redis://HOST:PORT\[/DB\] .* or ray"),
        (["--prefix-pool", "redis://127.0.0.1:1", "--block-tokens", "0"], r"--block-tokens 0 turns off"),
        (["--prefix-pool", "ray"], r"--prefix-pool ray shares blocks .*add --replicas N"),
        (
            ["--prefix-pool", "redis://127.0.0.1:1", "--prefix-pool-timeout-ms", "0"],
            r"--prefix-pool-timeout-ms 0",
        ),
        (["--prefix-pool", "ray", "--replicas", "2", "--prefix-pool-mb", "0"], r"--prefix-pool-mb 0"),
    ],
)
def test_serve_checks_the_pool_options_before_loading_the_model(argv, match):
    """``ccft serve`` names the option and the fix before the model (a folder that does not exist) loads."""
    from ccft.cli.serve import build_scheduler, check_prefix_pool

    args = _serve_args(*argv)
    with pytest.raises(ConfigError, match=match):
        (check_prefix_pool if "--replicas" in argv else build_scheduler)(args)


def test_serve_builds_a_redis_pool_under_the_store(monkeypatch, tiny_dir):
    """``ccft serve --prefix-pool redis://...``: the scheduler's store has a Redis pool tier with the timeout
    given (redis-py connects lazily, so nothing is reached here)."""
    from ccft.cli.serve import build_scheduler, check_prefix_pool

    args = _serve_args("--prefix-pool", "redis://127.0.0.1:1/0", "--prefix-pool-timeout-ms", "250")
    args.model = str(tiny_dir)
    assert check_prefix_pool(args) == "redis" and check_prefix_pool(_serve_args()) is None
    sched, _ = build_scheduler(args)
    backend = sched.store.pool.backend
    assert isinstance(backend, P.RedisBlockPool) and sched.store.block_tokens == 16
    kw = backend.client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 0.25 and kw["port"] == 1
    assert build_scheduler(_serve_args("--model", str(tiny_dir)))[0].store.pool is None


# ---------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_ray_object_store_pool():
    """Ray's object store: a block put once (a second put keeps the first), fetched by another pool object;
    the directory evicts least recently used blocks past its capacity; a block outlives the Ray worker
    that put it (the directory owns it)."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        one = P.PrefixPool(P.RayBlockPool(capacity_bytes=1800))
        two = P.PrefixPool(P.RayBlockPool())  # the same named directory (its capacity is the first's)
        a, b = PrefixKVStore(4, pool=one), PrefixKVStore(4, pool=two)
        k, v = _put(a, "fp", list(range(8)))
        _put(PrefixKVStore(4, pool=two), "fp", list(range(8)))
        assert one.published_blocks == 2 and two.present_blocks == 2
        got = b.match("fp", torch.float32, list(range(8)))
        assert len(got) == 2 and torch.equal(got[1].k, k[:, :, 4:]) and torch.equal(got[1].v, v[:, :, 4:])
        b.release(got)
        size = len(P.encode_block(_bid("fp", torch.float32, 4, 0, range(4)), k[:, :, :4], v[:, :, :4]))
        assert size * 3 + 30 <= 1800 < size * 4  # three blocks fit, four do not
        _put(a, "fp", list(range(100, 108)), seed=1)  # two more blocks: the LRU one is evicted
        st = one.backend.stats()
        assert st["blocks"] == 3 and st["evicted_blocks"] == 1

        @ray.remote(num_cpus=0)
        class Publisher:
            def publish(self):
                s = PrefixKVStore(4, pool=P.PrefixPool(P.RayBlockPool()))
                kk, vv = torch.randn(L, H, 4, D), torch.randn(L, H, 4, D)
                s.release(s.insert("late", torch.float32, [9, 9, 9, 9], kk, vv))
                return kk

        publisher = Publisher.remote()
        kk = ray.get(publisher.publish.remote())
        ray.kill(publisher)  # the process that published the block is gone; the directory still owns it
        got = PrefixKVStore(4, pool=P.PrefixPool(P.RayBlockPool())).match("late", torch.float32, [9] * 4)
        assert len(got) == 1 and torch.equal(got[0].k, kk)
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_redis_server_pool_and_its_death(world, prompt):
    """A real redis-server on 127.0.0.1: the moved session hits; the server killed mid-run leaves the next
    prefill local with the offline outputs (an ``unavailable`` error, not a hang)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary on this machine")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(100):  # wait for it to listen (no assertion on time)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        base, decs = world
        ea, eb = _engine(base, decs), _engine(base, decs)
        sa, sb = PrefixKVStore(4, pool=P.pool_from_spec(url)), PrefixKVStore(4, pool=P.pool_from_spec(url))
        p = prompt[:31]
        ea.prefill_cached(p, sa)[0].release()
        hb, hit = eb.prefill_cached(p, sb)
        assert hit == 28
        with eb.prefill([p]) as ref:
            assert _greedy(eb, hb, "math") == _greedy(eb, ref, "math")
        hb.release()
        proc.kill()
        proc.wait()
        sc = PrefixKVStore(4, pool=P.pool_from_spec(url))
        hc, hit = eb.prefill_cached(p, sc)
        assert hit == 0 and sc.pool.errors["unavailable"] == 1
        with eb.prefill([p]) as ref:
            assert _greedy(eb, hc, "math") == _greedy(eb, ref, "math")
        hc.release()
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _served(tmp_path, tokenizer, prompt_text, n_ids, router, seed, lora_seed):
    """``ccft serve --replicas 2 --router ROUTER --prefix-pool ray --block-tokens 4`` on a local Ray instance
    over a tiny base and a LoRA decoder ``math`` saved to folders: yields ``(client, ids, ref)``, an HTTP
    client of Ray Serve's proxy on 127.0.0.1, a prompt's ids and the offline engine's greedy ``Generation``
    of 8 tokens for it (the first ``n_ids`` tokens of ``prompt_text``)."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    httpx = pytest.importorskip("httpx", reason="the serve extra is not installed")
    from ray import serve

    from ccft.cli.main import build_parser
    from ccft.cli.serve import ray_app

    folder = make_tiny_folder(tmp_path / "base", tokenizer, seed=seed, scale=8.0)
    ccft.save_decoder(make_lora(ccft.load_base(str(folder)), "math", lora_seed, 4), tmp_path / "math")
    engine = ccft.SharedPrefillEngine(ccft.load_base(str(folder)), decoders={"math": str(tmp_path / "math")})
    ids = tokenize_prompt(tokenizer, prompt_text, chat_template=False)[:n_ids]
    with engine.prefill([ids]) as h:
        (ref,) = engine.generate(h, decoder="math", max_new_tokens=8)
    argv = ["serve", "--model", str(folder), "--threads", "1", "--replicas", "2", "--router", router]
    argv += ["--prefix-pool", "ray", "--block-tokens", "4", f"--decoder=math={tmp_path / 'math'}"]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app(build_parser().parse_args(argv)), name="ccft", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300.0) as client:
            yield client, ids, ref
    finally:
        serve.shutdown()
        ray.shutdown()


def _pool_metrics(client, session):
    """``(replica, {name: value})``: the ``ccft_prefix_pool*`` lines of the replica of ``session``."""
    from ccft.serving.ray_serve import REPLICA_HEADER, SESSION_HEADER

    r = client.get("/metrics", headers={SESSION_HEADER: session})
    assert r.status_code == 200, r.text
    lines = {
        ln.split(" ")[0]: float(ln.split(" ")[1])
        for ln in r.text.splitlines()
        if ln.startswith("ccft_prefix_pool")
    }
    return r.headers[REPLICA_HEADER], lines


def _wait_for_pool_blocks(n):
    """Until the replicas' pool (the named Ray directory) holds n blocks: their publisher threads are done."""
    directory = P.RayBlockPool()
    for _ in range(3000):  # (against hangs only; nothing asserts on time)
        if directory.stats().get("blocks") == n:
            break
        time.sleep(0.1)
    assert directory.stats().get("blocks") == n


@pytest.mark.slow
def test_ray_serve_replicas_share_a_context_through_the_pool(tmp_path, tokenizer, gsm8k_rows):
    """``ccft serve --replicas 2 --router round-robin --prefix-pool ray`` on a local Ray: the same prompt sent
    twice lands on both replicas; the second replica copies the context's blocks from the pool (its
    ``/metrics`` pool hits = the first's published blocks, no block published twice) and both answers equal
    an offline engine's."""
    from ccft.serving.ray_serve import REPLICA_HEADER

    with _served(tmp_path, tokenizer, gsm8k_rows[3]["prompt"], 37, "round-robin", 13, 31) as (
        client,
        ids,
        ref,
    ):
        blocks = (len(ids) - 1) // 4  # the context (handoff k = 1) in full blocks of 4
        answered = []
        for i in range(2):  # round-robin places requests that name a session; two sessions, one context
            body = {"model": "math", "prompt": ids, "max_tokens": 8, "return_token_ids": True}
            r = client.post("/v1/completions", json={**body, "session_id": f"moved-{i}"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref.token_ids
            answered.append(r.headers[REPLICA_HEADER])
            _wait_for_pool_blocks(blocks)
        assert answered[0] != answered[1]
        metrics = dict(_pool_metrics(client, f"scrape-{i}") for i in range(4))  # round-robin: both replicas
    first, second = metrics[answered[0]], metrics[answered[1]]
    assert first["ccft_prefix_pool_published_blocks_total"] == blocks
    assert first["ccft_prefix_pool_hit_blocks_total"] == 0
    assert second["ccft_prefix_pool_hit_blocks_total"] == blocks
    assert second["ccft_prefix_pool_published_blocks_total"] == 0
    assert first["ccft_prefix_pool_up"] == second["ccft_prefix_pool_up"] == 1


@pytest.mark.slow
def test_ray_serve_prefix_router_moves_a_session_to_a_pool_fetch(tmp_path, tokenizer, gsm8k_rows):
    """``ccft serve --replicas 2 --router prefix --prefix-pool ray``: a session's replica is killed (Ray Serve
    starts a replacement); the session's next request lands on a replica whose store never saw the context
    (the other one, or the replacement): it copies every full block of the context from the pool instead of
    prefilling it (its ``/metrics``: pool hits = the context's blocks), and answers an offline engine's
    tokens, before and after the move."""
    import ray

    from ccft.serving.ray_serve import REPLICA_HEADER, replica_actor

    with _served(tmp_path, tokenizer, gsm8k_rows[5]["prompt"], 41, "prefix", 17, 37) as (client, ids, ref):
        blocks = (len(ids) - 1) // 4  # the context (handoff k = 1) in full blocks of 4
        body = {"model": "math", "prompt": ids, "max_tokens": 8, "return_token_ids": True, "session_id": "s"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref.token_ids
        home = r.headers[REPLICA_HEADER]
        _wait_for_pool_blocks(blocks)
        replica, lines = _pool_metrics(client, "s")
        assert replica == home and lines["ccft_prefix_pool_published_blocks_total"] == blocks
        ray.kill(replica_actor(home), no_restart=True)  # Ray Serve starts a replacement
        for _ in range(3000):  # the next request of the session, once a live replica answers it
            r = client.post("/v1/completions", json=body)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref.token_ids
        moved = r.headers[REPLICA_HEADER]
        assert moved != home
        replica, lines = _pool_metrics(client, "s")
        assert replica == moved  # the session is pinned on its new replica
        assert lines["ccft_prefix_pool_hit_blocks_total"] == blocks  # fetched, not prefilled
        assert lines["ccft_prefix_pool_published_blocks_total"] == 0  # nothing of it was computed there
