"""Fault kind K5: whose KV is it. Fingerprints, compatibility checks, refusing foreign or self-written
caches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

import ccft
from ccft.core.cache import prefill
from ccft.core.tokens import right_pad, tokenize_prompt, tokenize_response
from conftest import make_tiny_folder

PROMPTS = ["How many legs do 3 spiders have?", "Name the largest planet in the solar system, please."]
RESPONSES = ["3 * 8 = 24 legs.\n#### 24", "Jupiter."]


def _prompts(tok):
    return [tokenize_prompt(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_dir, tokenizer):
    """Folders that differ from tiny_dir in exactly one respect."""
    root = tmp_path_factory.mktemp("fp_variants")
    out = {"seed": make_tiny_folder(root / "seed", tokenizer, seed=1)}

    template = root / "template"
    shutil.copytree(tiny_dir, template)
    tok = AutoTokenizer.from_pretrained(template)
    assert tok.chat_template
    (template / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out["template"] = template

    config = root / "config"
    shutil.copytree(tiny_dir, config)
    cfg = json.loads((config / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (config / "config.json").write_text(json.dumps(cfg))
    out["config"] = config

    volatile = root / "volatile"  # only bookkeeping keys changed: same base
    shutil.copytree(tiny_dir, volatile)
    cfg = json.loads((volatile / "config.json").read_text())
    cfg.update(transformers_version="0.0.0", use_cache=False, dtype="bfloat16")
    (volatile / "config.json").write_text(json.dumps(cfg))
    out["volatile"] = volatile
    return out


@pytest.fixture(scope="module")
def base(tiny_dir):
    """One fp32 base for the tests that attach no LoRA adapter to it (full decoders are copies)."""
    return ccft.load_base(str(tiny_dir))


@pytest.fixture(scope="module")
def base_bf16(tiny_dir):
    return ccft.load_base(str(tiny_dir), dtype="bfloat16")


@pytest.fixture(scope="module")
def other_base(variants):
    """Loads each variant folder once per module (nothing attaches adapters to these bases)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = ccft.load_base(str(variants[name]))
        return loaded[name]

    return get


def test_fingerprint_independent_of_load_dtype(tiny_dir, base, base_bf16):
    bf16 = base_bf16
    assert bf16.dtype == torch.bfloat16 and base.dtype == torch.float32
    assert bf16.fingerprint == base.fingerprint
    assert base.fingerprint.startswith("ccft1-")
    assert ccft.load_base(str(tiny_dir)).fingerprint == base.fingerprint  # deterministic


@pytest.mark.parametrize("variant", ["seed", "template", "config"])
def test_fingerprint_differs_for_other_base(base, other_base, variant):
    assert other_base(variant).fingerprint != base.fingerprint


def test_fingerprint_ignores_bookkeeping_config_keys(base, variants):
    assert ccft.load_base(str(variants["volatile"])).fingerprint == base.fingerprint


def _cfg(**kw):
    args = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
    )
    args.update(kw)
    if "hidden_size" in kw or "num_attention_heads" in kw:
        args.setdefault("head_dim", args["hidden_size"] // args["num_attention_heads"])
    return LlamaConfig(**args)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_hidden_layers": 3}, "num_hidden_layers: base=2 decoder=3"),
        ({"num_key_value_heads": 1}, "num_key_value_heads: base=2 decoder=1"),
        ({"num_attention_heads": 8, "head_dim": 8}, "head_dim: base=16 decoder=8"),
        ({"rope_theta": 500000.0}, "rope: "),
    ],
)
def test_check_compatible_names_the_field(tiny_dir, change, field):
    base_config = AutoConfig.from_pretrained(tiny_dir)
    with pytest.raises(ccft.IncompatibleModelError, match=field):
        ccft.check_compatible(base_config, _cfg(**change))
    ccft.check_compatible(base_config, _cfg())  # the same shapes pass
    ccft.check_compatible(base_config, _cfg(intermediate_size=256))  # MLP width does not touch the KV


