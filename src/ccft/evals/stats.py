"""Statistics for eval scores: percentile bootstrap CIs (plain and paired) and unbiased pass@k.

Everything is deterministic given ``seed`` (``numpy.random.default_rng``) and vectorised over
resamples. The resample indices depend only on ``(len(values), n_resamples, seed)``, so
``bootstrap_ci(a)``, ``bootstrap_ci(b)`` and ``paired_bootstrap_delta(a, b)`` with the same seed
draw the same index sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["bootstrap_ci", "mean_ci", "paired_bootstrap_delta", "pass_at_k"]

# Upper bound on the elements of one (resamples x n) index block, to bound memory for large n.
_BLOCK_ELEMENTS = 1 << 22


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} is empty: a confidence interval needs at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return x


def _check_params(n_resamples: int, confidence: float) -> None:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)) or n_resamples < 1:
        raise ValueError(f"n_resamples must be a positive int, got {n_resamples!r}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def _resampled_means(x: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Means of ``n_resamples`` bootstrap resamples of ``x`` (indices drawn with replacement)."""
    n = x.size
    rng = np.random.default_rng(seed)
    rows = max(1, _BLOCK_ELEMENTS // n)
    out = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, rows):
        stop = min(n_resamples, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = x[idx].mean(axis=1)
    return out


def _percentile_ci(means: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = 1.0 - float(confidence)
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval ``(lo, hi)`` of the mean of ``values``.

    Draws ``n_resamples`` resamples of ``len(values)`` indices with replacement (numpy
    ``default_rng(seed)``, one vectorised draw per block), takes each resample's mean, and returns
    the ``(1-confidence)/2`` and ``(1+confidence)/2`` quantiles (Efron & Tibshirani 1993, ch. 13).
    Same inputs and seed give the same interval.

    Raises ValueError for empty, non-1-D or non-finite ``values``, ``n_resamples < 1`` or
    ``confidence`` outside (0, 1).
    """
    x = _as_1d(values, "values")
    _check_params(n_resamples, confidence)
    return _percentile_ci(_resampled_means(x, n_resamples, seed), confidence)


def mean_ci(
    values: Sequence[float] | np.ndarray,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Return ``{"mean": float, "ci": (lo, hi), "n": int}`` for ``values`` (see ``bootstrap_ci``).

    Raises ValueError as ``bootstrap_ci`` does.
    """
    x = _as_1d(values, "values")
    return {
        "mean": float(x.mean()),
        "ci": bootstrap_ci(x, n_resamples=n_resamples, confidence=confidence, seed=seed),
        "n": int(x.size),
    }


def paired_bootstrap_delta(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Paired bootstrap of ``mean(a) - mean(b)`` for two systems scored on the same items.

    ``a[i]`` and ``b[i]`` must be scores of the same item (e.g. per-problem exact match of two
    decoders on GSM8K). Each resample draws one index set and uses it for both ``a`` and ``b``
    (equivalently, resamples the per-item differences ``a - b``), so item difficulty cancels and the
    interval is narrower than one from independent resampling when the systems are correlated.

    Returns ``{"delta": mean(a) - mean(b), "ci": (lo, hi), "n": len(a)}`` (percentile interval).
    Identical ``a`` and ``b`` give delta 0.0 and ci (0.0, 0.0) exactly.

    Raises ValueError if the lengths differ (naming both), and as ``bootstrap_ci`` does.
    """
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape:
        raise ValueError(
            f"paired_bootstrap_delta needs scores of the same items: len(a)={len(xa)} "
            f"!= len(b)={len(xb)} (shapes {xa.shape} and {xb.shape})"
        )
    xa = _as_1d(xa, "a")
    xb = _as_1d(xb, "b")
    _check_params(n_resamples, confidence)
    diff = xa - xb
    return {
        "delta": float(xa.mean() - xb.mean()),
        "ci": _percentile_ci(_resampled_means(diff, n_resamples, seed), confidence),
        "n": int(xa.size),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct.

    Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"), eq. 1:
    ``pass@k = 1 - C(n-c, k) / C(n, k)``, computed in their numerically stable product form
    ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``. Returns 1.0 when ``n - c < k`` (every k-subset holds a
    correct sample) and 0.0 when ``c == 0``.

    Raises ValueError if any argument is negative or not an int, ``k < 1``, ``k > n`` (pass@k is
    undefined with fewer than k samples) or ``c > n``.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"pass_at_k: {name} must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"pass_at_k: {name} must be >= 0, got {v}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} > n={n}; pass@k needs at least k samples per problem")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct > n={n} samples")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
