"""Reading HF safetensors checkpoints: the shard map, a tensor reader, and the whole-checkpoint
check that runs before any tensor data is read."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jspec.io.layout import Getter, RowSource, getter

# Buffers some exporters write that carry no parameters.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file, index.json, or all shards)."""
    path = Path(path)
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map'")
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise ValueError(f"{index_path} names the shard {f.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {path}")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} appears in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


class TensorReader:
    """Reads named tensors from a set of safetensors files, keeping each file open once.

    ``disk_names`` (optional) addresses tensors by other names than the stored ones: ``{name
    used here: name on disk}``; only those tensors are visible then. ``names`` lists what is
    visible. Use as a context manager (or call ``close``).
    """

    def __init__(self, files: dict[str, Path], disk_names: dict[str, str] | None = None):
        self._files = files
        self._disk = disk_names if disk_names is not None else {n: n for n in files}
        self._open = {}

    @property
    def names(self) -> set[str]:
        return set(self._disk)

    def _handle(self, name):
        f = self._files[self._disk[name]]
        if f not in self._open:
            self._open[f] = safe_open(f, framework="numpy").__enter__()
        return self._open[f]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self._disk[name]).get_shape())

    def get(self, name) -> np.ndarray:
        if self._handle(name).get_slice(self._disk[name]).get_dtype() in _RAW_DTYPES:
            return read_raw(self._files[self._disk[name]], self._disk[name])
        return self._handle(name).get_tensor(self._disk[name])

    def dtype(self, name) -> np.dtype:
        """The stored dtype of tensor ``name`` (no tensor data is read)."""
        return _numpy_dtype(self._handle(name).get_slice(self._disk[name]).get_dtype())

    def source(self, name) -> RowSource:
        """Tensor ``name`` read in row blocks straight from its file."""
        tensor = self._handle(name).get_slice(self._disk[name])
        return RowSource(tuple(tensor.get_shape()), lambda lo, hi: tensor[lo:hi])

    def getter(self, dtype) -> Getter:
        """``get(name_or_names, transpose=False)`` (see ``jspec.io.layout.getter``): tensors as
        device arrays of ``dtype``, PyTorch's ``[out, in]`` transposed to jspec's ``[in, out]``
        on request, a tuple of names fused along the last axis."""
        return getter(self.source, dtype)

    def close(self):
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_tensors(reader: TensorReader, names: set[str], expected: dict[str, tuple[int, ...]], *, tied: bool = False):
    """Raise ``ValueError`` naming the first problem: a missing, unexpected or mis-shaped tensor.

    ``tied``: the LM head is the embedding, so a stored ``lm_head.weight`` copy is ignored.
    """
    names = {n for n in names if not n.endswith(_IGNORABLE_SUFFIXES)}
    if tied:
        names.discard("lm_head.weight")  # some exporters write the tied copy; it is the embedding
    missing = sorted(set(expected) - names)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s) {missing[:5]}{more}")
    unexpected = sorted(names - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"checkpoint has unexpected tensor(s) {unexpected[:5]}{more}")
    for name, shape in expected.items():
        actual = reader.shape(name)
        if actual != shape:
            raise ValueError(f"tensor {name!r} has shape {actual}, expected {shape}")


def checkpoint_dtype(reader: TensorReader, name: str, dtype) -> np.dtype:
    """``dtype`` if given, else the stored dtype of tensor ``name``."""
    return np.dtype(dtype) if dtype is not None else reader.dtype(name)


_NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": ml_dtypes.bfloat16, "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                 "F8_E4M3": ml_dtypes.float8_e4m3fn}
# Dtypes safetensors' numpy reader cannot return (it asks numpy itself for float8): read as bytes.
_RAW_DTYPES = frozenset({"F8_E4M3"})


def read_raw(path: Path, name: str) -> np.ndarray:
    """Tensor ``name`` of the safetensors file ``path`` read from its bytes (the format: an 8-byte
    little-endian header size, a JSON header of ``{name: {dtype, shape, data_offsets}}``, the data)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
        lo, hi = info["data_offsets"]
        f.seek(8 + size + lo)
        data = f.read(hi - lo)
    return np.frombuffer(data, _numpy_dtype(info["dtype"])).reshape(info["shape"])


def _numpy_dtype(safetensors_dtype: str) -> np.dtype:
    """numpy's dtype for a safetensors dtype name ("F32", "BF16", ...)."""
    if safetensors_dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {safetensors_dtype!r}")
    return np.dtype(_NUMPY_DTYPES[safetensors_dtype])
