"""Evaluation suites (evals/*.yaml): one declaration read by ``ccft eval --suite``, ``ccft demo`` and ``ccft
study`` (docs/evaluation.md, "Suites")."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ccft.core.errors import ConfigError
from ccft.core.modes import MODES
from ccft.evals.suite import SuiteTask, load_suite

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_reads_its_suite():
    from ccft.train.config import EvalConfig, load_recipe

    _, ecfg, raw = load_recipe(ROOT / "recipes" / "demo.yaml")
    suite = load_suite(ROOT / "evals" / "demo.yaml")
    assert suite.tasks == (SuiteTask("gsm8k", 100, 50, 256),)
    t = suite.tasks[0]
    assert (ecfg.task, ecfg.nll_rows, ecfg.em_rows, ecfg.max_new_tokens) == (
        t.task,
        t.limit,
        t.generate_limit,
        t.max_new_tokens,
    )
    assert (ecfg.batch_size, ecfg.bootstrap, tuple(ecfg.modes)) == (25, 2000, tuple(MODES))
    assert ecfg != EvalConfig()  # the suite's values, not the dataclass defaults
    # the run records the resolved settings (a finished demo run is reused with the same ccft.json)
    assert raw["eval"]["nll_rows"] == 100 and "suite" not in raw["eval"]
    _, ecfg, _ = load_recipe(ROOT / "recipes" / "demo.yaml", ["eval.em_rows=5"])
    assert ecfg.em_rows == 5 and ecfg.nll_rows == 100  # eval.KEY overrides go over the suite


def test_the_study_reads_its_suite():
    from ccft.evals.study.config import load_study_config

    cfg = load_study_config(ROOT / "recipes" / "study.yaml")
    assert cfg.suite == "evals/study.yaml" and cfg.batch_size == 64 and cfg.sweep_limit == 40
    for name, spec in cfg.specialists.items():
        part = load_suite(ROOT / "evals" / "study.yaml", name)
        assert part.specialist == name and set(part.specialists) == {"math", "code", "tools"}
        assert [(t.task, t.limit, t.max_new_tokens) for t in part.tasks] == spec.task_list()
        assert spec.recipe.startswith("recipes/") and spec.train  # training stays in the study config
    assert [t.task for t in load_suite(ROOT / "evals" / "study.yaml", "math").tasks] == ["gsm8k", "gsm-plus"]
    over = load_study_config(ROOT / "recipes" / "study.yaml", ["specialists.math.tasks.gsm8k.limit=7"])
    assert over.specialists["math"].tasks["gsm8k"].limit == 7  # dotted overrides reach the suite's keys
    assert over.specialists["math"].tasks["gsm-plus"].limit == 100


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_bad_suites_are_refused_naming_the_file(tmp_path):
    study = ROOT / "evals" / "study.yaml"
    with pytest.raises(ConfigError, match="choose one with --specialist"):
        load_suite(study)
    with pytest.raises(ConfigError, match="no specialist 'chef'"):
        load_suite(study, "chef")
    bad = _write(tmp_path / "s.yaml", "task: gsm8k\nnll_rowz: 3\n")
    with pytest.raises(ConfigError, match=r"s\.yaml:2: unknown key 'nll_rowz'; did you mean 'nll_rows'"):
        load_suite(bad)
    bad = _write(tmp_path / "t.yaml", "specialists:\n  m:\n    tasks: {no-such-task: {limit: 3}}\n")
    with pytest.raises(ConfigError, match=r"t\.yaml: specialists\.m\.tasks\.no-such-task: unknown task"):
        load_suite(bad)
    bad = _write(tmp_path / "u.yaml", "specialists:\n  m:\n    recipe: r.yaml\n    tasks: {gsm8k: {}}\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['recipe'\]"):
        load_suite(bad)
    with pytest.raises(ConfigError, match="has no specialists .* drop --specialist"):
        load_suite(ROOT / "evals" / "demo.yaml", "math")
    with pytest.raises(ConfigError, match="evaluation suite .*nope.yaml does not exist"):
        load_suite(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"e\.yaml: an empty evaluation suite; declare at least `task:`"):
        load_suite(_write(tmp_path / "e.yaml", ""))
    with pytest.raises(ConfigError, match=r"o\.yaml: task: unknown task 'gsm9k'; known tasks: "):
        load_suite(_write(tmp_path / "o.yaml", "task: gsm9k\n"))
    with pytest.raises(ConfigError, match=r"l\.yaml:1: an evaluation suite is a mapping"):
        load_suite(_write(tmp_path / "l.yaml", "- task: gsm8k\n"))


def test_a_recipe_naming_a_missing_or_bad_suite_fails_at_its_line(tmp_path):
    from ccft.train.config import load_recipe

    r = _write(tmp_path / "r.yaml", "base: smollm2-135m-instruct\nmax_steps: 2\neval: evals/none.yaml\n")
    with pytest.raises(ConfigError, match=r"r\.yaml:3: eval: suite 'evals/none.yaml' not found"):
        load_recipe(r)
    _write(tmp_path / "s.yaml", "task: gsm8k\nmodes: [base, shared]\n")
    r = _write(tmp_path / "r2.yaml", f"base: smollm2-135m-instruct\neval: {tmp_path / 's.yaml'}\n")
    with pytest.raises(ConfigError, match=r"s\.yaml: eval\.modes has unknown mode\(s\) \['shared'\]"):
        load_recipe(r)
    # a study config whose suite has tasks for a specialist it cannot train
    _write(tmp_path / "st.yaml", "specialists:\n  art:\n    tasks: {gsm8k: {limit: 2}}\n")
    cfg = _write(
        tmp_path / "study.yaml",
        f"suite: {tmp_path / 'st.yaml'}\nspecialists:\n  math: {{recipe: "
        f"{ROOT / 'recipes/math-gsm8k.yaml'}}}\n",
    )
    from ccft.evals.study.config import load_study_config

    with pytest.raises(ConfigError, match="specialists.art has tasks but .* has no recipe for it"):
        load_study_config(cfg)


def _args(**kw):
    base = dict(
        suite=None,
        specialist=None,
        task=None,
        limit=None,
        max_new_tokens=None,
        batch_size=None,
        bootstrap=None,
        seed=None,
        engine=None,
    )
    return argparse.Namespace(**(base | kw))


def test_command_line_options_go_over_the_suite():
    from ccft.cli.eval import eval_plan

    plan = eval_plan(_args(suite=str(ROOT / "evals" / "demo.yaml")))
    assert plan.tasks == (SuiteTask("gsm8k", 100, 50, 256),) and (plan.batch_size, plan.bootstrap) == (
        25,
        2000,
    )
    plan = eval_plan(_args(suite=str(ROOT / "evals" / "demo.yaml"), limit=3, batch_size=2, seed=4))
    assert plan.tasks == (SuiteTask("gsm8k", 3, 50, 256),) and (plan.batch_size, plan.seed) == (2, 4)
    plan = eval_plan(_args(task=["gsm8k", "gsm-plus"]))  # no suite: today's defaults
    assert [t.task for t in plan.tasks] == ["gsm8k", "gsm-plus"] and plan.tasks[0].limit is None
    assert (plan.batch_size, plan.bootstrap, plan.seed) == (8, 2000, 0)
    with pytest.raises(ConfigError, match="drop --task"):
        eval_plan(_args(suite=str(ROOT / "evals" / "demo.yaml"), task=["gsm8k"]))
    with pytest.raises(ConfigError, match="give --suite too"):
        eval_plan(_args(specialist="math"))


def test_the_decode_path_has_one_default_and_the_command_line_wins(tmp_path):
    """``engine``: EvalConfig's default (the engine) for the demo, a one-task suite and ``ccft eval`` without
    a suite; a suite's ``engine: false`` chooses the reference path; ``--engine`` / ``--no-engine`` win."""
    from ccft.cli.eval import add_parser, eval_plan
    from ccft.train.config import EvalConfig, load_recipe

    assert EvalConfig.engine is True
    _, ecfg, _ = load_recipe(ROOT / "recipes" / "demo.yaml")
    assert ecfg.engine is True and load_suite(ROOT / "evals" / "demo.yaml").engine is True
    _, ecfg, _ = load_recipe(ROOT / "recipes" / "demo.yaml", ["eval.engine=false"])
    assert ecfg.engine is False
    off = _write(tmp_path / "off.yaml", "task: gsm8k\nnll_rows: 3\nengine: false\n")
    assert load_suite(off).engine is False
    assert eval_plan(_args(task=["gsm8k"])).engine is True
    assert eval_plan(_args(suite=str(off))).engine is False
    assert eval_plan(_args(suite=str(off), engine=True)).engine is True
    assert eval_plan(_args(suite=str(ROOT / "evals" / "demo.yaml"), engine=False)).engine is False
    assert load_suite(ROOT / "evals" / "study.yaml", "math").engine is None  # the study always uses it
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    parse = sub.choices["eval"].parse_args
    assert [parse(a).engine for a in ([], ["--engine"], ["--no-engine"])] == [None, True, False]
    with pytest.raises(ConfigError, match=r"b\.yaml:2: key 'engine' expects bool.*; fix the value there$"):
        load_suite(_write(tmp_path / "b.yaml", "task: gsm8k\nengine: sometimes\n"))
