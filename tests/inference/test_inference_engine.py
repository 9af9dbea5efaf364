"""SharedPrefillEngine == the reference path (ccft.generate / ccft.decoder_forward), K1, K3, K4, K5.

Tiny random Llama (GQA, RoPE, fp32) with a sharpened lm_head (clear greedy margins), LoRA decoders
with ``init_lora_weights=False`` (so an ignored adapter is caught), a perturbed full-weight decoder,
and every cache buffer NaN-filled before use (a read of unwritten memory would reach the logits).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError, FingerprintMismatchError, IncompatibleModelError
from ccft.core.tokens import right_pad
from ccft.inference import CapacityError, SamplingParams, SharedPrefillEngine
from conftest import make_full as _full
from conftest import make_lora as _lora
from conftest import make_tiny_folder, ragged_prompts

N_NEW = 6
ATOL = 1e-5
NAN = float("nan")
MODES = [("eager", "gather"), ("static", "gather")]
#: engine configurations of the teacher-forced test: eager and static, packed (CPU default) and per-projection
#: weights
CONFIGS = {
    "eager": {"decode": "eager"},
    "static": {"decode": "static"},
    "eager-unpacked": {"decode": "eager", "pack_weights": False},
    "static-unpacked": {"decode": "static", "pack_weights": False},
}


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    return make_tiny_folder(tmp_path_factory.mktemp("engine_sharp"), tokenizer, seed=3, scale=30.0)


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Six real prompts cut to different lengths (4 .. 29 tokens): ragged prefixes, left padding."""
    return ragged_prompts(gsm8k_rows, tokenizer, 6, 4, 5)


@pytest.fixture(scope="module")
def world(sharp_dir):
    """A base with two LoRA decoders (different ranks and targets) and one full-weight decoder (read-only)."""
    base = ccft.load_base(str(sharp_dir))
    full = _full(base, 7)  # before any adapter is attached: a copy of the plain base
    a = _lora(base, "math", 1, 4)
    b = _lora(base, "code", 2, 2, targets=["q_proj", "v_proj", "down_proj"])
    return base, {"math": a, "code": b, "full": full}


@pytest.fixture(scope="module")
def refs(world, prompts):
    """Reference greedy generations (ccft.generate) of every decoder on every prompt."""
    base, decs = world
    return {name: _reference(base, dec, prompts) for name, dec in [("base", None), *decs.items()]}


def _engine(base, decs, **kw):
    kw.setdefault("fill", NAN)
    return SharedPrefillEngine(base, decoders=decs, **kw)


def _reference(base, dec, prompts, n=N_NEW, **kw):
    if dec is None:
        return ccft.generate(prompts, mode="base", base=base, max_new_tokens=n, **kw)
    return ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=n, **kw)


def _same(ours, ref):
    assert [(g.token_ids, g.text, g.finish_reason) for g in ours] == [
        (g.token_ids, g.text, g.finish_reason) for g in ref
    ]


def _forced_logits(base, dec, cache, tails):
    """Reference teacher-forced logits ``(b, t, V)`` over tail_ids + forced tokens (C_base as prefix)."""
    ids, mask = right_pad(tails, base.tokenizer.pad_token_id)
    with torch.no_grad():
        if dec is None:
            with base.base_weights() as m:
                return ccft.decoder_forward(m, cache, ids, mask)
        return ccft.decoder_forward(dec, cache, ids, mask)


def test_prefill_writes_c_base(world, prompts):
    base, _ = world
    eng = _engine(base, {})
    ref = ccft.compute_base_cache(base, prompts)
    with eng.prefill(prompts) as h:
        got = h.to_base_cache()
        assert torch.equal(got.attention_mask, ref.attention_mask) and torch.equal(got.tail_ids, ref.tail_ids)
        for a, b in zip(got.keys + got.values, ref.keys + ref.values, strict=True):
            assert a.shape == b.shape and torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        assert h.lengths == ref.lengths.tolist()
    with eng.prefill_cache(ref) as h2:  # an imported C_base is stored bit for bit
        assert h2.to_base_cache().equal(ref)


