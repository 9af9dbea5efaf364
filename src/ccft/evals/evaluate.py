"""First evaluation: the four modes on the same GSM8K rows (DESIGN.md §1, CASES.md K7).

For each mode (``base``, ``full-ft``, ``naive``, ``prefillshare``):
  * ``nll``: response NLL per token (response + EOS), teacher-forced, averaged over rows (each row's
    mean over its tokens), with a 95% percentile-bootstrap CI over rows;
  * ``exact_match_strict`` (``#### N``) and ``exact_match_flexible`` (last number) from batched
    greedy generation, with bootstrap CIs; truncated generations (hit ``max_new_tokens``) counted;
  * paired deltas against ``full-ft`` on the same rows (paired bootstrap).
Self-prefill modes (base, full-ft) run the model over its own prompt; naive and prefillshare
decode on ``C_base`` computed by the frozen base for the very same prompt ids.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from ccft.core.cache import compute_base_cache
from ccft.core.decoder import Decoder, decoder_forward, full_forward
from ccft.core.generation import check_mode, generate
from ccft.evals.extract import exact_match, extract_flexible, extract_reference, extract_strict
from ccft.evals.stats import mean_ci, paired_bootstrap_delta
from ccft.train.data import Collator, TokenizedDataset
from ccft.train.trainer import response_nll_sum

SELF_PREFILL = ("base", "full-ft")


def decoder_for_mode(mode: str, decoders: dict[str, Decoder]) -> Decoder | None:
    """``base`` -> None; ``full-ft``/``naive`` -> the Full-FT decoder; ``prefillshare`` -> the CCFT decoder."""
    if mode == "base":
        return None
    key = "ccft" if mode == "prefillshare" else "full-ft"
    if key not in decoders:
        raise ValueError(f"mode {mode!r} needs a decoder trained with method={key!r}; none was given")
    return decoders[key]


def _activate(decoder: Decoder | None) -> None:
    if decoder is not None and decoder.kind == "lora":
        decoder.model.set_adapter(decoder.meta.get("adapter_name", "default"))


@torch.no_grad()
def row_nll(mode: str, base, decoder: Decoder | None, dataset: TokenizedDataset, *, batch_size: int = 8,
            progress: bool = False) -> list[float]:
    """Per-row mean NLL per supervised token (response + EOS) under ``mode``; one float per example."""
    check_mode(mode, decoder)
    k = decoder.handoff_tokens if decoder is not None else 1
    tok = base.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    collate = Collator(pad, k)
    out: list[float] = []
    examples = list(dataset.examples)
    _activate(decoder)
    for i in tqdm(range(0, len(examples), batch_size), desc=f"nll [{mode}]", disable=not progress, leave=False):
        batch = collate(examples[i:i + batch_size])
        if mode == "base":
            with base.base_weights() as model:
                logits = full_forward(model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"],
                                      batch["tail_mask"])
        elif mode == "full-ft":
            logits = full_forward(decoder.model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"],
                                  batch["tail_mask"])
        else:
            cache = compute_base_cache(base, [e.prompt_ids for e in examples[i:i + batch_size]], handoff_tokens=k)
            cache.check_reader(decoder.fingerprint, decoder.dtype)
            _activate(decoder)
            logits = decoder_forward(decoder.model, cache, batch["tail_ids"], batch["tail_mask"])
        for r in range(logits.shape[0]):
            nll, n = response_nll_sum(logits[r:r + 1], batch["labels"][r:r + 1])
            out.append(float(nll / n))
    return out


@dataclass
class ExactMatch:
    """Per-problem greedy generations and their scores."""

    strict: list[bool]
    flexible: list[bool]
    truncated: int
    samples: list[dict] = field(default_factory=list)


def gsm8k_exact_match(mode: str, base, decoder: Decoder | None, prompts: Sequence[Sequence[int]],
                      answers: Sequence[str], *, max_new_tokens: int = 256, batch_size: int = 16,
                      progress: bool = False) -> ExactMatch:
    """Greedy-generate each prompt under ``mode`` and score strict and flexible exact match against GSM8K answers."""
    gens = generate(prompts, mode=mode, base=base, decoder=decoder, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, progress=progress)
    strict, flexible, samples = [], [], []
    for g, ans in zip(gens, answers):
        ref = extract_reference(ans)
        s, f = extract_strict(g.text), extract_flexible(g.text)
        strict.append(exact_match(s, ref))
        flexible.append(exact_match(f, ref))
        samples.append({"reference": ref, "strict": s, "flexible": f, "finish_reason": g.finish_reason,
                        "text": g.text})
    return ExactMatch(strict, flexible, sum(g.truncated for g in gens), samples)


def summarize_mode(nll: list[float], em: ExactMatch | None, *, n_resamples: int = 2000, seed: int = 0) -> dict:
    """The per-mode block of ``results.json``."""
    out = {"n": len(nll)}
    if nll:
        m = mean_ci(nll, n_resamples=n_resamples, seed=seed)
        out.update(nll=m["mean"], nll_ci=list(m["ci"]))
    if em is not None:
        s = mean_ci([float(x) for x in em.strict], n_resamples=n_resamples, seed=seed)
        f = mean_ci([float(x) for x in em.flexible], n_resamples=n_resamples, seed=seed)
        out.update(exact_match_strict=s["mean"], exact_match_flexible=f["mean"],
                   em_ci={"strict": list(s["ci"]), "flexible": list(f["ci"])}, em_n=len(em.strict),
                   truncated=em.truncated)
    return out


def paired_deltas(per_mode: dict[str, dict], reference: str = "full-ft", *, n_resamples: int = 2000,
                  seed: int = 0) -> dict:
    """Paired-bootstrap deltas (mode − reference) of NLL and exact match over the same rows."""
    if reference not in per_mode:
        return {}
    ref = per_mode[reference]
    out = {}
    for mode, r in per_mode.items():
        if mode == reference:
            continue
        d = {}
        if r.get("nll_rows") and ref.get("nll_rows"):
            p = paired_bootstrap_delta(r["nll_rows"], ref["nll_rows"], n_resamples=n_resamples, seed=seed)
            d["nll"] = {"delta": p["delta"], "ci": list(p["ci"])}
        for key in ("strict", "flexible"):
            a, b = r.get(f"em_{key}_rows"), ref.get(f"em_{key}_rows")
            if a and b:
                p = paired_bootstrap_delta([float(x) for x in a], [float(x) for x in b], n_resamples=n_resamples,
                                           seed=seed)
                d[f"exact_match_{key}"] = {"delta": p["delta"], "ci": list(p["ci"])}
        out[mode] = d
    return out


def hardware() -> str:
    """One line naming the CPU/GPU and thread count the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = f"CUDA {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    import os

    return f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} using {torch.get_num_threads()} threads, {dev}"