def test_check_compatible_all_fields_and_tokenizer(tokenizer, other_base):
    other_tok = other_base("template").tokenizer
    bad = _cfg(num_hidden_layers=3, num_key_value_heads=1, rope_theta=1.0)
    with pytest.raises(ccft.IncompatibleModelError) as err:
        ccft.check_compatible(_cfg(), bad, tokenizer, other_tok)
    msg = str(err.value)
    for name in ("num_hidden_layers", "num_key_value_heads", "rope", "tokenizer"):
        assert name in msg
    with pytest.raises(ccft.IncompatibleModelError, match="tokenizer"):
        ccft.check_compatible(_cfg(), _cfg(), tokenizer, other_tok)
    ccft.check_compatible(_cfg(), _cfg(), tokenizer, tokenizer)


@pytest.mark.parametrize("variant", ["seed", "template", "config"])
def test_cache_from_another_base_is_refused(base, other_base, variant):
    other = other_base(variant)
    prompts = _prompts(base.tokenizer)
    foreign = ccft.compute_base_cache(other, prompts)
    decoder = ccft.make_decoder(base, "full", method="ccft")
    with pytest.raises(ccft.FingerprintMismatchError, match="C_base was computed by base"):
        foreign.check_reader(decoder.fingerprint, decoder.dtype)
    with pytest.raises(ccft.FingerprintMismatchError, match=other.fingerprint):
        ccft.generate(prompts, mode="prefillshare", decoder=decoder, cache=foreign, max_new_tokens=2)
    own = ccft.compute_base_cache(base, prompts)
    own.check_reader(decoder.fingerprint, decoder.dtype)  # the right cache passes


def test_cache_dtype_mismatch_refused_unless_converted(base, base_bf16):
    bf16 = base_bf16
    prompts = _prompts(base.tokenizer)
    cache = ccft.compute_base_cache(bf16, prompts)
    assert cache.dtype == torch.bfloat16 and cache.fingerprint == base.fingerprint
    decoder = ccft.make_decoder(base, "full", method="ccft")
    with pytest.raises(ccft.FingerprintMismatchError, match=r"dtype torch.bfloat16 differs.*torch.float32"):
        cache.check_reader(decoder.fingerprint, decoder.dtype)
    with pytest.raises(ccft.FingerprintMismatchError, match="dtype"):
        ccft.generate(prompts, mode="prefillshare", decoder=decoder, cache=cache, max_new_tokens=2)
    converted = cache.to(dtype=torch.float32)  # explicit conversion is accepted
    converted.check_reader(decoder.fingerprint, decoder.dtype)
    out = ccft.generate(prompts, mode="prefillshare", decoder=decoder, cache=converted, max_new_tokens=2)
    assert all(len(g.token_ids) == 2 for g in out)


def test_cache_written_by_a_decoder_is_refused(base):
    prompts = _prompts(base.tokenizer)
    decoder = ccft.make_decoder(base, "full", method="ccft")
    own = prefill(
        decoder.model,
        prompts,
        pad_token_id=base.tokenizer.pad_token_id,
        fingerprint=base.fingerprint,
        producer="self",
    )
    with pytest.raises(ccft.FingerprintMismatchError, match="written by 'self'"):
        own.check_reader(decoder.fingerprint, decoder.dtype)
    with pytest.raises(ccft.FingerprintMismatchError, match="written by 'self'"):
        ccft.generate(prompts, mode="prefillshare", decoder=decoder, cache=own, max_new_tokens=2)
    own.check_reader(decoder.fingerprint, decoder.dtype, allow_self=True)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_load_decoder_refuses_other_base(tiny_base, other_base, tmp_path, kind):
    decoder = ccft.make_decoder(tiny_base, kind, method="ccft")
    path = ccft.save_decoder(decoder, tmp_path / "dec")
    other = other_base("seed")
    with pytest.raises(ccft.FingerprintMismatchError, match=r"trained on base .* but the base given"):
        ccft.load_decoder(path, base=other)
    assert ccft.load_decoder(path, base=ccft.load_base(tiny_base.path)).fingerprint == tiny_base.fingerprint


