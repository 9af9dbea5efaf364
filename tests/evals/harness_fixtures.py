"""Shared pieces of the eval-harness tests: a small real-data task and tiny clear-margin decoders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

GSM8K_TRAIN = Path(__file__).resolve().parents[2] / "src" / "ccft" / "resources" / "gsm8k" / "train.jsonl"


def gsm8k_train(n: int) -> list[dict]:
    rows = []
    with open(GSM8K_TRAIN) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


class ToyTask:
    """GSM8K train questions as plain prompts (first 120 characters), the first 60 characters of the answer as
    reference; scored on properties of the generated text so that scores vary on a random model."""

    name = "toy"
    stop = ["\n\n"]
    max_new_tokens = 6
    metrics = ("long", "has_space")  # primary first, as ccft.evals.tasks declares it
    prompting = "zero-shot, plain text (no chat template)"
    data = "GSM8K train (MIT), first rows, question[:120] as prompt, answer[:60] as reference"

    def __init__(self, n: int = 9):
        self.rows = gsm8k_train(n)

    def load(self, limit=None):
        rows = self.rows if limit is None else self.rows[:limit]
        return [
            {"id": f"toy/{i}", "question": r["question"], "answer": r["answer"]} for i, r in enumerate(rows)
        ]

    def prompt_ids(self, tokenizer, item):
        from ccft.core.tokens import tokenize_prompt

        return tokenize_prompt(tokenizer, item["question"][:120], chat_template=False)

    def reference_text(self, item):
        return item["answer"][:60]

    def score(self, item, text):
        return {"has_space": " " in text, "long": len(text) > 12}

    def aggregate(self, per_item):
        """``{item_id: [score dict per sample]}`` -> summary, as ``ccft.evals.tasks.Task.aggregate``."""
        return {"items": len(per_item), "long_count": sum(s["long"] for v in per_item.values() for s in v)}


def perturb(decoder, seed: int, scale: float = 0.02, only_layers: set[int] | None = None):
    """Add seeded noise to a full decoder's projection weights (optionally only in some layers)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in decoder.model.named_parameters():
            if not name.endswith("proj.weight"):
                continue
            if only_layers is not None:
                layer = int(name.split("layers.")[1].split(".")[0])
                if layer not in only_layers:
                    continue
            p.add_(scale * torch.randn(p.shape, generator=g))
    return decoder


def decoders(base):
    """A Full-FT decoder and a CCFT decoder (full weight copies, different seeded perturbations)."""
    import ccft

    return (
        perturb(ccft.make_decoder(base, "full", method="full-ft"), 1),
        perturb(ccft.make_decoder(base, "full", method="ccft"), 2),
    )