def test_prefill_in_chunks_of_their_own_width(world, prompts, monkeypatch):
    """Rows prefilled in chunks, each padded only to its own longest row (unsorted rows, NaN-filled arena):
    the same C_base as one forward over all rows, pad slots zero (finite)."""
    from ccft.inference import prefill as P

    base, _ = world
    lengths = [len(p) - 1 for p in prompts]
    monkeypatch.setattr(P, "CHUNK_TOKENS", 2 * max(lengths))
    chunks = P.row_chunks(lengths, heads=4)
    assert len(chunks) > 1 and [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]]
    assert [w for _, _, w in chunks] == [max(lengths[a:b]) for a, b, _ in chunks]
    assert any(w < max(lengths) for _, _, w in chunks)  # some chunk is narrower than the handle
    order = [3, 0, 5, 1, 4, 2]
    rows = [prompts[i] for i in order]
    ref = ccft.compute_base_cache(base, rows)
    with _engine(base, {}).prefill(rows) as h:
        got = h.to_base_cache()
        assert torch.equal(got.attention_mask, ref.attention_mask)
        for a, b in zip(got.keys + got.values, ref.keys + ref.values, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("handoff", [1, 2])
def test_tail_logits_equal_decoder_forward(tiny_dir, prompts, handoff):
    """Teacher-forced tails on a handle (base, two LoRA decoders, a full-weight decoder; rows picked out of
    order, ragged tails) == decoder_forward on the handle's C_base (and the full-weight decoder on its own
    prefill); nothing is written; a decoder may not read another decoder's own prefill (K5)."""
    base = ccft.load_base(str(tiny_dir))
    full = _full(base, 9, handoff)
    decs = {
        "math": _lora(base, "math", 1, 4, handoff),
        "code": _lora(base, "code", 2, 2, handoff, ["k_proj", "up_proj"]),
        "full": full,
    }
    eng = _engine(base, decs, max_batch=4)
    g = torch.Generator().manual_seed(0)
    rows = [4, 0, 2, 5]
    tails = [
        prompts[r][-handoff:] + torch.randint(0, len(base.tokenizer), (3 + r,), generator=g).tolist()
        for r in rows
    ]
    ids, mask = right_pad(tails, base.tokenizer.pad_token_id)
    with eng.prefill(prompts) as h, eng.prefill(prompts, producer="full") as own:
        cache = h.to_base_cache().select(rows)
        snap = h.snapshot()
        for name in ["base", "math", "code", "full"]:
            got = eng.tail_logits(h, rows, ids, mask, decoder=name)
            ref = _forced_logits(base, None if name == "base" else decs[name], cache, tails)
            real = mask.bool()
            torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=0)
            keep = real & (torch.rand(real.shape, generator=g) < 0.6)  # some real positions only
            kept = eng.tail_logits(h, rows, ids, mask, decoder=name, keep=keep)
            assert 0 < keep.sum() < real.sum() and kept.shape == (int(keep.sum()), got.shape[-1])
            torch.testing.assert_close(kept, got[keep], atol=1e-5, rtol=0)  # row-major, the same logits
        got = eng.tail_logits(own, rows, ids, mask, decoder="full")
        with torch.no_grad():
            ref = ccft.decoder_forward(full, own.to_base_cache().select(rows), ids, mask, allow_self=True)
        torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # K1: read only
        with pytest.raises(FingerprintMismatchError, match="own weights"):
            eng.tail_logits(own, rows, ids, mask, decoder="math")
        with pytest.raises(ConfigError, match="out of range"):
            eng.tail_logits(h, [0, 9], ids[:2], mask[:2], decoder="math")


