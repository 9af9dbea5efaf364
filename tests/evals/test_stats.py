"""Bootstrap CIs, paired deltas and pass@k against brute force (docs/design.md K8: pass@k for c=0, k>n)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ccft.evals.stats import bootstrap_ci, mean_ci, paired_bootstrap_delta, pass_at_k

# ---------------------------------------------------------------- pass@k


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(1 for s in subsets if any(i < c for i in s))
    return hits / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = pass_at_k(n, c, k)
            assert got == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
            assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 10) == 1.0  # k = n with c > 0
    assert pass_at_k(10, 3, 8) == 1.0  # n - c < k
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is c/n
    assert pass_at_k(200, 37, 1) == pytest.approx(37 / 200)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 100) overflows a float; the product form must not.
    got = pass_at_k(1000, 5, 100)
    exact = 1 - math.comb(995, 100) / math.comb(1000, 100)  # int / int is correctly rounded
    assert got == pytest.approx(exact, rel=1e-12)
    assert 0.0 < got < 1.0


@pytest.mark.parametrize(
    ("n", "c", "k", "msg"),
    [
        (5, 2, 6, "k=6 > n=5"),
        (0, 0, 1, "k=1 > n=0"),
        (5, 6, 1, "c=6"),
        (-1, 0, 1, "n must be >= 0"),
        (5, -1, 1, "c must be >= 0"),
        (5, 2, -1, "k must be >= 0"),
        (5, 2, 0, "k must be >= 1"),
        (5.0, 2, 1, "n must be an int"),
    ],
)
def test_pass_at_k_errors(n, c, k, msg):
    with pytest.raises(ValueError, match=msg):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- bootstrap


def _binary(n: int, p: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_bootstrap_ci_contains_mean():
    for n in (20, 100, 1319):
        x = _binary(n, 0.6, seed=n)
        lo, hi = bootstrap_ci(x)
        assert lo <= x.mean() <= hi
        assert 0.0 <= lo < hi <= 1.0


def test_bootstrap_ci_shrinks_with_n():
    widths = []
    for n in (50, 500, 5000):
        lo, hi = bootstrap_ci(_binary(n, 0.5, seed=1))
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    # width ~ 1/sqrt(n): 10x the data, about 1/3.16 the width
    assert widths[0] / widths[1] == pytest.approx(math.sqrt(10), rel=0.25)
    # and close to the normal-approximation width 2 * 1.96 * sqrt(p(1-p)/n)
    assert widths[2] == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 5000), rel=0.1)


def test_bootstrap_ci_deterministic_by_seed():
    x = _binary(300, 0.4, seed=7)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
    assert bootstrap_ci(list(x), seed=3) == bootstrap_ci(x, seed=3)
    assert bootstrap_ci(x, seed=3) != bootstrap_ci(x, seed=4)


def test_bootstrap_ci_higher_confidence_is_wider():
    x = _binary(200, 0.5, seed=2)
    lo90, hi90 = bootstrap_ci(x, confidence=0.90)
    lo99, hi99 = bootstrap_ci(x, confidence=0.99)
    assert lo99 <= lo90 and hi90 <= hi99


def test_bootstrap_ci_constant_and_single():
    assert bootstrap_ci([0.7] * 10) == (pytest.approx(0.7), pytest.approx(0.7))
    assert bootstrap_ci([1.0]) == (1.0, 1.0)


def test_bootstrap_blocking_large_n():
    # n large enough that resamples are drawn in several blocks; still sane and deterministic.
    x = _binary(20000, 0.3, seed=5)
    ci = bootstrap_ci(x, n_resamples=300)
    assert ci == bootstrap_ci(x, n_resamples=300)
    assert ci[0] <= x.mean() <= ci[1]


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"values": []}, "empty"),
        ({"values": np.zeros((2, 2))}, "one-dimensional"),
        ({"values": [1.0, float("nan")]}, "NaN"),
        ({"values": [1.0], "n_resamples": 0}, "n_resamples"),
        ({"values": [1.0], "confidence": 1.0}, "confidence"),
        ({"values": [1.0], "confidence": 0.0}, "confidence"),
    ],
)
def test_bootstrap_ci_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        bootstrap_ci(**kwargs)


def test_mean_ci():
    x = _binary(400, 0.25, seed=9)
    out = mean_ci(x, seed=11)
    assert set(out) == {"mean", "ci", "n"}
    assert out["n"] == 400
    assert out["mean"] == pytest.approx(x.mean())
    assert out["ci"] == bootstrap_ci(x, seed=11)
    with pytest.raises(ValueError, match="empty"):
        mean_ci([])


# ---------------------------------------------------------------- paired delta


def test_paired_identical_is_exactly_zero():
    x = _binary(500, 0.5, seed=3)
    out = paired_bootstrap_delta(x, x.copy())
    assert out["delta"] == 0.0
    assert out["ci"] == (0.0, 0.0)
    assert out["n"] == 500


def test_paired_delta_value_and_keys():
    a = np.array([1, 1, 0, 1, 0, 1, 1, 0], dtype=float)
    b = np.array([1, 0, 0, 1, 0, 0, 1, 0], dtype=float)
    out = paired_bootstrap_delta(a, b, seed=1)
    assert set(out) == {"delta", "ci", "n"}
    assert out["delta"] == pytest.approx(a.mean() - b.mean())
    assert out["n"] == 8
    # every per-item difference is >= 0, so every resampled delta is too
    assert 0.0 <= out["ci"][0] <= out["delta"] <= out["ci"][1]


def test_paired_uses_same_indices_for_both():
    # With the same seed, the paired resamples are exactly the per-array resamples subtracted:
    # a constant shift b = a - 0.1 gives a degenerate interval at 0.1.
    a = np.random.default_rng(0).random(200)
    out = paired_bootstrap_delta(a, a - 0.1)
    assert out["ci"][0] == pytest.approx(0.1) and out["ci"][1] == pytest.approx(0.1)


def test_paired_narrower_than_unpaired_for_correlated_data():
    rng = np.random.default_rng(42)
    n = 1000
    difficulty = rng.random(n)
    # Two systems that mostly solve the same problems; a is slightly better.
    a = (difficulty < 0.62).astype(float)
    b = (difficulty < 0.58).astype(float)
    paired = paired_bootstrap_delta(a, b, seed=0)
    paired_width = paired["ci"][1] - paired["ci"][0]

    # Unpaired: independent resamples of a and b.
    reps = 2000
    ma = a[np.random.default_rng(1).integers(0, n, size=(reps, n))].mean(axis=1)
    mb = b[np.random.default_rng(2).integers(0, n, size=(reps, n))].mean(axis=1)
    lo, hi = np.quantile(ma - mb, [0.025, 0.975])
    unpaired_width = hi - lo

    # Exact: delta = mean(a) - mean(b) = #{0.58 <= difficulty < 0.62} / n, counted here without a or b
    # (44 of these 1000 seeded draws: 620 below 0.62, 576 below 0.58).
    in_band = int(((difficulty >= 0.58) & (difficulty < 0.62)).sum())
    assert (in_band, int(a.sum()), int(b.sum())) == (44, 620, 576)
    assert paired["delta"] == pytest.approx(44 / 1000, rel=1e-12, abs=0.0)
    assert paired_width < 0.5 * unpaired_width
    assert paired["ci"][0] > 0.0  # the paired test sees the improvement


def test_paired_length_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match=r"len\(a\)=3 != len\(b\)=4"):
        paired_bootstrap_delta([1, 0, 1], [1, 0, 1, 1])


def test_paired_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap_delta([], [])
