"""``add_request(suffix_ids=...)``: a request's own prompt tokens after a shared prefix, computed by the
base into the request's tail, equal prefilling the whole prompt (teacher-forced logits and greedy)."""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from conftest import make_full as _full
from conftest import make_lora as _lora
from conftest import make_tiny_folder

N_NEW = 6


def _world(tmp_path, tokenizer, scale, handoff):
    base = ccft.load_base(str(make_tiny_folder(tmp_path, tokenizer, seed=3 + handoff, scale=scale)))
    full = _full(base, 7, handoff=handoff)  # before any adapter is attached: a copy of the plain base
    return base, {"math": _lora(base, "math", 1, 4, handoff=handoff), "full": full}


def _prompts(gsm8k_rows, tokenizer):
    ids = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:4]]
    return ids[0][:20], [ids[1 + j][:n] for j, n in enumerate((1, 3, 9))]


def _run(eng, rid, logits=False):
    got, gen = [], None
    while eng.active:
        for o in eng.step(return_logits=logits):
            if o.request_id == rid:
                if logits:
                    got.append(o.logits.clone())
                if o.finished:
                    gen = o.generation
    return got, gen


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("handoff", [1, 2])
def test_suffix_logits_equal_whole_prompt(tmp_path, tokenizer, gsm8k_rows, decode, handoff):
    base, decs = _world(tmp_path, tokenizer, 1.0, handoff)
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    h = eng.prefill([shared], handoff_tokens=handoff)
    snap = h.snapshot()
    forced = torch.randint(3, 200, (N_NEW,), generator=torch.Generator().manual_seed(0)).tolist()
    for name in ("base", "math", "full"):
        for suf in suffixes:
            got, _ = _run(
                eng, eng.add_request(h, 0, decoder=name, suffix_ids=suf, forced_tokens=forced), True
            )
            with eng.prefill([shared + suf], handoff_tokens=handoff) as whole:
                ref, _ = _run(eng, eng.add_request(whole, 0, decoder=name, forced_tokens=forced), True)
            assert len(got) == N_NEW
            torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # K1
    h.release()
    assert eng.arena.used_tokens == 0


@pytest.mark.parametrize("handoff", [1, 2])
def test_suffix_greedy_equals_reference(tmp_path, tokenizer, gsm8k_rows, handoff):
    base, decs = _world(tmp_path, tokenizer, 30.0, handoff)
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    with eng.prefill([shared], handoff_tokens=handoff) as h:
        for name in ("base", "math", "full"):
            for suf in suffixes:
                _, gen = _run(eng, eng.add_request(h, 0, decoder=name, suffix_ids=suf, max_new_tokens=N_NEW))
                mode, dec = ("base", None) if name == "base" else ("prefillshare", decs[name])
                want = ccft.generate([shared + suf], mode=mode, base=base, decoder=dec, max_new_tokens=N_NEW)[
                    0
                ]
                assert gen.token_ids == want.token_ids, (name, len(suf))


def _admit_all(eng, admits, forced):
    """Admit every ``(handle, row, decoder, suffix)`` before the first step; each request's step logits."""
    ids = [eng.add_request(h, row, decoder=d, suffix_ids=s, forced_tokens=forced) for h, row, d, s in admits]
    got: dict[int, list] = {i: [] for i in ids}
    while eng.active:
        for o in eng.step(return_logits=True):
            got[o.request_id].append(o.logits.clone())
    return [torch.stack(got[i]) for i in ids]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("handoff", [1, 2])
