"""MultiPL-E generation stops at the language's stop tokens, as MultiPL-E's own harness does, and is scored on
the same text as a generation decoded on to ``max_new_tokens`` and cut afterwards (the study's route:
``decode_ahead`` into an ``EvalMemo``)."""

from __future__ import annotations

import pytest

from ccft.core.errors import DataError
from ccft.evals import multipl_e
from ccft.evals.generation import EvalMemo
from ccft.evals.multipl_e import MULTIPL_E_LANGUAGES, MultiPLETask, language_stop
from ccft.evals.protocol import task_stop
from ccft.evals.runner import EvalSettings, ModeSpec, decode_ahead
from ccft.evals.scoring import prepare
from ccft.evals.tasks import get_task

NEVER = ("\x00\x01",)  # a stop string the tokenizer never decodes to: the generation runs to max_new_tokens


@pytest.mark.parametrize("lang", MULTIPL_E_LANGUAGES)
def test_task_stop_is_the_stop_tokens_of_every_row(lang):
    task = get_task(f"multipl-e-{lang}")
    items = task.load()
    assert task.stop and task.stop == language_stop(lang)
    assert all(it.metadata["stop"] == task.stop and task_stop(task, it) == list(task.stop) for it in items)
    assert task.describe()["stop"] == list(task.stop)  # recorded in every run's settings (meta.json)


def test_rows_that_disagree_on_stop_tokens_are_refused(monkeypatch):
    monkeypatch.setattr(
        multipl_e, "_rows", lambda lang: ({"stop_tokens": ["\n}"]}, {"stop_tokens": ["\nend"]})
    )
    with pytest.raises(DataError, match="multipl-e-cpp.*stop_tokens differ"):
        language_stop("cpp")


def _generate(task, base, tmp_path, max_new=24, limit=4):
    """Greedy base-mode texts of the first ``limit`` items through the study's route (decode_ahead into a
    memo)."""
    settings = EvalSettings(limit=limit, max_new_tokens=max_new, engine=True)
    spec = ModeSpec("base")
    memo = EvalMemo()
    decode_ahead(
        [(task, settings)],
        base,
        [spec],
        tmp_path / str(abs(hash(task.stop))),
        memo=memo,
        batch_size=4,
        progress=False,
    )
    prep = prepare(task, base.tokenizer, limit)
    out = []
    for item, prompt in zip(prep.items, prep.prompts, strict=True):
        hit = memo.get(spec, prompt, tuple(task_stop(task, item)), max_new, 1)
        assert hit is not None, "decode_ahead generated every item"
        out.append((item, *hit))
    return out


def test_stopping_at_the_stop_strings_scores_the_same_text_as_cutting_afterwards(tiny_base, tmp_path):
    full = _generate(MultiPLETask(name="multipl-e-lua", language="lua", stop=NEVER), tiny_base, tmp_path)
    assert all(reason == "length" and n == 24 for _, _, reason, n in full)
    # the language's own stop tokens, and one cut out of the first generation so that a stop surely happens
    text0 = full[0][1]
    assert len(text0) >= 6
    crafted = (text0[3:6],)
    for stop in (language_stop("lua"), crafted):
        task = MultiPLETask(name="multipl-e-lua", language="lua", stop=stop)
        stopped = _generate(task, tiny_base, tmp_path)
        for (item, t_full, _, n_full), (_, t_stop, reason, n_stop) in zip(full, stopped, strict=True):
            assert task.postprocess(item, t_stop) == task.postprocess(item, t_full)
            assert n_stop <= n_full
            assert (reason == "stop") == any(s in t_full for s in stop)
    assert stopped[0][2] == "stop" and stopped[0][3] < 24  # the crafted stop cut the first row short