@pytest.mark.parametrize("rows,kind", [([1, 3, 4], slice), ([0, 5], torch.Tensor)])
def test_some_rows_of_a_handle_read_in_place_or_gathered(world, refs, prompts, monkeypatch, rows, kind):
    """Rows 1, 3, 4 of a 6-row handle are read as the span 1..4 in place (row 2 idles); rows 0 and 5 (a span
    three times their number) are gathered. Both decode the reference's tokens (NaN-filled memory)."""
    from ccft.inference import planner

    base, decs = world
    seen = []
    real = planner.prefix_groups

    def spy(batch_rows, device):
        groups = real(batch_rows, device)
        seen.extend(type(g.used) if not isinstance(g.used, torch.Tensor) else torch.Tensor for g in groups)
        return groups

    monkeypatch.setattr(planner, "prefix_groups", spy)
    eng = _engine(base, decs, decode="eager")
    with eng.prefill(prompts) as h:
        for name in ("base", "math", "full"):
            got = eng.generate(h, decoder=name, max_new_tokens=N_NEW, rows=rows)
            _same(got, [refs[name][r] for r in rows])
    assert kind in seen


def test_row_chunks_bounds():
    from ccft.inference.prefill import CHUNK_TOKENS, SCORE_ELEMENTS, row_chunks

    lengths = [5, 7, 9, 300, 310, 1500, 2, 2, 2]
    chunks = row_chunks(lengths, heads=9)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lengths)
    for r0, r1, w in chunks:
        assert w == max(lengths[r0:r1])
        assert r1 - r0 == 1 or ((r1 - r0) * w <= CHUNK_TOKENS and (r1 - r0) * 9 * w * w <= SCORE_ELEMENTS)
    assert row_chunks([], heads=9) == []


@pytest.mark.parametrize("mode,attention", MODES)
@pytest.mark.parametrize("batch", [1, 3, 4, 5])
def test_greedy_equals_reference(world, refs, prompts, mode, attention, batch):
    """Batch 1, 3, a bucket edge (4) and one past it (5: padded to 8 in static mode); every decoder."""
    base, decs = world
    rows = prompts[-batch:]
    eng = _engine(base, decs, decode=mode, attention=attention)
    with eng.prefill(rows) as h:
        snap = h.snapshot()
        for name in refs:
            _same(eng.generate(h, decoder=name, max_new_tokens=N_NEW), refs[name][-batch:])
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # K1
    assert eng.arena.used_tokens == 0  # released and no request left: freed


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("handoff", [1, 2])
def test_teacher_forced_logits_every_step(tiny_dir, prompts, config, handoff):
    """All decoders at once (two lanes, three adapters in one lane), every prompt: step
    logits == decoder_forward.

    On the unsharpened tiny model (logits of order 1, so 1e-5 is a meaningful fp32 bound)."""
    base = ccft.load_base(str(tiny_dir))
    full = _full(base, 9, handoff)
    decs = {
        "math": _lora(base, "math", 1, 4, handoff),
        "code": _lora(base, "code", 2, 2, handoff, ["k_proj", "up_proj"]),
        "full": full,
    }
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=handoff)
    g = torch.Generator().manual_seed(0)
    forced = torch.randint(0, len(base.tokenizer), (len(prompts), N_NEW), generator=g).tolist()
    eng = _engine(base, decs, max_batch=32, **CONFIGS[config])
    h = eng.prefill(prompts)  # k defaults to the decoders' handoff_tokens
    assert h.handoff_tokens == handoff
    names = ["base", "math", "code", "full"]
    rid = {
        (n, i): eng.add_request(h, i, decoder=n, forced_tokens=forced[i])
        for n in names
        for i in range(len(prompts))
    }
    steps = []
    while eng.active:
        steps.append({o.request_id: o for o in eng.step(return_logits=True)})
    assert len(steps) == N_NEW
    h.release()
    tails = [cache.tail_ids[i].tolist() + forced[i] for i in range(len(prompts))]
    for n in names:
        ref = _forced_logits(base, None if n == "base" else decs[n], cache, tails)
        for i in range(len(prompts)):
            got = torch.stack([s[rid[n, i]].logits for s in steps])
            torch.testing.assert_close(got, ref[i, handoff - 1 : handoff - 1 + N_NEW], atol=ATOL, rtol=0)
            assert [s[rid[n, i]].token_id for s in steps] == forced[i]
    assert eng.arena.used_tokens == 0


