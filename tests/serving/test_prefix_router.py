"""The ``prefix`` router (ccft.serving.router.PrefixRouter): requests go where their prompt's prefix blocks
were placed, sessions keep their affinity, the overload rule of the ``session`` router, a bounded LRU of chain
keys per worker, and its option errors. Pure Python."""

from __future__ import annotations

import pytest

from ccft.core.errors import ConfigError
from ccft.serving.block_keys import chain_keys
from ccft.serving.router import ROUTE_PRODUCER, PrefixRouter, SessionAffinityRouter, make_router

B = 4  # tokens per block in these tests


def blocks(*starts: int) -> list[int]:
    """One block of B consecutive ids per start: blocks(10, 20) == [10, 11, 12, 13, 20, 21, 22, 23]."""
    return [s + j for s in starts for j in range(B)]


CONTEXT = blocks(100, 110, 120, 130)  # a shared context of 4 blocks


def test_keys_are_the_prefix_store_chain_keys():
    r = PrefixRouter(block_tokens=B)
    ids = CONTEXT + [7, 8]  # 4 full blocks and a partial one
    keys = r.keys(ids)
    assert keys == chain_keys(ROUTE_PRODUCER, "tokens", B, ids) and len(keys) == 4
    # a chain key covers every token before it: the same block after another prefix is another key
    assert r.keys(blocks(130)) != keys[3:]
    # text is keyed over code points in blocks of CHARS_PER_TOKEN * B characters, apart from token keys
    text = "x" * (PrefixRouter.CHARS_PER_TOKEN * B * 2 + 3)
    assert len(r.keys(text)) == 2
    assert r.keys(text) != r.keys([ord(c) for c in text][: 2 * B])


def test_new_session_goes_where_its_prefix_is():
    r = PrefixRouter(block_tokens=B)
    assert r.place("a", CONTEXT + blocks(1), [1, 0]) == 1  # nothing placed yet: the least-loaded worker
    # a new session over the same context: worker 1 holds its first 4 blocks, busier but not overloaded
    assert r.place("b", CONTEXT + blocks(2), [0, 1]) == 1
    assert SessionAffinityRouter().place("b", CONTEXT + blocks(2), [0, 1]) == 0  # what `session` does
    assert r.place(None, CONTEXT, [0, 3]) == 1  # no session id: placed by its blocks too, not pinned
    assert r.stats() == {
        "new": 3,
        "affinity": 0,
        "fallback": 0,
        "prefix": 2,
        "matched_blocks": 8,
        "sessions": 2,
        "keys": 6,  # CONTEXT's 4 blocks, then the two sessions' own 5th blocks
    }
    assert r.placement == {"a": 1, "b": 1}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_divergent_prefix_prefers_the_longest_match(k):
    r = PrefixRouter(block_tokens=B)
    target = blocks(10, 20, 30, 40, 50, 60)
    # worker 0 holds target's first k blocks (then another tail)
    assert r.place("x", target[: k * B] + blocks(900, 901), [0, 1]) == 0
    # worker 1 holds its first k+2 blocks: worker 0 is overloaded (gap 4, 4 > 2*0), so y goes to worker 1
    assert r.place("y", target[: (k + 2) * B] + blocks(902), [4, 0]) == 1
    keys = r.keys(target)
    assert (r.matched_blocks(keys, 0), r.matched_blocks(keys, 1)) == (k, k + 2)
    assert r.place("z", target, [0, 2]) == 1  # the longest match wins over the lower load
    # y went to worker 1, which held none of its blocks: only z counts as placed by a match
    assert (r.stats()["prefix"], r.stats()["matched_blocks"]) == (1, k + 2)


def test_overload_sends_to_the_least_loaded_and_records_it():
    r = PrefixRouter(block_tokens=B)
    assert r.place("a", CONTEXT, [0, 0]) == 0
    keys = r.keys(CONTEXT)
    assert r.place("b", CONTEXT, [3, 0]) == 0  # gap 3 < 4: the block holder
    assert r.place("c", CONTEXT, [4, 0]) == 1  # gap 4 and 4 > 2*0: overloaded, the least-loaded one
    assert list(r.held[1]) == keys[::-1]  # recorded there, head most recent
    assert r.matched_blocks(keys, 1) == 4
    # both hold the chain now: ties go to the less loaded, then the lower index
    assert r.place("d", CONTEXT, [1, 0]) == 1
    assert r.place("e", CONTEXT, [0, 0]) == 0
    assert r.stats()["prefix"] == 3 and r.stats()["new"] == 5  # b, d, e matched; a and c did not


