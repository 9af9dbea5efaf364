"""The packaged recipes (``ccft/recipes/``; ``ccft recipes list`` / ``cp``) and the files a recipe names, read
from the recipe's own folder first (``ccft.train.recipes``): a copied recipe runs from any working directory,
and ``ccft train`` reads no ``eval:`` suite (issue 54, "A newcomer's paths")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ccft.cli.main import main
from ccft.core.errors import ConfigError
from ccft.train.config import load_eval_config, load_recipe
from ccft.train.recipes import (
    PACKAGE_DIR,
    SUITES_DIR,
    copy_recipe,
    describe,
    packaged_recipes,
    packaged_suites,
    recipe_argument,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = PACKAGE_DIR / "demo.yaml"
DEMO_SUITE = SUITES_DIR / "demo.yaml"


def cli(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_one_copy_the_repository_paths_are_links_to_the_package():
    assert (ROOT / "recipes").resolve() == PACKAGE_DIR == ROOT / "src" / "ccft" / "recipes"
    assert (ROOT / "evals").resolve() == SUITES_DIR
    assert (ROOT / "recipes" / "demo.yaml").read_bytes() == DEMO.read_bytes()
    assert set(packaged_suites()) == {"demo", "study"}
    names = set(packaged_recipes())
    assert {"demo", "math-gsm8k", "study", "frontier", "multipl-e", "accelerate/zero2"} <= names
    assert names == {p.stem for p in PACKAGE_DIR.glob("*.yaml")} | {
        f"accelerate/{p.stem}" for p in (PACKAGE_DIR / "accelerate").glob("*.yaml")
    }


def test_recipes_list_names_command_and_description(capsys):
    rc, out, err = cli(["recipes", "list"], capsys)
    assert (rc, err) == (0, "")
    rows = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(
            r"^  (\S+) +(ccft \w+|accelerate) +(.+)$", out.split("evaluation suites")[0], flags=re.M
        )
    }
    assert rows["demo"] == ("ccft demo", "The main job at CPU scale")
    assert rows["math-gsm8k"] == ("ccft train", "Math specialist on the full GSM8K train split")
    assert rows["study"] == ("ccft study", "The specialists study at CPU scale")
    assert rows["accelerate/ddp"] == ("accelerate", "Data parallel")
    assert rows["code-mbpp"] == ("ccft train", "Python code specialist on the MBPP *train* split")
    # every packaged recipe once, then the suites (demo and study appear as both)
    listed = re.findall(r"^  (\S+) ", out, flags=re.M)
    assert listed == [*packaged_recipes(), *packaged_suites()]
    for name, path in [*packaged_recipes().items(), *packaged_suites().items()]:
        assert describe(path)[1], name  # each has a description
    suites = out.split("evaluation suites")[1]
    assert re.search(r"^  demo +ccft eval +The demo's evaluation suite$", suites, flags=re.M), suites


def test_recipes_cp_copies_the_recipe_and_its_suite_and_refuses_to_overwrite(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["recipes", "cp", "demo", "."], capsys)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "[ccft] copied demo: demo.yaml, evals/demo.yaml",
        "[ccft] run it with: ccft demo demo.yaml --dry-run",
    ]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "demo.yaml",
        "evals/demo.yaml",
    ]
    assert (tmp_path / "demo.yaml").read_bytes() == DEMO.read_bytes()
    assert (tmp_path / "evals" / "demo.yaml").read_bytes() == DEMO_SUITE.read_bytes()

    # an edited copy is never overwritten without --force, and nothing else is written either
    (tmp_path / "evals" / "demo.yaml").write_text("task: gsm8k\nnll_rows: 3\n")
    (tmp_path / "demo.yaml").unlink()
    rc, out, err = cli(["recipes", "cp", "demo", "."], capsys)
    assert rc == 2 and out == ""
    assert err == (
        "ccft recipes: error: evals/demo.yaml already exist(s); nothing copied (add --force to overwrite, "
        "or give another DEST)\n"
    )
    assert not (tmp_path / "demo.yaml").exists()
    assert (tmp_path / "evals" / "demo.yaml").read_text() == "task: gsm8k\nnll_rows: 3\n"
    rc, _, err = cli(["recipes", "cp", "demo", ".", "--force"], capsys)
    assert (rc, err) == (0, "")
    assert (tmp_path / "demo.yaml").read_bytes() == DEMO.read_bytes()
    assert (tmp_path / "evals" / "demo.yaml").read_bytes() == DEMO_SUITE.read_bytes()

    rc, _, err = cli(["recipes", "cp", "nope", "."], capsys)
    assert rc == 2 and err.startswith(
        "ccft recipes: error: no packaged recipe 'nope'; the recipes are code-mbpp"
    )


def test_recipes_cp_to_a_file_name_and_a_new_folder(tmp_path):
    written = copy_recipe("demo", tmp_path / "exp" / "mine.yaml")
    assert written == [tmp_path / "exp" / "mine.yaml", tmp_path / "exp" / "evals" / "demo.yaml"]
    assert written[0].read_bytes() == DEMO.read_bytes()
    assert copy_recipe("math-gsm8k", tmp_path / "new") == [tmp_path / "new" / "math-gsm8k.yaml"]
    assert copy_recipe("accelerate/ddp", tmp_path / "new") == [tmp_path / "new" / "ddp.yaml"]
    with pytest.raises(ConfigError, match="is a folder; give another DEST"):
        (tmp_path / "clash" / "demo.yaml").mkdir(parents=True)
        copy_recipe("demo", tmp_path / "clash")


def test_a_copied_study_runs_from_another_folder(tmp_path, monkeypatch):
    from ccft.evals.study import load_study_config

    written = copy_recipe("study", tmp_path / "exp")
    rel = sorted(str(p.relative_to(tmp_path / "exp")) for p in written)
    assert rel == [
        "evals/study.yaml",
        "recipes/code-mbpp.yaml",
        "recipes/math-gsm8k.yaml",
        "recipes/tools-glaive.yaml",
        "study.yaml",
    ]
    for p in written:  # recipes/x.yaml of the copy is the packaged x.yaml
        source = SUITES_DIR / p.name if p.parent.name == "evals" else PACKAGE_DIR / p.name
        assert p.read_bytes() == source.read_bytes(), p
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_study_config("../exp/study.yaml")
    assert cfg.suite == "evals/study.yaml" and cfg.batch_size == 64
    assert {n: s.recipe_file for n, s in cfg.specialists.items()} == {
        n: str(tmp_path / "exp" / "recipes" / f"{r}.yaml")
        for n, r in (("math", "math-gsm8k"), ("tools", "tools-glaive"), ("code", "code-mbpp"))
    }


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_suite_is_read_beside_the_recipe_first(tmp_path, monkeypatch):
    recipe = _write(
        tmp_path / "a" / "r.yaml", "base: smollm2-135m-instruct\nmax_steps: 2\neval: s/suite.yaml\n"
    )
    _write(tmp_path / "a" / "s" / "suite.yaml", "task: gsm8k\nnll_rows: 7\nem_rows: 3\n")
    _write(tmp_path / "b" / "s" / "suite.yaml", "task: gsm8k\nnll_rows: 99\n")  # the working directory's
    monkeypatch.chdir(tmp_path / "b")
    _, ecfg, raw = load_recipe(recipe)
    assert (ecfg.nll_rows, ecfg.em_rows) == (7, 3) and raw["eval"]["nll_rows"] == 7
    # an old recipe naming a suite relative to the working directory still finds it
    (tmp_path / "a" / "s" / "suite.yaml").unlink()
    assert load_recipe(recipe)[1].nll_rows == 99
    # the old layout: recipes/r.yaml naming evals/x.yaml beside recipes/, from any working directory
    old = _write(
        tmp_path / "proj" / "recipes" / "r.yaml", "base: smollm2-135m-instruct\neval: evals/x.yaml\n"
    )
    _write(tmp_path / "proj" / "evals" / "x.yaml", "task: gsm8k\nnll_rows: 5\n")
    assert load_recipe(old)[1].nll_rows == 5
    # a packaged suite by name
    named = _write(tmp_path / "c" / "r.yaml", "base: smollm2-135m-instruct\neval: demo\n")
    assert load_recipe(named)[1] == load_eval_config(DEMO_SUITE)


def test_a_missing_suite_names_the_field_the_file_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = _write(
        tmp_path / "a" / "r.yaml", "base: smollm2-135m-instruct\nmax_steps: 2\neval: evals/none.yaml\n"
    )
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe)
    beside, above = tmp_path / "a" / "evals" / "none.yaml", tmp_path / "evals" / "none.yaml"
    assert str(e.value) == (
        f"{recipe}:3: eval: suite 'evals/none.yaml' not found (looked for {beside}, evals/none.yaml, "
        f"{above}); give a path relative to r.yaml's folder or the name of a packaged suite (demo, study; "
        "`ccft recipes list`)"
    )
    # training does not read it
    cfg, ecfg, raw = load_recipe(recipe, ["eval.nll_row=5"], with_eval=False)
    assert cfg.max_steps == 2 and "eval" not in raw and ecfg.nll_rows == 100


def test_a_copied_recipe_trains_and_demos_from_another_folder(tmp_path, monkeypatch, capsys, tiny_dir):
    copy_recipe("demo", tmp_path / "mine" / "copied.yaml")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    small = [f"base={tiny_dir}", "train_rows=6"]
    rc, out, err = cli(["train", "../mine/copied.yaml", "--dry-run", *small], capsys)
    assert (rc, err) == (0, "")
    assert out.startswith("[ccft] recipe OK: method=ccft decoder=lora base=") and "train rows=6 " in out
    rc, out, err = cli(["demo", "../mine/copied.yaml", "--dry-run", *small, "eval.nll_rows=4"], capsys)
    assert (rc, err) == (0, "")
    assert "train rows=6/6 (ccft, full-ft) max_steps=40; eval task=gsm8k nll_rows=4 em_rows=50" in out
    assert out.rstrip().endswith("would write runs/demo/ccft, runs/demo/full-ft and reports/demo")
    assert list((tmp_path / "elsewhere").iterdir()) == []  # a dry run writes nothing

    # without its suite the copy still trains (training reads no eval:); the demo refuses it before any work
    (tmp_path / "mine" / "evals" / "demo.yaml").unlink()
    rc, out, err = cli(["train", "../mine/copied.yaml", "--dry-run", *small], capsys)
    assert (rc, err) == (0, "") and out.startswith("[ccft] recipe OK")
    rc, out, err = cli(["demo", "../mine/copied.yaml", "--dry-run", *small], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("ccft demo: error: ../mine/copied.yaml:39: eval: suite 'evals/demo.yaml' not found")
    assert err.rstrip().endswith("(demo, study; `ccft recipes list`)")
    # a packaged recipe by name
    rc, out, err = cli(["train", "math-gsm8k", "--dry-run", *small], capsys)
    assert (rc, err) == (0, "") and "train rows=6 " in out
    assert recipe_argument("math-gsm8k") == str(PACKAGE_DIR / "math-gsm8k.yaml")
    assert recipe_argument("missing.yaml") == "missing.yaml"


def test_eval_suite_by_packaged_name():
    from ccft.evals.suite import load_suite

    assert load_suite("demo").tasks == load_suite(ROOT / "evals" / "demo.yaml").tasks
    assert [t.task for t in load_suite("study", "math").tasks] == ["gsm8k", "gsm-plus"]
