"""Bad user files end ``ccft train --dry-run`` / ``ccft precompute`` in one line with ``FILE:LINE``, exit 2.

A fuzz table over corrupted inputs (truncated JSONL, bad UTF-8, wrong types, directories where files are
expected and the reverse) run through the real CLI entry point (``ccft.cli.main.main``; two through
``python -m ccft.cli.main`` in a subprocess): exit status 2, one line on stderr, no traceback, and nothing
is written next to the inputs (docs/design.md, "Atomic writes"; K12: the guarantee at every entry point).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ccft.cli.main import main
from conftest import jsonl, snapshot

ROOT = Path(__file__).resolve().parents[2]
GOOD_ROWS = [{"prompt": f"What is {i} + {i}?", "response": str(2 * i)} for i in range(1, 6)]


def write_recipe(folder: Path, base: Path, **fields) -> Path:
    lines = [f"base: {base}", "train_data: data.jsonl", "output_dir: out", "max_steps: 1"]
    lines += [f"{k}: {v}" for k, v in fields.items()]
    (folder / "r.yaml").write_text("\n".join(lines) + "\n")
    return folder / "r.yaml"


def _malformed_line_4(d):
    text = jsonl(GOOD_ROWS).splitlines()
    text[3] = text[3][:-1]  # line 4 loses its closing brace
    (d / "data.jsonl").write_text("\n".join(text) + "\n")


def _truncated(d):
    text = jsonl(GOOD_ROWS)
    (d / "data.jsonl").write_text(text[: len(text) - 20])  # cut inside line 5


def _bad_utf8(d):
    raw = jsonl(GOOD_ROWS).encode().split(b"\n")
    raw[1] = raw[1].replace(b"What", b"Wh\xff\xfet")
    (d / "data.jsonl").write_bytes(b"\n".join(raw))


def _row(i, row):
    def make(d):
        rows = list(GOOD_ROWS)
        rows[i] = row
        (d / "data.jsonl").write_text(jsonl(rows))

    return make


def _json_truncated(d):
    (d / "data.json").write_text(json.dumps(GOOD_ROWS, indent=1)[:-30])
    (d / "r.yaml").write_text((d / "r.yaml").read_text().replace("data.jsonl", "data.json"))


def _json_not_list(d):
    (d / "data.json").write_text(json.dumps({"prompt": "q", "response": "a"}))
    (d / "r.yaml").write_text((d / "r.yaml").read_text().replace("data.jsonl", "data.json"))


def _data_dir(d):
    (d / "data.jsonl").unlink()
    (d / "data.jsonl").mkdir()


def _recipe(text: str | bytes):
    def make(d):
        (d / "r.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())

    return make


def _recipe_line(old: str, new: str):
    def make(d):
        (d / "r.yaml").write_text((d / "r.yaml").read_text().replace(old, new))

    return make


def _append(line: str):
    def make(d):
        with open(d / "r.yaml", "a") as f:
            f.write(line + "\n")

    return make


def _file_at(name: str):
    def make(d):
        (d / name).write_text("not a folder\n")

    return make


def _corrupt_store(d):
    (d / "store").mkdir()
    (d / "store" / "manifest.json").write_text('{"format": "ccft-cbase-1", "shards": ')
    _append("base_cache_store: store")(d)


def _eval_bad(d):
    (d / "eval.jsonl").write_text(jsonl(GOOD_ROWS[:2]) + '{"prompt": 7, "response": "x"}\n')
    _append("eval_data: eval.jsonl")(d)


# name -> (make the corruption in folder d, the command's extra args, what the one line must name)
CASES = {
    "jsonl line 4 without its closing brace": (_malformed_line_4, [], r"data\.jsonl:4:\d+: not valid JSON"),
    "truncated jsonl": (_truncated, [], r"data\.jsonl:5:\d+: not valid JSON"),
    "bad utf-8 on line 2": (_bad_utf8, [], r"data\.jsonl:2: not UTF-8"),
    "prompt of the wrong type": (
        _row(2, {"prompt": 3, "response": "6"}),
        [],
        r"data\.jsonl:3: row 2: `prompt` must be",
    ),
    "response of the wrong type": (
        _row(1, {"prompt": "q", "response": ["4"]}),
        [],
        r"data\.jsonl:2: row 1: the response",
    ),
    "a row that is a list": (_row(0, ["q", "a"]), [], r"data\.jsonl:1: a row must be a JSON object"),
    "a row that is null": (_row(4, None), [], r"data\.jsonl:5: a row must be a JSON object"),
    "messages of the wrong type": (_row(3, {"messages": "hi"}), [], r"data\.jsonl:4: row 3: `messages`"),
    "truncated .json": (_json_truncated, [], r"data\.json:\d+:\d+: not valid JSON"),
    ".json that is not a list": (_json_not_list, [], r"data\.json:1: a \.json data file holds a list"),
    "data file is a directory": (_data_dir, [], r"data\.jsonl' is a directory"),
    "eval data with a bad row": (_eval_bad, [], r"eval\.jsonl:3: row 2: `prompt` must be"),
    "recipe is a directory": (
        lambda d: ((d / "r.yaml").unlink(), (d / "r.yaml").mkdir()),
        [],
        r"r\.yaml is a directory",
    ),
    "recipe with bad YAML": (_append("lora_r: [8, 16"), [], r"r\.yaml:\d+:\d+: not valid YAML"),
    "recipe with bad utf-8": (_recipe(b"base: \xff\xfe\n"), [], r"r\.yaml: not UTF-8"),
    "recipe that is a list": (_recipe("- base: x\n"), [], r"r\.yaml:1: a recipe is a mapping"),
    "recipe value of the wrong type": (
        _recipe_line("max_steps: 1", "max_steps: many"),
        [],
        r"r\.yaml:4: key 'max_steps' expects int",
    ),
    "recipe with an unknown key": (
        _append("learning_rat: 0.1"),
        [],
        r"r\.yaml:5: unknown key 'learning_rat'",
    ),
    "output_dir is an existing file": (_file_at("out"), [], r"output_dir 'out' is an existing file"),
    "output_dir under a file": (
        lambda d: (_file_at("parent")(d), _recipe_line("output_dir: out", "output_dir: parent/run")(d)),
        [],
        r"output_dir 'parent/run' lies under 'parent', which is a file",
    ),
    "base_cache_store is a file": (
        lambda d: (_file_at("store")(d), _append("base_cache_store: store")(d)),
        [],
        r"base_cache_store 'store' is an existing file",
    ),
    "resume_from_checkpoint that is a file": (
        lambda d: (_file_at("ckpt")(d), _append("resume_from_checkpoint: ckpt")(d)),
        [],
        r"resume_from_checkpoint 'ckpt' is not a checkpoint folder \(a file\)",
    ),
    "store with a broken manifest": (_corrupt_store, [], r"store is not a C_base store"),
    "base is a file": (
        lambda d: (_file_at("weights.bin")(d), _recipe_line("base: ", "base: weights.bin  # ")(d)),
        [],
        r"base 'weights.bin' is a file",
    ),
    "base folder without a model": (
        lambda d: ((d / "empty").mkdir(), _recipe_line("base: ", "base: empty  # ")(d)),
        [],
        r"base folder 'empty' has no config.json",
    ),
}


@pytest.fixture
def workdir(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(jsonl(GOOD_ROWS))
    write_recipe(tmp_path, tiny_dir)
    return tmp_path


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def test_a_good_recipe_passes_dry_run_and_writes_nothing(workdir, capsys):
    before = snapshot(workdir)
    rc, err = run_cli(["train", "r.yaml", "--dry-run"], capsys)
    assert rc == 0, err
    assert snapshot(workdir) == before and not (workdir / "out").exists()


@pytest.mark.parametrize("command", ["train", "precompute"])
@pytest.mark.parametrize("case", list(CASES))
def test_corrupted_inputs_end_in_one_line_with_exit_2(workdir, capsys, case, command):
    make, extra, pattern = CASES[case]
    make(workdir)
    if command == "precompute" and case == "store with a broken manifest":
        pytest.skip("ccft precompute rebuilds the store: a broken store is its job, not an input error")
    before = snapshot(workdir)
    argv = [command, "r.yaml"] + (["--dry-run"] if command == "train" else ["--estimate-only"]) + extra
    rc, err = run_cli(argv, capsys)
    assert rc == 2, (case, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ccft {command}: error: "), err
    assert "Traceback" not in err
    import re

    assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert snapshot(workdir) == before  # nothing half-written (no output_dir, no store, no temp files)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("eval: [1, 2]", r"r\.yaml:5: `eval` is a mapping"),
        ("eval: evals/none.yaml", r"r\.yaml:5: eval: suite 'evals/none\.yaml' not found"),
        ("eval: {nll_row: 3}", r"r\.yaml:5: unknown key 'nll_row'"),
    ],
)
def test_a_bad_eval_section_stops_demo_not_train(workdir, capsys, line, pattern):
    """Training reads no ``eval:``: ``ccft train`` / ``ccft precompute`` pass it by, ``ccft demo`` (which
    evaluates) refuses it in one line before anything is written."""
    import re

    _append(line)(workdir)
    before = snapshot(workdir)
    for argv in (["train", "r.yaml", "--dry-run"], ["precompute", "r.yaml", "--estimate-only"]):
        rc, err = run_cli(argv, capsys)
        assert (rc, err) == (0, ""), argv
    rc, err = run_cli(["demo", "r.yaml", "--dry-run"], capsys)
    assert rc == 2 and err.startswith("ccft demo: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), (pattern, err)
    assert snapshot(workdir) == before


# a real run rebuilds a store whose manifest is broken (the store is a cache of C_base); --dry-run reports it
REAL_RUN = [c for c in CASES if c != "store with a broken manifest"]


@pytest.mark.parametrize("case", REAL_RUN)
def test_a_real_run_that_fails_to_start_writes_nothing(workdir, capsys, case):
    """Without --dry-run: the same one-line error, and output_dir (and everything else) as it was."""
    make, extra, pattern = CASES[case]
    make(workdir)
    before = snapshot(workdir)
    rc, err = run_cli(["train", "r.yaml", *extra], capsys)
    assert rc == 2, (case, err)
    import re

    assert re.search(pattern, err.strip().splitlines()[-1]), (pattern, err)
    assert snapshot(workdir) == before


def test_precompute_out_that_is_a_file(workdir, capsys):
    (workdir / "store.bin").write_text("x")
    rc, err = run_cli(["precompute", "r.yaml", "--out", "store.bin", "--estimate-only"], capsys)
    assert rc == 2 and "--out 'store.bin' is an existing file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("case", ["jsonl line 4 without its closing brace", "output_dir is an existing file"])
def test_the_installed_command_line(workdir, case):
    """The same through a real process (``python -m ccft.cli.main``): stderr is one line, exit status 2."""
    make, _, pattern = CASES[case]
    make(workdir)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("CCFT_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ccft.cli.main", "train", "r.yaml", "--dry-run"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    import re

    assert re.search(pattern, lines[0])
