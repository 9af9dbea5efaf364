"""ccft.core: the rules every other layer builds on (docs/design.md, "Layers").

Models and their fingerprint, token ids, ``C_base`` (``BaseCache``), the decode module (``Decoder``),
the four evaluation modes, sampling, stop strings, reference generation, checkpoints and atomic writes.
Nothing here imports ``ccft.train``, ``ccft.inference``, ``ccft.serving``, ``ccft.evals`` or ``ccft.cli``.
"""
