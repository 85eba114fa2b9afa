"""``jspec.quantize``: every declared weight of a model or drafter quantized, and what a checkpoint
records to rebuild a quantized model's structure.

The walk follows the dataclass fields of the pytree (models, layers, drafters, heads; tuples and
dicts of them) and quantizes the value of every field declared ``MATMUL_WEIGHT`` or ``TABLE_WEIGHT``
(``jspec.quant.weight``); static fields are configs and are left alone. A table is quantized once
with its hidden axis as K: the same :class:`QuantizedWeight` serves the token lookup and, where a
model ties it, the LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.quant.encode import check_platform, quantize_matrix
from jspec.quant.scheme import Scheme
from jspec.quant.weight import MATMUL, QUANTIZE, TABLE, QuantizedWeight, dequantize

# fn(path, value, role) -> the field's new value, for every declared field that holds a weight.
WeightFn = Callable[[str, "jax.Array | QuantizedWeight", str], object]


def quantize(tree, scheme: str | Scheme):
    """``tree`` (a model of any family, a drafter, or a pytree holding them) with every matmul weight
    and embedding table quantized by ``scheme``, round to nearest; weights already quantized stay as
    they are. Schemes (``jspec.quant.scheme``): ``"int8"`` and ``"fp8"`` (e4m3) per output channel,
    ``"int4"`` (group 128 along K with a min per group: small models lose much less than symmetric),
    ``"int4-g64"``, ``"int4-g32-sym"``, ...

    Raises:
      ValueError: an unknown scheme, fp8 on a GPU without fp8 units, or a weight the scheme does not
        fit (a group size that does not divide its K; a weight that is not a 2-D float matrix),
        naming each; raised before anything is quantized.
    """
    scheme = Scheme.parse(scheme)
    check_platform(scheme)
    misfits: dict[str, list[str]] = {}  # problem -> the paths of the weights that have it
    ks = set()

    def check(path, w, role):
        if not isinstance(w, QuantizedWeight):
            for problem in _misfits(w, scheme, role):
                misfits.setdefault(problem, []).append(path)
            if w.ndim == 2:
                ks.add(w.shape[1] if role == TABLE else w.shape[0])
        return w

    map_weights(tree, check)
    if misfits:
        raise ValueError(f"cannot quantize to {scheme.name}: " + "; ".join(
            f"{problem} ({_some(paths)})" for problem, paths in misfits.items()) + _fitting_group(scheme, ks))
    return map_weights(tree, lambda path, w, role: w if isinstance(w, QuantizedWeight) else _quantized(w, scheme, role))


def _quantized(w, scheme: Scheme, role: str, k_last: bool = True) -> QuantizedWeight:
    """A weight field's value quantized, stored K last (``jspec.quant.weight``: a matmul weight
    ``[K, N]`` as ``[N, K]``, a table as it is) or, for ``k_last=False``, as it is."""
    if role == TABLE:
        return quantize_matrix(w, scheme, transposed=True)
    return quantize_matrix(w.T, scheme, transposed=True) if k_last else quantize_matrix(w, scheme)


def _misfits(w, scheme: Scheme, role: str) -> list[str]:
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        return [f"a {role} weight must be a 2-D float matrix, got {w.dtype} {tuple(w.shape)}"]
    k = w.shape[1] if role == TABLE else w.shape[0]
    if scheme.group_size is not None and k % scheme.group_size:
        return [f"group size {scheme.group_size} does not divide K = {k}"]
    return []


def _some(paths: list[str], shown: int = 3) -> str:
    """``paths`` named, the first few of a long list and how many more."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def _fitting_group(scheme: Scheme, ks: set[int]) -> str:
    """A hint naming the largest smaller group that divides every K, if the group was the problem."""
    if scheme.group_size is None or all(k % scheme.group_size == 0 for k in ks):
        return ""
    for group in (g for g in (128, 64, 32, 16) if g < scheme.group_size):
        if all(k % group == 0 for k in ks):
            return f"; {dataclasses.replace(scheme, group_size=group).name} fits every weight"
    return "; use a group size that divides every K"


def map_weights(tree, fn: WeightFn, path: str = ""):
    """``tree`` with the value of every field declared a weight (``MATMUL_WEIGHT`` / ``TABLE_WEIGHT``)
    and not None replaced by ``fn(path, value, role)``; ``path`` as ``jax.tree_util.keystr`` writes it."""
    if isinstance(tree, (QuantizedWeight, jax.Array, np.ndarray)):
        return tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_weights(item, fn, f"{path}[{i}]") for i, item in enumerate(tree))
    if isinstance(tree, dict):
        return {key: map_weights(item, fn, f"{path}[{key!r}]") for key, item in tree.items()}
    if not dataclasses.is_dataclass(tree) or isinstance(tree, type):
        return tree
    changes = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        if field.metadata.get("static") or value is None:
            continue
        role = field.metadata.get(QUANTIZE)
        at = f"{path}.{field.name}"
        changes[field.name] = fn(at, value, role) if role in (MATMUL, TABLE) else map_weights(value, fn, at)
    return dataclasses.replace(tree, **changes)


def dequantize_tree(tree, dtype=None):
    """``tree`` with every quantized weight dequantized (``jspec.quant.dequantize``, in ``dtype``) to
    the array its field holds unquantized: a matmul weight ``[K, N]`` whatever its storage, a table
    ``[V, H]``."""
    def dense(path, w, role):
        if not isinstance(w, QuantizedWeight):
            return w
        array = dequantize(w, dtype)
        return array.T if role == MATMUL and w.transposed else array

    return map_weights(tree, dense)


def quantized_layout(tree) -> dict[str, dict]:
    """``{path: {"scheme": name, "transposed": bool}}`` of every quantized weight in ``tree`` (JSON):
    what :func:`quantize_like` needs to give an unquantized tree of the same structure the same
    quantized structure (a checkpoint's abstract target)."""
    layout = {}

    def record(path, w, role):
        if isinstance(w, QuantizedWeight):
            layout[path] = {"scheme": w.scheme.name, "transposed": w.transposed}
        return w

    map_weights(tree, record)
    return layout


def quantize_like(tree, layout: dict[str, dict]):
    """``tree`` with the weights at the paths of ``layout`` (:func:`quantized_layout`) quantized as it
    records; under ``jax.eval_shape`` the abstract structure of the quantized tree."""
    def requantize(path, w, role):
        if path not in layout:
            return w
        return _quantized(w, Scheme.parse(layout[path]["scheme"]), role, k_last=layout[path]["transposed"])

    return map_weights(tree, requantize)
