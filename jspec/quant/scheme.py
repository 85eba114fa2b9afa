"""Quantization schemes by name: ``"int8"``, ``"fp8"``, ``"int4"``, ``"int4-g64"``, ``"int4-g32-sym"``, ...

A scheme is a format of the values, the K extent of one scale (a group; None: per output channel,
one group of all K) and whether each group has a min (``w = scale * q + min``; int4 ``q`` in 0..15,
int8 ``q`` in 0..127 when quantized here, GGUF's 5-bit codes 0..31 when repacked from a file) or is
symmetric (``w = scale * q``; int4 ``q`` in -8..7, int8 -127..127). fp8 is always symmetric.
Names: int4 has mins unless ``-sym``; int8 is symmetric unless ``-mins``.

Plain ``"int4"`` is group 128 with mins: round-to-nearest int4 costs small models far more than
large ones, and mins recover much of it (a numpy trial of int4 g128 on SmolLM2-135M and
Qwen2.5-Coder-0.5B: 1.29x / 1.11x the fp32 perplexity with mins against 1.38x / 1.24x symmetric;
int8 per channel 1.01x / 1.00x). A min costs the bytes of a second scale per group.
"""

from __future__ import annotations

import dataclasses
import re

FORMATS = ("int8", "fp8", "int4")
DEFAULT_INT4_GROUP = 128
# The largest |q| a symmetric format stores (int4 stores -8 too: its scale maps the extreme to +-7).
MAX_CODE = {"int8": 127, "fp8": 448, "int4": 7}
# The highest code of a group with a min: codes 0..LEVELS (int8 keeps them non-negative in its int8).
LEVELS = {"int4": 15, "int8": 127}
_NAME = re.compile(r"(int8|fp8|int4)(?:-g(\d+))?(-sym|-mins)?")
_FORMS = ("'int8', 'fp8', 'int4' (= 'int4-g128', with mins), 'int4-g<G>' (with mins), 'int4-g<G>-sym' or "
          "'int4-sym'; 'int8-g<G>' / 'fp8-g<G>' for K-groups instead of one scale per output channel; "
          "'int8-g<G>-mins' for int8 with a min per group")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A quantization scheme (static, hashable); :meth:`parse` reads its name."""

    format: str  # one of FORMATS
    group_size: int | None = None  # entries along K per scale; None: one scale per output channel
    mins: bool = False  # a min per group (int4, int8)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"quantization format must be one of {FORMATS}, got {self.format!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"quantization group size must be positive, got {self.group_size}")
        if self.format == "int4" and (self.group_size is None or self.group_size % 2):
            # Two codes share a byte along K: a byte never straddles two groups.
            raise ValueError(f"int4 needs an even group size along K, got {self.group_size}")
        if self.mins and self.format not in LEVELS:
            raise ValueError(f"{self.format} is symmetric: only {' and '.join(LEVELS)} have mins")

    @classmethod
    def parse(cls, scheme: str | Scheme) -> Scheme:
        """The scheme a name stands for (module docstring); ``ValueError`` naming a bad one."""
        if isinstance(scheme, Scheme):
            return scheme
        match = _NAME.fullmatch(scheme) if isinstance(scheme, str) else None
        if match is None:
            raise ValueError(f"unknown quantization scheme {scheme!r}: expected {_FORMS}")
        fmt, group, suffix = match.groups()
        if suffix == "-sym" and fmt != "int4":
            raise ValueError(f"unknown quantization scheme {scheme!r}: '-sym' is for int4 ({fmt} is symmetric "
                             "unless '-mins')")
        if suffix == "-mins" and fmt not in LEVELS:
            raise ValueError(f"unknown quantization scheme {scheme!r}: {fmt} has no mins")
        if fmt == "int4":
            return cls(fmt, DEFAULT_INT4_GROUP if group is None else int(group), mins=suffix != "-sym")
        return cls(fmt, None if group is None else int(group), mins=suffix == "-mins")

    @property
    def name(self) -> str:
        group = "" if self.group_size is None else f"-g{self.group_size}"
        if self.format == "int4":
            return f"{self.format}{group}{'' if self.mins else '-sym'}"
        return f"{self.format}{group}{'-mins' if self.mins else ''}"
