"""Task API: registry, K7 (truncation, no doubled prompt, GSM-Plus golden table), K8 gates, pass@k, BFCL,
tools data."""

from __future__ import annotations

import json
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

from ccft.core.errors import DataError
from ccft.evals import bfcl, task_base, tasks
from ccft.evals.gsm_plus import (
    ABSTAIN,
    PERTURBATION_TYPES,
    abstains,
    extract_plus_flexible,
    extract_plus_strict,
    parse_answer,
)
from ccft.evals.humaneval import HUMANEVAL_STOP, extract_code_block
from ccft.evals.tasks import TASKS, Item, get_task, pass_at_k_summary, truncate_at_stop
from ccft.evals.tool_calls import format_tool_call, glaive_to_rows, openai_tool, parse_tool_calls

EXPECTED_TASKS = {"gsm8k", "gsm-plus", "humaneval", "humaneval-plus", "bfcl-multiple"} | {
    f"multipl-e-{lang}"
    for lang in ("cpp", "java", "js", "ts", "go", "rs", "php", "rb", "pl", "lua", "r", "sh")
}


# ------------------------------------------------------------------ registry and API


def test_registry_holds_every_task_with_declared_settings():
    assert set(TASKS) == EXPECTED_TASKS
    for name in EXPECTED_TASKS:
        task = get_task(name)
        d = task.describe()
        assert d["task"] == name and d["metrics"] and d["license"] and d["max_new_tokens"] > 0
        assert task.prompt_style in ("chat", "completion")


def test_registry_reexports_the_task_api_and_lists_names():
    for name in (
        "Item",
        "Task",
        "EnvironmentCheckError",
        "data_dir",
        "data_rows",
        "read_jsonl",
        "truncate_at_stop",
        "pass_at_k_summary",
        "sample_counts",
    ):
        assert getattr(tasks, name) is getattr(task_base, name)
    assert tasks.task_names() == sorted(EXPECTED_TASKS)
    with pytest.raises(ValueError, match="needs a name"):
        tasks.register_task(task_base.Task())


