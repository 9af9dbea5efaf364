"""Side-by-side benchmarks, shipped in the package so ``ccft bench`` runs from an installed wheel.

``decode`` (the inference engine against HF ``generate``, with the decode step's roofline),
``train`` (Full-FT and CCFT against TRL's ``SFTTrainer``) and ``serve`` (multi-agent serving,
PrefillShare against ``--no-share``). Each module has ``add_arguments(parser)``, ``run(args) -> dict``,
``report(result, out) -> int`` and ``main(argv)`` (``python -m ccft.bench.decode ...``).

Layer: above ``serving | evals`` and below ``cli`` (``.importlinter``); ``ccft.cli.bench`` is the
command. Measured results of the source repository live in its ``benchmarks/results/``.
"""
