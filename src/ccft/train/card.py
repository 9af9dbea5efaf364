"""Model cards: the ``README.md`` of every decoder folder ``ccft train`` and ``ccft export`` write.

Hub model-card format (``huggingface_hub.ModelCard`` / ``ModelCardData``): a YAML header with
``base_model`` (the Hub id of the base when ccft knows one: embedded models map to their upstream
repositories, a Hub id is kept, a local folder is left out), ``library_name`` (``peft`` for adapters,
``transformers`` for full weights), ``tags`` and ``datasets`` (Hub ids of ccft's built-in training
sets; local files are named in the body only), then a body: method, handoff, recipe, training
rows/steps, evaluation numbers when given (``summary.json`` of ``ccft eval`` task folders), and how
to load the folder with ccft, with PEFT or transformers, and how to serve it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["BASE_HUB_IDS", "DATASET_HUB_IDS", "card_data", "model_card_text", "write_model_card"]

#: Embedded base names -> the Hub repository their weights come from.
BASE_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

#: Built-in dataset names (``ccft.train.config.BUILTIN_DATASETS``) -> the Hub dataset of their rows' source.
DATASET_HUB_IDS = {
    "gsm8k": "openai/gsm8k",
    "mbpp": "google-research-datasets/mbpp",
    "mbxp": "mxeval/mbxp",
    "glaive-tools": "glaiveai/glaive-function-calling-v2",
}


def _base_hub_id(meta: Mapping) -> str | None:
    base = meta.get("base") or {}
    name = str(base.get("name") or "")
    if name in BASE_HUB_IDS:
        return BASE_HUB_IDS[name]
    # "org/name" that is not a folder on this machine: a Hub id.
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name):
        return name
    return None


def _datasets(meta: Mapping) -> list[str]:
    data = meta.get("data") or {}
    out = []
    for spec in (data.get("train_data"), data.get("eval_data")):
        name = str(spec or "").partition(":")[0]
        if name in DATASET_HUB_IDS and DATASET_HUB_IDS[name] not in out:
            out.append(DATASET_HUB_IDS[name])
    return out


def card_data(meta: Mapping, *, export: Mapping | None = None):
    """The ``ModelCardData`` (YAML header) of a decoder folder from its ``ccft.json`` (and export
    provenance)."""
    from huggingface_hub import ModelCardData

    target = (export or {}).get("target")
    kind = "full" if target == "merged" else meta.get("decoder_kind", "lora")
    tags = [
        "ccft",
        "prefillshare",
        "cache-conditioned-fine-tuning",
        f"method-{meta.get('method') or 'untrained'}",
    ]
    if target == "peft-alora":
        tags += ["lora", "alora", "activated-lora"]
    elif kind == "lora":
        tags += ["lora"]
    kwargs = {
        "library_name": "peft" if kind == "lora" else "transformers",
        "tags": tags,
        "pipeline_tag": "text-generation",
    }
    base = _base_hub_id(meta)
    if base:
        kwargs["base_model"] = base
    datasets = _datasets(meta)
    if datasets:
        kwargs["datasets"] = datasets
    return ModelCardData(**kwargs)


def _eval_table(evals: Sequence[Mapping]) -> str:
    rows = []
    for s in evals:
        for mode, block in (s.get("modes") or {}).items():
            metrics = ", ".join(
                f"{k} {v['mean']:.4f}"
                for k, v in (block.get("metrics") or {}).items()
                if isinstance(v, Mapping) and isinstance(v.get("mean"), (int, float))
            )
            nll = f"{block['nll']:.4f}" if isinstance(block.get("nll"), (int, float)) else "-"
            rows.append(f"| {s.get('task')} | {mode} | {block.get('n', '-')} | {nll} | {metrics or '-'} |")
    if not rows:
        return ""
    return (
        "| task | mode | n | NLL/token | metrics |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        'Modes (docs/design.md, "Modes"): `prefillshare` is this decoder on the base\'s prompt cache, '
        "`full-ft` the accuracy reference, `naive` a Full-FT decoder on the base's cache.\n"
    )


def model_card_text(meta: Mapping, *, export: Mapping | None = None, evals: Sequence[Mapping] = ()) -> str:
    """The full ``README.md`` (YAML header + body) for a decoder folder described by ``meta`` (its
    ``ccft.json``).

    Args:
        meta: ``ccft.json`` of the decoder (or of the decoder an export came from).
        export: provenance of an export (``target``: ``peft-alora`` | ``merged``, ``exported_from``,
            ``alora_invocation_tokens``, ``invocation_text``, ``warnings``); None for a trained decoder.
        evals: ``summary.json`` dicts of ``ccft eval`` task folders (their ``modes``' metrics are tabled).
    """
    from huggingface_hub import ModelCard

    from ccft.core.models import describe_model

    data = card_data(meta, export=export)
    target = (export or {}).get("target")
    base = meta.get("base") or {}
    k = meta.get("handoff_tokens", 1)
    method = meta.get("method")
    recipe = meta.get("recipe") or {}
    train = meta.get("data") or {}
    lines = [
        f"# ccft decoder ({method or 'untrained'}, {'aLoRA export' if target == 'peft-alora' else ''}"
        f"{'merged export' if target == 'merged' else ''}"
        f"{'' if target else meta.get('decoder_kind', 'lora')})",
        "",
        "A specialist decoder made with [ccft](https://arxiv.org/abs/2602.12029) (cache-conditioned "
        "fine-tuning, PrefillShare): a frozen base model prefills the prompt once (its KV cache, `C_base`), "
        "the decoder recomputes the last `handoff_tokens` prompt tokens and generates on that cache.",
        "",
        "## Method",
        "",
        f"- method: `{method}` ({'trained on the base prefill C_base' if method == 'ccft' else 'trained on its own prefill' if method == 'full-ft' else 'not trained'})",  # noqa: E501
        f"- decoder: `{meta.get('decoder_kind')}`" + (f", exported as `{target}`" if target else ""),
        f"- base: `{base.get('name')}`"
        + (
            f" ({describe_model(base['name'])}; from the Hub's `{data.base_model}`)"
            if base.get("name") in BASE_HUB_IDS
            else f" (Hub: `{data.base_model}`)"
            if data.base_model
            else ""
        )
        + f", fingerprint `{meta.get('base_fingerprint')}`: load exactly these base weights (for an embedded "
        "base, the folder `ccft.core.models.resolve_model_path(NAME)` converts)",
        f"- handoff: the decoder starts at the last {k} prompt token(s); the base's KV covers the rest",
        f"- dtype: `{meta.get('dtype')}`; ccft {meta.get('ccft_version')}",
    ]
    if target == "peft-alora":
        lines += [
            f"- aLoRA invocation tokens: `{export.get('alora_invocation_tokens')}` "
            f"({export.get('invocation_text')!r}): PEFT turns the adapter on from the start of their last "
            "occurrence; the prompt's KV before them is the base's"
        ]
    for w in (export or {}).get("warnings") or []:
        lines += [f"- **warning**: {w}"]
    lines += ["", "## Training", ""]
    facts = [
        ("data", f"`{train['train_data']}`" if train.get("train_data") else None),
        ("training rows", train.get("train_rows")),
        ("data offset", train.get("data_offset")),
        ("dropped over max_length", train.get("dropped_too_long")),
        ("max_length", train.get("max_length")),
        ("supervised tokens", train.get("supervised_tokens")),
        ("steps", meta.get("steps")),
        ("seed", meta.get("seed")),
        ("training path", meta.get("train_path")),
    ]
    facts = [f"- {name}: {value}" for name, value in facts if value is not None]
    lines += facts or ["- no training record in `ccft.json`"]
    if recipe:
        lines += [
            "",
            "Recipe:",
            "",
            "```json",
            json.dumps(recipe, indent=2, sort_keys=True, default=str),
            "```",
        ]
    lines += ["", "## Evaluation", ""]
    table = _eval_table(evals)
    lines += [
        table
        if table
        else "No evaluation recorded with this folder (`ccft eval --decoder THIS` measures it; "
        "`ccft export --eval-summary FILE` puts the numbers here)."
    ]
    lines += ["", "## Use", ""]
    if target == "peft-alora":
        lines += [
            "With stock PEFT (no ccft code):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "from peft import PeftModel",
            "",
            "base = AutoModelForCausalLM.from_pretrained(BASE)   # the base named above, same weights",
            "model = PeftModel.from_pretrained(base, 'THIS_FOLDER')",
            "tok = AutoTokenizer.from_pretrained('THIS_FOLDER')",
            "ids = tok.apply_chat_template([{'role': 'user', 'content': '...'}], add_generation_prompt=True,",
            "                              return_tensors='pt', return_dict=True)['input_ids']",
            "out = model.generate(input_ids=ids, max_new_tokens=256, do_sample=False)",
            "```",
            "",
            "Serve with an engine that supports activated LoRA (see ccft's docs/deploy.md for which were "
            "verified).",
        ]
    elif target == "merged" or meta.get("decoder_kind") == "full":
        lines += [
            "```python",
            "import ccft",
            "",
            "decoder = ccft.load_decoder('THIS_FOLDER')   # base from ccft.json",
            "gens = ccft.generate(prompts, mode='prefillshare' if decoder.method == 'ccft' else 'full-ft',"
            " decoder=decoder)",
            "```",
            "",
            "Or as a plain model: `AutoModelForCausalLM.from_pretrained('THIS_FOLDER')` (own prefill: "
            "exact for `full-ft` decoders; a `ccft` decoder is exact only on the base's KV, e.g. "
            "disaggregated prefill). Serve: `ccft serve --decoder NAME=THIS_FOLDER`.",
        ]
    else:
        lines += [
            "```python",
            "import ccft",
            "",
            "decoder = ccft.load_decoder('THIS_FOLDER')   # base from ccft.json",
            "gens = ccft.generate(prompts, mode='prefillshare', decoder=decoder)",
            "```",
            "",
            "Serve: `ccft serve --decoder NAME=THIS_FOLDER`. For other engines: `ccft export THIS_FOLDER "
            "--to peft-alora OUT` (a stock PEFT aLoRA adapter) or `--to merged OUT`.",
        ]
    # Built as text (not a Jinja template: recipe text may hold "{{"); ModelCard parses the header back.
    return ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(lines) + "\n").content


def write_model_card(
    folder: str | os.PathLike, meta: Mapping, *, export: Mapping | None = None, evals: Sequence[Mapping] = ()
) -> Path:
    """Write ``folder/README.md`` (see :func:`model_card_text`) atomically; returns its path."""
    from ccft.core.io import atomic_write_text

    path = Path(folder) / "README.md"
    atomic_write_text(path, model_card_text(meta, export=export, evals=evals))
    return path
