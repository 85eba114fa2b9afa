"""Quantized weights: the weight type (:class:`QuantizedWeight`), its schemes (:class:`Scheme`),
round-to-nearest quantization of a matrix and of whole models and drafters (:func:`quantize`), and
the matmul that takes either a weight array or a quantized weight (:func:`matmul`)."""

from jspec.quant.encode import check_platform, quantize_matrix
from jspec.quant.scheme import Scheme
from jspec.quant.tree import quantize, quantize_like, quantized_layout
from jspec.quant.weight import (MATMUL_WEIGHT, TABLE_WEIGHT, QuantizedWeight, dequantize, matmul,
                                matmul_parts)

__all__ = [
    "MATMUL_WEIGHT",
    "QuantizedWeight",
    "Scheme",
    "TABLE_WEIGHT",
    "check_platform",
    "dequantize",
    "matmul",
    "matmul_parts",
    "quantize",
    "quantize_like",
    "quantized_layout",
]
