"""pagechat's GGUF reader (core/gguf.py) on valid and hostile files.

Oracle for valid files: the gguf package's own reader. Files written by gguf.GGUFWriter (and, for
the empty arrays it refuses to write, by this module's byte-level writer) must read in GGUFFile
exactly as in gguf.GGUFReader: every metadata field, every tensor's type, shape, offset, size and
bytes. Hostile files are assembled byte by byte, each breaking one rule of the format; each must
end in one PagechatError naming the file, what is wrong and where, fast and without allocating
what the file cannot hold, and through the CLI in one `error:` line. A bounded fuzz of a small
valid file checks that nothing but a PagechatError ever escapes.
"""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import cli
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_files import write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagechat.core.errors import PagechatError
from pagechat.core.gguf import GGUFFile
from pagechat.core.timelimit import within

# -- a byte-level GGUF writer: every count, length, type id and offset as given -----------------


def u32(x: int) -> bytes:
    return struct.pack("<I", x)


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def text(s: str | bytes) -> bytes:
    """A GGUF string: its byte length, then its bytes."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type id, value bytes."""
    return text(key) + u32(vtype) + payload


def array(itype: int, items: list[bytes]) -> bytes:
    """An ARRAY value's payload: element type, length, elements."""
    return u32(itype) + u64(len(items)) + b"".join(items)


def info(name: str | bytes, dims: list[int], type_id: int = Q.F32, offset: int = 0) -> bytes:
    """One tensor-info record; dims in GGUF's order (the row length first)."""
    return text(name) + u32(len(dims)) + b"".join(map(u64, dims)) + u32(type_id) + u64(offset)


def assemble(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes,
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    align: int = 32,
) -> bytes:
    """Header, metadata, tensor infos, padding to `align`, then the data section."""
    n_tensors = len(infos) if n_tensors is None else n_tensors
    n_kv = len(kvs) if n_kv is None else n_kv
    head = b"GGUF" + u32(version) + u64(n_tensors) + u64(n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % align) + data


ARCH = kv("general.architecture", V.STRING, text("llama"))
A = info("a", [4, 2])  # 8 F32 values: bytes 0-31 of the data section
B = info("b", [8], offset=32)  # bytes 32-63


def small(**change) -> bytes:
    """A valid two-tensor file, with the keyword arguments of `assemble` changed."""
    return assemble(**{"kvs": [ARCH], "infos": [A, B], "data": bytes(range(64)), **change})


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# -- valid files: GGUFFile reads what gguf.GGUFReader reads ----------------------------------------


def assert_reads_as_gguf_does(path: Path) -> None:
    ref = gguf.GGUFReader(path)
    fields = {name: fld for name, fld in ref.fields.items() if not name.startswith("GGUF.")}
    with GGUFFile(path) as f:
        assert list(f.fields) == list(fields)
        for name, fld in fields.items():
            ours = f.fields[name]
            if fld.types[0] != V.ARRAY:
                assert ours == fld.contents() and type(ours) is type(fld.contents()), name
            # parts: key length, key, value type, element type, ... (also for an empty array)
            elif (itype := V(fld.parts[3][0])) == V.STRING:
                assert ours == fld.contents(), name
            else:
                want = np.array(fld.contents(), dtype=ref.gguf_scalar_to_np[itype])
                assert ours.dtype == want.dtype and np.array_equal(ours, want), name
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            ours = f.tensors[t.name]
            assert ours.type == t.tensor_type, t.name
            # GGUFReader keeps GGUF's order of dimensions (the row length first)
            assert ours.shape == tuple(reversed(t.shape.tolist())), t.name
            assert (ours.offset, ours.nbytes) == (t.data_offset, t.n_bytes), t.name
            assert f.bytes_of(t.name).tobytes() == np.asarray(t.data).tobytes(), t.name


# value type -> values at the ends of its range (for floats: the largest and a tiny one)
SCALARS = {
    V.UINT8: [0, 255],
    V.INT8: [-128, 127],
    V.UINT16: [0, 2**16 - 1],
    V.INT16: [-(2**15), 2**15 - 1],
    V.UINT32: [0, 2**32 - 1],
    V.INT32: [-(2**31), 2**31 - 1],
    V.UINT64: [0, 2**64 - 1],
    V.INT64: [-(2**63), 2**63 - 1],
    V.FLOAT32: [-1.5, float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)],
    V.FLOAT64: [-2.5, float(np.finfo(np.float64).max), 5e-324],
    V.BOOL: [False, True],
}
STRINGS = ["", "plain", "naïve café – 日本語 🦙", "line\nbreak\0nul"]