def test_read_jsonl_plain_gz_and_errors(tmp_path):
    import gzip

    he = task_base.data_rows("humaneval/HumanEval.jsonl.gz")
    with gzip.open(task_base.data_dir() / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        assert he == [json.loads(line) for line in f if line.strip()]
    assert len(he) == 164 and he[0]["task_id"] == "HumanEval/0"
    bfcl_rows = task_base.data_rows("bfcl/BFCL_v4_multiple.json")  # JSON Lines despite the suffix
    assert len(bfcl_rows) == 200 and bfcl_rows[0]["id"] == "multiple_0"
    (tmp_path / "ok.jsonl").write_text('{"a": 1}\n\n  \n{"a": 2}\n', encoding="utf-8")
    assert task_base.read_jsonl(tmp_path / "ok.jsonl") == [{"a": 1}, {"a": 2}]
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON line"):
        task_base.read_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        task_base.data_rows("no/such/file.jsonl")


class _BosTokenizer:
    """Adds BOS (id 1) like a Llama tokenizer; the text's own leading ``<s>`` is one more BOS."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        if text.startswith("<s>"):
            ids.append(1)
            text = text[3:]
        return {"input_ids": ids + [ord(c) for c in text]}


def test_completion_prompt_keeps_one_bos():
    task = get_task("humaneval")
    tok = _BosTokenizer()
    assert task.prompt_ids(tok, Item("a", "<s>ab", None)) == [1, 97, 98]  # doubled BOS kept once (K6)
    assert task.prompt_ids(tok, Item("b", "ab", None)) == [1, 97, 98]
    with pytest.raises(DataError, match="completion prompts must be strings"):
        task.prompt_ids(tok, Item("c", [{"role": "user", "content": "x"}], None))


def test_get_task_overrides_and_errors():
    t = get_task("humaneval", samples=5, timeout_s=3.0)
    assert (t.samples, t.timeout_s) == (5, 3.0)
    assert get_task("humaneval").samples == 1  # the registered task is untouched
    assert get_task("humaneval", prompt_style="chat").stop == ()
    with pytest.raises(KeyError, match="unknown task"):
        get_task("no-such-task")
    with pytest.raises(TypeError, match="unknown setting"):
        get_task("gsm8k", temperature=0.3)


@pytest.mark.parametrize("name", sorted(EXPECTED_TASKS))
def test_items_load_with_stable_unique_ids(name):
    items = get_task(name).load(limit=5)
    assert len(items) == 5
    assert len({it.id for it in get_task(name).load()}) == len(get_task(name).load())
    assert [it.id for it in items] == [it.id for it in get_task(name).load(limit=5)]


def test_prompt_ids_completion_vs_chat(tokenizer):
    he = get_task("humaneval")
    item = he.load(1)[0]
    ids = he.prompt_ids(tokenizer, item)
    assert tokenizer.decode(ids) == item.prompt  # raw prompt, no chat markers
    chat = get_task("humaneval", prompt_style="chat")
    text = tokenizer.decode(chat.prompt_ids(tokenizer, item))
    assert "<|im_start|>user" in text and item.prompt in text and text.endswith("<|im_start|>assistant\n")
    gsm = get_task("gsm-plus")
    g = gsm.load(1)[0]
    assert g.prompt in tokenizer.decode(gsm.prompt_ids(tokenizer, g))


# ------------------------------------------------------------------ K7: stop strings and prompts


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("    return x\ndef g():\n    pass", HUMANEVAL_STOP, "    return x"),
        (
            "    if x:\n        return 1\n    return 2\nif __name__ == '__main__':",
            HUMANEVAL_STOP,
            "    if x:\n        return 1\n    return 2",
        ),
        ("    # comment kept\n    return 1\n# cut", HUMANEVAL_STOP, "    # comment kept\n    return 1"),
        ("\tx = 1\n\treturn x\nprint(f())", HUMANEVAL_STOP, "\tx = 1\n\treturn x"),
        ("    return 1", HUMANEVAL_STOP, "    return 1"),
        ("abcSTOPdefEND", ("END", "STOP"), "abc"),
        ("", HUMANEVAL_STOP, ""),
    ],
)
def test_truncation_keeps_indentation(text, stop, expected):
    out = truncate_at_stop(text, stop)
    assert out == expected
    assert truncate_at_stop(out, stop) == out  # idempotent: generator cut + task cut agree


def test_humaneval_program_contains_prompt_once():
    task = get_task("humaneval")
    item = task.load(1)[0]
    body = item.reference
    for gen in (body, item.prompt + body):  # a continuation that echoes the prompt is cut back
        program, _ = task.build_program(item, task.postprocess(item, gen))
        assert program.count(item.prompt) == 1
        assert program.count(f"def {item.metadata['entry_point']}(") == 1
    assert task.score(item, item.prompt + body) == {"passed": 1.0, "compiles": 1.0}


def test_humaneval_first_line_indentation_survives_scoring():
    task = get_task("humaneval")
    item = task.load(3)[2]  # HumanEval/2 truncate_number
    assert task.score(item, "    return number % 1.0\n\ndef extra():\n    pass\n") == {
        "passed": 1.0,
        "compiles": 1.0,
    }
    # lost indentation: a module-level return, a compile-time error
    assert task.score(item, "return number % 1.0\n") == {"passed": 0.0, "compiles": 0.0}


def test_humaneval_chat_style_extracts_code_block():
    task = get_task("humaneval", prompt_style="chat")
    item = task.load(3)[2]
    reply = (
        "Sure!\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\nDone."
    )
    assert extract_code_block(reply).startswith("def truncate_number")
    assert task.score(item, reply)["passed"] == 1.0


# ------------------------------------------------------------------ K8: canonical solutions here


def test_humaneval_canonical_solutions_pass_in_this_environment():
    report = get_task("humaneval").check_environment(limit=12)
    assert report["ok"] and report["canonical_passed"] == report["canonical_total"] == 12
    assert report["known_bad_passed"] == []


def test_humaneval_environment_check_names_the_failing_canonical_solution(monkeypatch):
    """A canonical solution that fails here raises the check's own error naming it (not a crash while
    reporting it: the known-bad run that follows must not replace the canonical results)."""
    from ccft.evals.humaneval import HumanEvalTask
    from ccft.evals.task_base import EnvironmentCheckError

    task = get_task("humaneval")
    real = HumanEvalTask._canonical_pairs

    def broken_first(self, items):
        pairs = real(self, items)
        return [(pairs[0][0], "    return None\n")] + pairs[1:]

    monkeypatch.setattr(HumanEvalTask, "_canonical_pairs", broken_first)
    with pytest.raises(EnvironmentCheckError, match=r"canonical solutions failed.*\['HumanEval/0'\]"):
        task.check_environment(limit=6)


def test_humaneval_plus_canonical_and_extended_tests():
    task = get_task("humaneval-plus")
    report = task.check_environment(limit=3)
    assert report["ok"] and report["canonical_passed"] == 3
    items = task.load(3)
    assert all(len(it.metadata["inputs"]) > it.metadata["n_base"] for it in items)  # plus inputs present
    # HumanEval/0 with `<=` passes the 7 original asserts but not EvalPlus's extended inputs
    item = items[0]
    weak = (
        "    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
        "            if abs(a - b) <= threshold:\n                return True\n    return False\n"
    )
    assert get_task("humaneval").score(get_task("humaneval").load(1)[0], weak)["passed"] == 1.0
    assert task.score(item, weak)["passed"] == 0.0


# ------------------------------------------------------------------ pass@k


def _closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (5, 0), (5, 5), (5, 2), (10, 3), (20, 1), (20, 19)])
def test_pass_at_k_summary_matches_closed_form(n, c):
    per_item = {"a": [{"passed": 1.0}] * c + [{"passed": 0.0}] * (n - c)}
    out = pass_at_k_summary(per_item, ks=(1, 2, 5, 10, 100))
    for k in (1, 2, 5, 10, 100):
        if k > n:
            assert f"pass@{k}" not in out  # undefined for k > n: not reported
        else:
            assert out[f"pass@{k}"] == pytest.approx(_closed_form(n, c, k), abs=1e-12)
    if c == 0:
        assert out["pass@1"] == 0.0
    if c == n:
        assert all(v == 1.0 for v in out.values())


def test_code_task_aggregate_over_items():
    task = get_task("humaneval", samples=10)
    per_item = {"x": [{"passed": 1.0}] * 3 + [{"passed": 0.0}] * 7, "y": [{"passed": 0.0}] * 10}
    agg = task.aggregate(per_item)
    assert agg["pass@1"] == pytest.approx((0.3 + 0.0) / 2)
    assert agg["pass@10"] == pytest.approx((_closed_form(10, 3, 10) + 0.0) / 2) == 0.5
    assert "pass@100" not in agg and agg["n_items"] == 2 and agg["n_samples"] == 20
    assert task.per_item_scores(per_item) == {"x": 0.3, "y": 0.0}


# ------------------------------------------------------------------ GSM-Plus

# (generation, reference answer, strict, flexible)
GSM_PLUS_GOLDEN = [
    ("So 8,000 in total.\n#### 8,000", "8000", 1.0, 1.0),
    ("#### 3.2", "3.2", 1.0, 1.0),
    ("The average is 3.20 inches.", "3.2", 0.0, 1.0),
    ("#### 1/4", "1/4", 1.0, 1.0),
    ("She keeps 0.25 of it.\n#### 0.25", "1/4", 1.0, 1.0),
    ("10/2 = 5 so 1/4 remains", "1/4", 0.0, 1.0),
    ("#### 1/0", "1/4", 0.0, 0.0),
    ("#### $1,325", "1325", 1.0, 1.0),
    ("It drops to -3 degrees.\n#### -3", "-3", 1.0, 1.0),
    ("#### 5\nbut maybe 6", "5", 1.0, 0.0),
    ("We don't know the average height of heels.\n#### None", "None", 1.0, 1.0),
    ("The question does not specify the price, so it cannot be determined.", "None", 1.0, 1.0),
    ("#### None", "None", 1.0, 1.0),
    ("We cannot determine it, but guessing:\n#### 12", "None", 0.0, 1.0),
    ("The answer is 12.\n#### 12", "None", 0.0, 0.0),
    ("I computed 7 apples.", "None", 0.0, 0.0),
    ("Nonetheless the answer is 4.", "None", 0.0, 0.0),  # "none" only as a whole word
    ("#### None", "4", 0.0, 0.0),
]


@pytest.mark.parametrize(
    ("text", "answer", "strict", "flexible"), GSM_PLUS_GOLDEN, ids=[repr(g[0])[:30] for g in GSM_PLUS_GOLDEN]
)
def test_gsm_plus_golden(text, answer, strict, flexible):
    task = get_task("gsm-plus")
    ptype = "critical thinking" if answer == "None" else "digit expansion"
    item = Item("x", "q", "solution", {"answer": answer, "perturbation_type": ptype, "seed_answer": "1"})
    s = task.score(item, text)
    assert (s["exact_match_strict"], s["exact_match_flexible"]) == (strict, flexible)
    assert s[f"exact_match_strict[{ptype}]"] == strict


def test_gsm_plus_extractors():
    assert parse_answer("None") is ABSTAIN and parse_answer("5/8") == Fraction(5, 8)
    assert parse_answer("3.2") == Fraction(16, 5) and parse_answer("-4") == -4
    assert extract_plus_strict("#### none of them") is ABSTAIN
    assert extract_plus_strict("no marker 5") is None
    assert extract_plus_flexible("ratio 3/4 then 8,000") == 8000
    assert extract_plus_flexible("nothing here") is None
    assert abstains("There isn't enough info: we can't determine it") and not abstains("It is 5.")


def test_gsm_plus_every_reference_solution_scores_correct():
    """All 2,400 rows: answers parse (numbers, 7 fractions, 300 None) and each row's own solution is right."""
    task = get_task("gsm-plus")
    items = task.load()
    assert len(items) == 2400
    kinds = {"None": 0, "fraction": 0}
    per_item = {}
    for it in items:
        ans = it.metadata["answer"]
        kinds["None"] += ans == "None"
        kinds["fraction"] += "/" in ans
        per_item[it.id] = [task.score(it, task.reference_text(it))]
    assert kinds == {"None": 300, "fraction": 7}
    agg = task.aggregate(per_item)
    for t in PERTURBATION_TYPES:
        assert agg[f"exact_match_strict[{t}]"] == 1.0
    assert agg["exact_match_strict"] == 1.0 and agg["n_items"] == 2400


