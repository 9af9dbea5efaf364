"""The eval runner on the compact C_base (issue 35, item 3): a decoder trained on the native cache served on
the compact one (``EvalSettings.cache_format``), and a decoder trained on it (``Decoder.cache_format``).
With ``engine=True`` the engine serves both (the handle's int8 format) with the reference path's texts and
NLLs (fp32 rounding: the logits are large here), and those read C_base quantised and dequantised."""

from __future__ import annotations

import pytest
import torch
from harness_fixtures import ToyTask, perturb

import ccft
from ccft.core.cache import BaseCache
from ccft.core.compact import dequantize, quantize_keys, quantize_values
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_response
from ccft.evals.runner import EvalSettings, ModeSpec, run_task
from conftest import make_tiny_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    folder = make_tiny_folder(
        tmp_path_factory.mktemp("compact_eval"), tokenizer, seed=3, layers=4, scale=30.0
    )
    base = ccft.load_base(str(folder))
    dec = perturb(ccft.make_decoder(base, "full", method="ccft"), 2, scale=0.1)
    return base, dec


def _nll_by_hand(base, dec, task, item, compact: bool) -> float:
    p = task.prompt_ids(base.tokenizer, item)
    y = tokenize_response(base.tokenizer, task.reference_text(item))
    c = ccft.compute_base_cache(base, [p])
    if compact:
        c = BaseCache.from_tensors(
            [dequantize(*quantize_keys(k)) for k in c.keys],
            [dequantize(*quantize_values(v)) for v in c.values],
            c.attention_mask,
            c.tail_ids,
            1,
            c.fingerprint,
        )
    with torch.no_grad():
        logits = ccft.decoder_forward(dec, c, torch.tensor([[p[-1]] + y]))
    logp = torch.log_softmax(logits[0, :-1].float(), -1)
    return float(-logp.gather(-1, torch.tensor(y)[:, None]).mean())


def test_a_native_decoder_served_on_the_compact_cache(models, tmp_path):
    base, dec = models
    specs = [ModeSpec("prefillshare", dec, "cc"), ModeSpec("base")]
    kw = dict(batch_size=4, progress=False)
    asked = run_task(
        ToyTask(5),
        base,
        specs,
        tmp_path / "engine",
        settings=EvalSettings(engine=True, cache_format="int8"),
        **kw,
    )
    ref = run_task(
        ToyTask(5), base, specs, tmp_path / "ref", settings=EvalSettings(cache_format="int8"), **kw
    )
    native = run_task(ToyTask(5), base, specs, tmp_path / "native", settings=EvalSettings(), **kw)
    meta = asked.summary["meta"]["settings"]
    assert meta["decode_path"] == "SharedPrefillEngine (every mode)" and meta["cache_format"] == "int8"
    assert "cache_format" not in native.summary["meta"]["settings"]  # folders written before it still resume
    got, want = asked.records["prefillshare"], ref.records["prefillshare"]
    assert [r["text"] for r in got] == [r["text"] for r in want]
    assert [r["nll"] for r in got] == pytest.approx([r["nll"] for r in want], rel=1e-5)
    # base prefills its own prompt: the compact C_base does not touch it
    assert [r["nll"] for r in asked.records["base"]] == pytest.approx(
        [r["nll"] for r in native.records["base"]], rel=1e-5
    )
    task = ToyTask(5)
    item = task.load()[0]
    assert got[0]["nll"] == pytest.approx(_nll_by_hand(base, dec, task, item, compact=True), abs=1e-5)
    assert native.records["prefillshare"][0]["nll"] == pytest.approx(
        _nll_by_hand(base, dec, task, item, compact=False), abs=1e-5
    )
    assert got[0]["nll"] != native.records["prefillshare"][0]["nll"]  # the quantisation shows


def test_a_compact_trained_decoder_reads_its_format(models, tmp_path):
    base, dec = models
    dec.cache_format = "int8"
    try:
        specs = [ModeSpec("prefillshare", dec, "cc")]
        assert ModeSpec("prefillshare", dec).describe()["cache_format"] == "int8"
        assert specs[0].cache_format() == "int8" and specs[0].cache_format("native") == "native"
        kw = dict(batch_size=4, progress=False)
        own = run_task(ToyTask(3), base, specs, tmp_path / "own", settings=EvalSettings(engine=True), **kw)
        forced = run_task(
            ToyTask(3), base, specs, tmp_path / "forced", settings=EvalSettings(cache_format="int8"), **kw
        )
        assert own.summary["meta"]["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
        a, b = own.records["prefillshare"], forced.records["prefillshare"]  # the engine on its own format
        assert [r["text"] for r in a] == [r["text"] for r in b]
        assert [r["nll"] for r in a] == pytest.approx([r["nll"] for r in b], rel=1e-5)
    finally:
        dec.cache_format = "native"
    assert "cache_format" not in ModeSpec("prefillshare", dec).describe()
    assert ModeSpec("base").cache_format("int8") == "native"  # own-prefill modes read no C_base


def test_eval_cache_format_is_validated():
    with pytest.raises(ConfigError, match=r"eval cache_format='fp8': use one of native, int8"):
        EvalSettings(cache_format="fp8")


def test_ccft_eval_cache_format_flag(models, tmp_path):
    """``ccft eval --cache-format int8 --engine``: the run records the format and the engine decode path."""
    import json

    from ccft.cli.main import main

    base, dec = models
    ccft.save_decoder(dec, tmp_path / "dec")
    args = ["eval", "--decoder", str(tmp_path / "dec"), "--task", "gsm8k", "--mode", "prefillshare"]
    args += [
        "--limit",
        "2",
        "--max-new-tokens",
        "2",
        "--no-progress",
        "--engine",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(args + ["--cache-format", "int8"]) == 0
    meta = json.loads((tmp_path / "out" / "gsm8k" / "meta.json").read_text())
    assert meta["settings"]["cache_format"] == "int8"
    assert meta["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
    with pytest.raises(SystemExit):
        main(args + ["--cache-format", "fp8"])