def test_lru_bound_evicts_the_least_recently_placed_keys():
    r = PrefixRouter(block_tokens=2, max_keys_per_worker=3)
    k = r.keys([1, 2, 3, 4, 5, 6])  # k0, k1, k2
    assert r.place("s", [1, 2, 3, 4, 5, 6], [0]) == 0
    assert list(r.held[0]) == [k[2], k[1], k[0]]  # the tail oldest: trimmed before the head
    (j,) = r.keys([7, 8])
    r.place("t", [7, 8], [0])
    assert list(r.held[0]) == [k[1], k[0], j]
    m = r.keys([1, 2, 9, 9])  # shares block 0 with the first prompt
    r.place("u", [1, 2, 9, 9], [0])
    assert list(r.held[0]) == [j, m[1], k[0]]  # k1 evicted; k0 touched again (head last)
    assert r.matched_blocks(k, 0) == 1 and r.stats()["keys"] == 3
    big = PrefixRouter(block_tokens=1, max_keys_per_worker=2)
    big.place(None, [5, 6, 7, 8], [0])  # a chain longer than the bound keeps its head
    assert list(big.held[0]) == big.keys([5, 6])[::-1]


def test_sessions_keep_their_affinity():
    r = PrefixRouter(block_tokens=B)
    assert r.place("s", blocks(1), [0, 0]) == 0
    assert r.place("other", CONTEXT, [1, 0]) == 1  # worker 1 holds CONTEXT
    assert r.place("s", CONTEXT, [0, 0]) == 0  # home, although worker 1 holds the prompt's blocks
    assert r.place("s", CONTEXT, [3, 0]) == 0  # home busier, not overloaded
    assert r.place("s", CONTEXT, [4, 0]) == 1  # overloaded: moved, and re-pinned
    assert r.placement["s"] == 1 and r.place("s", blocks(1), [0, 1]) == 1
    r.on_finish("s", 1, session_done=True)
    assert "s" not in r.placement
    assert r.stats()["affinity"] == 3 and r.stats()["fallback"] == 1


def test_worker_ids_follow_workers_not_positions():
    r = PrefixRouter(block_tokens=B)
    assert r.place(None, CONTEXT, [1, 0], worker_ids=["a", "b"]) == 1  # recorded under "b"
    assert r.place(None, CONTEXT, [0, 0], worker_ids=["b", "c"]) == 0  # "b" is index 0 now
    assert set(r.held) == {"b"}  # "a" left the list: forgotten
    r.forget_worker("b")
    assert r.place(None, CONTEXT, [1, 0], worker_ids=["b", "c"]) == 1  # nothing held: least loaded
    with pytest.raises(ConfigError, match="worker_ids: 1 ids for 2 workers; give one id per"):
        r.place(None, CONTEXT, [0, 0], worker_ids=["b"])


def test_option_errors_name_the_option_and_the_fix():
    with pytest.raises(ConfigError, match=r"block_tokens: must be an int >= 1 .*--block-tokens.*got 0"):
        make_router("prefix", block_tokens=0)
    with pytest.raises(ConfigError, match=r"block_tokens: .* got '16'"):
        PrefixRouter(block_tokens="16")
    with pytest.raises(ConfigError, match=r"max_keys_per_worker: must be an int >= 1 .*--router-keys.*got 0"):
        PrefixRouter(max_keys_per_worker=0)
    with pytest.raises(ConfigError, match="max_keys_per_worker: .* got True"):
        PrefixRouter(max_keys_per_worker=True)
    with pytest.raises(ConfigError, match="max_load_ratio: must be >= 1.0"):
        make_router("prefix", max_load_ratio=0.5)
    with pytest.raises(ConfigError, match="min_load_gap: must be >= 1"):
        make_router("prefix", min_load_gap=0)
    with pytest.raises(ConfigError, match="does not take options"):
        make_router("prefix", keys=3)


def test_a_shared_system_prompt_draws_new_sessions_until_the_overload_rule():
    """The documented trade-off: one block in common is a match, so new sessions that share only a system
    prompt go to the worker holding it until it is overloaded (gap 4 here); once both workers hold it,
    ties go to the less loaded."""
    r = PrefixRouter(block_tokens=B)
    system = blocks(1)
    load = [0, 0]
    chosen = []
    for i in range(8):
        w = r.place(f"s{i}", system + blocks(100 + 10 * i), load)
        load[w] += 1  # every session keeps running
        chosen.append(w)
    assert chosen == [0, 0, 0, 0, 1, 1, 1, 1]