def test_gsm_plus_limit_covers_every_type():
    items = get_task("gsm-plus").load(limit=16)
    types = [it.metadata["perturbation_type"] for it in items]
    assert sorted(set(types)) == sorted(PERTURBATION_TYPES) and all(
        types.count(t) == 2 for t in PERTURBATION_TYPES
    )


def test_gsm8k_task_scores_reference():
    task = get_task("gsm8k")
    it = task.load(2)[1]
    assert task.score(it, it.reference) == {
        "exact_match_strict": 1.0,
        "exact_match_flexible": 1.0,
        "answer_format": 1.0,
    }
    assert task.score(it, "I give up") == {
        "exact_match_strict": 0.0,
        "exact_match_flexible": 0.0,
        "answer_format": 0.0,
    }


# ------------------------------------------------------------------ tool calls and BFCL


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [{"f": {"a": 1}}]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', [{"f": {"a": [1, 2]}}]),
        (
            '<tool_call>{"name": "a.b", "arguments": {}}</tool_call><tool_call>{"name": "g", '
            '"arguments": {"x": "y"}}',
            [{"a.b": {}}, {"g": {"x": "y"}}],
        ),
        ('{"name": "f", "arguments": {"a": 1}}', [{"f": {"a": 1}}]),
        ("<tool_call>not json</tool_call>", []),
        ("I cannot help with that.", []),
    ],
)
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == expected