def test_load_decoder_checks_shapes_before_compute(base, tokenizer, tmp_path):
    """A full-weight decoder whose config cannot read the base's KV is refused at load time."""
    deep = ccft.load_base(str(make_tiny_folder(tmp_path / "deep", tokenizer, layers=3)))
    decoder = ccft.make_decoder(deep, "full", method="ccft")
    path = ccft.save_decoder(decoder, tmp_path / "dec")
    meta = json.loads((path / "ccft.json").read_text())
    meta["base_fingerprint"] = base.fingerprint  # a lying ccft.json gets past the fingerprint check
    (path / "ccft.json").write_text(json.dumps(meta))
    with pytest.raises(ccft.IncompatibleModelError, match="num_hidden_layers: base=2 decoder=3"):
        ccft.load_decoder(path, base=base)


def test_prefillshare_really_reads_c_base(base):
    """K5: a decoder ≠ base must give different logits on C_base than on its own prefill.

    decoder_forward on C_base is the prefillshare computation; full_forward is self-prefill. A
    decoder that silently re-prefilled its prompt would make the two equal. Greedy generate in
    each mode must follow its own teacher-forced argmax.
    """
    tok = base.tokenizer
    prompts = _prompts(tok)
    decoder = ccft.make_decoder(base, "full")  # method None: allowed in every mode
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in decoder.model.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                p.add_(0.1 * torch.randn(p.shape, generator=g))

    c_base = ccft.compute_base_cache(base, prompts)
    own = prefill(
        decoder.model, prompts, pad_token_id=tok.pad_token_id, fingerprint=base.fingerprint, producer="self"
    )
    responses = [tokenize_response(tok, r) for r in RESPONSES]
    tails = [p[-1:] + r for p, r in zip(prompts, responses, strict=True)]
    tail_ids, tail_mask = right_pad(tails, tok.pad_token_id)
    with torch.no_grad():
        shared = ccft.decoder_forward(decoder, c_base, tail_ids, tail_mask)
        on_own = ccft.decoder_forward(decoder, own, tail_ids, tail_mask, allow_self=True)
        selfp = ccft.full_forward(decoder, *_prefix(prompts, tok), tail_ids, tail_mask)
        base_shared = ccft.decoder_forward(base.model, c_base, tail_ids, tail_mask)
        base_self = ccft.full_forward(base.model, *_prefix(prompts, tok), tail_ids, tail_mask)

    def diff(a, b):
        return max((a[i, : len(t)] - b[i, : len(t)]).abs().max().item() for i, t in enumerate(tails))

    assert diff(on_own, selfp) <= 1e-5  # the comparison is only about whose K/V is read
    assert diff(base_shared, base_self) <= 1e-5  # decoder == base: no difference
    assert diff(shared, selfp) > 1e-3, "prefillshare output equals self-prefill: C_base was not used"

    n = 4
    for mode, kw in (("prefillshare", {"cache": c_base}), ("full-ft", {})):
        gens = ccft.generate(prompts, mode=mode, decoder=decoder, max_new_tokens=n, stop=None, **kw)
        forced_tails = [p[-1:] + gen.token_ids for p, gen in zip(prompts, gens, strict=True)]
        ids, mask = right_pad(forced_tails, tok.pad_token_id)
        with torch.no_grad():
            logits = (
                ccft.decoder_forward(decoder, c_base, ids, mask)
                if mode == "prefillshare"
                else ccft.full_forward(decoder, *_prefix(prompts, tok), ids, mask)
            )
        for i, gen in enumerate(gens):
            assert len(gen.token_ids) == n
            assert logits[i, :n].argmax(-1).tolist() == gen.token_ids, mode


def _prefix(prompts, tok):
    from ccft.core.tokens import left_pad

    return left_pad([p[:-1] for p in prompts], tok.pad_token_id)