@pytest.mark.parametrize("alignment", [None, 64])
def test_files_gguf_writes_read_as_ggufs_reader_reads_them(tmp_path, alignment):
    """Every scalar value type at its extremes, strings, arrays of each, and tensors of float and
    quantised types in 1 to 4 dimensions, at the default alignment (32) and at 64."""
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for vtype, values in SCALARS.items():
        for i, value in enumerate(values):
            w.add_key_value(f"scalar.{vtype.name.lower()}.{i}", value, vtype)
        w.add_key_value(f"array.{vtype.name.lower()}", values, V.ARRAY, sub_type=vtype)
    for i, s in enumerate(STRINGS):
        w.add_string(f"string.{i}", s)
    w.add_array("array.string", STRINGS)
    w.add_array("array.long", list(range(1000)))
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 3, 4, 64), dtype=np.float32)
    w.add_tensor("f32_1d", values[0, 0, 0])
    w.add_tensor("f32_4d", values)
    w.add_tensor("f16_2d", values[0, 0].astype(np.float16))
    w.add_tensor("i32_3d", np.arange(2 * 3 * 5, dtype=np.int32).reshape(2, 3, 5))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.BF16):
        w.add_tensor(qtype.name, gguf.quants.quantize(values[0], qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_reads_as_gguf_does(tmp_path / "m.gguf")


def test_empty_arrays_read_as_ggufs_reader_reads_them(tmp_path):
    """Empty arrays (which GGUFWriter refuses to write) of a number type and of strings."""
    kvs = [
        ARCH,
        kv("empty.u32", V.ARRAY, array(V.UINT32, [])),
        kv("empty.s", V.ARRAY, array(V.STRING, [])),
    ]
    assert_reads_as_gguf_does(write(tmp_path, small(kvs=kvs)))


# -- hostile files: one PagechatError naming the file, what is wrong and where --------------------

# (id, file bytes, a regex the message must match)
HOSTILE = [
    ("empty", b"", "is not a GGUF file"),
    ("shorter than the header", small()[:12], r"tensor count runs past the end .* \(at byte 8\)"),
    ("wrong magic", b"GGML" + small()[4:], "is not a GGUF file"),
    (
        "version 1",
        small(version=1),
        r"GGUF version 1 is not supported \(2 and 3 are\) \(at byte 8\)",
    ),
    ("version 4", small(version=4), r"GGUF version 4 is not supported"),
    # a big-endian writer (GGUFWriter's endianess=BIG) keeps the magic, then writes 3 as 00 00 00 03
    (
        "big-endian",
        b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
        r"big-endian; pagechat reads little-endian GGUF files \(at byte 8\)",
    ),
    (
        "tensor count 2**60",
        small(n_tensors=2**60),
        r"tensor count is 1152921504606846976, more than the \d+ bytes left hold",
    ),
    (
        "metadata count 2**60",
        small(n_kv=2**60),
        r"metadata count is 1152921504606846976, more than",
    ),
    (
        "key past the end",
        assemble([u64(1000) + b"general.name"], [], b""),
        r"metadata key 0 \(1000 bytes\) runs past the end of the file \(\d+ bytes\) \(at byte 32\)",
    ),
    (
        "string past the end",
        small(kvs=[kv("s", V.STRING, u64(2**62) + b"ab")]),
        r"metadata 's' \(4611686018427387904 bytes\) runs past the end",
    ),
    (
        "numeric array of 2**60",
        small(kvs=[kv("a", V.ARRAY, u32(V.UINT32) + u64(2**60))]),
        "the length of metadata 'a' is 1152921504606846976, more than",
    ),
    (
        "string array of 2**60",
        small(kvs=[kv("a", V.ARRAY, u32(V.STRING) + u64(2**60))]),
        "the length of metadata 'a' is 1152921504606846976, more than",
    ),
    (
        "unknown value type",
        small(kvs=[kv("k", 13, u32(0))]),
        r"metadata 'k' has value type 13, which GGUF does not define \(at byte 37\)",
    ),
    (
        "unknown element type",
        small(kvs=[kv("k", V.ARRAY, array(99, []))]),
        "metadata 'k' has element type 99, which GGUF does not define",
    ),
    (
        "array of arrays",
        small(kvs=[kv("k", V.ARRAY, array(V.ARRAY, [array(V.UINT8, [b"\1"])]))]),
        "metadata 'k' is an array of arrays",
    ),
    ("duplicate key", small(kvs=[ARCH, ARCH]), "metadata key 'general.architecture' appears twice"),
    (
        "key not UTF-8",
        small(kvs=[kv(b"bad\xff", V.UINT8, b"\1")]),
        r"metadata key 0 is not valid UTF-8 \(at byte 32\)",
    ),
    (
        "string not UTF-8",
        small(kvs=[kv("s", V.STRING, text(b"\xed\xa0\x80"))]),
        "metadata 's' is not valid UTF-8",
    ),
    (
        "0 dimensions",
        small(infos=[info("a", [])]),
        r"tensor a has 0 dimensions \(1 to 4 are allowed\)",
    ),
    ("5 dimensions", small(infos=[info("a", [1] * 5)]), r"tensor a has 5 dimensions"),
    # a name is shown quoted when printing it would break the line or reach the terminal raw
    ("unprintable name", small(infos=[info("a\n\x1b[2J", [])]), r"tensor 'a\\n\\x1b\[2J' has 0"),
    (
        "a dimension of 0",
        small(infos=[info("a", [4, 0]), B]),
        r"tensor a has an empty dimension \[4, 0\]",
    ),
    (
        "dimensions past 2**64",
        small(infos=[info("a", [2**40, 2**40]), B]),
        # 2**82 bytes, not wrapped to 64 bits
        r"tensor a \(F32, shape \[1099511627776, 1099511627776\], 4835703278458516698824704 "
        r"bytes at offset 0\) runs past the end",
    ),
    (
        "type 4",
        small(infos=[info("a", [4, 2], 4), B]),
        "tensor a has type id 4, which ggml does not define",
    ),
    (
        "type 5",
        small(infos=[info("a", [4, 2], 5), B]),
        "tensor a has type id 5, which ggml does not define",
    ),
    ("type 1000", small(infos=[info("a", [4, 2], 1000), B]), "tensor a has type id 1000"),
    (
        "rows not whole blocks",
        small(infos=[info("a", [33], Q.Q8_0)]),
        r"tensor a \(Q8_0\) has rows of 33 values, not whole blocks of 32",
    ),
    (
        "offset not aligned",
        small(infos=[A, info("b", [8], offset=48)]),
        "tensor b starts at offset 48, not a multiple of 32",
    ),
    (
        "data past the end",
        small(data=bytes(63)),
        r"tensor b \(F32, shape \[8\], 32 bytes at offset 32\) runs past the end of the file",
    ),
    (
        "overlapping tensors",
        small(infos=[A, info("b", [8], offset=0)], data=bytes(32)),
        "tensors a and b overlap",
    ),
    (
        "duplicate tensor name",
        small(infos=[A, info("a", [8], offset=32)]),
        "tensor a appears twice",
    ),
    (
        "alignment 48",
        small(kvs=[kv("general.alignment", V.UINT32, u32(48))], align=48),
        "general.alignment must be a power of two, got 48",
    ),
    (
        "alignment 0",
        small(kvs=[kv("general.alignment", V.UINT32, u32(0))]),
        "general.alignment must be a power of two, got 0",
    ),
]


def check_refused(path: Path, pattern: str) -> str:
    """GGUFFile(path) raises one PagechatError: one line, naming the file, matching pattern."""
    with pytest.raises(PagechatError) as e:
        GGUFFile(path)
    message = str(e.value)
    chained = e.value.__cause__ or (None if e.value.__suppress_context__ else e.value.__context__)
    assert chained is None, chained  # one error: no other one a traceback would show with it
    assert "\n" not in message and str(path) in message, message
    assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize("data, pattern", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_a_hostile_file_ends_in_one_error_naming_what_and_where(tmp_path, data, pattern):
    check_refused(write(tmp_path, data), pattern)


def test_a_file_cut_short_anywhere_is_refused(tmp_path):
    """Every proper prefix of a small valid file (its last tensor ends the file)."""
    whole = small(kvs=[ARCH, kv("a", V.ARRAY, array(V.STRING, [text("x"), text("yz")]))])
    GGUFFile(write(tmp_path, whole)).close()
    for n in range(len(whole)):
        check_refused(write(tmp_path, whole[:n]), "not a GGUF file|past the end|bytes left hold")


def test_a_split_part_named_outside_its_split_is_refused(tmp_path):
    """A part number of 0 or past the split's count names no file of it."""
    for no in (1, 2):
        write(tmp_path, small(), f"m-0000{no}-of-00002.gguf")
    for name in ("m-00001-of-00000.gguf", "m-00000-of-00002.gguf", "m-00003-of-00002.gguf"):
        path = write(tmp_path, small(), name)
        check_refused(path, r"is named as part \d of \d, which no split has")


# a count or length of n where the file holds a few bytes
HUGE = {
    "tensor count": lambda n: small(n_tensors=n),
    "metadata count": lambda n: small(n_kv=n),
    "numeric array": lambda n: small(kvs=[kv("a", V.ARRAY, u32(V.UINT64) + u64(n))]),
    "string array": lambda n: small(kvs=[kv("a", V.ARRAY, u32(V.STRING) + u64(n))]),
    "string": lambda n: small(kvs=[kv("s", V.STRING, u64(n))]),
    "dimensions": lambda n: small(infos=[info("a", [n, n]), B]),
}


# 2**24: what a reader trusting the count could allocate (over 100 MB) rather than fail on
@pytest.mark.parametrize("n", [2**24, 2**60])
@pytest.mark.parametrize("case", HUGE)
def test_a_huge_count_is_refused_at_once_without_allocating(tmp_path, case, n):
    path = write(tmp_path, HUGE[case](n))
    tracemalloc.start()
    start = time.perf_counter()
    try:
        # within: a reader that loops over the count fails here instead of hanging the suite
        within(10, "parsing", lambda: check_refused(path, "more than|past the end"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 1 and peak < 1 << 20


# -- through the CLI -------------------------------------------------------------------------------


def test_the_cli_says_what_is_wrong_with_a_file_in_one_line(tmp_path, capsys):
    for data, pattern in [
        (small(n_tensors=2**60), "tensor count is"),
        (small()[:100], "past the end of the file"),
    ]:
        path = write(tmp_path, data)
        code, out, err = cli(["generate", str(path), "-p", "x"], capsys)
        assert code == 2 and out == "", err
        assert re.fullmatch(rf"error: {re.escape(str(path))}: .*{pattern}.*\n", err), err


def test_a_tensor_of_a_type_pagechat_cannot_read_is_named(tiny_models, tmp_path, capsys):
    """A tiny llama whose blk.0.attn_q.weight says Q8_1, a type gguf has no dequantize for: the
    file parses (Q8_1's 40 bytes per 32 values fit in the F32 tensor's place), loading names the
    tensor and its type."""
    path = write_gguf(tiny_models["llama"], tmp_path / "m.gguf")
    name = "blk.0.attn_q.weight"
    with GGUFFile(path) as f:
        rows, cols = f.tensors[name].shape
    record = info(name, [cols, rows])[:-12]  # up to its type id
    data = bytearray(path.read_bytes())
    at = data.index(record) + len(record)
    assert data[at : at + 4] == u32(Q.F32)
    data[at : at + 4] = u32(Q.Q8_1)
    path.write_bytes(data)
    with GGUFFile(path) as f:
        assert f.tensors[name].type == Q.Q8_1
    code, out, err = cli(["generate", str(path), "-p", "x"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"tensor {name} has type Q8_1, which pagechat cannot read" in err


# -- fuzz ------------------------------------------------------------------------------------------

FUZZ_BASE = small(
    kvs=[
        ARCH,
        kv("n", V.UINT32, u32(7)),
        kv("f", V.ARRAY, array(V.FLOAT32, [struct.pack("<f", 0.5)] * 3)),
        kv("s", V.ARRAY, array(V.STRING, [text("ab"), text("ü")])),
    ]
)


def mutate(data: bytes, how: str, at: int, size: int, value: int) -> bytes:
    """data with one change at `at`: a byte or a uint64 overwritten (counts, lengths, dimensions
    and offsets are uint64s), a cut, `size` bytes dropped, or `size` bytes from offset `value`
    spliced in."""
    at %= len(data) + 1
    if how == "byte":
        return data[:at] + bytes([value & 0xFF]) + data[at + 1 :]
    if how == "u64":
        return data[:at] + u64(value) + data[at + 8 :]
    if how == "cut":
        return data[:at]
    if how == "drop":
        return data[:at] + data[at + size :]
    start = value % (len(data) + 1)
    return data[:at] + data[start : start + size] + data[at:]


EDGES = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]  # where checks and integer types end


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["byte", "u64", "cut", "drop", "splice"]),
            st.integers(0, len(FUZZ_BASE)),
            st.integers(1, 40),
            st.sampled_from(EDGES) | st.integers(0, 2**64 - 1),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_mangled_file_reads_or_raises_a_pagechat_error(tmp_path, changes):
    """A small valid file changed in 1 to 4 places reads (every tensor's bytes too), or ends in a
    one-line PagechatError naming it: never another exception."""
    data = FUZZ_BASE
    for change in changes:
        data = mutate(data, *change)
    path = write(tmp_path, data)
    try:
        with GGUFFile(path) as f:
            for name in f.tensors:
                f.bytes_of(name)
    except PagechatError as e:
        assert str(path) in str(e) and "\n" not in str(e)
