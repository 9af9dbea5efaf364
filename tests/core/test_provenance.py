"""Provenance of C_base at every public entry point that reads one (docs/design.md, "C_base", K5 and K12).

One table: entry points × {foreign base (one weight changed by 1e-3), other dtype (bf16 C_base for an
fp32 decoder), a cache written by a decoder, a cache mutated in place}. Each raises the documented error
(``FingerprintMismatchError`` / ``CacheMutatedError``) and no model ran a forward before it did.
"""

from __future__ import annotations

import json

import pytest
import torch

import ccft
from ccft.core.cache import prefill
from ccft.core.errors import CacheMutatedError, FingerprintMismatchError
from ccft.core.generation import decode_on_cache
from ccft.core.tokens import right_pad, tokenize_prompt, tokenize_response

QUESTIONS = ["What is 2 + 2?", "Natalia sold clips to 48 of her friends in April, and half as many in May."]
ANSWERS = ["4", "72 clips"]
CASES = ["foreign", "dtype", "self", "mutated"]
ERRORS = {
    "foreign": (FingerprintMismatchError, "computed by base"),
    "dtype": (FingerprintMismatchError, "dtype"),
    "self": (FingerprintMismatchError, "written by 'self'"),
    "mutated": (CacheMutatedError, "modified in place"),
}


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory, tiny_dir):
    """The tiny base with one weight changed by 1e-3: another base (another fingerprint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1e-3
    path = tmp_path_factory.mktemp("foreign_base")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(path)
    return path


@pytest.fixture
def world(tiny_dir, foreign_dir):
    """The base, a CCFT LoRA decoder and a full-weight one on it, the foreign and bf16 bases, prompts."""
    base = ccft.load_base(str(tiny_dir))
    full = ccft.make_decoder(base, "full", method="ccft")
    full.model.eval()
    lora = ccft.make_decoder(base, "lora", method="ccft", lora={"r": 2, "init_lora_weights": False})
    lora.model.eval()
    foreign = ccft.load_base(str(foreign_dir))
    assert foreign.fingerprint != base.fingerprint
    bf16 = ccft.load_base(str(tiny_dir), dtype="bfloat16")
    assert bf16.fingerprint == base.fingerprint
    tok = base.tokenizer
    prompts = [tokenize_prompt(tok, q, chat_template=False) for q in QUESTIONS]
    responses = [tokenize_response(tok, a) for a in ANSWERS]
    return {
        "base": base,
        "full": full,
        "lora": lora,
        "foreign": foreign,
        "bf16": bf16,
        "prompts": prompts,
        "responses": responses,
        "models": [base.model, full.model, foreign.model, bf16.model],
    }


def make_cache(w, case: str, decoder):
    prompts = w["prompts"]
    if case == "foreign":
        return ccft.compute_base_cache(w["foreign"], prompts)
    if case == "dtype":
        return ccft.compute_base_cache(w["bf16"], prompts)
    if case == "self":
        return prefill(
            decoder.activate(),
            prompts,
            pad_token_id=w["base"].tokenizer.pad_token_id,
            fingerprint=w["base"].fingerprint,
            producer="self",
        )
    cache = ccft.compute_base_cache(w["base"], prompts)
    cache.keys[0][0, 0, -1, 0] += 1.0  # one value of layer 0 written in place
    return cache


class Forwards:
    """Counts forward calls of the given models (the 'no compute before the refusal' check)."""

    def __init__(self, models):
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in models]

    def _hook(self, *args):
        self.calls += 1

    def close(self):
        for h in self.handles:
            h.remove()


def tails(w):
    tail = [p[-1:] + r for p, r in zip(w["prompts"], w["responses"], strict=True)]
    return right_pad(tail, w["base"].tokenizer.pad_token_id)


def run_decoder_forward(w, decoder, cache):
    ids, mask = tails(w)
    ccft.decoder_forward(decoder, cache, ids, mask)


def run_decoder_forward_module(w, decoder, cache):
    """The trainer's call: a bare module, with the base fingerprint passed in."""
    ids, mask = tails(w)
    ccft.decoder_forward(decoder.activate(), cache, ids, mask, fingerprint=decoder.base.fingerprint)


