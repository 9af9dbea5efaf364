"""A failing request fails alone (docs/design.md, fault class K12): a step whose batched forward raises
is retried in parts until the error is confined to the rows that cause it; the others are stepped
and equal the reference path, in eager and static decode."""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine, StepError
from ccft.inference.weights import LoraWeights
from conftest import make_lora, make_tiny_folder

N_NEW = 5


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer, gsm8k_rows):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("isolate"), tokenizer, seed=3, scale=30.0))
    )
    decs = {"math": make_lora(base, "math", 1, 4), "code": make_lora(base, "code", 2, 2)}
    prompts = [
        tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[: 5 + 4 * i]
        for i, r in enumerate(gsm8k_rows[:3])
    ]
    refs = {
        "base": ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW),
        "math": ccft.generate(prompts, mode="prefillshare", decoder=decs["math"], max_new_tokens=N_NEW),
    }
    return base, decs, prompts, refs


def _break(eng, name):
    layer = eng.lanes["base"].weights.adapters[eng.decoders[name].adapter_index].layers[1]
    proj = next(iter(layer))
    layer[proj] = LoraWeights(torch.zeros(3, 5), layer[proj].b, layer[proj].scaling)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_step_error_is_confined_to_the_broken_decoder(world, decode):
    base, decs, prompts, refs = world
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    _break(eng, "code")
    h = eng.prefill(prompts)
    rids = {}
    for row in range(len(prompts)):  # rows of the three decoders interleaved in the lane's slots
        for name in ("base", "code", "math"):
            rids[eng.add_request(h, row, decoder=name, max_new_tokens=N_NEW)] = (name, row)
    results, failed, steps_with_error = {}, {}, 0
    while eng.active:
        try:
            outs = eng.step()
        except StepError as e:
            steps_with_error += 1
            outs = e.outputs
            failed.update(e.failed)
        for o in outs:
            if o.finished:
                results[rids[o.request_id]] = o.generation.token_ids
    assert steps_with_error == 1 and isinstance(eng.last_step_error, RuntimeError)
    # eager: only the step with the broken decoder's rows raised. static: the step computes every adapter
    # of the lane (row masks), so the broken one keeps raising; each later step ran in parts and failed
    # nothing
    assert eng.step_errors == 1 if decode == "eager" else eng.step_errors == N_NEW
    assert {rids[r] for r in failed} == {("code", row) for row in range(len(prompts))}
    assert all(isinstance(e, RuntimeError) for e in failed.values())
    assert results == {
        (name, row): refs[name][row].token_ids for name in ("base", "math") for row in range(len(prompts))
    }
    # generate with the broken decoder raises its own error and leaves nothing active; the engine goes on
    with pytest.raises(RuntimeError):
        eng.generate(h, decoder="code", max_new_tokens=N_NEW)
    assert eng.active == 0
    assert [g.token_ids for g in eng.generate(h, decoder="math", max_new_tokens=N_NEW)] == [
        g.token_ids for g in refs["math"]
    ]
    h.release()
    assert eng.arena.used_tokens == 0


def test_forced_tokens_outside_the_vocabulary_are_refused_at_admission(world):
    base, decs, prompts, _ = world
    eng = SharedPrefillEngine(base, decoders=decs)
    vocab = eng.lanes["base"].weights.embed.shape[0]
    with eng.prefill(prompts[:1]) as h, pytest.raises(ConfigError, match=f"outside 0..{vocab - 1}"):
        eng.add_request(h, 0, forced_tokens=[5, len(base.tokenizer) + 7])
    assert eng.active == 0