def test_requests_admitted_together_batch_their_suffixes(
    tmp_path, tokenizer, gsm8k_rows, decode, handoff, monkeypatch
):
    """Requests admitted before one step write their tails together: the base's part of the suffixes of the
    requests on one handle is one forward (``model.extend_rows``); every request's step logits equal its
    logits when admitted alone (``prefill_tail`` row by row). Covered: agents of several decoders on one
    context row with suffixes of 9, 3 and 1 tokens and none, a full-weight decoder (its own lane), and a
    second handle read at two rows."""
    from ccft.inference import model as M

    base, decs = _world(tmp_path, tokenizer, 1.0, handoff)
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    h = eng.prefill([shared], handoff_tokens=handoff)
    h2 = eng.prefill([shared[:12], shared[:17]], handoff_tokens=handoff)
    snaps = [h.snapshot(), h2.snapshot()]
    admits = [
        (h, 0, "base", suffixes[2]),
        (h, 0, "math", suffixes[1]),
        (h, 0, "full", suffixes[0]),
        (h, 0, "math", None),
        (h2, 1, "math", suffixes[2]),
        (h2, 0, "base", suffixes[1]),
    ]
    forced = torch.randint(3, 200, (N_NEW,), generator=torch.Generator().manual_seed(0)).tolist()
    batched = []
    real = M.extend_rows
    monkeypatch.setattr(M, "extend_rows", lambda *a, **k: batched.append(list(a[2])) or real(*a, **k))
    together = _admit_all(eng, admits, forced)
    assert sorted(batched) == [[9, 3], [9, 3]]  # one forward per handle on the base lane
    batched.clear()
    for (hh, row, d, s), got in zip(admits, together, strict=True):
        alone, _ = _run(eng, eng.add_request(hh, row, decoder=d, suffix_ids=s, forced_tokens=forced), True)
        torch.testing.assert_close(got, torch.stack(alone), atol=1e-5, rtol=0)
    assert batched == []  # alone: row by row
    for handle, snap in zip(
        (h, h2), snaps, strict=True
    ):  # K1: the batched write left the shared K/V as it was
        assert all(torch.equal(a, b) for a, b in zip(snap, handle.snapshot(), strict=True))
    h.release()
    h2.release()
    assert eng.arena.used_tokens == 0


def test_a_tail_that_fails_fails_its_request_alone(tmp_path, tokenizer, gsm8k_rows, monkeypatch):
    """A request whose tail cannot be written at the step after its admission fails alone (``StepError``
    naming it); the requests admitted with it decode as if admitted alone; a request aborted before that
    step is dropped without its tail being computed."""
    from ccft.inference import prefill as P
    from ccft.inference.requests import StepError

    base, decs = _world(tmp_path, tokenizer, 30.0, 1)
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    with eng.prefill([shared]) as h:
        want = {}
        for name in ("base", "math"):
            _, gen = _run(
                eng, eng.add_request(h, 0, decoder=name, suffix_ids=suffixes[2], max_new_tokens=N_NEW)
            )
            want[name] = gen.token_ids
        real = P.prefill_tail

        def fail_full(handle, row, tail, producer, weights, *a, **k):
            if weights is eng.decoders["full"].lane.weights:
                raise RuntimeError("tail write failed")
            return real(handle, row, tail, producer, weights, *a, **k)

        monkeypatch.setattr(P, "prefill_tail", fail_full)
        ok = {n: eng.add_request(h, 0, decoder=n, suffix_ids=suffixes[2], max_new_tokens=N_NEW) for n in want}
        dropped = eng.add_request(h, 0, decoder="math", suffix_ids=suffixes[1], max_new_tokens=N_NEW)
        bad = eng.add_request(h, 0, decoder="full", suffix_ids=suffixes[2], max_new_tokens=N_NEW)
        eng.abort(dropped)
        with pytest.raises(StepError) as err:
            eng.step()
        assert set(err.value.failed) == {bad} and "tail write failed" in str(err.value.failed[bad])
        tokens = {rid: [o.token_id] for o in err.value.outputs for rid in [o.request_id]}
        assert set(tokens) == set(ok.values())
        while eng.active:
            for o in eng.step():
                tokens[o.request_id].append(o.token_id)
        assert {n: tokens[r] for n, r in ok.items()} == want


