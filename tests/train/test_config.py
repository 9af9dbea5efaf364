"""Recipes and ``key=value`` overrides: every mistake is a ConfigError naming the key, before any model loads;
every bundled recipe parses, names its command in its first line and dry-runs one step on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ccft import ConfigError
from ccft.train.config import EvalConfig, TrainConfig, load_recipe, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
#: the training recipes (the study configs are tested in tests/evals: test_suite, test_frontier)
STUDY_CONFIGS = {"study.yaml", "frontier.yaml", "multipl-e.yaml"}
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name not in STUDY_CONFIGS)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "override, match",
    [
        ("learning_rat=1e-4", r"unknown key 'learning_rat'.*did you mean 'learning_rate'"),
        ("max_stepz=3", r"unknown key 'max_stepz'.*did you mean 'max_steps'"),
        ("max_steps=abc", r"'max_steps' expects int, got 'abc'"),
        ("per_device_train_batch_size=2.5", r"'per_device_train_batch_size' expects int"),
        ("learning_rate=fast", r"'learning_rate' expects float"),
        ("lora_r=[1, 2]", r"'lora_r' expects int"),
        ("method=sft", r"method='sft'.*ccft, full-ft"),
        ("decoder_kind=qlora", r"decoder_kind='qlora'.*lora, full"),
        ("dtype=float8", r"dtype='float8'"),
        ("handoff_tokens=0", r"handoff_tokens=0.*≥ 1"),
        ("handoff_tokens=-2", r"handoff_tokens=-2"),
        ("chat_template=maybe", r"chat_template='maybe'"),
        ("max_steps", r"override 'max_steps' is not key=value"),
        ("=3", r"override '=3' is not key=value"),
        ("lora_target_modules=[q_proj", r"lora_target_modules.*not a valid YAML value"),
        (
            "eval.nll_rowz=7",
            r"^command-line override eval.nll_rowz=7: unknown key 'nll_rowz'.*did you mean 'nll_rows'",
        ),
        ("eval.nll_rows=many", r"^command-line override eval.nll_rows=many.*'nll_rows' expects int"),
        ("eval.modes=[base, oracle]", r"eval.modes.*'oracle'"),
        ("train_data=/nonexistent/rows.jsonl", r"train_data.*/nonexistent/rows.jsonl"),
        ("eval_data=/nonexistent/test.jsonl", r"eval_data.*/nonexistent/test.jsonl"),
        ("train_data=gsm8k:validation", r"train_data.*unknown split 'validation'"),
    ],
)
def test_bad_override_is_a_config_error_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(None, [override])


def test_override_errors_name_the_override_not_the_recipe_file(capsys):
    """A bad key given on the command line is named as that override (not blamed on the recipe file); the
    help lists the eval: keys too."""
    from ccft.cli.main import main

    with pytest.raises(
        ConfigError,
        match=r"^command-line override eval.nll_row=5: unknown key 'nll_row'; did you "
        r"mean 'nll_rows'",
    ):
        load_recipe(ROOT / "recipes" / "demo.yaml", ["eval.nll_row=5"])
    with pytest.raises(ConfigError, match=r"^command-line override max_step=3: unknown key 'max_step'"):
        load_recipe(ROOT / "recipes" / "demo.yaml", ["max_step=3"])
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "eval.nll_rows" in out and "held-out rows" in out and "handoff_tokens" in out


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_recipe(tmp_path / "nope.yaml")

    listing = tmp_path / "list.yaml"
    listing.write_text("- max_steps: 3\n- lora_r: 4\n")
    with pytest.raises(ConfigError, match=r"list\.yaml:1: a recipe is a mapping of keys to values, got list"):
        load_recipe(listing)

    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(
        ConfigError, match=r"scalar\.yaml:1: a recipe is a mapping of keys to values, got str"
    ):
        load_recipe(scalar)

    broken = tmp_path / "broken.yaml"
    broken.write_text("max_steps: [1, 2\nlora_r: 4\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:2:\d+: not valid YAML"):
        load_recipe(broken)

    typo = tmp_path / "typo.yaml"
    typo.write_text("# ccft train typo.yaml\nlora_alpah: 8\n")
    with pytest.raises(
        ConfigError, match=r"typo\.yaml:2: unknown key 'lora_alpah'.*did you mean 'lora_alpha'"
    ):
        load_recipe(typo)

    bad_eval = tmp_path / "bad_eval.yaml"
    bad_eval.write_text("eval:\n  em_rowz: 5\n")
    with pytest.raises(ConfigError, match=r"bad_eval\.yaml:2: unknown key 'em_rowz'"):
        load_recipe(bad_eval)

    bad_data = tmp_path / "bad_data.yaml"
    bad_data.write_text(f"train_data: {tmp_path / 'missing.jsonl'}\n")
    with pytest.raises(ConfigError, match=r"bad_data\.yaml:1: train_data: .*missing\.jsonl"):
        load_recipe(bad_data)


def test_errors_are_raised_before_any_model_loads(monkeypatch):
    import ccft.core.models

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ccft.core.models, "load_base", boom)
    monkeypatch.setattr(ccft.core.models, "convert_embedded", boom)
    with pytest.raises(ConfigError, match="max_steps"):
        load_recipe(None, ["max_steps=abc"])
    load_recipe(None, ["max_steps=3"])  # the default (embedded) base is not touched by parsing either


def test_train_config_validates_directly():
    with pytest.raises(ConfigError, match="method"):
        TrainConfig(output_dir="x", method="dpo", report_to="none")
    with pytest.raises(ConfigError, match="handoff_tokens"):
        TrainConfig(output_dir="x", handoff_tokens=0, report_to="none")


# ------------------------------------------------------------------ parsing


def test_overrides_parse_yaml_scalars():
    assert parse_overrides(
        ["learning_rate=1e-4", "lora_target_modules=[q_proj,v_proj]", "eval.nll_rows=7", "system_prompt=a=b"]
    ) == {
        "learning_rate": "1e-4",  # YAML 1.1 reads 1e-4 as a string; the typed field converts it (below)
        "lora_target_modules": ["q_proj", "v_proj"],
        "eval": {"nll_rows": 7},
        "system_prompt": "a=b",
    }
    cfg, ecfg, raw = load_recipe(
        None,
        [
            "learning_rate=1e-4",
            "lora_target_modules=[q_proj,v_proj]",
            "eval.nll_rows=7",
            "max_steps=12",
            "lora_dropout=0",
            "gradient_checkpointing=true",
            "save_strategy=no",
            "eval_data=gsm8k:test",
        ],
    )
    assert isinstance(cfg.learning_rate, float) and cfg.learning_rate == 1e-4
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert isinstance(ecfg, EvalConfig) and ecfg.nll_rows == 7 and ecfg.em_rows == EvalConfig().em_rows
    assert cfg.max_steps == 12 and cfg.lora_dropout == 0
    assert cfg.gradient_checkpointing is True
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert str(cfg.save_strategy.value) == "no"  # `no` is a save strategy, not YAML false
    assert cfg.report_to in ("none", [], ["none"])  # no tracker unless asked
    assert raw["learning_rate"] == 1e-4 and raw["eval"] == {"nll_rows": 7}


def test_values_convert_as_hf_argument_parser_converts_the_command_line(tmp_path):
    """A recipe value means what ``--key=value`` means to ``transformers.HfArgumentParser`` (the
    reference)."""
    from transformers import HfArgumentParser

    cli = [
        "--learning_rate=3e-4",
        "--max_steps=7",
        "--save_strategy=steps",
        "--save_steps=5",
        "--lr_scheduler_type=cosine",
        "--gradient_checkpointing=true",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--chat_template=false",
        "--eval_rows=3",
        "--use_cpu=yes",
        "--warmup_steps=2",
        "--report_to=none",
    ]
    (want,) = HfArgumentParser(TrainConfig).parse_args_into_dataclasses(cli)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "learning_rate: 3e-4\nmax_steps: 7\nsave_strategy: steps\nsave_steps: 5\n"
        "lr_scheduler_type: cosine\ngradient_checkpointing: true\nlora_target_modules: [q_proj, v_proj]\n"
        "chat_template: false\neval_rows: 3\nuse_cpu: yes\nwarmup_steps: 2\n"
    )
    got, _, raw = load_recipe(recipe)
    for key in (
        "learning_rate",
        "max_steps",
        "save_strategy",
        "save_steps",
        "lr_scheduler_type",
        "gradient_checkpointing",
        "lora_target_modules",
        "chat_template",
        "eval_rows",
        "use_cpu",
        "warmup_steps",
        "report_to",
    ):
        assert getattr(got, key) == getattr(want, key), key
    assert got.learning_rate == 3e-4 and got.max_steps == 7 and got.chat_template_flag is False
    assert got.lora_target_modules == ["q_proj", "v_proj"] and got.use_cpu is True
    # The recorded recipe holds plain values (enum choices as their text) for ccft.json.
    assert (
        raw["save_strategy"] == "steps"
        and raw["lr_scheduler_type"] == "cosine"
        and raw["chat_template"] == "false"
    )
    # A value the parser refuses names the key, where it was set (here the command line) and the parser's
    # reason.
    with pytest.raises(
        ConfigError,
        match=r"^command-line override save_strategy=sometimes: key 'save_strategy' "
        r"expects .*invalid choice: 'sometimes'",
    ):
        load_recipe(recipe, ["save_strategy=sometimes"])
    with pytest.raises(ConfigError, match=r"key 'eval_data' expects str \| None, got \['a'\]"):
        load_recipe(recipe, ["eval_data=[a]"])


def test_override_text_with_a_colon_stays_text():
    cfg, _, _ = load_recipe(None, ["system_prompt=Answer: briefly, then give #### N", "chat_template=true"])
    assert cfg.system_prompt == "Answer: briefly, then give #### N" and cfg.chat_template_flag is True
    cfg, _, _ = load_recipe(None, ["system_prompt=Put the answer after #### please"])  # not a YAML comment
    assert cfg.system_prompt == "Put the answer after #### please"
    cfg, _, _ = load_recipe(None, ["system_prompt='quoted: text'"])
    assert cfg.system_prompt == "quoted: text"
    cfg, _, _ = load_recipe(None, ["columns={prompt: q, response: a}"])
    assert cfg.columns == {"prompt": "q", "response": "a"}


def test_overrides_replace_recipe_values(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "# ccft train r.yaml\nlearning_rate: 2.0e-4\nmax_steps: 5\nlora_r: 8\n"
        "eval:\n  nll_rows: 3\n  modes: [base, prefillshare]\n"
    )
    cfg, ecfg, raw = load_recipe(recipe, ["max_steps=9", "eval.em_rows=2"])
    assert cfg.learning_rate == 2e-4 and cfg.max_steps == 9 and cfg.lora_r == 8
    assert ecfg.nll_rows == 3 and ecfg.em_rows == 2 and ecfg.modes == ["base", "prefillshare"]
    assert raw["max_steps"] == 9 and raw["eval"] == {
        "nll_rows": 3,
        "modes": ["base", "prefillshare"],
        "em_rows": 2,
    }


# ------------------------------------------------------------------ bundled recipes


def test_recipes_folder_has_recipes():
    names = {p.name for p in RECIPES}
    assert len(RECIPES) >= 2, names
    assert {"demo.yaml", "math-gsm8k.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_parses_names_its_command_and_dry_runs(recipe, tmp_path, tiny_dir):
    lines = recipe.read_text().splitlines()
    assert lines and lines[0].startswith("#"), f"{recipe.name} must open with a comment naming its command"
    commands = (f"ccft train recipes/{recipe.name}", "make demo")
    assert any(c in lines[0] for c in commands), f"{recipe.name}: first line {lines[0]!r} lacks {commands}"

    cfg, ecfg, raw = load_recipe(recipe)  # parses as shipped
    assert cfg.method in ("ccft", "full-ft") and raw

    from ccft.train.run import setup

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # eval_rows: a recipe that evaluates at the end of training scores 4 held-out rows, not hundreds.
        cfg, ecfg, raw = load_recipe(
            recipe,
            [
                f"base={tiny_dir}",
                "train_rows=6",
                "max_steps=1",
                f"output_dir={tmp_path / 'run'}",
                "eval_rows=4",
            ],
        )
        base, decoder, train_set, eval_set, trainer = setup(cfg)
        assert len(train_set) == 6
        out = trainer.train()
    finally:
        torch.set_num_threads(before)
    assert trainer.state.global_step == 1
    assert math.isfinite(out.training_loss) and out.training_loss > 0, out.training_loss
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert all(math.isfinite(v) and v > 0 for v in evals), evals
