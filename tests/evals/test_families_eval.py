"""The engine path of ``ccft eval`` (``EvalSettings(engine=True)``, the CLI's default) on every model family
the engine runs (tests/families.py): a tiny random base of each family with a Full-FT and a CCFT decoder
(tests/evals/harness_fixtures.py), the four modes on a few GSM8K items (``ToyTask``, as
tests/evals/test_runner.py), and each mode's per-item texts, finish reasons, scores and reference NLLs equal
the reference path's (``engine=False``: ``ccft.core.generation.generate`` and HF forwards)."""

from __future__ import annotations

import json

import pytest
from harness_fixtures import ToyTask, decoders

import ccft
from ccft.evals.runner import EvalSettings, ModeSpec, run_task
from families import MODEL_FAMILIES, make_family_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models are latency-bound

MODES = ("base", "full-ft", "naive", "prefillshare")
ITEMS = 3


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_engine_path_equals_reference_path(family, tokenizer, tmp_path):
    pytest.importorskip("ccft.inference")
    base = ccft.load_base(str(make_family_folder(tmp_path / "base", tokenizer, family)))
    ff, cc = decoders(base)
    specs = [
        ModeSpec("base"),
        ModeSpec("full-ft", ff, "ff"),
        ModeSpec("naive", ff, "ff"),
        ModeSpec("prefillshare", cc, "cc"),
    ]
    task = ToyTask(n=ITEMS)
    runs = {
        engine: run_task(
            task,
            base,
            specs,
            tmp_path / ("engine" if engine else "reference"),
            settings=EvalSettings(engine=engine),
            batch_size=2,  # two batches: the engine refills its rows
            progress=False,
            n_resamples=10,
        )
        for engine in (False, True)
    }
    ref, eng = runs[False], runs[True]
    assert eng.summary["meta"]["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
    assert ref.summary["meta"]["settings"]["decode_path"] != eng.summary["meta"]["settings"]["decode_path"]
    for mode in MODES:
        want, got = ref.records[mode], eng.records[mode]
        assert len(got) == len(want) == ITEMS
        assert [r["id"] for r in got] == [r["id"] for r in want]
        assert [(r["text"], r["finish_reason"], r["scores"]) for r in got] == [
            (r["text"], r["finish_reason"], r["scores"]) for r in want
        ], mode
        assert [r["nll"] for r in got] == pytest.approx([r["nll"] for r in want], abs=1e-4), mode
    # the decoders differ from the base and from each other (an ignored decoder would show)
    texts = {mode: [r["text"] for r in ref.records[mode]] for mode in MODES}
    assert texts["full-ft"] != texts["base"] and texts["prefillshare"] != texts["base"]


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_ccft_eval_gsm8k_engine_default_equals_no_engine(family, tokenizer, tmp_path, capsys):
    """``ccft eval --task gsm8k`` on saved decoders of the family: the default (engine) path's per-item
    records equal ``--no-engine``'s."""
    from ccft.cli.main import main
    from ccft.evals.runner import read_jsonl

    base = ccft.load_base(str(make_family_folder(tmp_path / "base", tokenizer, family)))
    ff, cc = decoders(base)
    ccft.save_decoder(ff, tmp_path / "ff")
    ccft.save_decoder(cc, tmp_path / "cc")
    argv = ["eval", "--task", "gsm8k", "--decoder", str(tmp_path / "ff"), "--decoder", str(tmp_path / "cc")]
    argv += [
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--batch-size",
        "2",
        "--no-progress",
        "--bootstrap",
        "10",
    ]
    assert main(argv + ["--out", str(tmp_path / "engine")]) == 0
    assert main(argv + ["--no-engine", "--out", str(tmp_path / "reference")]) == 0
    capsys.readouterr()
    for mode in MODES:
        got = read_jsonl(tmp_path / "engine" / "gsm8k" / f"items.{mode}.jsonl")
        want = read_jsonl(tmp_path / "reference" / "gsm8k" / f"items.{mode}.jsonl")
        assert len(got) == len(want) == 2
        keys = ("id", "text", "finish_reason", "scores")
        assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want], mode
        assert [r["nll"] for r in got] == pytest.approx([r["nll"] for r in want], abs=1e-4), mode
    meta = json.loads((tmp_path / "engine" / "gsm8k" / "meta.json").read_text())
    assert meta["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
