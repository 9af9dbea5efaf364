"""MultiPL-E generation with and without stopping at the language's stop tokens (docs/study.md, "Time").

The study's MultiPL-E decode in base mode (the 12 languages x their first 10 items, 256 new tokens, 64 engine
rows, one ``decode_ahead`` as in the study), once decoding every row on to ``max_new_tokens`` (what the study
did before 2026-12-02: a stop string no text contains) and once stopping at the language's stop tokens (now).
Prints both wall times and token counts, and checks that every scored completion (the text cut at the stop
tokens, as ``MultiPLETask.postprocess`` scores it) is the same in both.

``--modes four`` decodes the study's four modes jointly (480 rows, as the study does): base, and LoRA decoders
(r=16, PEFT's default initialisation, so their texts equal the base's) as full-ft on its own prefill, naive
and prefillshare on C_base: the engine's mixed steps and refills at the study's row count, with the base's
stop positions (the trained decoders' own lengths differ).

    .venv/bin/python benchmarks/multipl_e_stop.py --out benchmarks/results/multipl_e_stop_cpu.json
    .venv/bin/python benchmarks/multipl_e_stop.py --modes four \\
        --out benchmarks/results/multipl_e_stop_cpu_4modes.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import ccft
from ccft.evals.generation import EvalMemo
from ccft.evals.multipl_e import MULTIPL_E_LANGUAGES, MultiPLETask, language_stop
from ccft.evals.protocol import task_stop
from ccft.evals.results import hardware
from ccft.evals.runner import EvalSettings, ModeSpec, decode_ahead
from ccft.evals.scoring import prepare

NEVER = ("\x00\x01",)
LIMIT, MAX_NEW, ROWS = 10, 256, 64


def mode_list(base, which: str) -> list[ModeSpec]:
    """``base`` alone, or the study's four modes with freshly initialised LoRA decoders (texts equal the
    base's)."""
    if which == "base":
        return [ModeSpec("base")]
    ff = ccft.make_decoder(base, "lora", method="full-ft", adapter_name="ff")
    cc = ccft.make_decoder(base, "lora", method="ccft", adapter_name="cc")
    return [
        ModeSpec("base"),
        ModeSpec("full-ft", ff, "ff"),
        ModeSpec("naive", ff, "ff"),
        ModeSpec("prefillshare", cc, "cc"),
    ]


def run(base, specs: list[ModeSpec], kind: str) -> tuple[float, int, dict[str, str]]:
    """(seconds, generated tokens, scored completion per mode/task/item) of one joint decode of every
    language."""
    tasks = [
        (
            MultiPLETask(
                name=f"multipl-e-{lang}",
                language=lang,
                stop=NEVER if kind == "never" else language_stop(lang),
            ),
            EvalSettings(limit=LIMIT, max_new_tokens=MAX_NEW, engine=True),
        )
        for lang in MULTIPL_E_LANGUAGES
    ]
    memo = EvalMemo()
    t0 = time.perf_counter()
    decode_ahead(tasks, base, specs, Path(tempfile.mkdtemp()), memo=memo, batch_size=ROWS, progress=False)
    seconds = time.perf_counter() - t0
    tokens, scored = 0, {}
    for task, _ in tasks:
        scorer = MultiPLETask(name=task.name, language=task.language)  # cuts at the language's stop tokens
        prep = prepare(task, base.tokenizer, LIMIT)
        for spec in specs:
            for item, prompt in zip(prep.items, prep.prompts, strict=True):
                text, _, n = memo.get(spec, prompt, tuple(task_stop(task, item)), MAX_NEW, 1)
                tokens += n
                scored[f"{spec.mode}/{task.name}/{item.id}"] = scorer.postprocess(item, text)
    return seconds, tokens, scored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument(
        "--modes",
        choices=("base", "four"),
        default="base",
        help="base alone (120 rows) or the study's four modes decoded jointly (480 rows)",
    )
    args = ap.parse_args()
    base = ccft.load_base("smollm2-135m-instruct", dtype="float32")
    specs = mode_list(base, args.modes)
    res = {}
    for kind in ("never", "stop"):
        res[kind] = run(base, specs, kind)
        print(
            f"{kind}: {res[kind][0]:.1f} s, {res[kind][1]} generated tokens, {len(res[kind][2])} generations",
            flush=True,
        )
    equal = sum(res["never"][2][k] == res["stop"][2][k] for k in res["never"][2])
    t_ratio, n_ratio = res["stop"][0] / res["never"][0], res["stop"][1] / res["never"][1]
    print(
        f"scored completions equal: {equal} of {len(res['never'][2])}; stop / never: time {t_ratio:.3f}, "
        f"tokens {n_ratio:.3f}"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "what": (
                        "MultiPL-E base-mode greedy decode"
                        if args.modes == "base"
                        else "MultiPL-E greedy decode of the four modes jointly "
                        "(LoRA decoders freshly initialised)"
                    )
                    + f", {len(MULTIPL_E_LANGUAGES)} languages x {LIMIT} items, "
                    f"max_new_tokens {MAX_NEW}, {ROWS} engine rows; never = decode to max_new_tokens and cut "
                    f"afterwards, stop = stop at the language's stop tokens",
                    "model": "smollm2-135m-instruct (embedded), float32",
                    "hardware": hardware(),
                    "generations": len(res["never"][2]),
                    "seconds": {k: round(v[0], 1) for k, v in res.items()},
                    "new_tokens": {k: v[1] for k, v in res.items()},
                    "scored_completions_equal": equal,
                    "time_ratio_stop_vs_never": round(t_ratio, 3),
                    "token_ratio_stop_vs_never": round(n_ratio, 3),
                    # the freshly initialised decoders' texts equal the base's (LoRA B = 0): the proxy's row
                    # lengths
                    "scored_completions_equal_to_base": sum(
                        v == res["stop"][2]["base/" + k.split("/", 1)[1]] for k, v in res["stop"][2].items()
                    ),
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
