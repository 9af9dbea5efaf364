"""lm-eval model ``ccft``: run lm-evaluation-harness tasks on the shared prefill.

    python -m ccft.evals.lm_eval_model --model ccft \\
        --model_args base=smollm2-135m-instruct,decoder=runs/demo/ccft,mode=prefillshare --tasks gsm8k

takes exactly ``lm_eval``'s arguments; importing this module registers the model, so from Python
``import ccft.evals.lm_eval_model`` then ``lm_eval.simple_evaluate(model="ccft", model_args=...)``.
(lm-eval 0.4.x discovers third-party models only by import: the plain ``lm_eval`` console script
does not know ``ccft`` unless this module was imported in that process.)

``model_args``:
  * ``base``: base model (embedded name, folder or hub id); default: the one the decoder records.
  * ``decoder``: decoder folder (``ccft train`` output); required for every mode but ``base``.
  * ``mode``: ``base`` | ``full-ft`` | ``naive`` | ``prefillshare`` (checked against the decoder's method).
  * ``dtype`` (``float32``), ``device`` (``cpu``), ``batch_size`` (8), ``max_length`` (the model's
    ``max_position_embeddings``), ``max_gen_toks`` (256), ``add_bos_token`` (False, as lm-eval's ``hf``).

How requests run (the same layout as ``ccft eval``; who prefills and who decodes is
``ccft.core.modes``'s, docs/design.md, "Modes"): for the shared-prefill modes (``naive`` /
``prefillshare``) the frozen base prefills ``context[:-k]`` (k = the decoder's ``handoff_tokens``; fewer when
the context is that short) and the decoder processes ``context[-k:]`` + the continuation on that ``C_base``;
``generate_until`` decodes on ``C_base`` (``ccft.core.generation.generate``). ``base`` / ``full-ft``
run the model over its own prompt.
``loglikelihood`` returns ``(sum log p(continuation), greedy)``; ``loglikelihood_rolling`` uses
lm-eval's disjoint rolling windows.
"""

from __future__ import annotations

import json
from typing import Any

import lm_eval.models  # noqa: F401  (fills the registry's built-in placeholders before we add ours)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ccft.core.compact import read_cache
from ccft.core.decoder import decoder_forward, full_forward
from ccft.core.errors import ConfigError
from ccft.core.generation import generate
from ccft.core.modes import check_mode, get_mode
from ccft.core.tokens import left_pad, pad_token_id, right_pad
from ccft.evals.sharing import ragged_prefill


def _as_bool(x) -> bool:
    return x if isinstance(x, bool) else str(x).lower() in ("1", "true", "yes")


def _pick_device(device) -> torch.device:
    """lm-eval's CLI passes ``--device`` (default ``cuda``); like its ``hf`` model, fall back to CPU without
    CUDA."""
    want = str(device or "cpu")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        import warnings

        warnings.warn(
            f"lm-eval model ccft: device={want!r} but CUDA is not available; using the CPU", stacklevel=3
        )
        want = "cpu"
    return torch.device(want)


