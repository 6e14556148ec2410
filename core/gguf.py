"""GGUF files (llama.cpp's format, as llama.cpp, Ollama and LM Studio keep models) read safely:
the metadata, where each tensor lies, and its bytes memory-mapped.

A GGUF is untrusted input (llama.cpp's own parser has had overflows): every count, length, offset
and size is checked against the bytes the file has before anything is read or allocated, so a
truncated or hostile file ends in one PagechatError naming what and where, and nothing is
allocated that is larger than the file. ggml's `gguf` package names the types and their block
sizes; its reader is not used for the header, because it loops over an array's declared length
without looking at the file's (an array "of 2^60 elements" never ends) and takes 3.4 s over
SmolLM2's 49k-token vocabulary, where this takes a tenth of that. A test checks this reader
against gguf's on the same files.

A split model (`NAME-00001-of-00003.gguf` ...) is read as one: metadata from the first part,
tensors from all.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from pagechat.core.errors import PagechatError

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SCALARS = {  # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
_MIN_KV_BYTES = 8 + 4 + 1  # a key's length, a value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # a name's length, dims, one dim, type, offset


def is_gguf(path: Path) -> bool:
    """Whether path is a file that starts with GGUF's magic (Ollama's blobs have no .gguf name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == struct.pack("<I", GGUF_MAGIC)
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF: its type, its shape in torch's order (GGUF lists the fastest-varying
    dimension first: [in, out] for a linear's weight, here [out, in]), and where its bytes lie."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # from the start of its file
    nbytes: int
    part: int  # which file of a split model

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension): whole blocks of the type."""
        block, size = GGML_QUANT_SIZES[self.type]
        return self.shape[-1] // block * size


class _Cursor:
    """Bounds-checked little-endian reads from a file's bytes; every error names the offset."""

    def __init__(self, data: np.ndarray, where: str) -> None:
        self.data, self.where, self.pos, self.size = data, where, 0, len(data)

    def fail(self, what: str) -> PagechatError:
        return PagechatError(f"{self.where}: {what} (at byte {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file ({self.size} bytes)")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.data[self.pos : self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None
        self.pos += n
        return text

    def count(self, what: str, least_bytes: int) -> int:
        """A uint64 count of items of at least least_bytes each, which must fit what is left."""
        n = self.scalar("<Q", what)
        if n * least_bytes > self.size - self.pos:
            raise self.fail(f"{what} is {n}, more than the {self.size - self.pos} bytes left hold")
        return n

    def value(self, vtype: int, what: str):
        """A metadata value of vtype: a Python scalar or str, or for an array a list of str or a
        numpy array."""
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"{what} has value type {vtype}, which GGUF does not define") from None
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[vtype][0], what)
        itype = self.scalar("<I", f"the element type of {what}")
        if itype == GGUFValueType.ARRAY:
            raise self.fail(f"{what} is an array of arrays, which llama.cpp does not read either")
        if itype == GGUFValueType.STRING:
            n = self.count(f"the length of {what}", 8)
            return [self.string(f"{what}[{i}]") for i in range(n)]
        try:
            fmt, dtype = _SCALARS[GGUFValueType(itype)]
        except (ValueError, KeyError):
            raise self.fail(
                f"{what} has element type {itype}, which GGUF does not define"
            ) from None
        width = struct.calcsize(fmt)
        n = self.count(f"the length of {what}", width)
        values = np.frombuffer(
            self.data, dtype=np.dtype(dtype).newbyteorder("<"), count=n, offset=self.pos
        ).copy()
        self.pos += n * width
        return values


@dataclass(slots=True)
class _Part:
    """One file's header: its metadata and tensors."""

    fields: dict[str, object]
    tensors: list[TensorInfo]


