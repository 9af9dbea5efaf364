"""One admitted row of the step API: ``Request`` (token bookkeeping, stopping) and ``StepOutput``.

A request is one prompt row of a ``PrefixHandle`` decoded by one decoder. Per step it receives the
token chosen for it (``choose_tokens``: the one sampler, ``ccft.core.sampling``; or its next forced
token) and ``advance`` records it and says whether the request ended:

* EOS ends it (``finish_reason="eos"``; the EOS id is not part of the output) unless ``ignore_eos``;
* a stop string ends it (``"stop"``): the text is cut just before the earliest one
  (``ccft.core.text.StopMatcher``). The text is grown by a per-request ``TextStream`` and only the
  part a new delta can complete is scanned (``StopMatcher.scan_from``), so the check costs
  O(delta + longest stop string) per token, not a decode of the whole output;
* ``max_new_tokens`` ends it (``"length"``).

The result equals the reference path (``ccft.core.generation.decode_on_cache``: full decode of
the ids so far, cut at ``StopMatcher.find``): the scanned text is ``stream.text + stream.pending``,
which is that full decode (an incomplete trailing UTF-8 character as U+FFFD, and complete text the
stream still holds back with it), so both find the first stop string at the same token and cut at
the same index (docs/design.md, "Stop strings and streaming"; fault class K7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ccft.core.errors import CCFTError
from ccft.core.generation import Generation
from ccft.core.sampling import SamplingParams, select_tokens
from ccft.core.text import StopMatcher, TextStream
from ccft.inference.handles import OwnPrefix, PrefixHandle


@dataclass
class StepOutput:
    """One row's result of ``step()``: the token chosen this step (an EOS token too), and, when the
    request ended with it, its ``Generation``. ``logits (V,)`` when ``step(return_logits=True)``.

    For a request admitted with ``logprobs=k`` (``SharedPrefillEngine.add_request``): ``logprob``, the
    natural log of the probability of ``token_id`` under the step's raw distribution (log-softmax of
    the model's logits in fp32, before temperature / top-p), and ``top_logprobs``, the ``k`` most
    likely ``(token id, logprob)`` pairs of that distribution, most likely first (``[]`` for k=0).
    Both None for a request admitted without ``logprobs``."""

    request_id: int
    token_id: int
    finished: bool
    generation: Generation | None = None
    logits: torch.Tensor | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class StepError(CCFTError, RuntimeError):
    """Some requests failed in a ``step()``; every other active row was stepped.

    The engine retries a lane whose batched forward raised on parts of its rows (by decoder, then
    halves) until the error is confined to the rows that cause it; those requests are removed.

    Attributes:
        outputs: the ``StepOutput`` of every row that was stepped (deliver them as usual).
        failed: request id -> the exception its rows raised (the request is no longer active).
    """

    def __init__(self, outputs: list[StepOutput], failed: dict[int, BaseException]):
        self.outputs, self.failed = outputs, failed
        detail = "; ".join(f"request {rid}: {type(e).__name__}: {e}" for rid, e in list(failed.items())[:3])
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        super().__init__(
            f"{len(failed)} request(s) failed in this step and were removed, the other "
            f"{len(outputs)} row(s) were stepped: {detail}{more}"
        )


@dataclass(eq=False)
class Request:
    """An active request (see the module docstring).

    Attributes:
        id: the request id.  handle, row: the prompt it decodes.  decoder: the decoder's name.
        adapter_index: the decoder's adapter in its lane (None: the lane's own weights).
        eos: ids that end it.  tokenizer: decodes its ids (stop strings, the final text).
        next_token: the token fed at the next step.  tail_written: tokens in its tail slot.
        out_ids: the generated ids (EOS excluded).  reason: ``"eos"``, ``"stop"``, ``"length"`` once ended.
        logprobs: None, or how many top log-probabilities each step reports (``StepOutput.logprob``).
        own: its decoder's own prefix K/V below the decoder's sharing depth m (``handles.OwnPrefix``; None at
            m = 0 or on a handle the decoder prefilled itself).
    """

    id: int
    handle: PrefixHandle
    row: int
    decoder: str
    adapter_index: int | None
    eos: set[int]
    tokenizer: object
    max_new_tokens: int
    stop: StopMatcher
    sampling: SamplingParams
    generator: torch.Generator | None
    forced: list[int] | None
    ignore_eos: bool
    next_token: int
    tail_written: int
    out_ids: list[int] = field(default_factory=list)
    reason: str | None = None
    text: str | None = None
    stream: TextStream | None = None
    logprobs: int | None = None
    own: OwnPrefix | None = None

    def __post_init__(self) -> None:
        if self.stop and self.stream is None:
            self.stream = TextStream(self.tokenizer)

    @property
    def prefix_len(self) -> int:
        """The real prefix length of its row (its first decoder position)."""
        return self.handle.lengths[self.row]

    def token_to_feed(self, chosen: int) -> int:
        """The token this step records: the next forced token (teacher forcing), else ``chosen``."""
        return self.forced[len(self.out_ids)] if self.forced is not None else chosen

    def advance(self, tok: int) -> bool:
        """Record token ``tok``; True when the request is finished (EOS, stop string, ``max_new_tokens``)."""
        if tok in self.eos and not self.ignore_eos:
            self.reason = "eos"
            return True
        self.out_ids.append(tok)
        if self.stream is not None:
            new_from = len(self.stream.text)
            self.stream.push([tok])
            text = self.stream.text + self.stream.pending  # == the full decode of out_ids
            cut = self.stop.scan_from(text, new_from)
            if cut >= 0:
                self.reason, self.text = "stop", text[:cut]
                return True
        if len(self.out_ids) >= self.max_new_tokens:
            self.reason = "length"
            return True
        self.next_token = tok
        return False

    def generation(self) -> Generation:
        """What it generated: the text cut at the stop string, else the full decode of ``out_ids``."""
        text = (
            self.text
            if self.text is not None
            else self.tokenizer.decode(self.out_ids, skip_special_tokens=True)
        )
        return Generation(text=text, token_ids=list(self.out_ids), finish_reason=self.reason or "length")


def choose_tokens(logits: torch.Tensor, rows: list[Request]) -> list[int]:
    """The next token of each row: ``logits (len(rows), V)`` -> ids. Greedy unless a row samples
    (``ccft.core.sampling.select_tokens`` with the row's own seeded generator, so a row's draws do
    not depend on the batch; docs/design.md, "Sampling"). Forced rows take the greedy value (ignored)."""
    chosen = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.sampling.do_sample and r.forced is None]
    if sampled:
        chosen = chosen.clone()
        for i in sampled:
            chosen[i] = select_tokens(logits[i : i + 1], rows[i].sampling, rows[i].generator)[0]
    return chosen.tolist()


def logprob_entries(
    lp: torch.Tensor, targets: Sequence[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of ``lp (r, V)`` (log-softmax rows): (logprob of ``targets[row]``, its ``top`` most likely
    ``(id, logprob)`` pairs, most likely first; ``[]`` for top=0)."""
    idx = torch.tensor([int(t) for t in targets], device=lp.device)[:, None]
    chosen = lp.gather(-1, idx)[:, 0].tolist()
    if top <= 0:
        return [(c, []) for c in chosen]
    vals, ids = lp.topk(top, dim=-1)
    return [
        (c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist(), strict=True)
    ]


def token_logprobs(
    logits: torch.Tensor, rows: list[Request], tokens: list[int]
) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the rows that asked for them (``Request.logprobs`` set), computed only for those.

    Args:
        logits: ``(len(rows), V)`` the step's logits.  tokens: the token each row records this step.
    Returns:
        row index -> (logprob of its token, its ``logprobs`` most likely ``(id, logprob)``), from
        ``log_softmax`` of the logits in fp32 (the raw model distribution, before temperature / top-p).
    """
    want = [i for i, r in enumerate(rows) if r.logprobs is not None]
    if not want:
        return {}
    lp = torch.log_softmax(logits[want].float(), dim=-1)
    entries = logprob_entries(lp, [tokens[i] for i in want], max(rows[i].logprobs for i in want))
    return {i: (e[0], e[1][: rows[i].logprobs]) for i, e in zip(want, entries, strict=True)}


__all__ = ["StepOutput", "StepError", "Request", "choose_tokens", "token_logprobs", "logprob_entries"]
