"""GSM8K as a task of the evaluation API: zero-shot chat, strict and flexible exact match (the only GSM8K
task).

Prompt: the question as one user turn of the tokenizer's chat template (the same rows and
template ``ccft train`` uses for ``gsm8k:train``, so a math specialist sees its training format;
``ccft demo`` and ``ccft eval`` render it with the decoders' recorded recipe, ``ccft.evals.prompting``).
Reference: the GSM8K answer (chain of thought ending ``#### N``), also the NLL reference text.
Metrics: ``exact_match_strict`` (first ``#### N``) and ``exact_match_flexible`` (last number), from
``ccft.evals.extract``, on the continuation with a copy of the question at its start dropped
(``Task.postprocess``): a generation that only repeats the question scores 0 even when the
question's last number is the answer (K7 in docs/design.md, "Fault classes").
"""

from __future__ import annotations

from dataclasses import dataclass

from ccft.evals.extract import exact_match, extract_flexible, extract_reference, extract_strict
from ccft.evals.task_base import Item, Task, read_jsonl
from ccft.train.config import RESOURCES

__all__ = ["GSM8KTask", "tasks"]


@dataclass
class GSM8KTask(Task):
    name: str = "gsm8k"
    prompt_style: str = "chat"
    max_new_tokens: int = 256
    default_limit: int | None = 50
    #: ``answer_format``: the generation states an answer in GSM8K's ``#### N`` form (the strict
    #: extractor finds a number), right or wrong; the study's secondary metric for math (it moves after a
    #: few dozen steps on GSM8K solutions while exact match of a 135M model stays near the floor).
    metrics: tuple[str, ...] = ("exact_match_flexible", "exact_match_strict", "answer_format")
    primary_metric: str = "exact_match_flexible"  # the last number: the model is not taught the ``####`` form
    secondary_metric: str | None = "answer_format"
    license: str = "MIT (openai/grade-school-math)"
    data: str = "src/ccft/resources/gsm8k/test.jsonl (1,319 rows)"

    def _load_all(self) -> list[Item]:
        rows = read_jsonl(RESOURCES / "gsm8k" / "test.jsonl")
        return [
            Item(
                id=f"gsm8k/test/{i}",
                prompt=r["question"],
                reference=r["answer"],
                metadata={"answer": extract_reference(r["answer"])},
            )
            for i, r in enumerate(rows)
        ]

    def score(self, item: Item, generation: str) -> dict[str, float]:
        text = self.postprocess(item, generation)
        ref = item.metadata["answer"]
        strict = extract_strict(text)
        return {
            "exact_match_strict": float(exact_match(strict, ref)),
            "exact_match_flexible": float(exact_match(extract_flexible(text), ref)),
            "answer_format": float(strict is not None),
        }


def tasks() -> list[Task]:
    return [GSM8KTask()]