def test_decoders_interleaved_on_one_handle(world, refs, prompts):
    """A, B, A (and the full decoder) on one prefill, rows of several decoders in one step; K1 throughout."""
    base, decs = world
    eng = _engine(base, decs)
    ref = refs
    h = eng.prefill(prompts)
    snap = h.snapshot()
    first_a = eng.generate(h, decoder="math", max_new_tokens=N_NEW)
    kept = [(g.token_ids[:], g.text) for g in first_a]
    # B and the full decoder concurrently with a second A run, joined one step apart
    ids = {}
    for i in range(len(prompts)):
        ids["code", i] = eng.add_request(h, i, decoder="code", max_new_tokens=N_NEW)
    eng.step()
    for i in range(len(prompts)):
        ids["math", i] = eng.add_request(h, i, decoder="math", max_new_tokens=N_NEW)
        ids["full", i] = eng.add_request(h, i, decoder="full", max_new_tokens=N_NEW)
    outs = _drain(eng)
    for (n, i), rid in ids.items():
        g = outs[rid]
        assert (g.token_ids, g.text) == (ref[n][i].token_ids, ref[n][i].text), (n, i)
    assert [(g.token_ids, g.text) for g in first_a] == kept  # A's first outputs untouched by B's run
    assert all(torch.equal(x, y) for x, y in zip(snap, h.snapshot(), strict=True))
    h.release()


def _drain(eng, **kw):
    done = {}
    while eng.active:
        for o in eng.step(**kw):
            if o.finished:
                done[o.request_id] = o.generation
    return done


@pytest.mark.parametrize("mode,attention", MODES)
def test_requests_join_and_leave(world, prompts, mode, attention):
    """Continuous batching across two handles: joins, an abort and an early finish leave the others
    unchanged."""
    base, decs = world
    ref_a = _reference(base, decs["math"], [prompts[1], prompts[2], prompts[5]], n=10)
    ref_base = _reference(base, None, [prompts[0], prompts[4]], n=10)
    eng = _engine(base, decs, decode=mode, attention=attention, max_batch=8)
    h1, h2 = eng.prefill(prompts[:3]), eng.prefill(prompts[3:])
    r0 = eng.add_request(h2, 2, decoder="math", max_new_tokens=10)
    r1 = eng.add_request(h1, 0, decoder="base", max_new_tokens=10)
    eng.step()
    eng.step()
    r2 = eng.add_request(h1, 1, decoder="math", max_new_tokens=10)
    victim = eng.add_request(h2, 0, decoder="math", max_new_tokens=10)
    early = eng.add_request(h2, 1, decoder="base", max_new_tokens=10)
    eng.step()
    eng.abort(victim)
    r3 = eng.add_request(h1, 2, decoder="math", max_new_tokens=10)
    eng.step()
    g_early = eng.finish(early)
    assert g_early.finish_reason == "stop" and g_early.token_ids == ref_base[1].token_ids[:2]
    with pytest.raises(ConfigError, match="not active"):
        eng.abort(victim)
    outs = _drain(eng)
    assert outs[r0].token_ids == ref_a[2].token_ids
    assert outs[r1].token_ids == ref_base[0].token_ids
    assert outs[r2].token_ids == ref_a[0].token_ids
    assert outs[r3].token_ids == ref_a[1].token_ids
    h1.release()
    h2.release()
    assert eng.arena.used_tokens == 0