def test_format_then_parse_roundtrip():
    text = format_tool_call("triangle_properties.get", {"side1": 5, "flags": [True, None]})
    assert parse_tool_calls(text) == [{"triangle_properties.get": {"side1": 5, "flags": [True, None]}}]


def test_bfcl_items_and_reference_calls():
    task = get_task("bfcl-multiple")
    items = task.load()
    assert len(items) == 200
    for it in items:
        ((name, _),) = it.reference[0].items()
        assert name in {f["name"] for f in it.metadata["functions"]}
        assert [next(iter(c)) for c in parse_tool_calls(task.reference_text(it))] == [name]
        assert all(t["type"] == "function" for t in it.metadata["tools"])
    tool = openai_tool(items[0].metadata["functions"][0])
    assert tool["function"]["parameters"]["type"] == "object"


def test_bfcl_prompt_shows_the_functions(tokenizer):
    task = get_task("bfcl-multiple")
    item = task.load(1)[0]
    text = tokenizer.decode(task.prompt_ids(tokenizer, item))
    for f in item.metadata["functions"]:
        assert f["name"] in text  # SmolLM2's template ignores tools=: they go into the system turn
    assert item.prompt[0]["content"] in text


@pytest.mark.skipif(
    bfcl.checker_python() is None, reason="BFCL checker env absent (python -m ccft.evals.bfcl setup)"
)
def test_bfcl_scored_by_its_ast_checker():
    task = get_task("bfcl-multiple")
    items = task.load(4)
    good = [(it, task.reference_text(it)) for it in items]
    wrong_fn = [(items[0], format_tool_call("not_a_function", {}))]
    ((name, args),) = items[1].reference[0].items()
    wrong_arg = [(items[1], format_tool_call(name, {k: "definitely wrong" for k in args}))]
    scores = task.score_many(good + wrong_fn + wrong_arg + [(items[2], "no call at all")])
    assert [s["accuracy"] for s in scores] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert [s["parsed"] for s in scores] == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_bfcl_without_checker_is_unavailable(monkeypatch):
    monkeypatch.setattr(bfcl, "checker_python", lambda: None)
    task = get_task("bfcl-multiple")
    item = task.load(1)[0]
    assert task.score(item, task.reference_text(item)) == {"available": 0.0}
    report = task.check_environment()
    assert report["available"] is False and "setup" in report["reason"]


