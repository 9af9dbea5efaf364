"""Evaluations on the block-weight path (docs/inference.md, "Block weights"): the setting is read when the
settings are made, given to the evaluation's engine, recorded in the resume key whenever it is not "off" (one
folder never mixes records of the fp32 and the block path), and an engine that cannot be built leaves the
folder untouched."""

from __future__ import annotations

import pytest
from harness_fixtures import ToyTask, decoders

import ccft
from ccft.core.errors import ConfigError
from ccft.evals import runner as runner_mod
from ccft.evals.results import FolderConflictError
from ccft.evals.runner import EvalSettings, ModeSpec, run_task
from ccft.inference import blocks as B
from conftest import make_block_folder, make_tiny_folder


def _specs(base):
    ff, cc = decoders(base)
    return [ModeSpec("base"), ModeSpec("full-ft", ff, "ff"), ModeSpec("prefillshare", cc, "cc")]


def test_settings_take_the_environment_and_record_only_the_block_path(monkeypatch):
    task = ToyTask()
    monkeypatch.delenv(B.ENV, raising=False)
    fp32 = EvalSettings(engine=True)
    assert fp32.block_weights == "off" and "block_weights" not in fp32.as_dict(
        task
    )  # old folders still resume
    monkeypatch.setenv(B.ENV, "auto")
    blocks = EvalSettings(engine=True)
    assert blocks.block_weights == "auto" and blocks.as_dict(task)["block_weights"] == "auto"
    reference = EvalSettings(engine=False)  # the reference path never reads blocks: nothing to record
    assert reference.block_weights is None and "block_weights" not in reference.as_dict(task)
    assert (
        EvalSettings(engine=True, block_weights="off").block_weights == "off"
    )  # explicit beats the environment
    monkeypatch.setenv(B.ENV, "fast")
    with pytest.raises(ConfigError, match=B.ENV):
        EvalSettings(engine=True)
    with pytest.raises(ConfigError, match="eval block_weights='yes'"):
        EvalSettings(engine=True, block_weights="yes")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("bw_tiny"), tokenizer, seed=3, scale=30.0))
    )
    return base, _specs(base)


def _evaluate(base, specs, out, block_weights: str):
    return run_task(
        ToyTask(4),
        base,
        specs,
        out,
        settings=EvalSettings(engine=True, block_weights=block_weights),
        progress=False,
    )


def test_an_fp32_folder_is_not_resumed_on_the_block_path(tiny, tmp_path):
    base, specs = tiny
    _evaluate(base, specs, tmp_path, "off")
    folder = tmp_path / "toy"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FolderConflictError, match="block_weights"):
        _evaluate(base, specs, tmp_path, "auto")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_engine_that_cannot_be_built_leaves_the_folder_untouched(tiny, tmp_path):
    base, specs = tiny  # not dequantised from a GGUF file: "on" cannot be honoured
    with pytest.raises(ConfigError, match="block_weights"):
        _evaluate(base, specs, tmp_path, "on")
    assert not (tmp_path / "toy").exists()


def test_block_path_evaluation_equals_the_fp32_one(tmp_path_factory, tokenizer, monkeypatch):
    if B.load_kernel() is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    engines = []
    real = runner_mod.make_engine
    monkeypatch.setattr(
        runner_mod, "make_engine", lambda *a, **k: engines.append(real(*a, **k)) or engines[-1]
    )
    folder = make_block_folder(tmp_path_factory.mktemp("bw_blocks"), tokenizer, seed=3, scale=30.0)
    base = ccft.load_base(str(folder))
    specs = _specs(base)
    out = {}
    for setting in ("off", "on"):
        out[setting] = run_task(
            ToyTask(6),
            base,
            specs,
            tmp_path_factory.mktemp(f"bw_{setting}"),
            settings=EvalSettings(engine=True, block_weights=setting),
            batch_size=4,
            progress=False,
        )
    assert [e.block_weights for e in engines] == [None, folder.parent / "model.gguf"]  # the GGUF's blocks ran
    assert out["on"].summary["meta"]["settings"]["block_weights"] == "on"
    assert "block_weights" not in out["off"].summary["meta"]["settings"]
    for mode in ("base", "full-ft", "prefillshare"):
        fp32, blocks = out["off"].records[mode], out["on"].records[mode]
        assert [r["text"] for r in blocks] == [r["text"] for r in fp32], (
            mode
        )  # clear margins: no near tie flips
        assert [r["nll"] for r in blocks] == pytest.approx([r["nll"] for r in fp32], abs=1e-4), mode