def test_output_independent_of_capacity_and_padding(tiny_dir, prompts):
    """K4: tail capacity, slot count, arena size and batch padding do not change the logits.

    Eager configurations agree bit for bit (same widths read); static ones (bucketed widths, padded
    batch) within fp32 rounding (unsharpened model, logits of order 1)."""
    base = ccft.load_base(str(tiny_dir))
    decs = {
        "math": _lora(base, "math", 1, 4),
        "code": _lora(base, "code", 2, 2, targets=["o_proj", "gate_proj"]),
    }
    results = []
    configs = (
        {"max_tail_tokens": 16},
        {"max_tail_tokens": 4096, "max_batch": 32},
        {"decode": "static", "max_batch": 7},
        {"decode": "static", "max_prefix_tokens": 4096},
    )
    for kw in configs:
        eng = _engine(base, decs, **kw)
        h = eng.prefill(prompts)
        if kw.get("max_batch") == 32:
            eng.lanes["base"].pool.ensure(32, 1024)  # a much larger pool than needed
        ids = [
            eng.add_request(h, i, decoder=n, max_new_tokens=N_NEW) for i in range(3) for n in ("math", "code")
        ]
        logits = {rid: [] for rid in ids}
        while eng.active:
            for o in eng.step(return_logits=True):
                logits[o.request_id].append(o.logits)
        results.append([torch.stack(logits[r]) for r in ids])
    assert all(torch.equal(x, y) for x, y in zip(results[0], results[1], strict=True))
    for other in results[2:]:
        for x, y in zip(results[0], other, strict=True):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_stop_strings_and_eos_match_reference(world, refs, prompts):
    base, decs = world
    stop = refs["math"][2].text[3:6]
    assert stop.strip()
    eng = _engine(base, decs)
    with eng.prefill(prompts) as h:
        ours = eng.generate(h, decoder="math", max_new_tokens=N_NEW, stop=stop)
    _same(ours, _reference(base, decs["math"], prompts, stop=stop))
    assert ours[2].finish_reason == "stop"
    # EOS: a decoder whose generation config names the token it emits first
    eos_dec = decs["full"]
    cfg = eos_dec.model.generation_config
    saved = cfg.eos_token_id
    cfg.eos_token_id = [
        base.tokenizer.eos_token_id,
        refs["full"][0].token_ids[0],
        refs["full"][1].token_ids[2],
    ]
    try:
        eng = _engine(base, {"full": eos_dec})
        with eng.prefill(prompts) as h:
            ours = eng.generate(h, decoder="full", max_new_tokens=4)
        _same(ours, _reference(base, eos_dec, prompts, 4))
    finally:
        cfg.eos_token_id = saved
    assert ours[0].finish_reason == "eos" and ours[0].token_ids == []
    assert ours[1].finish_reason == "eos" and ours[1].token_ids == refs["full"][1].token_ids[:2]


def test_sampling_is_reproducible(world, prompts):
    base, decs = world
    eng = _engine(base, decs)
    with eng.prefill(prompts[:3]) as h:
        s = SamplingParams(do_sample=True, temperature=5.0, top_p=0.9, seed=11)
        one = eng.generate(h, decoder="math", max_new_tokens=N_NEW, sampling=s)
        two = eng.generate(h, decoder="math", max_new_tokens=N_NEW, sampling=s)
        other = eng.generate(
            h, decoder="math", max_new_tokens=N_NEW, sampling=SamplingParams(True, 5.0, 0.9, seed=12)
        )
    assert [g.token_ids for g in one] == [g.token_ids for g in two]
    assert [g.token_ids for g in one] != [g.token_ids for g in other]


def test_more_rows_than_slots(world, refs, prompts):
    """generate admits rows as slots free up (max_batch=2 < 6 rows)."""
    base, decs = world
    eng = _engine(base, decs, max_batch=2)
    with eng.prefill(prompts) as h:
        _same(eng.generate(h, decoder="code", max_new_tokens=N_NEW), refs["code"])


