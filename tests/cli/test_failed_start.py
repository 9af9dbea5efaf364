"""A command that fails to start writes nothing: ``ccft train``, ``demo``, ``study``, ``precompute`` and
``export`` x {malformed data line, a row without its field, no rows left, the output folder is a file, the
output folder holds an earlier run}, and ``ccft eval`` with an output folder that is a file. Each run is real
(no ``--dry-run``): exit status 2, one error line naming the file (and line) and the fix, and every file under
the working folder exactly as it was (size and mtime), earlier runs included (docs/design.md, "Atomic
writes"). ``ccft eval``'s input table is tests/cli/test_eval_inputs.py; ``ccft train --dry-run``'s
tests/cli/test_bad_files.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ccft.cli.main import main
from conftest import jsonl, make_lora, snapshot

GOOD_ROWS = [{"prompt": f"What is {i} + {i}?", "response": str(2 * i)} for i in range(1, 9)]

RECIPE = """base: {base}
decoder_kind: lora
lora_r: 2
lora_alpha: 4
train_data: data.jsonl
output_dir: run
max_steps: 1
per_device_train_batch_size: 2
save_strategy: "no"
use_cpu: true
report_to: none
disable_tqdm: true
eval:
  task: gsm8k
  nll_rows: 2
  em_rows: 1
  max_new_tokens: 4
  batch_size: 2
"""

STUDY = """runs: runs
out: report
bootstrap: 20
batch_size: 2
specialists:
  math:
    recipe: r.yaml
    tasks: {gsm8k: {limit: 2, max_new_tokens: 4}}
  tools:
    recipe: r2.yaml
    tasks: {bfcl-multiple: {limit: 2, max_new_tokens: 4}}
"""


def _malformed_line_4(d: Path, name: str = "data.jsonl") -> None:
    lines = jsonl(GOOD_ROWS).splitlines()
    lines[3] = lines[3][:-1]
    (d / name).write_text("\n".join(lines) + "\n")


def _missing_field(d: Path, name: str = "data.jsonl") -> None:
    rows = [dict(r) for r in GOOD_ROWS]
    del rows[2]["response"]
    (d / name).write_text(jsonl(rows))


def _no_rows_left(d: Path, name: str = "r.yaml") -> None:
    (d / name).write_text((d / name).read_text().replace("max_steps: 1", "max_steps: 1\nmax_length: 3"))


# what the commands read and write, per command: (argv, the folder the command writes, the file a data case
# breaks, the recipe a "no rows left" case edits)
COMMANDS = {
    "train": (["train", "r.yaml"], "run", "data.jsonl", "r.yaml"),
    "demo": (["demo", "r.yaml", "--runs", "runs", "--out", "report"], "report", "data.jsonl", "r.yaml"),
    "precompute": (["precompute", "r.yaml", "--out", "store"], "store", "data.jsonl", "r.yaml"),
    # the second specialist's data is the bad one: the first must not have been trained (or its folder made)
    "study": (["study", "s.yaml", "--skip-serving"], "report", "data2.jsonl", "r2.yaml"),
}

CASES = {
    "malformed line": (lambda d, f, r: _malformed_line_4(d, f), r"\.jsonl:4:\d+: not valid JSON"),
    "missing field": (lambda d, f, r: _missing_field(d, f), r"\.jsonl:3: row 2: .*response"),
    "no rows left": (lambda d, f, r: _no_rows_left(d, r), r"no rows left: .* longer than max_length=3"),
    "output is a file": (None, r"'(run|report|store)' is an existing file"),
}


@pytest.fixture
def workdir(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CCFT_NO_PROGRESS", "1")
    for data, recipe in (("data.jsonl", "r.yaml"), ("data2.jsonl", "r2.yaml")):
        (tmp_path / data).write_text(jsonl(GOOD_ROWS))
        text = RECIPE.format(base=tiny_dir).replace("data.jsonl", data)
        (tmp_path / recipe).write_text(text.replace("output_dir: run", f"output_dir: run{recipe[1:-5]}"))
    (tmp_path / "s.yaml").write_text(STUDY)
    return tmp_path


def _earlier_run(d: Path, out: str) -> None:
    """An earlier run's output folder: files the failed start must leave as they are."""
    (d / out).mkdir()
    (d / out / "results.json").write_text('{"earlier": true}\n')
    (d / out / "notes.txt").write_text("an earlier run\n")


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("earlier", [False, True], ids=["no earlier run", "earlier run"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_failed_start_writes_nothing(workdir, capsys, command, case, earlier):
    argv, out, data, recipe = COMMANDS[command]
    make, pattern = CASES[case]
    if case == "output is a file":
        if earlier:
            pytest.skip("a file is not an earlier run")
        (workdir / out).write_text("not a folder\n")
    else:
        if earlier:
            _earlier_run(workdir, out)
        make(workdir, data, recipe)
    before = snapshot(workdir)
    rc, err = run_cli(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[ccft")]
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert snapshot(workdir) == before


def _decoder(folder: Path, tiny_dir: Path) -> Path:
    import ccft

    base = ccft.load_base(str(tiny_dir))
    dec = make_lora(base, "default", seed=0, r=2)
    ccft.save_decoder(dec, folder)
    return folder


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("malformed line", r"ccft\.json:\d+:\d+: not valid JSON"),
        ("missing field", r"ccft\.json.*`base`"),
        ("output is a file", r"out 'out' is an existing file, not a folder"),
    ],
)
@pytest.mark.parametrize("earlier", [False, True], ids=["no earlier run", "earlier run"])
def test_export_that_fails_to_start_writes_nothing(
    tmp_path, tiny_dir, capsys, monkeypatch, case, pattern, earlier
):
    monkeypatch.chdir(tmp_path)
    dec = _decoder(tmp_path / "dec", tiny_dir)
    meta = json.loads((dec / "ccft.json").read_text())
    if case == "malformed line":
        (dec / "ccft.json").write_text(json.dumps(meta, indent=1)[:-20])
    elif case == "missing field":
        del meta["base"]
        (dec / "ccft.json").write_text(json.dumps(meta, indent=1))
    if case == "output is a file":
        if earlier:
            pytest.skip("a file is not an earlier run")
        (tmp_path / "out").write_text("not a folder\n")
    elif earlier:  # refused as not empty unless the decoder folder fails first (its ccft.json is read first)
        _earlier_run(tmp_path, "out")
        pattern = f"{pattern}|output folder out exists and is not empty"
    capsys.readouterr()  # the decoder's own set-up output
    before = snapshot(tmp_path)
    rc, err = run_cli(["export", "dec", "out", "--to", "merged"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert snapshot(tmp_path) == before


def test_eval_with_an_output_that_is_a_file_writes_nothing(tmp_path, tiny_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _decoder(tmp_path / "dec", tiny_dir)
    (tmp_path / "out").write_text("not a folder\n")
    capsys.readouterr()
    before = snapshot(tmp_path)
    rc, err = run_cli(["eval", "--task", "gsm8k", "--decoder", "dec", "--out", "out", "--limit", "2"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert re.search(r"--out 'out' is an existing file, not a folder", lines[0]), lines[0]
    assert snapshot(tmp_path) == before
