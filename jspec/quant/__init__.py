"""Quantized weights: the weight type (:class:`QuantizedWeight`), its schemes (:class:`Scheme`),
round-to-nearest quantization of a matrix and of whole models and drafters (:func:`quantize`), and
the matmul that takes either a weight array or a quantized weight (:func:`matmul`)."""

from jspec.quant.encode import check_platform, quantize_matrix
from jspec.quant.scheme import Scheme
from jspec.quant.tree import dequantize_tree, quantize, quantize_like, quantized_layout
from jspec.quant.weight import (MATMUL_WEIGHT, TABLE_WEIGHT, QuantizedWeight, dequantize, in_features, matmul,
                                matmul_parts, out_features)

__all__ = [
    "MATMUL_WEIGHT",
    "QuantizedWeight",
    "Scheme",
    "TABLE_WEIGHT",
    "check_platform",
    "dequantize",
    "dequantize_tree",
    "in_features",
    "matmul",
    "matmul_parts",
    "out_features",
    "quantize",
    "quantize_like",
    "quantized_layout",
]
