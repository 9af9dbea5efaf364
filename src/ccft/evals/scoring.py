"""Teacher-forced scoring: a task's items tokenised once, and the response NLL of each under a mode.

The response NLL of an item is ``− Σ_t log p(r_t | prompt, r_<t) / |r|`` over the reference answer's
tokens plus EOS (``ccft.core.tokens.tokenize_response``; the tokens CCFT supervises, arXiv 2602.12029
§3). Who prefills the prompt is the mode's (``ccft.core.modes``): the model itself for ``base`` /
``full-ft`` (``full_forward``), the frozen base's ``C_base`` for ``naive`` / ``prefillshare``
(``decoder_forward``; a decoder trained at sharing depth m > 0 reads its own K/V below layer m,
``ccft.core.depth``; C_base is read in the decoder's ``cache_format`` or the one given,
``ccft.core.compact``). The handoff layout is the same in every mode: a prefix over ``prompt[:n−k]``,
then the last ``k`` prompt tokens and the response (docs/design.md, "Terms").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ccft.core.cache import BaseCache, compute_base_cache
from ccft.core.compact import check_cache_format
from ccft.core.decoder import Decoder, decoder_forward, full_forward
from ccft.core.depth import decoder_prefix
from ccft.core.errors import ConfigError
from ccft.core.modes import check_mode
from ccft.core.tokens import pad_token_id, tokenize_response
from ccft.evals.prompting import PromptFormat, prompt_ids
from ccft.evals.protocol import item_id, task_name
from ccft.evals.sharing import kept_row_nlls, row_nlls, scored_positions
from ccft.train.data import Collator, Example

__all__ = ["Prepared", "batch_nll", "prepare", "prompt_hash"]


@dataclass
class Prepared:
    """Items of a task tokenised once: the same prompt ids and references for every mode.

    Attributes:
        items: the task's items, in its order; ids: their stable ids.
        prompts: prompt token ids per item; references: reference response ids + EOS (None: no reference).
    """

    items: list
    ids: list[str]
    prompts: list[list[int]]
    references: list[list[int] | None]

    @property
    def n(self) -> int:
        return len(self.items)


def prompt_hash(ids: Sequence[int]) -> str:
    """A short hash of prompt ids (stored per item record: a resumed run must see the same prompt)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def prepare(
    task, tokenizer, limit: int | None, handoff_tokens: int = 1, prompt_format: PromptFormat | None = None
) -> Prepared:
    """Load and tokenise the task's first ``limit`` items (prompt ids, reference response ids + EOS).

    Prompt ids follow ``ccft.evals.prompting.prompt_ids`` (``prompt_format`` None: the task's own).

    Raises:
        ConfigError: a prompt shorter than ``handoff_tokens + 1`` tokens, or item ids that are not unique.
    """
    items = list(task.load(limit))
    if limit is not None:
        items = items[:limit]
    ids, prompts, refs = [], [], []
    for i, item in enumerate(items):
        ids.append(item_id(task, item, i))
        p = prompt_ids(task, tokenizer, item, prompt_format)
        if len(p) < handoff_tokens + 1:
            raise ConfigError(
                f"task {task_name(task)} item {ids[-1]}: the prompt has {len(p)} tokens; "
                f"handoff_tokens={handoff_tokens} needs at least {handoff_tokens + 1}"
            )
        prompts.append(p)
        ref = task.reference_text(item) if hasattr(task, "reference_text") else None
        refs.append(tokenize_response(tokenizer, ref) if ref else None)
    if len(set(ids)) != len(ids):
        dup = sorted({x for x in ids if ids.count(x) > 1})[:5]
        raise ConfigError(
            f"task {task_name(task)}: item ids are not unique ({dup}); resuming needs unique ids"
        )
    return Prepared(items, ids, prompts, refs)


#: NLL forwards of rows of similar length hold at most about this many (padded) tokens (the eval runner's and
#: the sharing sweep's): the logits of 4096 tokens over a 49k vocabulary are 0.8 GB in fp32
NLL_TOKENS = 4096


