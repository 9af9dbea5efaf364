"""A prefix arena sized up front (``SharedPrefillEngine(max_prefix_tokens=N)``): allocated whole when the
engine is built, it never grows; outputs equal those of the default arena (which starts at 1024 slots and
doubles).
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.inference import CapacityError, SharedPrefillEngine
from ccft.inference.engine import kv_bytes_per_token
from conftest import make_lora, make_tiny_folder

N_NEW = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("arena"), tokenizer, seed=3, scale=30.0))
    )
    return base, {"math": make_lora(base, "math", 1, 4)}


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(eng, batches):
    """Hold every batch's handle at once (the arena must hold them together), then decode each row greedily
    with the base and ``math``; the greedy tokens, in order."""
    handles = [eng.prefill(prompts) for prompts in batches]
    out = []
    for h in handles:
        for name in ("base", "math"):
            out += [g.token_ids for g in eng.generate(h, decoder=name, max_new_tokens=N_NEW, ignore_eos=True)]
    for h in handles:
        h.release()
    return out


def test_fixed_arena_is_whole_from_the_start_and_outputs_equal_the_default(world):
    base, decs = world
    per_token = kv_bytes_per_token(base)
    assert per_token == 2 * 2 * 2 * 16 * 4  # layers × (K, V) × kv_heads × head_dim × fp32 bytes
    # 6 prompts of 140 tokens and 4 of 100 held together: 6·139 + 4·99 = 1230 prefix slots, more than the
    # default arena's 1024
    batches = [[_ids(140, i) for i in range(6)], [_ids(100, 10 + i) for i in range(4)]]

    default = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    assert default.arena.capacity == 1024
    ref = _run(default, batches)
    assert default.arena.capacity == 2048 and default.arena.generation == 1  # it doubled

    fixed = SharedPrefillEngine(base, decoders=decs, max_prefix_tokens=1600, fill=float("nan"))
    assert fixed.kv_bytes_per_token == per_token
    assert fixed.arena.capacity == 1600 and fixed.arena.nbytes == 1600 * per_token
    got = _run(fixed, batches)
    assert fixed.arena.capacity == 1600 and fixed.arena.generation == 0  # never grew
    assert fixed.arena.used_tokens == 0
    assert got == ref and all(len(t) == N_NEW for t in got)


def test_fixed_arena_fits_and_capacity_error(world):
    base, _ = world
    eng = SharedPrefillEngine(base, max_prefix_tokens=300)
    arena = eng.arena
    assert arena.fits(300) and not arena.fits(301)
    first = eng.prefill([_ids(201, 1)])  # 200 prefix slots (the last token is the handoff)
    assert arena.used_tokens == 200 and arena.fits(100) and not arena.fits(101)
    with pytest.raises(CapacityError, match="max_prefix_tokens=300"):
        eng.prefill([_ids(151, 2)])
    assert arena.used_tokens == 200 and arena.capacity == 300  # nothing taken, nothing grown
    first.release()
    assert arena.fits(300)
    # the default arena always fits: it grows
    assert SharedPrefillEngine(base).arena.fits(10**6)
