"""Host-side plans of one decode step: which prefix each row reads, which adapter each row applies.

The rows of a lane (``Request``s in slot order, row r in tail slot r) are described to the model
in two ways:

* eager step (``model.decode_step_eager``): ``prefix_groups`` groups rows by the handle they read
  (the shared prefix is read once per group, ``attention.prefix_attention_grouped``) and
  ``lora_plan`` lists, per adapter of the lane, the rows that apply it (index tensors);
* static step (``model.decode_step_static``, what ``graphs.StaticRunner`` runs and captures):
  ``static_inputs`` pads the rows to a batch bucket and gives fixed-shape tensors (per-row token,
  RoPE position, tail write index; per-adapter 0/1 row masks; the prefix placement in the arena).

Both describe the same arithmetic (docs/design.md, "Invariants the tests hold" 6; fault class K4).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ccft.inference import model as M
from ccft.inference.attention import CompactMeta, PrefixGroup, build_prefix_meta
from ccft.inference.handles import CompactHandle
from ccft.inference.requests import Request
from ccft.inference.weights import LaneWeights

#: a handle's rows in a decode batch that lie within a span of at most this many times their number are read
#: in place as that span (a view; the span's other rows are computed and dropped) instead of gathered (a copy
#: of their whole prefix K/V in every layer, every step)
SPAN_FACTOR = 2


def prefix_groups(rows: Sequence[Request], device) -> list[PrefixGroup]:
    """The prefix groups covering ``rows`` (batch index i is ``rows[i]``).

    Rows reading one handle with the same own K/V (``Request.own``: a decoder at sharing depth m reads its
    own below layer m) form one group: a handle whose every row is present, in order and
    contiguous, reads its region directly (``rows=None``); otherwise a ``(prompt rows, m)`` table
    maps each prompt row read to the batch rows reading it (-1 padded), with ``used`` None (every
    prompt row), a slice (the span of the rows read, read in place: ``SPAN_FACTOR``) or the prompt
    rows gathered.
    """
    by_handle: dict[tuple[int, int], list[tuple[int, Request]]] = {}
    for i, r in enumerate(rows):
        by_handle.setdefault((r.handle.id, -1 if r.own is None else r.own.id), []).append((i, r))
    groups = []
    for members in by_handle.values():
        h, own = members[0][1].handle, members[0][1].own
        kf = (lambda hh, oo: lambda i: hh.layer_keys(i, oo))(h, own)
        vf = (lambda hh, oo: lambda i: hh.layer_values(i, oo))(h, own)
        every = h.every_layer if own is None else None  # a depth-m reader's layers are in two regions
        first = members[0][0]
        if len(members) == h.batch_size and all(i == first + r.row for i, r in members):
            groups.append(PrefixGroup(kf, vf, h.key_start, None, first, every_layer=every))
            continue
        per: dict[int, list[int]] = {}
        for i, r in members:
            per.setdefault(r.row, []).append(i)
        used = sorted(per)
        m = max(len(v) for v in per.values())
        lo, hi = used[0], used[-1] + 1
        if len(used) == h.batch_size:
            used_t, span = None, used
        elif hi - lo <= SPAN_FACTOR * len(
            used
        ):  # read the span lo..hi-1 in place (rows without a reader idle)
            used_t, span = slice(lo, hi), list(range(lo, hi))
        else:  # few rows of a wide span: gather them
            used_t, span = torch.tensor(used, device=device), used
        table = torch.full((len(span), m), -1, dtype=torch.long)
        for j, u in enumerate(span):
            if u in per:
                table[j, : len(per[u])] = torch.tensor(per[u])
        groups.append(PrefixGroup(kf, vf, h.key_start, table.to(device), 0, used_t, every_layer=every))
    return groups


def lora_plan(weights: LaneWeights, rows: Sequence[Request], device) -> M.LoraPlan:
    """Per adapter of the lane, the batch rows that apply it (None: every row); rows of the lane's
    own weights apply none. PEFT's ``W x + B (A x) · scaling`` per row (``model.project``)."""
    if not weights.adapters:
        return M.NO_LORA
    by_adapter: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.adapter_index is not None:
            by_adapter.setdefault(r.adapter_index, []).append(i)
    entries = []
    for a, idx in by_adapter.items():
        sel = None if len(idx) == len(rows) else torch.tensor(idx, dtype=torch.long, device=device)
        entries.append((weights.adapters[a], sel))
    return M.LoraPlan(entries)