def test_decoder_folders_and_clear_errors(world, refs, prompts, tmp_path, tokenizer, tiny_dir, sharp_dir):
    _, decs = world
    path = ccft.save_decoder(decs["math"], tmp_path / "math")
    base = ccft.load_base(str(sharp_dir))  # a fresh base: the folder's adapter attaches to it
    other_base = ccft.load_base(str(tiny_dir))  # another base: other fingerprint
    eng = _engine(base, {})
    eng.add_decoder("math", path)  # a LoRA folder loaded onto this base's single weight copy
    assert eng.decoders["math"].lane is eng.lanes["base"]
    with eng.prefill(prompts[:2]) as h:
        _same(eng.generate(h, decoder="math", max_new_tokens=N_NEW), refs["math"][:2])
    with pytest.raises(ConfigError, match="already registered"):
        eng.add_decoder("math", path)
    with pytest.raises(FingerprintMismatchError, match="trained on base"):
        SharedPrefillEngine(other_base, decoders={"math": path})
    foreign = ccft.make_decoder(other_base, "full")
    with pytest.raises(FingerprintMismatchError, match="conditioned on base"):
        eng.add_decoder("foreign", foreign)
    with pytest.raises(IncompatibleModelError, match="contains LoRA layers"):
        copied = ccft.make_decoder(base, "full")
        copied.model = copy.deepcopy(base.model)  # a user's copy taken after adapters were attached
        eng.add_decoder("copied", copied)
    bad_tok = make_tiny_folder(tmp_path / "badtok", tokenizer)
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(bad_tok)
    t2.add_special_tokens({"additional_special_tokens": ["<extra_tok>"]})
    full = _full(base, 1)
    with pytest.raises(IncompatibleModelError, match="different tokenizer"):
        eng.add_decoder("tok", full, tokenizer=t2)
    # capacity: per-request tail, batch slots, prefix arena
    small = _engine(base, {}, max_tail_tokens=8, max_batch=2, max_prefix_tokens=64)
    h = small.prefill(prompts[:2])
    with pytest.raises(CapacityError, match="max_tail_tokens=8"):
        small.add_request(h, 0, max_new_tokens=8)
    small.add_request(h, 0, max_new_tokens=7)
    small.add_request(h, 1, max_new_tokens=7)
    with pytest.raises(CapacityError, match="max_batch=2"):
        small.add_request(h, 0, max_new_tokens=2)
    with pytest.raises(CapacityError, match="max_prefix_tokens=64"):
        small.prefill(prompts)
    with pytest.raises(ConfigError, match="unknown decoder"):
        small.add_request(h, 0, decoder="nope")
    with pytest.raises(ConfigError, match="row=5"):
        small.add_request(h, 5)
    h.release()
    with pytest.raises(ConfigError, match="released"):
        small.add_request(h, 0)
    small.close()
    assert h.freed and small.arena.used_tokens == 0
    with pytest.raises(ConfigError, match="released"):
        h.keys(0)
    k2 = _engine(base, {"math": eng.decoders["math"].decoder})
    with k2.prefill(prompts[:2], handoff_tokens=2) as h2:
        with pytest.raises(ConfigError, match="handoff_tokens=1"):
            k2.add_request(h2, 0, decoder="math")
    with pytest.raises(FingerprintMismatchError):
        k2.prefill_cache(ccft.compute_base_cache(other_base, prompts[:2]))
    # decoders trained with different k: a prefill without handoff_tokens is refused
    # (ccft.core.decoder.resolve_handoff)
    math2 = dataclasses.replace(eng.decoders["math"].decoder, handoff_tokens=2)
    mixed = _engine(base, {"math": eng.decoders["math"].decoder, "math2": math2})
    with pytest.raises(ConfigError, match=r"different handoff_tokens \[1, 2\].*pass handoff_tokens="):
        mixed.prefill(prompts[:2])
    with mixed.prefill(prompts[:2], handoff_tokens=2) as h2:
        assert h2.handoff_tokens == 2
    with mixed.prefill(prompts[:2], producer="math2") as own:  # a decoder's own prefill: its k
        assert own.handoff_tokens == 2
    mixed.close()
    for mode in ("cuda_graph", "compiled_graph"):
        with pytest.raises(ConfigError, match=f"decode='{mode}' needs the model on a CUDA device"):
            SharedPrefillEngine(base, decode=mode)


@pytest.mark.slow
def test_compiled_decode_equals_eager_with_bounded_recompiles(world, refs, prompts):
    """decode='compile': the static step under torch.compile; one compilation per bucket key (K4)."""
    torch._dynamo.reset()
    base, decs = world
    eng = _engine(base, decs, decode="compile", max_batch=8)
    with eng.prefill(prompts) as h:
        for name in ("base", "math", "code", "math"):
            _same(eng.generate(h, decoder=name, max_new_tokens=N_NEW), refs[name])
        runner = eng.lanes["base"].runner
        keys = runner.captures
        _same(
            eng.generate(h, decoder="code", max_new_tokens=N_NEW), refs["code"]
        )  # same keys: no new compile
        assert runner.captures == keys
    # batch buckets {8, 4, 2, 1} as rows finish (6 rows padded to 8) x one tail width x one prefix width
    assert keys <= 4