def _read_part(path: Path, part: int) -> _Part:
    """Parse and check one GGUF file's header and tensor table."""
    where = str(path)
    try:
        data = np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as e:
        raise PagechatError(f"cannot read {where}: {e}") from None
    c = _Cursor(data, where)
    if c.size < 4 or bytes(data[:4]) != struct.pack("<I", GGUF_MAGIC):
        raise PagechatError(f"{where} is not a GGUF file (its first bytes are not 'GGUF')")
    c.pos = 4
    version = c.scalar("<I", "the version")
    if version & 0xFFFF == 0 and version:
        raise c.fail("the file is big-endian; pagechat reads little-endian GGUF files")
    if version not in (2, 3):
        raise c.fail(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.count("the tensor count", _MIN_TENSOR_BYTES)
    n_kv = c.count("the metadata count", _MIN_KV_BYTES)
    fields: dict[str, object] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in fields:
            raise c.fail(f"metadata key {key!r} appears twice")
        fields[key] = c.value(c.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")
    infos = [_tensor_info(c, i) for i in range(n_tensors)]
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise PagechatError(f"{where}: general.alignment must be a power of two, got {alignment!r}")
    start = c.pos + (-c.pos % alignment)
    tensors = [_place(c, info, start, alignment, part) for info in infos]
    _check_overlaps(tensors, where)
    return _Part(fields, tensors)


def _shown(name: str) -> str:
    """A tensor's name as a message shows it: quoted where it is empty or holds a line break, an
    escape sequence or another unprintable character (it is the file's; the message is one line)."""
    return name if name.isprintable() and name else repr(name)


def _tensor_info(c: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string(f"the name of tensor {i}")
    shown = _shown(name)
    n_dims = c.scalar("<I", f"the dimension count of {shown}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"tensor {shown} has {n_dims} dimensions (1 to {MAX_DIMS} are allowed)")
    dims = tuple(c.scalar("<Q", f"a dimension of {shown}") for _ in range(n_dims))
    type_id = c.scalar("<I", f"the type of {shown}")
    offset = c.scalar("<Q", f"the offset of {shown}")
    return name, dims, type_id, offset


def _place(c: _Cursor, info: tuple, start: int, alignment: int, part: int) -> TensorInfo:
    """A tensor's info checked against the file: a type GGUF defines, whole blocks per row, bytes
    that lie within the file at an aligned offset."""
    name, dims, type_id, offset = info
    where = f"{c.where}: tensor {_shown(name)}"
    try:
        qtype = GGMLQuantizationType(type_id)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise PagechatError(f"{where} has type id {type_id}, which ggml does not define") from None
    if min(dims) < 1:
        raise PagechatError(f"{where} has an empty dimension {list(dims)}")
    if dims[0] % block:
        raise PagechatError(
            f"{where} ({qtype.name}) has rows of {dims[0]} values, not whole blocks of {block}"
        )
    elements = 1
    for d in dims:
        elements *= d  # Python integers: a product past 2^64 is only large, not wrapped
    nbytes = elements // block * size
    if offset % alignment:
        raise PagechatError(f"{where} starts at offset {offset}, not a multiple of {alignment}")
    if start + offset + nbytes > c.size:
        raise PagechatError(
            f"{where} ({qtype.name}, shape {list(dims)}, {nbytes} bytes at offset {offset}) "
            f"runs past the end of the file ({c.size} bytes)"
        )
    return TensorInfo(name, qtype, tuple(reversed(dims)), start + offset, nbytes, part)


def _check_overlaps(tensors: list[TensorInfo], where: str) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise PagechatError(f"{where}: tensors {_shown(a.name)} and {_shown(b.name)} overlap")


def split_parts(path: Path) -> list[Path]:
    """The files of the model `path` is (a part of): itself, or every part of its split, which
    must all be there."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        raise PagechatError(f"{path} is named as part {no} of {count}, which no split has")
    parts = [
        path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise PagechatError(f"{path} is part of a {count}-file split, but {missing[0]} is missing")
    return parts


class GGUFFile:
    """A GGUF model (all parts of a split): its metadata, its tensors, their bytes memory-mapped
    on demand. close() unmaps them (the bytes a loaded model copied out are its own)."""

    def __init__(self, path: Path) -> None:
        self.paths = split_parts(Path(path))
        parts = [_read_part(p, i) for i, p in enumerate(self.paths)]
        self.fields = parts[0].fields
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            for t in part.tensors:
                if t.name in self.tensors:
                    raise PagechatError(
                        f"{self.paths[t.part]}: tensor {_shown(t.name)} appears twice"
                    )
                self.tensors[t.name] = t
        self._maps: dict[int, np.memmap] = {}

    @property
    def path(self) -> Path:
        return self.paths[0]

    def bytes_of(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 [rows, row_bytes] (rows: every dimension but the last),
        memory-mapped, read-only."""
        t = self.tensors[name]
        if t.part not in self._maps:
            self._maps[t.part] = np.memmap(self.paths[t.part], mode="r")
        raw = self._maps[t.part][t.offset : t.offset + t.nbytes]
        return raw.reshape(-1, t.row_bytes)

    def close(self) -> None:
        self._maps.clear()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
