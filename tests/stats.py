"""Statistical checks for sampling tests."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import chi2, norm

P_VALUE_FLOOR = 1e-4  # a correct sampler fails a check with at most this probability


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


def _z_threshold(num_cells: int) -> float:
    """Two-sided z threshold of ``num_cells`` Bonferroni-corrected tests at ``P_VALUE_FLOOR``."""
    return float(-norm.ppf(P_VALUE_FLOOR / (2 * num_cells)))


def samples_to_detect(min_mass: float, relative_error: float, num_cells: int, power: float = 0.9) -> int:
    """Samples with which :func:`assert_cells_match` catches a ``relative_error`` in one cell of
    mass ``min_mass`` with probability ``power`` (normal approximation of the cell count)."""
    z = _z_threshold(num_cells) + float(norm.ppf(power))
    shift = min_mass * relative_error  # the wrong cell's mass moves by this much
    return math.ceil((z * math.sqrt(min_mass * (1 - min_mass)) / shift) ** 2)


def assert_cells_match(samples: np.ndarray, probs: np.ndarray, min_mass: float) -> None:
    """Every outcome of mass >= ``min_mass`` is observed as often as ``probs`` says: one
    binomial z-test per such cell, Bonferroni-corrected to ``P_VALUE_FLOOR`` in all."""
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size).astype(np.float64)
    n = counts.sum()
    cells = np.flatnonzero(probs >= min_mass)
    z = (counts[cells] - n * probs[cells]) / np.sqrt(n * probs[cells] * (1 - probs[cells]))
    worst = int(np.argmax(np.abs(z)))
    limit = _z_threshold(len(cells))
    assert abs(z[worst]) < limit, (
        f"outcome {cells[worst]}: {counts[cells[worst]]:.0f} samples, expected {n * probs[cells[worst]]:.0f} "
        f"(z = {z[worst]:.1f}, limit {limit:.1f})"
    )
