"""Stop strings on multi-byte text: the engine's incremental check (per-request ``TextStream`` +
``StopMatcher.scan_from``) ends each request at the same token, with the same text, as the
reference path (``ccft.generate`` -> ``decode_on_cache``: full decode cut at ``StopMatcher.find``).
docs/design.md, "Stop strings and streaming"; fault class K7.

The base is a tiny Llama whose attention and MLP outputs are zeroed (``o_proj``, ``down_proj``), so
the residual stream is the current token's embedding and greedy decoding walks a fixed chain of
tokens: one-hot embeddings and an ``lm_head`` that maps each token of ``TEXT`` to the next one (the
prompt's last token to the first, the last to EOS). The byte-level tokenizer splits the emoji and
the CJK characters into several tokens, and has tokens such as " " + the first byte of "🎉".
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.inference import SharedPrefillEngine

TEXT = "答案是 42 🎉 done 漢字"
PROMPT = "Answer in Chinese:"


@pytest.fixture
def chain(tiny_base, tokenizer):
    """(base, prompt ids, the token chain of TEXT): greedy decoding on ``base`` emits the chain, then EOS."""
    return _chain(tiny_base, tokenizer)


def _chain(base, tokenizer, cycle: bool = False):
    """Make ``base`` a chain model (see the module docstring); ``cycle``: after the last token comes
    the first again (never EOS)."""
    seq = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    chain = [prompt[-1], *seq]
    hidden = base.model.config.hidden_size
    assert len(set(chain)) == len(chain) <= hidden and tokenizer.eos_token_id not in chain
    m = base.model
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.zero_()
        for j, tok in enumerate(chain):
            m.model.embed_tokens.weight[tok] = torch.nn.functional.one_hot(torch.tensor(j), hidden).float()
            nxt = chain[j + 1] if j + 1 < len(chain) else (seq[0] if cycle else tokenizer.eos_token_id)
            m.lm_head.weight[nxt] += 10.0 * torch.nn.functional.one_hot(torch.tensor(j), hidden).float()
    return base, prompt, seq


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_chain_model_emits_the_text(chain, tokenizer):
    base, prompt, seq = chain
    (ref,) = ccft.generate([prompt], mode="base", base=base, max_new_tokens=len(seq) + 4)
    assert (ref.token_ids, ref.text, ref.finish_reason) == (seq, TEXT, "eos")
    # the tokenizer splits the multi-byte characters: some prefixes of the chain end in a partial character
    assert sum(_decode(tokenizer, seq[:t]).endswith("\ufffd") for t in range(1, len(seq))) >= 5


@pytest.mark.parametrize(
    "stop, text",
    [
        ("42 ", "答案是 "),  # completed by " " + the first byte of 🎉: the stop is in the full decode
        # one token before the emoji is complete
        ("🎉 do", "答案是 42 "),  # the emoji's bytes and " done": spans four tokens
        ("漢", "答案是 42 🎉 done "),  # one CJK character split over tokens
        (["字", "案是"], "答"),  # the earliest occurrence wins
        ("e 漢字", "答案是 42 🎉 don"),
        ("not in the text", TEXT),
    ],
)
@pytest.mark.parametrize("decode", ["eager", "static"])
def test_stop_strings_on_multibyte_text_equal_reference(chain, tokenizer, stop, text, decode):
    base, prompt, seq = chain
    n = len(seq) + 4
    (ref,) = ccft.generate([prompt], mode="base", base=base, max_new_tokens=n, stop=stop)
    eng = SharedPrefillEngine(base, decode=decode, fill=float("nan"))
    with eng.prefill([prompt]) as h:
        (ours,) = eng.generate(h, max_new_tokens=n, stop=stop)
    assert (ours.token_ids, ours.text, ours.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert ours.text == text
    if text == TEXT:
        assert ours.finish_reason == "eos" and ours.token_ids == seq
    else:
        # it stops at the first token whose full decode contains a stop string
        t = len(ours.token_ids)
        assert ours.finish_reason == "stop" and ours.token_ids == seq[:t]
        stops = [stop] if isinstance(stop, str) else stop
        assert any(s in _decode(tokenizer, seq[:t]) for s in stops)
        assert not any(s in _decode(tokenizer, seq[: t - 1]) for s in stops)


def test_stop_completed_by_a_token_that_starts_a_character(chain, tokenizer):
    """ "42 " is complete in the full decode at the token " " + first byte of 🎉, while a stream of
    complete characters shows the space only with the emoji, three tokens later."""
    base, prompt, seq = chain
    eng = SharedPrefillEngine(base, fill=float("nan"))
    with eng.prefill([prompt]) as h:
        rid = eng.add_request(h, 0, max_new_tokens=len(seq), stop="42 ")
        outs = []
        while eng.active:
            outs += eng.step()
    last = tokenizer.decode(outs[-1].token_id)
    assert outs[-1].finished and last.startswith(" ") and last.endswith("\ufffd")
    assert outs[-1].request_id == rid and outs[-1].generation.text == "答案是 "
    assert _decode(tokenizer, outs[-1].generation.token_ids) == "答案是 42 \ufffd"


def test_stop_check_decodes_each_token_a_bounded_number_of_times(tiny_base, tokenizer, monkeypatch):
    """Linear in the output length: over 8 laps of the chain with a stop string that never comes, the
    ids passed to ``tokenizer.decode`` add up to a small multiple of the output length (re-decoding
    the whole output at every token would pass n(n+1)/2 of them), and the text is the full decode."""
    base, prompt, seq = _chain(tiny_base, tokenizer, cycle=True)
    n = 8 * len(seq)
    decoded = []
    plain = base.tokenizer.decode

    def counting(ids, *a, **kw):
        decoded.append(len(ids))
        return plain(ids, *a, **kw)

    eng = SharedPrefillEngine(base)
    monkeypatch.setattr(base.tokenizer, "decode", counting)
    with eng.prefill([prompt]) as h:
        (ours,) = eng.generate(h, max_new_tokens=n, stop="never in the text")
    monkeypatch.undo()
    assert ours.token_ids == seq * 8 and ours.text == TEXT * 8 and ours.finish_reason == "length"
    assert sum(decoded) <= 4 * n < n * (n + 1) // 2