def run_generate(w, decoder, cache):
    ccft.generate(w["prompts"], mode="prefillshare", decoder=decoder, cache=cache, max_new_tokens=2)


def run_decode_on_cache(w, decoder, cache):
    decode_on_cache(decoder, w["base"].tokenizer, cache, max_new_tokens=2, allow_self=False)


def run_engine_prefill_cache(w, decoder, cache):
    from ccft.inference import SharedPrefillEngine

    engine = SharedPrefillEngine(w["base"])
    try:
        engine.prefill_cache(cache)
    finally:
        engine.close()


ENTRY_POINTS = {
    "decoder_forward": run_decoder_forward,
    "decoder_forward(module)": run_decoder_forward_module,
    "generate": run_generate,
    "decode_on_cache": run_decode_on_cache,
    "engine.prefill_cache": run_engine_prefill_cache,
}


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_cache_reader_refuses_before_compute(world, entry, case, kind):
    decoder = world[kind]
    cache = make_cache(world, case, decoder)
    error, match = ERRORS[case]
    if entry == "engine.prefill_cache" and case == "mutated":
        error, match = CacheMutatedError, "modified in place"  # checked after the (model-free) copy
    forwards = Forwards(world["models"])
    try:
        with pytest.raises(error, match=match):
            ENTRY_POINTS[entry](world, decoder, cache)
    finally:
        forwards.close()
    assert forwards.calls == 0, f"{entry} ran {forwards.calls} forward(s) before refusing a {case} cache"


def test_generate_refuses_a_foreign_base_before_computing_c_base(world):
    """No cache given: the C_base the base would compute is refused before the prefill runs."""
    for other, match in (
        (world["foreign"], "conditioned on base"),
        (world["bf16"], "computed in torch.bfloat16"),
    ):
        forwards = Forwards(world["models"])
        try:
            with pytest.raises(FingerprintMismatchError, match=match):
                ccft.generate(
                    world["prompts"], mode="prefillshare", base=other, decoder=world["full"], max_new_tokens=2
                )
        finally:
            forwards.close()
        assert forwards.calls == 0


