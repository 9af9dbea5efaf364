"""lm-eval's ``local-completions`` model (a client no one here wrote) against a running ``ccft serve``.

Offline: the tasks are written by this test into its temporary folder (YAML + local rows, no
download; ``HF_*_OFFLINE`` are set by conftest); lm-eval's tokenizer is the tiny model's folder
(``tokenizer_backend=huggingface``). Each task is run twice, through the server and through ccft's
in-process lm-eval model (``ccft.evals.lm_eval_model``, model ``ccft``) on the same items, and every
per-item loglikelihood, greedy flag, generated text and the task scores must agree:

* the base (``mode=base``): multiple choice with multi-token continuations, and generation;
* a LoRA CCFT decoder (``mode=prefillshare``): multiple choice with one-token continuations (the
  echo logprob of a prompt token is the decoder's on C_base of what precedes it, which is the
  in-process loglikelihood of a one-token continuation; docs/serving.md, "Log-probabilities"), and
  generation; longer continuations through the ccft extension ``echo_context_tokens`` (which
  lm-eval cannot send: checked with plain HTTP against the in-process model's loglikelihoods).
"""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

import ccft
from ccft.inference import SharedPrefillEngine
from ccft.serving.scheduler import Scheduler
from ccft.serving.server import BackgroundServer, create_app
from conftest import make_lora, make_tiny_folder

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

WAIT = 120.0

ROWS = [  # lm-eval joins context and choice with its target delimiter " "
    {
        "question": "What is 2 + 3?",
        "answer": "5",
        "letters": ["A", "B", "C"],
        "words": ["five apples", "six pears", "twenty three"],
        "label": 0,
    },
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in May?",
        "answer": "24",
        "letters": ["A", "B", "C"],
        "words": ["ninety six", "twenty four", "seventy two"],
        "label": 1,
    },
    {
        "question": "Which is larger, 7 or 70?",
        "answer": "70",
        "letters": ["A", "B"],
        "words": ["seven pears", "seventy apples"],
        "label": 1,
    },
    {
        "question": "Tom has 3 boxes of 4 pens. How many pens?",
        "answer": "12",
        "letters": ["A", "B", "C", "D"],
        "words": ["twelve pens", "seven boxes", "thirty four", "one pen"],
        "label": 0,
    },
]

UTILS = """
import json
from pathlib import Path


def load(**kwargs):
    import datasets

    rows = [json.loads(x) for x in (Path(__file__).parent / "rows.jsonl").read_text().splitlines() \
if x.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
"""

MC = """
task: {name}
custom_dataset: !function utils.load
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: {choices}
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN = """
task: clients_gen
custom_dataset: !function utils.load
output_type: generate_until
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lm_eval_client")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(UTILS)
    (tasks / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tasks / "letters.yaml").write_text(textwrap.dedent(MC.format(name="clients_letters", choices="letters")))
    (tasks / "words.yaml").write_text(textwrap.dedent(MC.format(name="clients_words", choices="words")))
    (tasks / "gen.yaml").write_text(textwrap.dedent(GEN))
    base_dir = make_tiny_folder(root / "base", tokenizer, seed=17, scale=8.0)
    base = ccft.load_base(str(base_dir))
    dec_dir = ccft.save_decoder(make_lora(base, "cc", 51, 4), root / "cc")
    # the server loads the same folders, as `ccft serve` would
    served_base = ccft.load_base(str(base_dir))
    engine = SharedPrefillEngine(served_base, decoders={"cc": str(dec_dir)})
    srv = BackgroundServer(create_app(Scheduler(engine), served_base.tokenizer)).start()
    for name in ("letters", "words"):  # the premise of each task: one-token vs multi-token continuations
        lens = {len(tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for r in ROWS for c in r[name]}
        assert (lens == {1}) == (name == "letters"), lens
    yield {"tasks": tasks, "base": base_dir, "decoder": dec_dir, "url": srv.url}
    srv.stop()


def _evaluate(setup, model: str, model_args: str, tasks: list[str]) -> dict:
    import ccft.evals.lm_eval_model  # noqa: F401  (registers "ccft")

    tm = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=tm, log_samples=True, bootstrap_iters=0
    )


def _served(setup, model: str, tasks: list[str]) -> dict:
    args = (
        f"model={model},base_url={setup['url']}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={setup['base']},max_retries=1,num_concurrent=1"
    )
    return _evaluate(setup, "local-completions", args, tasks)


def _same(served: dict, local: dict, tasks: list[str]) -> None:
    for task in tasks:
        a, b = served["samples"][task], local["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b]
        for sa, sb in zip(a, b, strict=True):
            assert sa["arguments"] == sb["arguments"]
            ra, rb = sa["filtered_resps"], sb["filtered_resps"]
            if isinstance(ra[0], (list, tuple)):  # loglikelihoods: (logprob, greedy) per choice
                assert [float(x[0]) for x in ra] == pytest.approx(
                    [float(x[0]) for x in rb], rel=1e-5, abs=1e-4
                )
                assert [bool(x[1]) for x in ra] == [bool(x[1]) for x in rb]
            else:  # generated text
                assert ra == rb
        metrics = {
            k: v for k, v in local["results"][task].items() if k.endswith(",none") and "stderr" not in k
        }
        assert metrics and all(served["results"][task][k] == pytest.approx(v) for k, v in metrics.items())


def test_base_multi_token_choices_and_generation(setup):
    tasks = ["clients_words", "clients_gen"]
    served = _served(setup, "base", tasks)
    local = _evaluate(setup, "ccft", f"base={setup['base']},mode=base,batch_size=3", tasks)
    _same(served, local, tasks)


def test_prefillshare_decoder_one_token_choices_and_generation(setup):
    tasks = ["clients_letters", "clients_gen"]
    served = _served(setup, "cc", tasks)
    local = _evaluate(setup, "ccft", f"decoder={setup['decoder']},mode=prefillshare,batch_size=3", tasks)
    _same(served, local, tasks)


def test_echo_context_tokens_matches_in_process_multi_token(setup, tokenizer):
    """The ccft extension: the server told where the context ends scores a multi-token continuation
    exactly as the in-process lm-eval model does (decoder generating it on C_base of the context)."""
    from ccft.evals.lm_eval_model import CCFTLM

    lm = CCFTLM(decoder=str(setup["decoder"]), mode="prefillshare", batch_size=4)
    items = [(f"Question: {r['question']}\nAnswer:", " " + w) for r in ROWS for w in r["words"]]
    pairs = [(lm.tok_encode(c), lm.tok_encode(c + w)[len(lm.tok_encode(c)) :]) for c, w in items]
    want = [lp for lp, _ in lm._loglikelihood_tokens([(None, c, x) for c, x in pairs], disable_tqdm=True)]
    got = []
    with httpx.Client(base_url=setup["url"], timeout=WAIT) as http:
        for c, x in pairs:
            r = http.post(
                "/v1/completions",
                json={
                    "model": "cc",
                    "prompt": c + x,
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 0,
                    "echo_context_tokens": len(c),
                },
            )
            assert r.status_code == 200, r.text
            got.append(sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(c) :]))
        r = http.post(
            "/v1/completions",
            json={
                "model": "cc",
                "prompt": pairs[0][0],
                "max_tokens": 0,
                "echo": True,
                "logprobs": 0,
                "echo_context_tokens": len(pairs[0][0]),
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo_context_tokens"
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