def test_static_inputs_are_one_buffer_copied_in_one_copy():
    """A static step's long inputs are views of one buffer (``StaticInputs.packed``, what
    ``planner.static_inputs`` builds), so a captured graph's inputs receive a step in one copy:
    ``copy_from`` overwrites every field (and the adapter masks) with the other step's values."""
    from ccft.inference.attention import CompactMeta, PrefixMeta
    from ccft.inference.model import StaticInputs

    b = 3
    sizes = [b] * 12 + [b + 1, b]  # tokens .. tail_len, then PrefixMeta's fields (row_ptr has b + 1)

    def step(seed):
        """Inputs with every optional part (own K/V rows at depth m, compact C_base rows)."""
        g = torch.Generator().manual_seed(seed)
        longs = [torch.randint(0, 1000, (n,), generator=g) for n in sizes + sizes[4:] + [b] * 13]
        masks = torch.rand((2, b, 1), generator=g)
        meta = lambda ts: PrefixMeta(*ts, max_len=seed)  # noqa: E731
        plain = StaticInputs(*longs[:4], masks, meta(longs[4:14]), meta(longs[14:24]), longs[24])
        plain.compact_meta = CompactMeta(meta(longs[25:35]), longs[35], longs[36])
        plain.compact = torch.rand(b, generator=g) > 0.5
        return longs, plain.packed()

    longs, one = step(1)
    _, graph_buffers = step(2)
    assert one.to("cpu") is one and one.flat.numel() == sum(t.numel() for t in longs)
    buffer = one.flat.untyped_storage().data_ptr()
    for t, want in zip([t for t in one.tensors() if t.dtype == torch.long], longs, strict=True):
        assert torch.equal(t, want) and t.untyped_storage().data_ptr() == buffer
    graph_buffers.copy_from(one)
    assert all(torch.equal(x, y) for x, y in zip(graph_buffers.tensors(), one.tensors(), strict=True))


def test_prompts_and_generations_past_the_models_positions_are_refused(tiny_base):
    """``max_positions`` (the base's ``max_position_embeddings``) bounds a row's prompt + ``max_new_tokens``,
    as vLLM's ``max_model_len`` and ``ccft serve``'s ``context_length_exceeded``: ``prefill`` and
    ``prefill_cached`` refuse a longer prompt before anything is allocated or computed, ``add_request`` a
    prompt (with its suffix) + ``max_new_tokens`` beyond it; exactly the limit decodes."""
    from ccft.serving import PrefixKVStore

    tiny_base.config.max_position_embeddings = 40  # this fresh Base's config only
    eng = SharedPrefillEngine(tiny_base)
    assert eng.max_positions == 40
    ids = list(range(100, 141))  # 41 tokens
    with pytest.raises(ConfigError, match=r"prompts \[1\] are longer than the base model's 40 positions"):
        eng.prefill([ids[:30], ids])
    with pytest.raises(ConfigError, match="the longest has 41 tokens"):
        eng.prefill_cached(ids, PrefixKVStore(block_tokens=4))
    assert eng.arena.used_tokens == 0
    with eng.prefill([ids[:30]]) as h:
        with pytest.raises(ConfigError, match=r"row 0: a prompt of 30 tokens \+ max_new_tokens=11 is more"):
            eng.add_request(h, 0, max_new_tokens=11)
        with pytest.raises(ConfigError, match=r"a prompt of 33 tokens \+ max_new_tokens=8"):
            eng.add_request(h, 0, suffix_ids=[5, 6, 7], max_new_tokens=8)
        assert eng.active == 0
        rid = eng.add_request(h, 0, max_new_tokens=10, ignore_eos=True)  # 30 + 10: exactly the limit
        done = [o for _ in range(10) for o in eng.step() if o.finished]
        assert [o.request_id for o in done] == [rid] and len(done[0].generation.token_ids) == 10