@pytest.mark.parametrize(
    "name, lengths, selected, packed",
    [
        ("base", [9, 3, 1], None, True),
        ("math", [9, 3, 1], None, True),
        ("math", [9, 9, 9], None, False),  # packing would cost > PACK_MAX_WORK x the padded batch's attention
        ("math", [9, 3, 1], [0, 2], False),  # the adapter selects rows: the packed batch has one row
    ],
)
def test_rows_on_one_prefix_are_packed_into_one_sequence(
    tmp_path, tokenizer, gsm8k_rows, monkeypatch, name, lengths, selected, packed
):
    """``model.extend_rows`` given ONE prefix row (agents admitted on one context) packs the rows into one
    sequence under a block-diagonal causal mask, unless the LoRA plan selects rows or packing costs more
    attention than ``PACK_MAX_WORK`` times the right-padded batch (then a padded batch over a broadcast view
    of the prefix). Either way the K/V it writes equal those of the rows with the prefix gathered per row and
    of ``extend`` row by row, and nothing past a row's length is written. The prefix is the left-padded row of
    a batch-2 handle."""
    from ccft.inference import model as M

    base, decs = _world(tmp_path, tokenizer, 1.0, 1)
    eng = SharedPrefillEngine(base, decoders=decs, fill=float("nan"))
    shared, suffixes = _prompts(gsm8k_rows, tokenizer)
    h = eng.prefill([shared[:12], shared[:17]])
    row = 0
    assert not bool(h.real_slots()[row].all())  # the row is left-padded
    entry = eng.decoders[name]
    lw, lora = entry.lane.weights, entry.lora_plan()
    row_lora = [lora] * 3
    if selected is not None:
        ((adapter, _),) = lora.entries
        lora = M.LoraPlan([(adapter, torch.tensor(selected))])
        row_lora = [M.LoraPlan([(adapter, None)]) if r in selected else M.NO_LORA for r in range(3)]
    tokens = torch.zeros(3, max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        tokens[r, :n] = torch.tensor((suffixes[2] * 2)[r : r + n])
    starts = torch.full((3,), h.lengths[row], dtype=torch.long)

    def pool():
        return torch.full((lw.num_layers, 3, lw.kv_heads, 12, lw.head_dim), float("nan"))

    batches = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    spy = lambda q, *a, **k: batches.append(q.shape[0]) or sdpa(q, *a, **k)  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    one = torch.tensor([row])
    one_k, one_v = pool(), pool()
    M.extend_rows(
        lw,
        tokens,
        lengths,
        starts,
        lambda i: h.keys(i)[row : row + 1],
        lambda i: h.values(i)[row : row + 1],
        h.real_slots(one),
        one_k,
        one_v,
        [0, 1, 2],
        lora,
    )
    assert set(batches) == {1 if packed else 3}
    rows = one.repeat(3)
    apart_k, apart_v = pool(), pool()
    M.extend_rows(
        lw,
        tokens,
        lengths,
        starts,
        lambda i: h.keys(i).index_select(0, rows),
        lambda i: h.values(i).index_select(0, rows),
        h.real_slots(rows),
        apart_k,
        apart_v,
        [0, 1, 2],
        lora,
    )
    alone_k, alone_v = pool(), pool()
    for r, n in enumerate(lengths):
        M.extend(
            lw,
            tokens[r, :n],
            h.lengths[row],
            lambda i: h.keys(i)[row],
            lambda i: h.values(i)[row],
            int(h.key_start[row]),
            alone_k[:, r],
            alone_v[:, r],
            0,
            row_lora[r],
            logits=False,
        )
    for r, n in enumerate(lengths):
        for got in (one_k, one_v, apart_k, apart_v):
            assert bool(got[:, r, :, n:].isnan().all())  # nothing written past the row's tokens
        for got, want in ((one_k, alone_k), (one_v, alone_v), (apart_k, alone_k), (apart_v, alone_v)):
            torch.testing.assert_close(got[:, r, :, :n], want[:, r, :, :n], atol=1e-5, rtol=0)
    h.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_gives_the_attention_of_the_bool_mask_bit_for_bit(dtype):
    """The forwards build their attention mask once per forward as an additive mask (``model.additive_mask``);
    ``scaled_dot_product_attention`` gives exactly what it gives with the bool mask (GQA, ragged masks)."""
    from ccft.inference.model import additive_mask

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 13, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 3, 40, 64, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(2, 1, 13, 40, generator=g) > 0.3
    allowed[..., -1] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    got = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=additive_mask(allowed, dtype), enable_gqa=True
    )
    assert torch.equal(got, want)