def test_glaive_rows_convert_one_row_per_assistant_turn():
    from ccft.train.config import resolve_data

    # the bundled rows' source, first 12 conversations (tests/fixtures/glaive/README.md): always checked
    src = json.loads(
        (
            Path(__file__).resolve().parents[1]
            / "fixtures"
            / "glaive"
            / "glaive_toolcall_en_demo_head12.json"
        ).read_text(encoding="utf-8")
    )
    path, _ = resolve_data("glaive-tools:train")
    rows = [json.loads(x) for x in open(path)]
    assert len(rows) == 957
    calls = [r for r in rows if r["messages"][-1]["content"].startswith("<tool_call>")]
    assert len(calls) == 211
    for r in rows:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][0]["role"] == "user"
        assert all(t["type"] == "function" for t in r["tools"])
    for r in calls:
        assert len(parse_tool_calls(r["messages"][-1]["content"])) == 1
    head = [r for r in rows if r["source_row"] < len(src)]
    assert (len(src), len(head), sum(r in calls for r in head)) == (12, 41, 8)
    assert glaive_to_rows(src) == head


def test_tools_reach_the_prompt_for_any_template(tokenizer):
    from ccft.core.tokens import tokenize_prompt

    tools = [
        openai_tool(
            {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {
                    "type": "dict",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            }
        )
    ]
    text = tokenizer.decode(tokenize_prompt(tokenizer, "Weather in Paris?", tools=tools))
    assert "get_weather" in text and "<tool_call>" in text  # fallback system turn (SmolLM2 ignores tools)
    assert text.count("<|im_start|>system") == 1
    native = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    native.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
        "assistant:{% endif %}"
    )
    ntext = native.decode(tokenize_prompt(native, "Weather in Paris?", tools=tools))
    assert ntext.startswith("TOOLS:") and "get_weather" in ntext and "<tool_call>" not in ntext
