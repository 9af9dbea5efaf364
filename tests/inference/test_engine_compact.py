"""SharedPrefillEngine serving decoders on the compact C_base (issue 35, item 3; ``cache_format`` ``int8``,
``ccft.core.compact``): the handle's int8 format holds the values ``read_cache`` gives, and the engine's
tokens and logits equal the reference path (``ccft.generate`` / ``decoder_forward`` on
``ccft.core.depth.decoder_prefix``) for a decoder trained on int8, a native decoder registered on int8, and
int8 at sharing depth m = 2; eager and static.

A 4-layer tiny Llama (``deep_dir``: lm_head ×20, clear greedy margins), every cache buffer NaN-filled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ccft
from ccft.core.compact import CompactCache, kv_nbytes, read_cache
from ccft.core.depth import decoder_prefix, prompt_prefixes
from ccft.core.errors import ConfigError
from ccft.core.tokens import pad_token_id, right_pad
from ccft.inference import SharedPrefillEngine
from conftest import forced_step_logits, make_full, make_lora, ragged_prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N_NEW = 6
NAN = float("nan")


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Five real prompts of 6 .. 26 tokens: ragged prefixes, left padding."""
    return ragged_prompts(gsm8k_rows, tokenizer, 5, 6, 5)


def _world(deep_dir, handoff: int = 1):
    """A full-weight decoder trained on int8, a LoRA decoder trained on int8 at depth 2, a native LoRA one."""
    base = ccft.load_base(str(deep_dir))
    full = make_full(base, 7, handoff)
    full.cache_format = "int8"
    deep = make_lora(base, "deep", 1, 4, handoff)
    deep.cache_format, deep.share_from_layer = "int8", 2
    flat = make_lora(base, "flat", 2, 2, handoff, ["q_proj", "v_proj", "down_proj"])
    return base, {"full": full, "deep": deep, "flat": flat}


def _tokens(gens):
    return [g.token_ids for g in gens]


def test_the_int8_format_holds_read_cache_values(deep_dir, prompts):
    """The handle's int8 format stores ``CompactCache``'s codes and scales (int8 and bfloat16, at
    ``kv_nbytes``'s size) and reads back ``read_cache``'s values."""
    base, decs = _world(deep_dir)
    eng = SharedPrefillEngine(base, decoders=decs, fill=NAN)
    L = base.config.num_hidden_layers
    with eng.prefill(prompts) as h:
        eng.generate(h, decoder="full", max_new_tokens=1)
        derived = h.formats["int8"]
        assert derived.cache_format == "int8" and h.cache_format == "native"
        native = h.to_base_cache()
        want, codes = read_cache(native, "int8"), CompactCache.from_base(native)
        got = derived.to_base_cache()
        for i in range(L):
            assert torch.equal(got.keys[i], want.keys[i]) and torch.equal(got.values[i], want.values[i])
            assert not torch.equal(got.keys[i], h.keys(i))  # the test can fail: int8 changes the values
            assert derived.key_codes(i).dtype == torch.int8 and derived.key_scales(i).dtype == torch.bfloat16
            assert torch.equal(derived.key_codes(i), codes.key_codes[i])
            assert torch.equal(derived.key_scales(i), codes.key_scales[i])
            assert torch.equal(derived.value_codes(i), codes.value_codes[i])
            assert torch.equal(derived.value_scales(i), codes.value_scales[i])
        a = eng.code_arena
        nbytes = kv_nbytes(
            "int8", layers=L, kv_heads=a.kv_heads, head_dim=a.head_dim, tokens=h.width, rows=len(prompts)
        )
        assert derived.nbytes == codes.nbytes == nbytes
        assert nbytes * 3 < kv_nbytes(
            "native", layers=L, kv_heads=a.kv_heads, head_dim=a.head_dim, tokens=h.width, rows=len(prompts)
        )
        assert (
            eng.arena.used_tokens == len(prompts) * h.width
        )  # C_base only: the int8 copy is in its own arenas
        assert eng.code_arena.used_tokens == eng.vscale_arena.used_tokens == len(prompts) * h.width
        assert eng.kscale_arena.used_tokens == len(prompts)
    for arena in (eng.arena, eng.code_arena, eng.vscale_arena, eng.kscale_arena):
        assert arena.used_tokens == 0  # freed with the handle


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_greedy_on_int8_equals_reference(deep_dir, prompts, decode):
    base, decs = _world(deep_dir)
    refs = {
        n: _tokens(ccft.generate(prompts, mode="prefillshare", decoder=d, max_new_tokens=N_NEW))
        for n, d in decs.items()
    }
    on_int8 = _tokens(
        ccft.generate(
            prompts, mode="prefillshare", decoder=decs["flat"], max_new_tokens=N_NEW, cache_format="int8"
        )
    )
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    eng.add_decoder("flat-int8", decs["flat"], cache_format="int8")  # a native decoder served on int8
    refs["flat-int8"] = on_int8
    with eng.prefill(prompts) as h:
        snap = h.snapshot()
        for name in refs:
            assert _tokens(eng.generate(h, decoder=name, max_new_tokens=N_NEW)) == refs[name], name
        rid = {
            (n, i): eng.add_request(h, i, decoder=n, max_new_tokens=N_NEW)
            for i in range(len(prompts))
            for n in refs
        }
        done = {}
        while eng.active:
            done.update({o.request_id: o.generation.token_ids for o in eng.step() if o.finished})
        for (n, i), r in rid.items():
            assert done[r] == refs[n][i], (n, i)
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))  # C_base unchanged
    assert eng.arena.used_tokens == 0 and eng.own_arena.used_tokens == 0 and eng.code_arena.used_tokens == 0