def single_lora_plan(weights: LaneWeights, adapter_index: int | None) -> M.LoraPlan:
    """The plan of one decoder over all rows: its adapter (``adapter_index`` in ``weights.adapters``), or
    none."""
    if adapter_index is None:
        return M.NO_LORA
    return M.LoraPlan([(weights.adapters[adapter_index], None)])


def static_inputs(
    weights: LaneWeights,
    rows: Sequence[Request],
    tokens: Sequence[int],
    positions: Sequence[int],
    write: Sequence[int],
    batch: int,
    device,
) -> M.StaticInputs:
    """Host-built ``StaticInputs`` for ``rows`` padded to ``batch`` rows.

    Args:
        tokens, positions, write: per row the input token, its RoPE position and its tail write index.
        batch: the batch bucket (≥ len(rows)); padded rows feed token 0 at position 0 into their own
            unused slots, apply no adapter and read no prefix.
    Returns:
        ``StaticInputs``: ``(batch,)`` long tokens / positions / write_pos / tail_len (write_pos + 1),
        ``(adapters, batch, 1)`` row masks in the lane dtype, and the prefix placement
        (``attention.build_prefix_meta``); when a row reads its own K/V below its sharing depth
        (``Request.own``), their placement in the own-layer arena and the rows' depths (0: none; rows
        without own K/V point at another row's, never selected); when a row reads the compact C_base
        (``handles.CompactHandle``), the placement of its codes and scales and which rows read them.
    """
    n = len(rows)
    pad = batch - n
    # built on the host, packed into one long buffer (StaticInputs.packed) and moved in one copy: a captured
    # step's inputs are that buffer copied into the graph's (graphs.StaticRunner)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    write_pos = t(list(write) + [0] * pad)
    masks = torch.zeros((len(weights.adapters), batch, 1), dtype=weights.dtype)
    for i, r in enumerate(rows):
        if r.adapter_index is not None:
            masks[r.adapter_index, i] = 1
    compact = [r for r in rows if isinstance(r.handle, CompactHandle)]
    # rows on the compact C_base read no region of the prefix arena: they point at its first slot (never
    # selected)
    meta = build_prefix_meta(
        [
            (0, 0, 1, 1)
            if isinstance(r.handle, CompactHandle)
            else (r.handle.start, r.row, r.handle.width, r.prefix_len)
            for r in rows
        ],
        batch,
        weights.kv_heads,
        "cpu",
    )
    tokens_t, positions_t = t(list(tokens) + [0] * pad), t(list(positions) + [0] * pad)
    inp = M.StaticInputs(tokens_t, positions_t, write_pos, write_pos + 1, masks, meta)
    if compact:
        first = compact[0]
        placed = [r if isinstance(r.handle, CompactHandle) else first for r in rows]
        h = weights.kv_heads
        inp.compact_meta = CompactMeta(
            build_prefix_meta(
                [(r.handle.code_start, r.row, r.handle.width, r.prefix_len) for r in placed], batch, h, "cpu"
            ),
            t([(r.handle.vscale_start + r.row * r.handle.width) * h for r in placed] + [0] * pad),
            t([(r.handle.kscale_start + r.row) * h for r in placed] + [0] * pad),
        )
        inp.compact = torch.tensor([isinstance(r.handle, CompactHandle) for r in rows] + [False] * pad)
    with_own = [r for r in rows if r.own is not None]
    if with_own:
        first = with_own[0]
        inp.own_meta = build_prefix_meta(
            [
                (o.start, r.row, o.width, r.prefix_len)
                if (o := r.own) is not None
                else (first.own.start, first.row, first.own.width, first.prefix_len)
                for r in rows
            ],
            batch,
            weights.kv_heads,
            "cpu",
        )
        inp.depth = t([0 if r.own is None else r.own.depth for r in rows] + [0] * pad)
    return inp.packed().to(device)


__all__ = ["prefix_groups", "lora_plan", "single_lora_plan", "static_inputs"]