def test_the_checks_accept_what_they_should(world):
    """The same entry points on a clean C_base (or an own prefill with allow_self) compute, and agree."""
    base, dec = world["base"], world["full"]
    cache = ccft.compute_base_cache(base, world["prompts"])
    ids, mask = tails(world)
    with torch.no_grad():
        a = ccft.decoder_forward(dec, cache, ids, mask)
        b = ccft.decoder_forward(dec.model, cache, ids, mask, fingerprint=base.fingerprint)
    assert torch.equal(a, b)
    own = make_cache(world, "self", dec)
    with torch.no_grad():
        ccft.decoder_forward(dec, own, ids, mask, allow_self=True)
    converted = ccft.compute_base_cache(world["bf16"], world["prompts"]).to(dtype=torch.float32)
    assert [
        g.token_ids
        for g in ccft.generate(
            world["prompts"], mode="prefillshare", decoder=dec, cache=converted, max_new_tokens=2
        )
    ]
    # Under autocast the reader computes in the autocast dtype: a bf16 C_base is its own dtype there.
    bf16_cache = ccft.compute_base_cache(world["bf16"], world["prompts"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ccft.decoder_forward(dec, bf16_cache, ids, mask)


# ------------------------------------------------------------------ the C_base store and the trainer


@pytest.fixture
def store(world, tmp_path, tokenizer):
    from ccft.train.cache_store import precompute
    from ccft.train.data import Example

    examples = [
        Example(tuple(p), tuple(r)) for p, r in zip(world["prompts"], world["responses"], strict=True)
    ]
    path = tmp_path / "store"
    precompute(world["base"], examples, path, log=lambda *a: None)
    return path, examples


def _batch(world, examples):
    from ccft.train.data import Collator

    return Collator(world["base"].tokenizer.pad_token_id, 1)(examples)


@pytest.mark.parametrize("case", ["foreign", "dtype", "mutated"])
def test_cache_store_refuses_before_compute(world, store, case):
    """``CacheStore.batch_cache``: a store of another base or dtype, or a shard changed on disk, is
    refused."""
    from ccft.train.cache_store import MANIFEST, CacheStore

    path, examples = store
    reader = {"foreign": world["foreign"], "dtype": world["bf16"]}.get(case, world["base"])
    if case == "mutated":
        name = next(iter(json.loads((path / MANIFEST).read_text())["shards"]))
        raw = bytearray((path / name).read_bytes())
        raw[-3] ^= 0x01  # one bit of one stored value
        (path / name).write_bytes(bytes(raw))
    error = CacheMutatedError if case == "mutated" else FingerprintMismatchError
    batch = _batch(world, examples)
    forwards = Forwards(world["models"])
    try:
        with pytest.raises(
            error, match="changed since it was written" if case == "mutated" else "C_base store"
        ):
            CacheStore(path).batch_cache(
                batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :1], base=reader
            )
    finally:
        forwards.close()
    assert forwards.calls == 0


def test_trainer_refuses_a_store_of_another_base(world, store, tmp_path):
    """The trainer's use of a store: a store computed by another base fails the first step, before any
    forward."""
    from ccft.train.cache_store import CacheStore, precompute
    from ccft.train.config import TrainConfig
    from ccft.train.data import Collator, TokenizedDataset
    from ccft.train.trainer import CacheConditionedTrainer

    _, examples = store
    other = tmp_path / "other_store"
    precompute(world["foreign"], examples, other, log=lambda *a: None)
    args = TrainConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = CacheConditionedTrainer(
        model=world["lora"].model,
        args=args,
        base=world["base"],
        cache_store=CacheStore(other),
        train_dataset=TokenizedDataset(examples),
        data_collator=Collator(world["base"].tokenizer.pad_token_id, 1),
    )
    forwards = Forwards(world["models"])
    try:
        with pytest.raises(FingerprintMismatchError, match="computed by base"):
            trainer.train()
    finally:
        forwards.close()
    assert forwards.calls == 0


# ------------------------------------------------------------------ evals (their public API)


@pytest.mark.parametrize("other", ["foreign", "bf16"])
@pytest.mark.parametrize("fn", ["shared_forward", "shared_generate"])
def test_sharing_refuses_another_base_before_compute(world, fn, other):
    from ccft.evals import sharing

    forwards = Forwards(world["models"])
    try:
        with pytest.raises(FingerprintMismatchError):
            if fn == "shared_forward":
                sharing.shared_forward(
                    world[other],
                    world["full"],
                    world["prompts"],
                    world["responses"],
                    over="positions",
                    rho=1.0,
                )
            else:
                sharing.shared_generate(
                    world[other], world["full"], world["prompts"], over="positions", rho=1.0, max_new_tokens=2
                )
    finally:
        forwards.close()
    assert forwards.calls == 0  # refused before any forward


def test_lm_eval_model_refuses_a_decoder_of_another_base(world, tmp_path, foreign_dir):
    """The lm-eval model loads base and decoder from paths: a decoder of another base is refused at load."""
    pytest.importorskip("lm_eval")
    from ccft.evals.lm_eval_model import CCFTLM

    path = ccft.save_decoder(world["full"], tmp_path / "dec")
    with pytest.raises(FingerprintMismatchError):
        CCFTLM(base=str(foreign_dir), decoder=str(path), mode="prefillshare")


@pytest.mark.parametrize("other", ["foreign", "bf16"])
def test_sweep_refuses_a_decoder_of_another_base_before_compute(world, other, tmp_path):
    """``run_sweep(task, base, decoders)``: a decoder conditioned on another base (or dtype) than ``base``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    try:
        from harness_fixtures import ToyTask
    finally:
        sys.path.pop(0)
    from ccft.evals.sweep import run_sweep

    forwards = Forwards(world["models"])
    try:
        with pytest.raises(FingerprintMismatchError):
            run_sweep(
                ToyTask(2),
                world[other],
                {"prefillshare": world["full"]},
                tmp_path / "sw",
                rhos=[1.0],
                axes=["positions"],
                progress=False,
                n_resamples=10,
            )
    finally:
        forwards.close()
    assert forwards.calls == 0  # refused before any forward
    assert not (tmp_path / "sw").exists()  # and before anything is written
