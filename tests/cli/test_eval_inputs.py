"""``ccft eval`` refuses bad inputs in one line, exit 2, before any model loads (K12).

Decoder folders that are files or hold a damaged ``ccft.json`` (``FILE:LINE:COL``), and a task whose data
is missing. The model loader is replaced by one that fails the test, so "before the model loads" is checked,
not assumed.
"""

from __future__ import annotations

import pytest

from ccft.cli.main import main


@pytest.fixture
def no_model(monkeypatch):
    """Any model load is recorded and stops the command."""
    import ccft.core.models

    loads = []

    def refuse(*args, **kwargs):
        loads.append(args)
        raise RuntimeError("a model was loaded")

    monkeypatch.setattr(ccft.core.models, "load_base", refuse)
    return loads


def run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "damage,pattern",
    [
        ("file", r"dec is a file; a decoder is a folder"),
        ("empty", r"dec is not a ccft decoder folder \(ccft\.json missing\)"),
        ("truncated", r"ccft\.json:1:\d+: not valid JSON"),
        ("not utf-8", r"ccft\.json: not UTF-8"),
        ("a list", r"ccft\.json:1: ccft\.json holds a JSON object, got list"),
    ],
)
def test_damaged_decoder_folders(tmp_path, capsys, no_model, damage, pattern):
    import re

    dec = tmp_path / "dec"
    if damage == "file":
        dec.write_text("weights")
    else:
        dec.mkdir()
        meta = {
            "truncated": b'{"method": "ccft", "base": {"na',
            "not utf-8": b'{"method": "\xff"}',
            "a list": b"[1, 2]",
        }.get(damage)
        if meta is not None:
            (dec / "ccft.json").write_bytes(meta)
    rc, err = run(["eval", "--task", "gsm8k", "--decoder", str(dec), "--out", str(tmp_path / "out")], capsys)
    assert rc == 2, err
    assert re.search(pattern, one_line(err)), err
    assert not no_model and not (tmp_path / "out").exists()


def test_missing_task_data_fails_before_the_model_loads(tmp_path, capsys, no_model, monkeypatch):
    monkeypatch.setenv("CCFT_EVAL_DATA", str(tmp_path / "no-data"))
    rc, err = run(
        ["eval", "--task", "humaneval", "--mode", "base", "--base", "tiny", "--out", str(tmp_path / "out")],
        capsys,
    )
    assert rc == 2 and "no-data" in one_line(err) and not no_model, err


@pytest.mark.parametrize(
    "base_meta,loaded",
    [
        ({"name": "smollm2-135m-instruct", "path": "/machine/cache/smollm2"}, "smollm2-135m-instruct"),
        ({"name": "tiny-local", "path": "/data/tiny-local"}, "/data/tiny-local"),
        ({"name": "tiny-local"}, "tiny-local"),
    ],
)
def test_eval_loads_an_embedded_base_by_name(monkeypatch, base_meta, loaded):
    """``ccft eval --decoder DIR`` without ``--base``: a decoder trained on an embedded model loads it by its
    name (results record the name, not the trainer's machine path); any other base by its recorded folder."""
    from types import SimpleNamespace

    import ccft.core.checkpoint as checkpoint
    import ccft.core.models as models
    from ccft.cli.eval import load_models

    monkeypatch.setattr(checkpoint, "read_meta", lambda d: {"method": "ccft", "base": base_meta})
    seen = []
    monkeypatch.setattr(models, "load_base", lambda name, **kw: seen.append(name) or "BASE")
    monkeypatch.setattr(checkpoint, "load_decoder", lambda d, base: SimpleNamespace(method="ccft"))
    base, decoders = load_models(["dec"])
    assert seen == [loaded] and base == "BASE" and list(decoders) == ["ccft"]
