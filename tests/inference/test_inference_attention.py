"""Cascade (shared-prefix + tail, log-sum-exp merge) attention == plain attention, and the static caches.

Random shapes: GQA, ragged prefixes (left padding) from several handles, prefix rows shared by
several decode rows (rows of different decoders on one prompt), ragged tails; every arena byte not
written by a prefill is NaN. The Triton kernel is checked by the same cases in Triton's interpreter
(a subprocess with TRITON_INTERPRET=1: triton reads it at import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ccft.inference import attention
from ccft.inference.attention import (
    PrefixGroup,
    build_prefix_meta,
    cascade_attention_rowwise,
    key_bias,
    merge,
    plain_attention,
    prefix_attention_gathered,
    prefix_attention_grouped,
    tail_attention,
)
from ccft.inference.kv import CapacityError, PrefixArena, TailPool, bucket

ROOT = Path(__file__).resolve().parents[2]
CASES = [  # (seed, kv_heads, query heads per kv head, head_dim, handles as (prompts, [lengths]), decode rows)
    (0, 1, 1, 16, [[5]], 1),
    (1, 2, 3, 16, [[7, 4, 5], [3, 5]], 6),
    (2, 3, 3, 64, [[12, 1, 9, 12]], 9),
    (3, 4, 2, 32, [[2], [6, 6], [1, 3, 2]], 11),
]


def make_case(seed, kv_heads, rep, d, handles, n_rows, device="cpu"):
    """Arena with NaN everywhere a prefill did not write, decode rows -> (region, prefix row), tails."""
    g = torch.Generator().manual_seed(seed)
    arena = PrefixArena(1, kv_heads, d, torch.float32, device, capacity_tokens=4, fill=float("nan"))
    regions = []
    for lengths in handles:
        p = max(lengths)
        start = arena.allocate(len(lengths) * p)
        k, v = arena.view("k", 0, start, len(lengths), p), arena.view("v", 0, start, len(lengths), p)
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        for i, n in enumerate(lengths):  # left padding, zeroed as the prefill does
            k[i, :, : p - n] = 0
            v[i, :, : p - n] = 0
        regions.append((start, p, lengths))
    # every prefix row is used at least once when there are enough rows; then random extra sharers
    pairs = [(h, i) for h, (_, _, lengths) in enumerate(regions) for i in range(len(lengths))]
    rows = pairs[:n_rows] + [
        pairs[int(j)] for j in torch.randint(len(pairs), (max(0, n_rows - len(pairs)),), generator=g)
    ]
    rows = [rows[int(j)] for j in torch.randperm(len(rows), generator=g)]
    heads = kv_heads * rep
    q = torch.randn(n_rows, heads, d, generator=g)
    width = 9
    tail_len = torch.randint(1, width + 1, (n_rows,), generator=g)
    tk = torch.randn(n_rows, kv_heads, width, d, generator=g)
    tv = torch.randn(n_rows, kv_heads, width, d, generator=g)
    for r in range(n_rows):  # never-written tail slots hold stale finite data, which must not matter
        tk[r, :, tail_len[r] :] = 1e3
        tv[r, :, tail_len[r] :] = -1e3
    return arena, regions, rows, q, tk, tv, tail_len


def reference(arena, regions, rows, q, tk, tv, tail_len, scale):
    out = []
    for r, (h, i) in enumerate(rows):
        start, p, lengths = regions[h]
        n = lengths[i]
        k = torch.cat([arena.view("k", 0, start, len(lengths), p)[i, :, p - n :], tk[r, :, : tail_len[r]]], 1)
        v = torch.cat([arena.view("v", 0, start, len(lengths), p)[i, :, p - n :], tv[r, :, : tail_len[r]]], 1)
        valid = torch.ones(1, 1, k.shape[1], dtype=torch.bool, device=q.device)
        out.append(plain_attention(q[r : r + 1, :, None], k[None], v[None], valid, scale)[0, :, 0])
    return torch.stack(out)


def grouped_plan(arena, regions, rows, device="cpu"):
    groups = []
    for h, (start, p, lengths) in enumerate(regions):
        members: dict[int, list[int]] = {}
        for r, (hh, i) in enumerate(rows):
            if hh == h:
                members.setdefault(i, []).append(r)
        if not members:
            continue
        used = sorted(members)
        m = max(len(x) for x in members.values())
        table = torch.full((len(used), m), -1, dtype=torch.long)
        for j, u in enumerate(used):
            table[j, : len(members[u])] = torch.tensor(members[u])
        n_rows = len(lengths)
        groups.append(
            PrefixGroup(
                k=lambda layer, s=start, n=n_rows, p=p: arena.view("k", layer, s, n, p),
                v=lambda layer, s=start, n=n_rows, p=p: arena.view("v", layer, s, n, p),
                key_start=torch.tensor([p - n for n in lengths], device=device),
                rows=table.to(device),
                used=None if len(used) == len(lengths) else torch.tensor(used, device=device),
            )
        )
    return groups


def static_meta(regions, rows, batch, kv_heads, device="cpu"):
    return build_prefix_meta(
        [(regions[h][0], i, regions[h][1], regions[h][2][i]) for h, i in rows], batch, kv_heads, device
    )


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "matmul"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}")
def test_cascade_equals_plain_attention(case, fused, monkeypatch):
    if not fused:  # the matmul + softmax fallback (what CUDA's eager path runs)
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    arena, regions, rows, q, tk, tv, tail_len = make_case(*case)
    kv_heads, d = case[1], case[3]
    scale = d**-0.5
    ref = reference(arena, regions, rows, q, tk, tv, tail_len, scale)
    ot, lt = tail_attention(q, tk, tv, tail_len, scale)
    og, lg = prefix_attention_grouped(q, grouped_plan(arena, regions, rows), 0, scale)
    torch.testing.assert_close(merge(og, lg, ot, lt), ref, atol=1e-6, rtol=0)
    # static shapes: batch padded to a bucket, gather width a bucket ≥ the longest prefix
    b = bucket(len(rows))
    qp = torch.cat([q, torch.randn(b - len(rows), *q.shape[1:])])
    meta = static_meta(regions, rows, b, kv_heads)
    width = bucket(meta.max_len, 16)
    ak, av = arena.k[0].view(-1, d), arena.v[0].view(-1, d)
    os_, ls = prefix_attention_gathered(qp, ak, av, meta, kv_heads, width, scale)
    torch.testing.assert_close(merge(os_[: len(rows)], ls[: len(rows)], ot, lt), ref, atol=1e-6, rtol=0)
    assert torch.isfinite(os_).all()


def test_identity_layout_reads_views_without_copies():
    """One decode row per prefix row, in order: the grouped path is plain batched attention on the arena
    view."""
    arena, regions, rows, q, tk, tv, tail_len = make_case(5, 2, 2, 16, [[4, 6, 3]], 3)
    rows = [(0, 0), (0, 1), (0, 2)]
    start, p, lengths = regions[0]
    group = PrefixGroup(
        lambda layer: arena.view("k", layer, start, 3, p),
        lambda layer: arena.view("v", layer, start, 3, p),
        torch.tensor([p - n for n in lengths]),
    )
    ref = reference(arena, regions, rows, q, tk, tv, tail_len, 0.25)
    ot, lt = tail_attention(q, tk, tv, tail_len, 0.25)
    og, lg = prefix_attention_grouped(q, [group], 0, 0.25)
    torch.testing.assert_close(merge(og, lg, ot, lt), ref, atol=1e-6, rtol=0)
    # the eager fast path: both score blocks under one softmax (same decomposition, no K/V concatenation)
    key_start = torch.tensor([p - n for n in lengths])
    bias = torch.cat(
        [
            key_bias(key_start, torch.full_like(key_start, p), p),
            key_bias(torch.zeros_like(tail_len), tail_len, tk.shape[2]),
        ],
        dim=-1,
    )
    out = cascade_attention_rowwise(
        q, arena.view("k", 0, start, 3, p), arena.view("v", 0, start, 3, p), tk, tv, bias, 0.25
    )
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_arena_allocates_frees_and_grows():
    arena = PrefixArena(2, 1, 4, torch.float32, "cpu", capacity_tokens=8, fill=float("nan"))
    a = arena.allocate(3)
    b = arena.allocate(4)
    arena.view("k", 1, a, 1, 3).fill_(1.0)
    arena.view("k", 1, b, 2, 2).fill_(2.0)
    arena.free(a)
    c = arena.allocate(2)  # first fit: the freed hole
    assert c == a and arena.generation == 0
    d = arena.allocate(20)  # grows (contents kept, generation bumped)
    assert arena.generation == 1 and arena.capacity >= 26
    assert (arena.view("k", 1, b, 2, 2) == 2.0).all()
    for s in (b, c, d):
        arena.free(s)
    assert arena.used_tokens == 0 and arena.free_ranges == [(0, arena.capacity)]
    capped = PrefixArena(1, 1, 4, torch.float32, "cpu", capacity_tokens=4, max_tokens=10)
    capped.allocate(8)
    with pytest.raises(CapacityError, match="max_prefix_tokens=10"):
        capped.allocate(3)


def test_arena_reserve_grows_once_to_exactly_what_the_regions_need():
    """Reserving for two regions: one growth to their sum (not a power of two), the regions then fit without
    another; contents kept; an arena that already has room does not grow; max_tokens caps a reservation."""
    arena = PrefixArena(2, 1, 4, torch.float32, "cpu", capacity_tokens=8, fill=float("nan"))
    a = arena.allocate(3)
    arena.view("k", 1, a, 1, 3).fill_(1.0)
    arena.reserve(2 * 30)
    assert arena.generation == 1 and arena.capacity == 3 + 60  # the 5 free tail slots count towards it
    r1, r2 = arena.allocate(30), arena.allocate(30)
    assert arena.generation == 1 and {r1, r2} == {3, 33}
    assert (arena.view("k", 1, a, 1, 3) == 1.0).all()
    for s in (a, r1, r2):
        arena.free(s)
    arena.reserve(40)  # 63 free slots in one range: nothing to do
    assert (arena.generation, arena.capacity) == (1, 63)
    # allocating region by region instead doubles to a power of two (what reserve avoids)
    doubling = PrefixArena(2, 1, 4, torch.float32, "cpu", capacity_tokens=8)
    doubling.allocate(3)
    doubling.allocate(40), doubling.allocate(40)
    assert doubling.capacity == 128 and doubling.generation == 2  # reserve(80) would make it 83, growing once
    capped = PrefixArena(1, 1, 4, torch.float32, "cpu", capacity_tokens=4, max_tokens=10)
    capped.reserve(50)
    assert capped.capacity == 10
    arena.reserve(0)
    assert arena.generation == 1


def test_tail_pool_grows_keeps_rows_and_compacts():
    pool = TailPool(
        2, 1, 4, torch.float32, "cpu", slots=1, capacity=4, max_slots=4, max_capacity=64, fill=float("nan")
    )
    pool.k[:, 0, :, :3] = 7.0
    pool.ensure(3, 20)
    assert (pool.slots, pool.capacity, pool.generation) == (4, 32, 1)
    assert (pool.k[:, 0, :, :3] == 7.0).all()
    pool.clear_slot(2)
    assert (pool.k[:, 2] == 0).all() and (pool.v[:, 2] == 0).all()
    pool.k[:, 3, :, :5] = 3.0
    pool.move(3, 1, 5)
    assert (pool.k[:, 1, :, :5] == 3.0).all() and (pool.k[:, 1, :, 5:] == 0).all()
    with pytest.raises(CapacityError, match="max_batch=4"):
        pool.ensure(5, 4)
    with pytest.raises(CapacityError, match="max_tail_tokens=64"):
        pool.ensure(1, 65)


def test_triton_kernel_in_interpreter():
    """Runs test_inference_triton_interpret.py in a subprocess with TRITON_INTERPRET=1."""
    pytest.importorskip("triton", reason="the Triton kernel test needs `pip install triton` (CI installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    target = Path(__file__).with_name("test_inference_triton_interpret.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