@pytest.mark.parametrize("handoff", [1, 2])
def test_teacher_forced_logits_on_int8(deep_dir, prompts, handoff):
    base, decs = _world(deep_dir, handoff)
    pad = pad_token_id(base.tokenizer)
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=handoff)
    ids, mask = prompt_prefixes(prompts, handoff, pad)
    eng = SharedPrefillEngine(base, decoders=decs, decode="static", fill=NAN, max_batch=32)
    h = eng.prefill(prompts)
    forced, rid, steps = forced_step_logits(eng, h, decs, len(prompts), N_NEW)
    tail_ids, tail_mask = right_pad(
        [cache.tail_ids[i].tolist() + forced[i] for i in range(len(prompts))], pad
    )
    for n, dec in decs.items():
        with torch.no_grad():
            prefix = decoder_prefix(
                dec, cache, ids, mask, share_from_layer=dec.share_from_layer, cache_format=dec.cache_format
            )
            ref = ccft.decoder_forward(dec, prefix, tail_ids, tail_mask)
        scale = ref.abs().max().item()
        tl = eng.tail_logits(h, range(len(prompts)), tail_ids, tail_mask, decoder=n)
        assert (tl - ref)[tail_mask.bool()].abs().max().item() <= 1e-5 * scale, n
        for i in range(len(prompts)):
            got = torch.stack([s[rid[n, i]] for s in steps])
            want = ref[i, handoff - 1 : handoff - 1 + N_NEW]
            assert (got - want).abs().max().item() <= 1e-5 * scale, (n, i)
    h.release()


def test_clear_errors_on_int8(deep_dir, prompts, tmp_path):
    base, decs = _world(deep_dir)
    with pytest.raises(ConfigError, match="cache_format='fp4': use one of native, int8"):
        SharedPrefillEngine(base, fill=NAN).add_decoder("x", decs["flat"], cache_format="fp4")
    eng = SharedPrefillEngine(base, decoders=decs, fill=NAN)
    with eng.prefill([prompts[1]]) as h:
        with pytest.raises(ConfigError, match="cache_format=int8.*suffix_ids.*prefill the whole prompt"):
            eng.add_request(h, 0, decoder="full", suffix_ids=[5, 6])
        assert not h.formats  # refused before any work
        eng.add_request(h, 0, decoder="flat", suffix_ids=[5, 6], max_new_tokens=1)  # native: as before
        while eng.active:
            eng.step()
    # a reload from a folder trained on another cache format: refused before anything changes
    folder = Path(ccft.save_decoder(decs["deep"], tmp_path / "deep"))
    eng.reload_decoder("deep", folder)  # the same format and depth: accepted
    meta = json.loads((folder / "ccft.json").read_text())
    (folder / "ccft.json").write_text(json.dumps(dict(meta, cache_format="native")))
    with pytest.raises(
        ConfigError, match="'cache_format' is native but the served decoder was trained on int8"
    ):
        eng.reload_decoder("deep", folder)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_compact_handle_outlives_its_native_one(deep_dir, prompts, decode):
    """``engine.compact(handle)`` then ``handle.release()``: only the codes and scales stay, int8 readers
    decode on them as on the native handle's format; native readers refuse them."""
    base, decs = _world(deep_dir)
    want = _tokens(ccft.generate(prompts, mode="prefillshare", decoder=decs["deep"], max_new_tokens=N_NEW))
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=NAN)
    native = eng.prefill(prompts)
    compact = eng.compact(native)
    native.release()
    assert eng.arena.used_tokens == 0 and compact.cache_format == "int8"
    with compact:
        assert _tokens(eng.generate(compact, decoder="deep", max_new_tokens=N_NEW)) == want
        with pytest.raises(ConfigError, match="reads C_base in cache_format=native.*give it a native handle"):
            eng.add_request(compact, 0, decoder="flat")
        with pytest.raises(ConfigError, match="compact takes a native C_base handle"):
            eng.compact(compact)
    assert eng.code_arena.used_tokens == eng.own_arena.used_tokens == 0
