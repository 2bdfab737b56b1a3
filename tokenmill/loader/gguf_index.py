"""A fast index of a GGUF file: its scalar metadata and its tensor directory, memory-mapped.

``gguf.GGUFReader`` turns every metadata value into numpy arrays, one or two per element, which takes
tens of seconds for a 262k-token vocabulary (Gemma 3) even when only the tensors are wanted. This
index skips array values (tokenizer vocabularies, merges, scores) without materialising them and
keeps only scalars and strings, which is all the weight loader reads; the tokenizer is converted by
transformers from the file itself. Tensors are read-only views into one memory map, in the same
layout ``GGUFReader`` gives (``shape`` innermost first, quantized data as rows of bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of one item (8: string and 9: array are handled apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Unquantized tensor types and their numpy item types; every other type is read as bytes.
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor: ``shape`` as GGUF lists it (innermost dimension first) and its raw ``data``."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # numpy order (outermost first); quantized types as uint8 rows of blocks


class GGUFIndex:
    """Parse ``path``'s header: ``fields`` maps each scalar or string key to its value (array values
    are skipped and absent), ``tensors`` lists the tensors in file order.

    Raises ``ValueError`` for a file that is not a little-endian GGUF of version 2 or 3.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)  # type: ignore[arg-type]  # numpy arrays are buffers
        self._offset = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
        self._offset = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: unsupported GGUF version {version} (or a big-endian file)")
        num_tensors, num_fields = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            value_type = self._scalar("I")
            if value_type == _ARRAY:
                self._skip_array()
            else:
                self.fields[key] = self._value(value_type)
        directory = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._scalar("I")
            dims = struct.unpack_from(f"<{num_dims}Q", self._buffer, self._offset)
            self._offset += 8 * num_dims
            tensor_type = GGMLQuantizationType(self._scalar("I"))
            directory.append((name, tuple(int(d) for d in dims), tensor_type, self._scalar("Q")))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *entry) for entry in directory]

    def _tensor(
        self,
        data_start: int,
        name: str,
        dims: tuple[int, ...],
        tensor_type: GGMLQuantizationType,
        offset: int,
    ) -> IndexedTensor:
        numpy_shape = tuple(reversed(dims))
        num_elements = int(np.prod(dims))
        start = data_start + offset
        plain = _PLAIN_TYPES.get(tensor_type)
        if plain is not None:
            data = np.frombuffer(self._map, dtype=plain, count=num_elements, offset=start).reshape(
                numpy_shape
            )
        else:
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            num_bytes = num_elements * type_size // block_size
            data = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=start)
            data = data.reshape(quant_shape_to_byte_shape(numpy_shape, tensor_type))
        return IndexedTensor(name=name, shape=dims, tensor_type=tensor_type, data=data)

    def _scalar(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def _string(self) -> str:
        length = self._scalar("Q")
        start = self._offset
        self._offset += length
        return bytes(self._buffer[start : self._offset]).decode("utf-8")

    def _value(self, value_type: int) -> object:
        if value_type == _STRING:
            return self._string()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"{self.path!r}: unknown GGUF metadata type {value_type}")
        (value,) = struct.unpack_from("<" + fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _skip_array(self) -> None:
        item_type, count = self._scalar("I"), self._scalar("Q")
        if item_type == _STRING:
            for _ in range(count):
                length = self._scalar("Q")  # the length prefix, then that many bytes
                self._offset += length
        elif item_type == _ARRAY:
            for _ in range(count):
                self._skip_array()
        else:
            fmt = _SCALAR_FORMATS.get(item_type)
            if fmt is None:
                raise ValueError(f"{self.path!r}: unknown GGUF array item type {item_type}")
            self._offset += count * struct.calcsize(fmt)