@register_model("ccft")
class CCFTLM(TemplateLM):
    """lm-eval ``LM`` over a ccft base + decoder in one of the four modes (see the module docstring)."""

    backend = "causal"

    def __init__(
        self,
        base: str | None = None,
        decoder: str | None = None,
        mode: str = "prefillshare",
        dtype: str = "float32",
        device: str | None = "cpu",
        batch_size: Any = 8,
        max_batch_size: Any = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool = False,
        **kwargs,
    ):
        super().__init__()
        from ccft.core.checkpoint import load_decoder, read_meta
        from ccft.core.models import DEFAULT_BASE, load_base

        unknown = {k: v for k, v in kwargs.items() if v is not None}
        if unknown:
            raise ConfigError(
                f"lm-eval model ccft: unknown model_args {sorted(unknown)}; known: base, decoder, mode, "
                "dtype, device, batch_size, max_length, max_gen_toks, add_bos_token"
            )
        spec = get_mode(mode)
        if spec.needs_decoder and not decoder:
            raise ConfigError(f"mode={mode!r} needs decoder=PATH in --model_args")
        meta = read_meta(decoder) if decoder else {}
        base_name = (
            base or (meta.get("base", {}).get("path") or meta.get("base", {}).get("name")) or DEFAULT_BASE
        )
        self._device = _pick_device(device)
        self.base = load_base(base_name, dtype=dtype, device=self._device)
        # mode=base with a decoder: the decoder only names the base (and handoff_tokens); the base decodes
        self.decoder = (
            load_decoder(decoder, base=self.base, dtype=dtype) if decoder and spec.needs_decoder else None
        )
        self.spec = check_mode(mode, self.decoder)
        self.mode = mode
        self.handoff_tokens = int(meta.get("handoff_tokens", 1))
        self.tokenizer = self.base.tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _as_bool(add_bos_token)
        self._max_length = (
            int(max_length)
            if max_length
            else int(getattr(self.base.config, "max_position_embeddings", 2048) or 2048)
        )

    # -------------------------------------------------------------------- tokenizer plumbing

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "ccft")).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs
    ):
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        ids = self.tokenizer(string, add_special_tokens=special)["input_ids"]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # -------------------------------------------------------------------- scoring

    @torch.no_grad()
    def _batch_logprobs(self, contexts: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum log p(cont | context), greedy) per row, in this object's mode, one forward for the batch."""
        k0 = self.handoff_tokens
        ks = [min(k0, len(c)) for c in contexts]
        prefixes = [c[: len(c) - k] for c, k in zip(contexts, ks, strict=True)]
        tails = [c[len(c) - k :] + x for c, k, x in zip(contexts, ks, conts, strict=True)]
        pad = pad_token_id(self.tokenizer)
        tail_ids, tail_mask = right_pad(tails, pad)
        tail_ids, tail_mask = tail_ids.to(self._device), tail_mask.to(self._device)
        if self.spec.shared_prefill:
            with self.base.base_weights() as model:
                cache = ragged_prefill(
                    model, prefixes, pad_token_id=pad, fingerprint=self.base.fingerprint, producer="base"
                )
            cache.check_reader(self.decoder.fingerprint, self.decoder.dtype)
            # in the decoder's C_base format (issue 35; ccft.generate does the same for generate_until)
            cache = read_cache(cache, self.decoder.cache_format)
            logits = decoder_forward(self.decoder, cache, tail_ids, tail_mask)
        else:
            prefix_ids, prefix_mask = left_pad(prefixes, pad)
            args = (prefix_ids.to(self._device), prefix_mask.to(self._device), tail_ids, tail_mask)
            if self.spec.needs_decoder:  # the decoder prefills its own context
                logits = full_forward(self.decoder, *args)
            else:
                with self.base.base_weights() as model:
                    logits = full_forward(model, *args)
        logp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, (k, x) in enumerate(zip(ks, conts, strict=True)):
            # tail token j is predicted by logit j-1; the continuation occupies tail positions k .. k+len(x)-1
            lp = logp[i, k - 1 : k - 1 + len(x)]
            target = torch.tensor(x, device=lp.device)
            out.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        rows = []
        for i, (_key, ctx, cont) in enumerate(requests):
            ctx, cont = list(ctx), list(cont)
            if not cont:
                raise ConfigError("loglikelihood request with an empty continuation")
            over = len(ctx) + len(cont) - self.max_length
            if over > 0:  # left-truncate the context, keep at least one token of it
                ctx = ctx[min(over, len(ctx) - 1) :]
            rows.append((i, ctx, cont))
        rows.sort(key=lambda r: -(len(r[1]) + len(r[2])))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), desc=f"loglikelihood [ccft {self.mode}]", disable=disable_tqdm)
        for s in range(0, len(rows), self.batch_size):
            chunk = rows[s : s + self.batch_size]
            for (i, _, _), r in zip(
                chunk, self._batch_logprobs([c for _, c, _ in chunk], [x for _, _, x in chunk]), strict=True
            ):
                results[i] = r
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, r)
            bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in tqdm(requests, desc=f"loglikelihood_rolling [ccft {self.mode}]", disable=disable_tqdm):
            (string,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, c, x) for c, x in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # -------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"generate_until [ccft {self.mode}]", disable=disable_tqdm)
        for key, idx in groups.items():
            kw = dict(json.loads(key))
            until = kw.pop("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            do_sample = _as_bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 1.0) or 0.0)
            if temperature == 0.0:
                do_sample = False
            top_p = float(kw.pop("top_p", 1.0) or 1.0)
            prompts = []
            for i in idx:
                ids = self.tok_encode(requests[i].args[0])
                room = self.max_length - max_new
                prompts.append(ids[-room:] if room > 0 and len(ids) > room else ids)
            short = [
                requests[i].args[0][:40]
                for i, p in zip(idx, prompts, strict=True)
                if len(p) < self.handoff_tokens + 1
            ]
            if short:
                raise ConfigError(
                    f"contexts shorter than handoff_tokens+1={self.handoff_tokens + 1} tokens: {short}"
                )
            for s in range(0, len(idx), self.batch_size):
                sub = idx[s : s + self.batch_size]
                gens = generate(
                    prompts[s : s + self.batch_size],
                    mode=self.mode,
                    base=self.base,
                    decoder=self.decoder,
                    max_new_tokens=max_new,
                    stop=until,
                    do_sample=do_sample,
                    temperature=temperature or 1.0,
                    top_p=top_p,
                    batch_size=len(sub),
                )
                for i, g in zip(sub, gens, strict=True):
                    results[i] = g.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, g.text)
                bar.update(len(sub))
        bar.close()
        return results  # type: ignore[return-value]


def main() -> None:
    """``python -m ccft.evals.lm_eval_model ARGS``: lm-eval's own CLI with the ``ccft`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
