"""The local disk tier under the prefix store (issue 36; ``ccft.serving.prefix_spill``).

Store tests use synthetic K/V (distinct random values per position, so a wrong block shows): evicted
blocks are written once in the ``ccft precompute`` shard format and come back bit for bit, before the
pool is asked; another producer, dtype or token list never hits, nor does a file whose metadata names
another producer; a flipped bit or a truncated file is a miss, counted, deleted and written again after
the block is recomputed; the disk's capacity deletes least recently used files. Engine tests use a tiny
random Llama: a scheduler whose store budget forces spills answers what one without a budget answers,
with context blocks read back from disk. Then ``/metrics`` and the ``ccft serve`` options.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.serving import PrefixKVStore
from ccft.serving.block_keys import BlockId
from ccft.serving.prefix_pool import MemoryBlockPool, PrefixPool
from ccft.serving.prefix_spill import ENTRY, DiskSpill
from ccft.serving.scheduler import Scheduler, ServeRequest
from ccft.train.cache_store import FORMAT, bytes_per_token
from conftest import make_lora, make_tiny_folder

L, H, D = 2, 2, 3  # synthetic geometry: layers, KV heads, head dim
F32 = torch.float32
NAN = float("nan")
N_NEW = 6


def _kv(n: int, seed: int = 0, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g).to(dtype), torch.randn(L, H, n, D, generator=g).to(dtype)


def _block_bytes(bt: int, dtype=F32) -> int:
    return 2 * L * H * bt * D * torch.empty((), dtype=dtype).element_size()


def _put(store, producer, tokens, seed=0, dtype=F32):
    k, v = _kv(len(tokens), seed, dtype)
    store.release(store.insert(producer, dtype, tokens, k, v))
    return k, v


def _id(store, producer, tokens, i, dtype=F32) -> BlockId:
    """Block ``i`` of ``tokens`` as ``store`` names it."""
    b = store.block_tokens
    return BlockId(
        store.chain_keys(producer, dtype, tokens)[i], producer, dtype, b, i, tokens[i * b : (i + 1) * b]
    )


def _file(spill, store, producer, tokens, i, dtype=F32):
    return spill.directory / DiskSpill.file_name(_id(store, producer, tokens, i, dtype))


# ---------------------------------------------------------------------------------------------- store
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_evicted_blocks_spill_to_disk_and_come_back_bit_for_bit(tmp_path, dtype):
    spill = DiskSpill(tmp_path / "spill", 1 << 20)
    store = PrefixKVStore(4, budget_bytes=2 * _block_bytes(4, dtype), spill=spill)
    a, b = list(range(8)), list(range(100, 108))
    ka, va = _put(store, "fp", a, seed=1, dtype=dtype)
    _put(store, "fp", b, seed=2, dtype=dtype)  # full: a's two blocks are evicted to disk (leaf first)
    assert store.evicted_blocks == 2 and store.spilled_blocks == 2 and len(spill) == 2
    got = store.match("fp", dtype, a[:4] + [55] * 4)  # a0 read back (the next block is not a1)
    assert [blk.tokens for blk in got] == [tuple(a[:4])] and store.spill_hit_blocks == 1
    store.release(got)
    got = store.match("fp", dtype, a + [9, 9])  # a1 from disk; a0 back in DRAM already
    assert [blk.index for blk in got] == [0, 1] and store.spill_hit_blocks == 2
    for i, blk in enumerate(got):
        assert blk.dtype == dtype and blk.k.dtype == dtype
        assert torch.equal(blk.k, ka[:, :, 4 * i : 4 * i + 4]) and torch.equal(
            blk.v, va[:, :, 4 * i : 4 * i + 4]
        )
    store.release(got)
    st = store.stats()
    assert st["hit_blocks"] == 3 and st["spill_hit_blocks"] == 2 and st["spilled_blocks"] == 4  # b's too
    assert (
        st["spill"]["hit_blocks"] == 2 and st["spill"]["spilled_blocks"] == 4 and st["spill"]["blocks"] == 4
    )
    assert st["spill"]["bytes_on_disk"] == sum(p.stat().st_size for p in spill.directory.glob("blk-*"))
    assert st["spill"]["errors"] == {"corrupt": 0, "mismatch": 0, "io": 0}
    _put(store, "fp", b, seed=2, dtype=dtype)  # a's blocks evicted again: already on disk, not rewritten
    assert spill.present_blocks == 2 and spill.spilled_blocks == 4 and store.spilled_blocks == 4
    # the file is a precompute shard: "<key>.k" / "<key>.v" and the store's identity in its metadata
    from safetensors import safe_open

    key = store.chain_keys("fp", dtype, a)[1].hex()
    with safe_open(str(_file(spill, store, "fp", a, 1, dtype)), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == [f"{key}.k", f"{key}.v"]
        assert torch.equal(f.get_tensor(f"{key}.v"), va[:, :, 4:8])
    assert meta["format"] == FORMAT and meta["entry"] == ENTRY and meta["fingerprint"] == "fp"
    assert (meta["index"], json.loads(meta["tokens"]), meta["key"]) == ("1", a[4:8], key)


def test_disk_is_asked_before_the_pool(tmp_path):
    pool = PrefixPool(MemoryBlockPool())
    store = PrefixKVStore(4, budget_bytes=2 * _block_bytes(4), pool=pool, spill=DiskSpill(tmp_path, 1 << 20))
    a = list(range(12))
    k, v = _put(store, "fp", a[:8])  # published to the pool too
    _put(store, "fp", list(range(50, 58)))  # a0, a1 to disk
    got = store.match("fp", F32, a)
    assert len(got) == 2 and store.spill_hit_blocks == 2 and store.pool_hit_blocks == 0
    assert pool.hit_blocks == 0 and pool.miss_blocks == 1  # a2: on neither; the pool was asked after disk
    assert torch.equal(got[1].k, k[:, :, 4:8])
    store.release(got)


def test_block_file_names_and_metadata_are_unchanged(tmp_path):
    """A ``BlockId`` names a block file as the six separate arguments it replaced did: the file name and the
    metadata of a fixed block are the ones ``DiskSpill.file_name(chain_key, producer, dtype)`` and
    ``DiskSpill.put(chain_key, producer, dtype, block_tokens, index, tokens, k, v)`` wrote (commit 20eb885),
    so a folder a previous version filled is still read."""
    from safetensors import safe_open

    block = BlockId(bytes(range(16)), "base-fp", F32, 4, 2, [5, 6, 7, 8])
    name = DiskSpill.file_name(block)
    assert name == "blk-float32-b23815d329563e65-000102030405060708090a0b0c0d0e0f.safetensors"
    spill = DiskSpill(tmp_path, 1 << 20)
    k = torch.arange(2 * 2 * 4 * 3, dtype=F32).reshape(2, 2, 4, 3)
    assert spill.put(block, k, -k) and spill.contains(block)
    key = "000102030405060708090a0b0c0d0e0f"
    with safe_open(str(tmp_path / name), framework="pt") as f:
        assert f.metadata() == {
            "format": FORMAT,
            "fingerprint": "base-fp",
            "cache_format": "native",
            "entry": ENTRY,
            "dtype": "float32",
            "block_tokens": "4",
            "index": "2",
            "tokens": "[5, 6, 7, 8]",
            "key": key,
            "sha256": "ab202aa3b7d273b9783dc62474e75909b57055d8a509633a95e163d235ee0ab5",
        }
        assert sorted(f.keys()) == [f"{key}.k", f"{key}.v"]
    got = spill.get(block)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], -k)


def test_other_producers_dtypes_and_tokens_never_hit(tmp_path, caplog):
    spill = DiskSpill(tmp_path, 1 << 20)
    store = PrefixKVStore(4, budget_bytes=0, spill=spill)  # a budget of 0: every block goes to disk
    a = list(range(8))
    k, v = _kv(8)
    store.spill.put(_id(store, "fp", a, 0), k[:, :, :4], v[:, :, :4])
    store.spill.put(_id(store, "fp", a, 1), k[:, :, 4:], v[:, :, 4:])
    fresh = PrefixKVStore(4, spill=spill)
    assert fresh.match("decoder-key", F32, a) == [] and fresh.match("fp", torch.bfloat16, a) == []
    assert fresh.match("fp", F32, [1] + a[1:]) == [] and fresh.match("fp", F32, a[:4] + [0] * 4) != []
    assert fresh.spill_hit_blocks == 1 and spill.miss_blocks == 4  # three chains missed, a1 ≠ [0]*4
    # a file that claims another producer's name is refused by its metadata
    thief = DiskSpill.file_name(_id(store, "thief", a, 0))
    (tmp_path / thief).write_bytes(_file(spill, store, "fp", a, 0).read_bytes())
    spill.close()
    reopened = DiskSpill(tmp_path, 1 << 20)  # a new process reuses the folder's files
    assert len(reopened) == 3
    s2 = PrefixKVStore(4, spill=reopened)
    with caplog.at_level(logging.WARNING, logger="ccft.serving.prefix_spill"):
        assert s2.match("thief", F32, a) == []
    assert reopened.errors == {"corrupt": 0, "mismatch": 1, "io": 0} and "fingerprint differs" in caplog.text
    assert not (tmp_path / thief).exists() and len(reopened) == 2
    got = s2.match("fp", F32, a)
    assert len(got) == 2 and torch.equal(got[1].v, v[:, :, 4:])
    s2.release(got)
    with pytest.raises(ConfigError, match="used by another process"):
        DiskSpill(tmp_path, 1 << 20)  # the folder is locked by `reopened`
    assert DiskSpill.claim(tmp_path, 1 << 20).directory == tmp_path / "replica-0"


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_or_truncated_file_is_counted_deleted_and_recomputed(tmp_path, caplog, damage):
    spill = DiskSpill(tmp_path, 1 << 20)
    store = PrefixKVStore(4, budget_bytes=3 * _block_bytes(4), spill=spill)
    a = list(range(12))
    k, v = _put(store, "fp", a)
    assert store.evict(3 * _block_bytes(4)) == 3 * _block_bytes(4) and len(spill) == 3
    bad = _file(spill, store, "fp", a, 1)
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x08  # one bit of v's last value
    elif damage == "truncate":
        data = data[:-7]
    else:
        data = bytearray(b"\x00" * 40)
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ccft.serving.prefix_spill"):
        got = store.match("fp", F32, a)
    assert len(got) == 1 and torch.equal(got[0].k, k[:, :, :4])  # the chain stops at the bad block
    assert spill.errors == {"corrupt": 1, "mismatch": 0, "io": 0} and not bad.exists() and len(spill) == 2
    assert ("checksum mismatch" if damage == "flip" else "unreadable") in caplog.text
    assert store.stats()["spill"]["errors"]["corrupt"] == 1
    # the block is prefilled again (inserted from block 1 on), and spilled again on the next eviction
    k2, v2 = _kv(12)
    store.release(store.insert("fp", F32, a, k2, v2, start_block=1))
    store.release(got)
    store.evict(3 * _block_bytes(4))
    assert bad.exists() and spill.spilled_blocks == 4 and spill.present_blocks == 2
    got = store.match("fp", F32, a)
    assert len(got) == 3 and torch.equal(got[1].v, v[:, :, 4:8]) and torch.equal(got[2].k, k[:, :, 8:])
    store.release(got)


def test_disk_capacity_deletes_least_recently_used_files(tmp_path):
    probe = DiskSpill(tmp_path / "probe", 1 << 20)
    probe.put(BlockId(b"\x00" * 16, "fp", F32, 4, 0, [0, 1, 2, 3]), *_kv(4))
    size = probe.bytes_on_disk  # one block file: K/V bytes and the safetensors header
    assert size > _block_bytes(4)
    spill = DiskSpill(tmp_path / "spill", int(2.5 * size))
    store = PrefixKVStore(4, budget_bytes=0, spill=spill)
    chains = [[c] * 4 for c in range(4)]
    for i, tokens in enumerate(chains[:3]):
        store.spill.put(_id(store, "fp", tokens, 0), *_kv(4, i))
    assert len(spill) == 2 and spill.evicted_blocks == 1 and spill.bytes_on_disk == 2 * size
    assert not _file(spill, store, "fp", chains[0], 0).exists()  # the oldest went
    big = PrefixKVStore(4, spill=spill)
    big.release(big.match("fp", F32, chains[1]))  # read: chain 1 is now the most recently used
    big.clear()
    store.spill.put(_id(store, "fp", chains[3], 0), *_kv(4, 3))
    assert sorted(p.name for p in spill.directory.glob("blk-*")) == sorted(
        _file(spill, store, "fp", chains[i], 0).name for i in (1, 3)
    )
    assert spill.stats()["evicted_blocks"] == 2 and spill.stats()["bytes_on_disk"] == 2 * size
    small = DiskSpill(tmp_path / "small", size // 4)  # a block larger than the whole capacity
    assert (
        not small.put(BlockId(b"\x01" * 16, "fp", F32, 4, 0, [0] * 4), *_kv(4))
        and small.too_large_blocks == 1
    )
    spill.close()
    assert len(DiskSpill(tmp_path / "spill", size)) == 1  # reopened with less room: trimmed to fit
    with pytest.raises(ConfigError, match="capacity_bytes=0"):
        DiskSpill(tmp_path / "zero", 0)


def test_forget_deletes_one_producers_files(tmp_path):
    spill = DiskSpill(tmp_path, 1 << 20)
    store = PrefixKVStore(4, budget_bytes=0, spill=spill)
    for who in ("fp", "old-decoder"):
        tokens = list(range(4))
        store.spill.put(_id(store, who, tokens, 0), *_kv(4))
    store.forget("old-decoder")
    assert len(spill) == 1 and store.spill.contains(_id(store, "fp", [0, 1, 2, 3], 0))


# --------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    path = make_tiny_folder(tmp_path_factory.mktemp("spill_sharp"), tokenizer, seed=3, scale=30.0)
    base = ccft.load_base(str(path))
    return base, {"math": make_lora(base, "math", 1, 4)}


@pytest.fixture(scope="module")
def prompt(gsm8k_rows, tokenizer):
    ids = tokenize_prompt(
        tokenizer, gsm8k_rows[0]["prompt"] + "\n" + gsm8k_rows[1]["prompt"], chat_template=False
    )
    return ids[:48]


def _engine(base, decs):
    return ccft.SharedPrefillEngine(base, decoders=decs, fill=NAN)


def _turn(prompt, start, session):
    ctx = prompt[start : start + 33]  # 32 context tokens: 8 full blocks of 4
    return [
        ServeRequest(
            d, ctx + prompt[40 : 42 + j], shared_len=len(ctx), max_new_tokens=N_NEW, session_id=session
        )
        for j, d in enumerate(("base", "math"))
    ]


def _run(sched, reqs):
    tickets = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert [t.state for t in tickets] == ["done"] * len(tickets)
    return [t.result.token_ids for t in tickets]


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_scheduler_with_a_spilling_store_answers_like_one_without_a_budget(world, prompt, tmp_path, chunk):
    """Session A's context, then B's (which pushes A's blocks out of a store that holds one context, onto
    disk), then A's again: its 8 blocks are read back from disk (no context token prefilled), and every
    answer equals the one of a scheduler whose store has no budget (whole and chunked prefills)."""
    base, decs = world
    per_block = bytes_per_token(base.config, F32) * 4
    spill = DiskSpill(tmp_path, 1 << 30)
    store = PrefixKVStore(4, budget_bytes=8 * per_block, spill=spill)
    tight = Scheduler(_engine(base, decs), store=store, prefill_chunk_tokens=chunk)
    roomy = Scheduler(_engine(base, decs), store=PrefixKVStore(4), prefill_chunk_tokens=chunk)
    turns = [_turn(prompt, 0, "a"), _turn(prompt, 3, "b"), _turn(prompt, 0, "a2")]
    for i, reqs in enumerate(turns):
        before = tight.counters["prefill_tokens"]
        assert _run(tight, reqs) == _run(roomy, reqs), f"turn {i}"
        if i == 2:
            assert tight.counters["prefill_tokens"] == before  # the context came from disk
    st = tight.store.stats()
    assert st["spill_hit_blocks"] == 8 and st["spill"]["hit_blocks"] == 8 and st["spilled_blocks"] >= 8
    assert tight.counters["prefix_hit_tokens"] == roomy.counters["prefix_hit_tokens"] == 32
    assert roomy.store.evicted_blocks == 0 and st["evicted_blocks"] >= 8
    assert st["spill"]["errors"] == {"corrupt": 0, "mismatch": 0, "io": 0}
    # the blocks read back from disk hold, bit for bit, the K/V the roomy store computed and kept
    ctx = prompt[:32]
    back, kept = tight.store.match(base.fingerprint, F32, ctx), roomy.store.match(base.fingerprint, F32, ctx)
    assert len(back) == len(kept) == 8 and tight.store.spill_hit_blocks == 8  # in memory again, no new read
    for x, y in zip(back, kept):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
    tight.store.release(back)
    roomy.store.release(kept)
    spill.close()


def test_metrics_show_the_spill(world, prompt, tmp_path):
    pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
    from ccft.serving.metrics import ServerMetrics

    base, decs = world
    spill = DiskSpill(tmp_path, 1 << 30)
    sched = Scheduler(_engine(base, decs), store=PrefixKVStore(4, budget_bytes=0, spill=spill))
    _run(sched, _turn(prompt, 0, "a"))
    assert spill.spilled_blocks == 0  # a budget of 0 stores nothing, so nothing is evicted
    store = PrefixKVStore(4, spill=spill)
    sched = Scheduler(_engine(base, decs), store=store)
    _run(sched, _turn(prompt, 0, "a"))
    store.evict(1 << 30)
    _run(sched, _turn(prompt, 0, "a2"))
    text = ServerMetrics(sched).render().decode()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("ccft_")}
    assert lines["ccft_prefix_spill_spilled_blocks_total"] == 8 == spill.spilled_blocks
    assert lines["ccft_prefix_spill_hit_blocks_total"] == 8
    assert lines["ccft_prefix_spill_bytes"] == spill.bytes_on_disk > 8 * 1000
    assert lines["ccft_prefix_spill_blocks"] == 8
    assert lines['ccft_prefix_spill_errors_total{kind="corrupt"}'] == 0
    assert (
        lines["ccft_prefix_spill_write_seconds_count"] == 8
        and lines["ccft_prefix_spill_read_seconds_sum"] > 0
    )
    assert "ccft_prefix_spill" not in ServerMetrics(Scheduler(_engine(base, decs))).render().decode()


# -------------------------------------------------------------------------------------------- config
def _serve_args(*argv):
    from ccft.cli.main import build_parser

    return build_parser().parse_args(["serve", "--model", "no/such/model", *argv])


def test_serve_checks_the_spill_options_before_loading_the_model(tmp_path):
    """``ccft serve`` names the option and the fix before the model (a folder that does not exist) loads."""
    from ccft.cli.serve import build_scheduler, check_prefix_spill

    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, match in [
        (["--prefix-spill-dir", str(tmp_path / "s"), "--block-tokens", "0"], r"--block-tokens 0 turns the"),
        (
            ["--prefix-spill-dir", str(tmp_path / "s"), "--prefix-spill-mb", "0"],
            r"--prefix-spill-mb 0: use a",
        ),
        (["--prefix-spill-dir", str(tmp_path / "s"), "--prefix-spill-mb", "-1"], r"--prefix-spill-mb -1"),
        (["--prefix-spill-dir", str(afile)], r"--prefix-spill-dir .* is an existing file"),
        (["--prefix-spill-dir", str(afile / "sub")], r"--prefix-spill-dir .* lies under .*which is a file"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_scheduler(_serve_args(*argv))
    assert not (tmp_path / "s").exists()  # nothing created
    assert check_prefix_spill(_serve_args()) is None
    assert check_prefix_spill(_serve_args("--prefix-spill-dir", str(tmp_path / "s"))) == str(tmp_path / "s")


def test_serve_builds_a_disk_spill_under_the_store(tiny_dir, tmp_path):
    from ccft.cli.serve import build_scheduler

    args = _serve_args("--prefix-spill-dir", str(tmp_path / "s"), "--prefix-spill-mb", "2")
    args.model = str(tiny_dir)
    sched, _ = build_scheduler(args)
    spill = sched.store.spill
    assert (
        isinstance(spill, DiskSpill) and spill.capacity_bytes == 2 << 20 and spill.directory == tmp_path / "s"
    )
    spill.close()
    args.replicas = 2  # a replica of `ccft serve --replicas N` claims its own subfolder
    sched, _ = build_scheduler(args)
    assert sched.store.spill.directory == tmp_path / "s" / "replica-0"
    assert build_scheduler(_serve_args("--model", str(tiny_dir)))[0].store.spill is None