def length_chunks(lengths: dict[int, int] | Sequence[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Rows (keys of ``lengths``, or indices of a sequence) in forwards of similar length: sorted by length,
    then consecutive rows while a forward holds at most ``max_rows`` rows and ``rows × longest ≤ max_tokens``
    padded tokens (a longer row goes alone). Less padding than chunks in any other order, and a bound on the
    ``(rows, tokens, vocabulary)`` logits of a forward."""
    items = lengths.items() if isinstance(lengths, dict) else enumerate(lengths)
    order = [i for i, _ in sorted(items, key=lambda x: (x[1], x[0]))]
    size = dict(lengths) if isinstance(lengths, dict) else dict(enumerate(lengths))
    chunks: list[list[int]] = []
    for i in order:
        if chunks and len(chunks[-1]) < max_rows and (len(chunks[-1]) + 1) * size[i] <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


@torch.no_grad()
def batch_nll(
    mode: str,
    base,
    decoder: Decoder | None,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    handoff_tokens: int = 1,
    cache: BaseCache | None = None,
    cache_format: str | None = None,
) -> list[tuple[float, int]]:
    """(summed NLL in nats, token count) of each response (+ EOS) under ``mode``, one forward for the batch.

    Args:
        mode: one of ``ccft.core.modes.MODES``; decoder: the mode's decoder (None for ``base``).
        prompts: b prompt id lists; responses: b response id lists ending with EOS.
        cache: the prefix K/V of exactly these prompts' ``prompt[:n-k]``: for the shared-prefill modes
            ``C_base`` (computed when None); for ``base`` / ``full-ft`` optionally the mode's own prefill
            (written by the base / by the Full-FT decoder, e.g.
            ``ccft.inference.PrefixHandle.to_base_cache``), read instead of a forward over the whole prompt
            (equal within fp32 rounding: the model's K/V are causal).
        cache_format: the format the shared-prefill modes read C_base in (``native`` or ``int8``, issue 35;
            ``ccft.core.compact``); default: the decoder's own ``cache_format``. The own-prefill modes ignore
            it.
    Returns:
        b pairs ``(Σ −log p, n tokens)``.
    Raises:
        ConfigError: the mode does not fit the decoder (``check_mode``), or an own-prefill mode is given a
            cache another model wrote.
        FingerprintMismatchError: ``cache`` comes from another base or dtype (K5).
    """
    spec = check_mode(mode, decoder)
    k = handoff_tokens
    batch = Collator(pad_token_id(base.tokenizer), k)(
        [Example(tuple(p), tuple(r)) for p, r in zip(prompts, responses, strict=True)]
    )
    batch = {key: v.to(base.device) for key, v in batch.items()}
    if cache is not None and not spec.shared_prefill:  # the mode's own prefill, computed elsewhere
        if (cache.producer == "base") == spec.needs_decoder:
            raise ConfigError(
                f"mode {mode!r} reads its own prefill, but this cache was written by "
                f"{cache.producer!r}; pass the prefix its own model computed (or no cache)"
            )
        if spec.needs_decoder:
            logits = decoder_forward(decoder, cache, batch["tail_ids"], batch["tail_mask"], allow_self=True)
        else:
            with base.base_weights() as model:
                logits = decoder_forward(
                    model, cache, batch["tail_ids"], batch["tail_mask"], fingerprint=base.fingerprint
                )
    elif spec.shared_prefill:
        if cache is None:
            cache = compute_base_cache(base, prompts, handoff_tokens=k)
        cache.check_reader(decoder.fingerprint, decoder.dtype)
        # C_base in its format, then at depth m the decoder's own K/V below layer m (ccft.core.depth)
        fmt = check_cache_format(decoder.cache_format if cache_format is None else cache_format)
        cache = decoder_prefix(
            decoder,
            cache,
            batch["prefix_ids"],
            batch["prefix_mask"],
            share_from_layer=decoder.share_from_layer,
            cache_format=fmt,
        )
        logits = decoder_forward(decoder, cache, batch["tail_ids"], batch["tail_mask"])
    elif spec.needs_decoder:  # the decoder prefills its own prompt
        logits = full_forward(
            decoder, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"]
        )
    else:
        with base.base_weights() as model:
            logits = full_forward(
                model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"]
            )
    return row_nlls(logits, batch["labels"])


@torch.no_grad()
def handle_nll(
    engine,
    handle,
    rows: Sequence[int],
    decoder: str,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    handoff_tokens: int = 1,
) -> list[tuple[float, int]]:
    """``batch_nll`` on a prefix an engine already holds: (summed NLL in nats, token count) of each response
    (+ EOS) after ``prompts[i]`` (= the prompt of ``handle`` row ``rows[i]``) under engine decoder
    ``decoder``, in one teacher-forced forward of the engine (``SharedPrefillEngine.tail_logits``). Same
    layout and labels as ``batch_nll`` (``ccft.train.data.Collator``), equal to it within fp32 rounding
    (tested).

    Raises:
        ConfigError: a prompt whose last k tokens are not the handle row's handoff tokens (another prompt's
            prefix), or a decoder that may not read the handle (``tail_logits``).
    """
    k = handoff_tokens
    for r, p in zip(rows, prompts, strict=True):
        if list(p[-k:]) != list(handle.tail_ids[r]) or len(p) - k != handle.lengths[r]:
            raise ConfigError(
                f"handle row {r} holds the prefix of another prompt than the one scored; pass the "
                "prompts the handle was prefilled with"
            )
    batch = Collator(pad_token_id(engine.tokenizer), k)(
        [Example(tuple(p), tuple(r)) for p, r in zip(prompts, responses, strict=True)]
    )
    labels = batch["labels"]
    logits = engine.tail_logits(  # the scored positions' logits only (not the padding's vocabulary softmax)
        handle, rows, batch["tail_ids"], batch["tail_mask"], decoder=decoder, keep=scored_positions(labels)
    )
    return kept_row_nlls(logits, labels.to(logits.device))
