"""Statistical checks for sampling tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import chi2

P_VALUE_FLOOR = 1e-4  # a correct sampler fails with this probability per test


def assert_matches_distribution(samples: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> None:
    """Chi-square goodness of fit of integer ``samples`` to ``probs`` (cells with small
    expected counts are pooled). Also fails on any sample of a zero-probability outcome."""
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size).astype(np.float64)
    impossible = counts[probs == 0].sum()
    assert impossible == 0, f"{impossible:.0f} samples of zero-probability outcomes"
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(len(obs) - 1, 1)
    p_value = float(chi2.sf(jnp.float32(stat), dof))
    assert p_value > P_VALUE_FLOOR, f"chi-square {stat:.1f} on {dof} dof, p = {p_value:.2e}"
