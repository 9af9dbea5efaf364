"""PrefixKVStore accounting and keying (K5), and SharedPrefillEngine.prefill_cached == prefill.

Store tests use synthetic K/V (distinct random values per position, so a wrong block shows). Engine
tests use a tiny random Llama (GQA, RoPE, fp32) — sharpened lm_head for greedy equality, the plain
one for teacher-forced logits at 1e-5 — LoRA decoders with ``init_lora_weights=False`` and a
perturbed full-weight decoder; every engine buffer is NaN-filled so a read of unwritten memory shows.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.cache import prefill as hf_prefill
from ccft.core.errors import ConfigError, FingerprintMismatchError
from ccft.core.tokens import tokenize_prompt
from ccft.serving import PrefixKVStore
from conftest import make_full, make_lora, make_tiny_folder

ATOL = 1e-5
NAN = float("nan")
N_NEW = 6
L, H, D = 2, 2, 3  # synthetic geometry: layers, KV heads, head dim


def _kv(n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g).to(dtype), torch.randn(L, H, n, D, generator=g).to(dtype)


def _block_bytes(bt: int, dtype=torch.float32) -> int:
    return 2 * L * H * bt * D * torch.empty((), dtype=dtype).element_size()


def _put(store, producer, tokens, seed=0, start=0, dtype=torch.float32):
    """Insert every full block of ``tokens`` and drop the references; returns the (k, v) inserted."""
    k, v = _kv(len(tokens), seed, dtype)
    store.release(store.insert(producer, dtype, tokens, k, v, start_block=start))
    return k, v


# ---------------------------------------------------------------------------------------------- store
def test_match_returns_longest_chain_with_its_kv_and_counts():
    s = PrefixKVStore(block_tokens=4)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    k, v = _kv(10)
    got = s.insert("fp", torch.float32, a, k, v)
    assert [b.index for b in got] == [0, 1] and [b.refs for b in got] == [1, 1]
    assert s.stats()["inserted_blocks"] == 2 and len(s) == 2 and s.bytes_in_use == 2 * _block_bytes(4)
    s.release(got)
    m = s.match("fp", torch.float32, a)
    assert [b.index for b in m] == [0, 1] and all(b.refs == 1 for b in m)
    for j, b in enumerate(m):  # a copy of the right positions, every layer
        assert torch.equal(b.k, k[:, :, 4 * j : 4 * j + 4]) and torch.equal(b.v, v[:, :, 4 * j : 4 * j + 4])
        assert b.k.data_ptr() != k.data_ptr()
    k.zero_()  # the store holds copies
    assert not torch.equal(m[0].k, k[:, :, :4])
    s.release(m)
    assert [
        len(s.match("fp", torch.float32, t)) for t in (a[:7], a[:8], a[:4] + [0] * 4, [0] + a[1:8], a[:3])
    ] == [1, 2, 1, 0, 0]  # partial block not looked up; chain: block 1 after a different block 0 misses
    st = s.stats()
    # looked-up full blocks: 2 + 1 + 2 + 2 + 2 + 0 = 9; hits: 2 + 1 + 2 + 1 + 0 = 6
    assert (st["lookups"], st["hit_blocks"], st["miss_blocks"]) == (6, 6, 3)
    assert (st["hit_tokens"], st["miss_tokens"]) == (24, 12) and st["hit_ratio"] == pytest.approx(24 / 36)
    assert (
        st["referenced_blocks"] == 2
    )  # the matches above were never released: block 0 held 3 times, block 1 once
    assert [b.refs for b in s.match("fp", torch.float32, a[:4])] == [4]
    s.reset_stats()
    assert s.hit_ratio == 0.0 and s.stats()["lookups"] == 0


def test_insert_extends_a_chain_and_reuses_stored_blocks():
    s = PrefixKVStore(block_tokens=4)
    a = list(range(12))
    ka, _ = _put(s, "fp", a[:8])
    m = s.match("fp", torch.float32, a)
    assert len(m) == 2
    k, v = _kv(12, seed=5)
    new = s.insert("fp", torch.float32, a, k, v, start_block=len(m))
    assert [b.index for b in new] == [2] and new[0].parent is m[-1] and m[-1].children == 1
    again = s.insert("fp", torch.float32, a, k, v)  # already stored: reused, not overwritten
    assert again[:2] == m and torch.equal(again[0].k, ka[:, :, :4]) and s.stats()["inserted_blocks"] == 3
    s.release(m + new + again)
    assert all(b.refs == 0 for b in s.blocks())
    with pytest.raises(ConfigError, match="released more often"):
        s.release(m[:1])
    # a chain whose parent is not stored is not inserted (it could never be reached)
    assert s.insert("fp", torch.float32, [9] * 12, k, v, start_block=1) == []
    assert s.stats()["skipped_blocks"] == 2 and len(s) == 3


def test_chain_keys_are_the_shared_block_identity():
    """The store keys blocks with ccft.serving.block_keys.chain_keys (the prefix router uses it too); the
    values are those the store computed before the function moved there."""
    from ccft.serving.block_keys import chain_keys

    ids = list(range(9))  # two full blocks and one token
    keys = PrefixKVStore(block_tokens=4).chain_keys("fp", torch.float32, ids)
    assert keys == chain_keys("fp", torch.float32, 4, ids) == chain_keys("fp", "torch.float32", 4, ids)
    assert [k.hex() for k in keys] == ["05ad50169712ad846e6b7addfcc98c2d", "73d96ba017e502a6303f1d8699052d52"]


def test_keys_separate_producers_and_dtypes():
    """K5: K/V written by another base / decoder, or in another dtype, is never matched."""
    s = PrefixKVStore(block_tokens=4)
    a = list(range(8))
    _put(s, "baseA", a)
    assert len(s.match("baseA", torch.float32, a)) == 2
    assert s.match("baseB", torch.float32, a) == []
    assert s.match("baseA+math/123", torch.float32, a) == []
    assert s.match("baseA", torch.bfloat16, a) == []
    _put(s, "baseA", a, dtype=torch.bfloat16, seed=3)  # same tokens in bf16: separate blocks
    (b16,) = s.match("baseA", torch.bfloat16, a[:4])
    assert b16.dtype == torch.bfloat16 and b16.k.dtype == torch.bfloat16 and len(s) == 4
    assert s.chain_keys("baseA", torch.float32, a) != s.chain_keys("baseB", torch.float32, a)
    k, v = _kv(8)
    with pytest.raises(ConfigError, match="dtype"):
        s.insert("baseA", torch.bfloat16, a, k, v)  # K/V labelled with another dtype than theirs
    with pytest.raises(ConfigError, match="positions"):
        s.insert("baseA", torch.float32, a + [1] * 4, k, v)


def test_lru_eviction_leaves_first_refcounts_and_budget():
    bb = _block_bytes(2)
    s = PrefixKVStore(block_tokens=2, budget_bytes=3 * bb)
    x, y, z, w = [1, 2, 3, 4], [5, 6], [7, 8], [9, 10, 11, 12]
    _put(s, "fp", y)  # y0
    _put(s, "fp", x)  # x0 <- x1
    s.release(
        s.match("fp", torch.float32, x[:2])
    )  # touch x0 only: LRU order y0, x1, x0 (a parent is never older)
    assert [b.tokens for b in s.blocks()] == [(5, 6), (3, 4), (1, 2)]
    _put(s, "fp", z)  # full: evicts the LRU unreferenced leaf y0
    assert s.match("fp", torch.float32, y) == [] and s.stats()["evicted_blocks"] == 1
    assert s.bytes_in_use == 3 * bb
    held = s.match("fp", torch.float32, z)  # z0 referenced: protected
    _put(s, "fp", w)  # two blocks: x1 (leaf, LRU) then x0 go; z0 stays
    assert [b.tokens for b in s.blocks()] == [(7, 8), (11, 12), (9, 10)]
    assert s.stats()["evicted_blocks"] == 3 and s.stats()["evicted_bytes"] == 3 * bb
    for b in s.blocks():  # every stored block is reachable: its parent is stored
        assert b.parent is None or b.parent.stored
    # everything left is referenced (or an ancestor of a referenced block): nothing can be evicted
    held += s.match("fp", torch.float32, w)
    assert s.evict(10 * bb) == 0
    before = len(s)
    assert s.insert("fp", torch.float32, [0, 0], *_kv(2)) == []  # does not fit: not stored
    assert len(s) == before and s.bytes_in_use == 3 * bb and s.stats()["skipped_blocks"] == 1
    s.release(held)
    assert s.evict(1) == bb and [b.tokens for b in s.blocks()] == [(11, 12), (9, 10)]  # z0 was LRU
    # evict() never takes a parent before its child
    assert s.evict(bb) == bb and [b.tokens for b in s.blocks()] == [(9, 10)]
    # a block whose child is referenced stays, even when it is itself unreferenced and LRU
    _put(s, "fp", w)  # w1 back
    (w0,) = s.match("fp", torch.float32, w[:2])
    k, v = _kv(6, seed=9)
    (w2,) = s.insert("fp", torch.float32, w + [13, 14], k, v, start_block=2)  # only w2 is referenced
    s.release([w0])
    assert [b.refs for b in s.blocks()] == [1, 0, 0] and s.evict(10 * bb) == 0
    assert [b.tokens for b in s.blocks()] == [(13, 14), (11, 12), (9, 10)]
    s.release([w2])
    assert s.evict(10 * bb) == 3 * bb and len(s) == 0 and s.bytes_in_use == 0
    _put(s, "fp", x)
    s.clear()
    assert len(s) == 0 and s.bytes_in_use == 0 and s.match("fp", torch.float32, x) == []


def test_budget_smaller_than_a_block_stores_nothing():
    s = PrefixKVStore(block_tokens=4, budget_bytes=_block_bytes(4) - 1)
    assert s.insert("fp", torch.float32, list(range(8)), *_kv(8)) == []
    assert len(s) == 0 and s.stats()["skipped_blocks"] == 2
    with pytest.raises(ConfigError, match="block_tokens"):
        PrefixKVStore(block_tokens=0)


# --------------------------------------------------------------------------------------------- engine
def _lora(base, name, seed, r, targets=None, handoff=1):
    return make_lora(base, name, seed, r, handoff, targets, method=None)


def _full(base, seed, handoff=1):
    return make_full(base, seed, handoff, method=None)


def _decoders(base, handoff=1):
    full = _full(base, 7, handoff)  # before any adapter is attached: a copy of the plain base
    return {
        "full": full,
        "math": _lora(base, "math", 1, 4, handoff=handoff),
        "code": _lora(base, "code", 2, 2, ["q_proj", "v_proj", "down_proj"], handoff=handoff),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """Sharpened tiny base (clear greedy margins) with two LoRA decoders and a full-weight one (read-only)."""
    path = make_tiny_folder(tmp_path_factory.mktemp("store_sharp"), tokenizer, seed=3, scale=30.0)
    base = ccft.load_base(str(path))
    return base, _decoders(base)


@pytest.fixture(scope="module")
def prompt(gsm8k_rows, tokenizer):
    """40 real tokens: a shared context (two GSM8K questions) the test cuts into turns."""
    ids = tokenize_prompt(
        tokenizer, gsm8k_rows[0]["prompt"] + "\n" + gsm8k_rows[1]["prompt"], chat_template=False
    )
    assert len(ids) >= 40
    return ids[:40]


def _engine(base, decs=None, **kw):
    return ccft.SharedPrefillEngine(base, decoders=decs or {}, fill=NAN, **kw)


def _kv_close(h, ref):
    assert h.lengths == ref.lengths and h.width == ref.width and h.tail_ids == ref.tail_ids
    for i in range(h.engine.num_layers):
        for a, b in ((h.keys(i), ref.keys(i)), (h.values(i), ref.values(i))):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _greedy(eng, h, name):
    return [(g.token_ids, g.finish_reason) for g in eng.generate(h, decoder=name, max_new_tokens=N_NEW)]


@pytest.mark.parametrize("chunk", [None, 3])
def test_prefill_cached_equals_prefill(world, prompt, chunk):
    """No hit, partial hit, full hit, a hit ending at a block boundary, a prompt shorter than a block:
    the K/V equal plain prefill and every decoder decodes the same tokens (chunk=3: several chunked
    passes)."""
    base, decs = world
    eng = _engine(base, decs)
    store = PrefixKVStore(block_tokens=4)
    other = [t + 1 for t in prompt]
    cases = [  # (prompt, expected hit tokens); the prefill covers prompt[:-1]
        (prompt[:3], 0),  # shorter than one block: nothing to look up or store
        (prompt[:23], 0),  # cold: 22 tokens, 5 full blocks stored
        (prompt[:23], 20),  # the same prompt: 5 blocks hit, 2 tokens computed
        (prompt[:21], 20),  # 20 tokens = exactly the 5 stored blocks: full hit, nothing computed
        (prompt[:12] + other[12:20], 12),  # diverges at a block boundary
        (prompt[:14] + other[14:20], 12),  # diverges inside block 3
        (prompt[:40], 20),  # the context grew: blocks 0-4 hit, 19 tokens computed
        (prompt[:40], 36),  # ... and the grown chain is stored
        (other[:30], 0),  # another prompt
    ]
    names = ["base", "math", "code", "full"]
    for p, want in cases:
        h, hit = eng.prefill_cached(p, store, chunk_tokens=chunk)
        assert hit == want, (len(p), hit, want)
        assert h.producer == "base" and h.producer_key == base.fingerprint and h.batch_size == 1
        with eng.prefill([p]) as ref:
            _kv_close(h, ref)
            for n in names:
                assert _greedy(eng, h, n) == _greedy(eng, ref, n), (len(p), n)
        h.release()
    st = store.stats()
    assert st["hit_tokens"] == sum(w for _, w in cases) and st["referenced_blocks"] == 0
    assert (
        st["blocks"] == 5 + 1 + 1 + 4 + 7
    )  # prompt[:23]: 5; each diverging block 3; [:40] grows to 9; other: 7
    assert eng.arena.used_tokens == 0


def test_prefill_cached_handoff_and_hold(world, prompt):
    """handoff k=2 (the prefix is prompt[:-2]); hold=True pins the prompt's blocks until the handle is
    freed."""
    base, decs = world
    eng = _engine(base, decs)
    bb = 2 * eng.num_layers * 2 * 4 * 16 * 4  # layers x KV heads 2 x block 4 x head dim 16, fp32, K and V
    store = PrefixKVStore(block_tokens=4, budget_bytes=6 * bb)
    h1, hit = eng.prefill_cached(
        prompt[:26], store, handoff_tokens=2
    )  # 24 tokens: 6 blocks, the whole budget
    assert hit == 0 and h1.tail_ids == [prompt[24:26]] and h1.lengths == [24]
    assert store.stats()["referenced_blocks"] == 6
    eng.add_request(h1, decoder="base", max_new_tokens=2)
    h1.release()  # a request still reads it: the blocks stay pinned
    h2, _ = eng.prefill_cached(
        prompt[1:27], store, handoff_tokens=2
    )  # another chain: no room, nothing evicted
    assert store.stats()["skipped_blocks"] == 6 and store.bytes_in_use == 6 * bb
    assert all(b.refs == 1 for b in store.blocks())
    while eng.active:
        eng.step()
    assert h1.freed and all(b.refs == 0 for b in store.blocks())
    h3, _ = eng.prefill_cached(prompt[1:27], store, handoff_tokens=2)  # now h1's blocks can go
    assert store.stats()["evicted_blocks"] == 6 and store.bytes_in_use == 6 * bb
    h4, hit = eng.prefill_cached(prompt[1:27], store, handoff_tokens=2, hold=False)
    assert hit == 24
    h4.release()
    assert all(b.refs == 1 for b in store.blocks())  # h3's references only
    with eng.prefill([prompt[1:27]], handoff_tokens=2) as ref:
        _kv_close(h3, ref)
    for h in (h2, h3):
        h.release()
    assert all(b.refs == 0 for b in store.blocks())


def test_store_never_serves_another_base_decoder_or_dtype(world, prompt, tiny_dir):
    """K5 through the engine: base, each decoder and a bf16 copy of the base have separate chains."""
    base, decs = world
    eng = _engine(base, decs)
    store = PrefixKVStore(block_tokens=4)
    p = prompt[:21]
    keys = {eng.producer_key(n) for n in (None, "math", "code", "full")}
    assert len(keys) == 4 and eng.producer_key() == base.fingerprint == eng.producer_key("base")
    assert eng.producer_key("math").startswith(f"{base.fingerprint}+math/")
    for n in (None, "math", "code", "full"):  # each producer writes its own chain: the first lookup misses
        h, hit = eng.prefill_cached(p, store, producer=n)
        assert hit == 0 and h.producer == (n or "base")
        h.release()
    assert eng.prefill_cached(p, store, producer="code", hold=False)[1] == 20  # ... the second hits
    assert len(store) == 4 * 5
    other = _engine(ccft.load_base(str(tiny_dir)))  # another base (fingerprint)
    assert other.prefill_cached(p, store, hold=False)[1] == 0
    bf16 = ccft.load_base(base.path, dtype="bfloat16")  # the same base (same fingerprint) in bf16
    assert bf16.fingerprint == base.fingerprint
    e16 = _engine(bf16)
    h16, hit = e16.prefill_cached(p, store)
    assert hit == 0 and h16.keys(0).dtype == torch.bfloat16
    h16.release()
    assert e16.prefill_cached(p, store, hold=False)[1] == 20 and len(store) == 4 * 5 + 5 + 5
    with pytest.raises(ConfigError, match="unknown producer"):
        eng.prefill_cached(p, store, producer="nope")


@pytest.mark.parametrize("name", ["math", "full"])
def test_no_share_prefill_decodes_like_the_decoder_itself(world, prompt, name):
    """producer=X: X prefills its own prompt (its own weights); X's greedy
    decode == ccft.generate(mode="full-ft")."""
    base, decs = world
    dec = decs[name]
    eng = _engine(base, decs)
    store = PrefixKVStore(block_tokens=4)
    prompts = [prompt[:30], prompt[:38]]  # the second grows the first: a partial hit on X's own blocks
    refs = ccft.generate(prompts, mode="full-ft", decoder=dec, max_new_tokens=N_NEW)
    shared = ccft.generate(prompts, mode="naive", decoder=dec, max_new_tokens=N_NEW)
    assert [g.token_ids for g in refs] != [g.token_ids for g in shared]  # X's own KV is not C_base
    for p, ref, want_hit in zip(prompts, refs, (0, 28), strict=True):
        h, hit = eng.prefill_cached(p, store, producer=name, chunk_tokens=5)
        assert hit == want_hit and h.producer == name and h.producer_key == eng.producer_key(name)
        own = hf_prefill(dec.activate(), [p], handoff_tokens=1, producer="self")  # HF/PEFT X over its prompt
        for i in range(eng.num_layers):
            torch.testing.assert_close(h.keys(i), own.keys[i], atol=ATOL, rtol=0)
            torch.testing.assert_close(h.values(i), own.values[i], atol=ATOL, rtol=0)
        (g,) = eng.generate(h, decoder=name, max_new_tokens=N_NEW)
        assert (g.token_ids, g.text, g.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        with eng.prefill([p], producer=name) as plain:  # the uncached no-share prefill: same K/V
            _kv_close(h, plain)
        h.release()


@pytest.mark.parametrize("handoff", [1, 2])
def test_no_share_teacher_forced_logits_equal_full_forward(tiny_dir, prompt, handoff):
    """Step logits of X on a handle X prefilled (cached, partial hit) == a plain HF/PEFT forward of X over
    prompt + forced tokens (unsharpened model: logits of order 1, so 1e-5 is a meaningful fp32 bound)."""
    base = ccft.load_base(str(tiny_dir))
    decs = _decoders(base, handoff)
    eng = _engine(base, decs)
    store = PrefixKVStore(block_tokens=4)
    eng.prefill_cached(prompt[:20], store, producer="code", hold=False)
    eng.prefill_cached(prompt[:20], store, producer="full", hold=False)
    p = prompt[:33]
    forced = torch.randint(
        0, len(base.tokenizer), (N_NEW,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    for name in ("code", "full"):
        h, hit = eng.prefill_cached(p, store, producer=name)
        assert hit == 16 and h.handoff_tokens == handoff
        rid = eng.add_request(h, decoder=name, forced_tokens=forced)
        got = []
        while eng.active:
            got += [o.logits for o in eng.step(return_logits=True) if o.request_id == rid]
        n = len(p) - handoff
        tail = torch.tensor([p[n:] + forced])
        with torch.no_grad():
            ref = ccft.full_forward(
                decs[name], torch.tensor([p[:n]]), torch.ones(1, n, dtype=torch.long), tail
            )
        torch.testing.assert_close(
            torch.stack(got), ref[0, handoff - 1 : handoff - 1 + N_NEW], atol=ATOL, rtol=0
        )
        h.release()


def test_add_request_refuses_kv_written_by_another_decoder(world, prompt):
    base, decs = world
    eng = _engine(base, decs)
    store = PrefixKVStore(block_tokens=4)
    h, _ = eng.prefill_cached(prompt[:10], store, producer="math")
    for reader in ("code", "full", "base"):
        with pytest.raises(
            FingerprintMismatchError, match=f"decoder 'math'.*decoder '{reader}'.*producer='{reader}'"
        ):
            eng.add_request(h, decoder=reader)
    assert eng.active == 0 and h.refs == 1  # refused before anything was admitted
    eng.add_request(h, decoder="math", max_new_tokens=1)  # its own K/V: fine
    with pytest.raises(
        FingerprintMismatchError, match="not by the base"
    ):  # exported, it is not C_base either
        h.to_base_cache().check_reader(base.fingerprint, base.dtype)
    with eng.prefill([prompt[:10]], producer="full") as hf:
        with pytest.raises(FingerprintMismatchError, match="decoder 'full'"):
            eng.add_request(hf, decoder="math")
    with eng.prefill([prompt[:10]]) as hb:  # C_base: every decoder may read it
        for reader in ("math", "code", "full", "base"):
            eng.add_request(hb, decoder=reader, max_new_tokens=1)
        while eng.active:
            eng.step()
    h.release()
    assert eng.arena.used_tokens == 0
    with pytest.raises(ConfigError, match="handoff_tokens\\+1"):
        eng.prefill_cached(prompt[:1], store)


def test_forget_drops_one_producers_blocks():
    store = PrefixKVStore(block_tokens=2)
    kv = torch.zeros(1, 1, 6, 2)
    ids = [1, 2, 3, 4, 5, 6]
    a = store.insert("old", torch.float32, ids, kv, kv)
    b = store.insert("new", torch.float32, ids, kv, kv)
    store.release(a + b)
    per_producer = store.bytes_in_use // 2
    assert store.forget("old") == per_producer
    assert {blk.producer for blk in store.blocks()} == {"new"} and len(store) == 3
    assert store.bytes_in_use == per_producer
    assert store.match("old", torch.float32, ids) == []
    assert len(store.match("new", torch.float32, ids)) == 3
