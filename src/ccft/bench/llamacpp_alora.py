"""A CCFT decoder inside llama.cpp: ``ccft export DECODER --to gguf-alora OUT`` and llama-server's aLoRA
requests.

llama.cpp's server shares one prompt's KV cache between the base and activated-LoRA (aLoRA) adapters: for
a request naming an aLoRA adapter it computes the prompt before the adapter's invocation tokens without
the adapter, so that part of a slot's cache is the base's and is reused across base → aLoRA and
aLoRA → aLoRA requests. That is PrefillShare's sharing (one ``C_base``, many decoders) for LoRA decoders,
in an engine people deploy.

**The boundary.** A CCFT decoder with handoff ``k`` reads ``C_base(prompt[:n-k])`` and computes
``prompt[n-k:]`` and the response with its adapter (docs/design.md, "Terms"). PEFT's aLoRA turns the
adapter on at the *start* ``s`` of the last occurrence of its invocation tokens, so ``ccft export --to
peft-alora`` writes the k handoff ids (``ccft.train.export``). llama-server (the tree ``make llamacpp``
builds, ``tools/server/server-context.cpp``) finds the same ``s`` but processes only ``prompt[:s-1]``
without the adapter, and caps cache reuse at ``s - 1``: its adapter is on from **one token before** the
invocation tokens (its own converter drops the first token of older aLoRAs' invocation strings for the
same reason). With the k handoff ids as invocation tokens llama.cpp would compute k + 1 tokens with the
adapter — a different model from the one trained. So the GGUF's invocation tokens are the handoff ids
without their first token (:func:`gguf_invocation_tokens`): ``s = n - k + 1``, adapter on from ``n - k``,
exactly ccft's prefillshare. ``k = 1`` cannot be written that way (an empty invocation) and is refused
with the fix (retrain with ``handoff_tokens >= 2``; 4 covers SmolLM2's ``<|im_start|>assistant\\n``).
:func:`llamacpp_adapter_start` restates the server's rule; tests/bench/test_llamacpp_alora.py checks the
export against it and (slow) against the running server, logits included.

**The export** (``OUT``, a new or empty folder, staged and renamed into place):

* ``adapter.f32.gguf`` — the adapter converted by llama.cpp's own ``convert_lora_to_gguf.py`` (same
  source tree as the build) from a PEFT folder whose ``alora_invocation_tokens`` are the GGUF's;
* ``base.f32.gguf`` — the base, converted once by ``convert_hf_to_gguf.py`` into the llama.cpp cache
  (``ccft.bench.llamacpp.convert_to_gguf``) and hard-linked (else copied) here;
* ``peft/`` — the stock PEFT aLoRA export (``ccft.train.export.export_alora``: PEFT's rule, the k ids);
* ``ccft_export.json`` (provenance, both invocation sequences, the serve command) and ``README.md``.

Serve it: ``llama-server -m OUT/base.f32.gguf --lora OUT/adapter.f32.gguf --lora-init-without-apply -fa off``
(``-fa off``: :data:`EXACT_FLAGS`; more ``--lora`` files for more decoders; ids in that order) and send
``"lora": [{"id": I, "scale": 1.0}]`` with each request (:func:`lora_field`); requests without it run the
base.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ccft.bench.llamacpp import LlamaCpp, LlamaCppError, convert_to_gguf, ensure_built, post_json
from ccft.core.errors import ConfigError

__all__ = [
    "EXACT_FLAGS",
    "GGUF_ALORA_TARGET",
    "GgufAloraExport",
    "alora_server_args",
    "complete",
    "export_gguf_alora",
    "gguf_invocation_tokens",
    "llamacpp_adapter_start",
    "lora_field",
]

GGUF_ALORA_TARGET = "gguf-alora"
#: llama-server flags for fp32-exact attention: its CPU flash attention (on by default, ``-fa auto``) rounds
#: through fp16 (measured on the tiny test Llama: log-probabilities 5.8e-3 from HF's with it, 9e-5 without)
EXACT_FLAGS = ("-fa", "off")
#: llama-server turns an aLoRA adapter on this many tokens before its invocation tokens start
LLAMACPP_EARLY_TOKENS = 1


def gguf_invocation_tokens(handoff_ids: Sequence[int]) -> list[int]:
    """The invocation tokens to write into a GGUF aLoRA so llama-server's adapter starts at the handoff.

    Args:
        handoff_ids: the decoder's k handoff ids (the last k ids of every prompt; ``ccft.train.export.
            invocation_sequence``).
    Returns:
        ``handoff_ids[1:]`` (llama-server starts the adapter :data:`LLAMACPP_EARLY_TOKENS` token before them).
    Raises:
        ConfigError: k < 2 (the invocation would be empty); the message names the fix.
    """
    ids = [int(t) for t in handoff_ids]
    if len(ids) <= LLAMACPP_EARLY_TOKENS:
        raise ConfigError(
            f"handoff_tokens={len(ids)}: llama-server turns an aLoRA adapter on one token before its "
            "invocation tokens, so a decoder with a 1-token handoff would need an empty invocation sequence, "
            "which llama.cpp cannot express. Fix: retrain with handoff_tokens >= 2 (for SmolLM2, "
            "handoff_tokens: 4 covers the generation prompt <|im_start|>assistant\\n), or serve it with ccft "
            "/ export --to peft-alora"
        )
    return ids[LLAMACPP_EARLY_TOKENS:]


def llamacpp_adapter_start(prompt_ids: Sequence[int], invocation_ids: Sequence[int]) -> int | None:
    """The first prompt position llama-server computes with an aLoRA adapter, or None when it stays off.

    llama-server's rule (pinned tree, ``tools/server/server-context.cpp``): scan the prompt backwards for
    the last occurrence of ``invocation_ids``; with its start ``s`` the tokens ``[0, s-1)`` run without the
    adapter and the rest with it (cache reuse is capped at ``s - 1``). No occurrence: the adapter is off.
    """
    prompt, inv = list(prompt_ids), list(invocation_ids)
    if not inv:
        return None
    for s in range(len(prompt) - len(inv), -1, -1):
        if prompt[s : s + len(inv)] == inv:
            return max(0, s - LLAMACPP_EARLY_TOKENS)
    return None


@dataclass
class GgufAloraExport:
    """What :func:`export_gguf_alora` wrote (paths inside ``out``).

    Attributes:
        out: the export folder.
        adapter_gguf / base_gguf: the GGUF files (f32).
        peft_dir: the PEFT aLoRA export (PEFT's invocation rule).
        handoff_ids: the decoder's k handoff ids (PEFT's invocation tokens).
        invocation_ids: the GGUF's invocation tokens (``handoff_ids[1:]``).
        warnings: sentences for the user.
    """

    out: Path
    adapter_gguf: Path
    base_gguf: Path
    peft_dir: Path
    handoff_ids: list[int]
    invocation_ids: list[int]
    warnings: list[str] = field(default_factory=list)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)


def export_gguf_alora(
    decoder_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    build: LlamaCpp | None = None,
    jobs: int = 2,
    log: Callable[[str], None] = print,
    runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> GgufAloraExport:
    """Export the CCFT LoRA decoder folder ``decoder_path`` for llama.cpp (see the module docstring).

    Args:
        decoder_path: a ``ccft train`` output of a LoRA decoder trained with ``method: ccft`` and
            ``handoff_tokens >= 2`` on chat prompts.
        out: a new (or empty) folder.
        build: a llama.cpp build (default: ``ensure_built()``, which builds the pinned tree once).
        jobs: parallel compile jobs when llama.cpp must be built.
    Returns:
        :class:`GgufAloraExport`.
    Raises:
        ConfigError: a non-empty ``out``, a full-weight or ``full-ft`` decoder, ``handoff_tokens`` < 2, or
            what ``ccft.train.export.export_alora`` refuses — all before any model is loaded or anything is
            built, where ``ccft.json`` tells.
        LlamaCppError: llama.cpp cannot be built, or its converters fail (the message has their output).
    """
    from ccft.core.checkpoint import read_meta
    from ccft.core.models import resolve_model_path
    from ccft.train.export import EXPORT_META_FILE, check_alora_kind, check_export_folder, export_decoder

    out = check_export_folder(out)
    meta = read_meta(decoder_path)
    k = int(meta.get("handoff_tokens", 1))
    kind = meta.get("decoder_kind") or (
        "lora" if (Path(decoder_path) / "adapter_config.json").is_file() else "full"
    )
    check_alora_kind(  # --to peft-alora's refusals, before any load
        kind, meta.get("method"), str(decoder_path), meta.get("share_from_layer", 0), meta.get("cache_format")
    )
    if k <= LLAMACPP_EARLY_TOKENS:
        gguf_invocation_tokens([0] * k)  # raises the ConfigError naming the fix
    build = build or ensure_built(jobs=jobs, log=log, runner=runner)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        peft_dir = tmp / "peft"
        result = export_decoder(decoder_path, "peft-alora", peft_dir)
        handoff = list(result.invocation.ids)
        invocation = gguf_invocation_tokens(handoff)
        export_meta = json.loads((peft_dir / EXPORT_META_FILE).read_text())
        base = export_meta.get("base") or {}
        base_dir = resolve_model_path(base.get("path") or base.get("name"))
        # the converter's input: the PEFT folder with llama.cpp's invocation tokens (PEFT's stays as exported)
        staged = tmp / "peft-for-llamacpp"
        shutil.copytree(peft_dir, staged)
        cfg = json.loads((staged / "adapter_config.json").read_text())
        cfg["alora_invocation_tokens"] = invocation
        (staged / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        adapter = tmp / "adapter.f32.gguf"
        cmd = [
            sys.executable,
            build.source / "convert_lora_to_gguf.py",
            "--base",
            base_dir,
            "--outtype",
            "f32",
            "--outfile",
            adapter,
            staged,
        ]
        log("[ccft] $ " + " ".join(map(str, cmd)))
        proc = runner([str(c) for c in cmd], capture_output=True, text=True)
        if proc.returncode != 0 or not adapter.is_file():
            raise LlamaCppError(
                f"llama.cpp's convert_lora_to_gguf.py failed (exit {proc.returncode}):\n"
                f"{(proc.stderr or '')[-2000:]}"
            )
        shutil.rmtree(staged)
        cached_base = convert_to_gguf(
            build, base_dir, export_meta["base_fingerprint"], log=log, runner=runner
        )
        _link_or_copy(cached_base, tmp / "base.f32.gguf")
        serve = (
            "llama-server -m base.f32.gguf --lora adapter.f32.gguf --lora-init-without-apply -ctk f32 "
            "-ctv f32 -fa off; "
            'per request: "lora": [{"id": 0, "scale": 1.0}]'
        )
        record = {
            "exported_from": str(decoder_path),
            "target": GGUF_ALORA_TARGET,
            "method": meta.get("method"),
            "base": base,
            "base_fingerprint": export_meta["base_fingerprint"],
            "handoff_tokens": k,
            "peft_alora_invocation_tokens": handoff,
            "gguf_alora_invocation_tokens": invocation,
            "invocation_text": result.invocation.text,
            "llamacpp": build.describe() | {"root": None},
            "serve": serve,
            "warnings": result.warnings,
            "files": {"adapter": "adapter.f32.gguf", "base": "base.f32.gguf", "peft": "peft/"},
        }
        (tmp / EXPORT_META_FILE).write_text(json.dumps(record, indent=2, default=str))
        (tmp / "README.md").write_text(_readme(record))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return GgufAloraExport(
        out=out,
        adapter_gguf=out / "adapter.f32.gguf",
        base_gguf=out / "base.f32.gguf",
        peft_dir=out / "peft",
        handoff_ids=handoff,
        invocation_ids=invocation,
        warnings=list(result.warnings),
    )


def _readme(record: dict) -> str:
    return (
        f"# CCFT decoder for llama.cpp (activated LoRA, GGUF)\n\n"
        f"Exported by ccft from `{record['exported_from']}` (method `{record['method']}`, handoff_tokens "
        f"{record['handoff_tokens']}, base fingerprint `{record['base_fingerprint']}`).\n\n"
        f"- `adapter.f32.gguf`: the adapter; invocation tokens {record['gguf_alora_invocation_tokens']} "
        f"(llama-server turns the adapter on one token before them, at the decoder's handoff "
        f"{record['invocation_text']!r})\n"
        "- `base.f32.gguf`: the base it reads the prompt cache of\n"
        f"- `peft/`: the same decoder as a stock PEFT aLoRA adapter (invocation tokens "
        f"{record['peft_alora_invocation_tokens']}: PEFT turns the adapter on at their start)\n\n"
        "Serve:\n\n```\nllama-server -m base.f32.gguf --lora adapter.f32.gguf --lora-init-without-apply "
        "-ctk f32 -ctv f32 -fa off\n```\n\n(`-fa off`: llama.cpp's CPU flash attention rounds through "
        'fp16)\n\nand send `"lora": [{"id": 0, "scale": 1.0}]` with each request that '
        "should decode with this decoder; requests without it run the base, and both reuse one cached prompt "
        "up to the handoff.\n"
    )


# ------------------------------------------------------------------ serving with aLoRA adapters


def alora_server_args(adapters: Sequence[str | os.PathLike], *, exact: bool = True) -> list[str]:
    """llama-server flags loading ``adapters`` (GGUF files; ids 0, 1, ... in this order) switched off until a
    request asks for one (``--lora-init-without-apply``); ``exact``: with :data:`EXACT_FLAGS`."""
    args: list[str] = [*EXACT_FLAGS] if exact else []
    for a in adapters:
        args += ["--lora", str(a)]
    return [*args, "--lora-init-without-apply"] if adapters else args


def lora_field(adapter_id: int | None, n_adapters: int) -> list[dict]:
    """The per-request ``"lora"`` field: adapter ``adapter_id`` at scale 1, every other at 0 (None: the
    base)."""
    return [{"id": i, "scale": 1.0 if i == adapter_id else 0.0} for i in range(n_adapters)]


def complete(
    url: str,
    prompt_ids: Sequence[int],
    n_predict: int,
    *,
    adapter_id: int | None = None,
    n_adapters: int = 0,
    n_probs: int = 0,
    cache_prompt: bool = True,
    timeout: float = 600.0,
) -> dict:
    """One greedy ``/completion`` request (EOS ignored) on ``prompt_ids`` (token ids, used as they are).

    Returns ``{"tokens": [...], "prompt_n": prompt tokens computed (llama.cpp's timings), "cached": prompt
    tokens reused, "top_logprobs": per generated token {token id: log-probability} of the ``n_probs`` most
    likely (from the distribution before sampling), "raw": the reply}``."""
    body = {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(n_predict),
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": cache_prompt,
        "return_tokens": True,
        "seed": 0,
        "lora": lora_field(adapter_id, n_adapters),
    }
    if n_probs:
        body["n_probs"] = int(n_probs)
        body["post_sampling_probs"] = False
    r = post_json(url + "/completion", body, timeout=timeout)
    top = []
    for step in r.get("completion_probabilities") or ():
        top.append({int(p["id"]): float(p["logprob"]) for p in step.get("top_logprobs") or ()})
    timings = r.get("timings") or {}
    return {
        "tokens": [int(t) for t in r.get("tokens") or ()],
        "prompt_n": timings.get("prompt_n"),
        "cached": r.get("tokens_cached"),
        "top_logprobs": top,
        "raw": r,
    }


def compare_with_prefillshare(
    decoder,
    url: str,
    adapter_id: int,
    n_adapters: int,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    n_probs: int = 10,
) -> dict:
    """llama-server's aLoRA outputs against ccft's prefillshare for ``decoder`` (a loaded ``ccft.Decoder``).

    Per prompt (token ids), llama-server generates ``new_tokens`` greedily with adapter ``adapter_id`` (its
    ``n_probs`` top log-probabilities per step, before sampling); ccft computes, on ``C_base(prompt[:n-k])``,
    the decoder's log-probabilities along llama.cpp's tokens (teacher forcing, so a flipped near tie does not
    hide the rest of the row) and generates greedily on its own (``ccft.core.generation.generate``).

    Returns ``{"rows", "rows_equal", "rows_equal_share", "max_logprob_gap" (largest |ccft − llama.cpp| over
    every reported (step, token)), "first_divergence" (per row: the first step whose greedy tokens differ, or
    None), "margin_at_divergence" (ccft's top-1 − top-2 log-probability there: a near tie when small)}``."""
    import torch

    import ccft
    from ccft.core.generation import generate

    k = decoder.handoff_tokens
    gaps, equal, firsts, margins = [], 0, [], []
    for prompt in prompts:
        prompt = [int(t) for t in prompt]
        got = complete(url, prompt, new_tokens, adapter_id=adapter_id, n_adapters=n_adapters, n_probs=n_probs)
        toks = got["tokens"]
        cache = ccft.compute_base_cache(decoder.base, [prompt], handoff_tokens=k)
        with torch.no_grad():
            logits = ccft.decoder_forward(decoder, cache, torch.tensor([prompt[-k:] + toks[:-1]]))[0]
        want = torch.log_softmax(logits[k - 1 :].double(), dim=-1)
        gaps.append(
            max(
                abs(float(want[i, t]) - lp)
                for i, step in enumerate(got["top_logprobs"])
                for t, lp in step.items()
            )
        )
        own = list(
            generate([prompt], mode="prefillshare", decoder=decoder, max_new_tokens=new_tokens)[0].token_ids
        )
        n = len(own)  # ccft stops at EOS; llama.cpp's request ignores it
        first = next((i for i in range(n) if own[i] != toks[i]), None)
        equal += first is None
        firsts.append(first)
        if first is not None:
            top2 = torch.topk(want[first], 2).values
            margins.append(float(top2[0] - top2[1]))
        else:
            margins.append(None)
    return {
        "rows": len(prompts),
        "rows_equal": equal,
        "rows_equal_share": equal / len(prompts) if prompts else None,
        "new_tokens": new_tokens,
        "n_probs": n_probs,
        "max_logprob_gap": max(gaps, default=None),
        "logprob_gap_per_row": gaps,
        "first_divergence": firsts,
        "margin_at_divergence": margins,
    }


def cache_reuse(url: str, prompt: Sequence[int], n_adapters: int, *, new_tokens: int = 4) -> dict:
    """Prompt tokens llama-server computes for one prompt sent as base, then adapter 0, then adapter 1 (if
    loaded), each on the cache the previous left (``timings.prompt_n``); the first request gets a fresh slot
    prompt (``cache_prompt`` false)."""
    out = {
        "prompt_tokens": len(prompt),
        "base_first": complete(url, prompt, new_tokens, n_adapters=n_adapters, cache_prompt=False)[
            "prompt_n"
        ],
    }
    out["alora_after_base"] = complete(url, prompt, new_tokens, adapter_id=0, n_adapters=n_adapters)[
        "prompt_n"
    ]
    if n_adapters > 1:
        out["alora_after_alora"] = complete(url, prompt, new_tokens, adapter_id=1, n_adapters=n_adapters)[
            "prompt_n"
        ]
    return out


__all__ += ["LLAMACPP_EARLY_TOKENS", "LlamaCppError", "cache_reuse", "compare_with_prefillshare"]
