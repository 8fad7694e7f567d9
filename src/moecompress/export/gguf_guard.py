"""A bounded reader of a GGUF file's header, run before `gguf`'s reader or transformers' GGUF loader sees the file.

`gguf.GGUFReader` trusts every length a file declares: a 101-byte file declaring an array of 2^61 entries made
`eval` and `load` grow memory without bound (issue 51). `read_header` walks the same header incrementally from
the file, in pure Python, and checks every declared size against the bytes the file really has before it reads
(or skips) them:

* the magic, the version (2 or 3; a byte-swapped file is read as such), the tensor and key counts (each key needs at
  least 13 bytes, each tensor info 24);
* every string's length and every array's entry count against the bytes left (an array of N entries of type T
  needs at least N x size(T) bytes, a string 8), arrays nested at most `MAX_ARRAY_DEPTH` deep, strings UTF-8,
  keys unique, value types known, ``general.alignment`` a 32-bit power of two;
* every tensor info: a name of at most `MAX_NAME` bytes, 1 to `GGML_MAX_DIMS` dimensions, each positive, a ggml type
  `gguf.GGML_QUANT_SIZES` knows, a first dimension that is a multiple of its type's block, an offset aligned, and
  its data [offset, offset + bytes) inside the file and overlapping no other tensor's (so the tensors together hold
  at most the file's size).

Array contents are checked, never kept (`GGUFArray` records the type and count), so the reader's memory is bounded
by the longest string it keeps (`KEEP_STRING`). Any violation is one sentence naming the file and the problem.

`check_complete` then says whether a MoE GGUF holds every tensor its own metadata implies (block count, leading
dense blocks, expert count): transformers fuses ``ffn_gate_exps`` and ``ffn_up_exps`` into one parameter, so its
missing-weight report cannot see a file lacking one of them, which then loaded as zeros.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MoECompressError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
MAX_ARRAY_DEPTH = 2  # an array of arrays at most (llama.cpp reads none; gguf's reader recurses without bound)
MAX_NAME = 256  # bytes of a tensor name (llama.cpp's GGML_MAX_NAME is 64)
KEEP_STRING = 1 << 20  # string values up to this many bytes are kept; longer ones are checked and dropped
DEFAULT_ALIGNMENT = 32
_CHUNK = 1 << 20

# GGUF value types: struct format and size of the scalars; 8 = string, 9 = array
_SCALARS = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_STRING, _ARRAY = 8, 9
_INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)
# the fewest bytes one value of each type takes: a string its 8-byte length, an array its type and count
_MIN_SIZE = {**{t: s for t, (_, s) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_FUSED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp.weight")


@dataclass(frozen=True)
class GGUFArray:
    """An array value: its element type and length (the entries were checked, not kept)."""

    type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header declares it: dims in GGML order (ne), absolute data offset and byte size."""

    name: str
    dims: tuple[int, ...]
    type: int
    type_name: str
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass
class GGUFHeader:
    """What `read_header` found: scalar and string metadata (arrays as `GGUFArray`), the tensor infos."""

    path: Path
    version: int
    size: int
    alignment: int
    data_offset: int
    metadata: dict = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        """``general.architecture`` (refused when it is missing or not a string)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise _invalid(self.path, "it has no general.architecture string")
        return arch

    def integer(self, key: str) -> int | None:
        """The integer value of `key`, None when absent; refused when it is there but not a non-negative integer."""
        if key not in self.metadata:
            return None
        value = self.metadata[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _invalid(self.path, f"its key '{shown(key)}' is not a non-negative integer")
        return value

    @property
    def tensor_bytes(self) -> int:
        """Bytes of every tensor's data, without header or padding."""
        return sum(t.nbytes for t in self.tensors.values())


class _Short(Exception):
    """The file ended inside a fixed-size field."""


def shown(text: str, limit: int = 80) -> str:
    """`text` safe to print in one line: printable ASCII, at most `limit` characters."""
    clean = "".join(c if " " <= c <= "~" and c not in "[]" else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def _invalid(path, problem: str) -> MoECompressError:
    return MoECompressError(
        f"{path} is not a valid GGUF file: {problem}; re-export it or use the original file."
    )


class _Cursor:
    """Reads the file forward through a bounded buffer; every read and skip is checked against the file's size."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.buf, self.pos, self.base = b"", 0, 0
        self.order = "<"

    @property
    def offset(self) -> int:
        return self.base + self.pos

    @property
    def left(self) -> int:
        return self.size - self.offset

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise _Short
        if self.pos + n > len(self.buf):
            rest = self.buf[self.pos :]
            self.base += self.pos
            self.buf, self.pos = rest + self.f.read(max(_CHUNK, n - len(rest))), 0
            if len(self.buf) < n:  # the file shrank while it was read
                raise _Short
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def skip(self, n: int) -> None:
        if n > self.left:
            raise _Short
        if self.pos + n <= len(self.buf):
            self.pos += n
            return
        target = self.offset + n
        self.f.seek(target)
        self.buf, self.pos, self.base = b"", 0, target

    def unpack(self, fmt: str, size: int):
        return struct.unpack(self.order + fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.unpack("I", 4)

    def u64(self) -> int:
        return self.unpack("Q", 8)


class _Walk:
    """One pass over a header; `fail` raises the sentence for the file."""

    def __init__(self, path: Path, cur: _Cursor):
        self.path, self.cur = path, cur

    def fail(self, problem: str) -> MoECompressError:
        return _invalid(self.path, problem)

    def string(self, what: str, keep: bool = True, limit: int | None = None) -> str | None:
        """A string (length, UTF-8 bytes): kept when `keep` and at most `KEEP_STRING` bytes, else checked only."""
        n = self.cur.u64()
        if n > self.cur.left:
            raise self.fail(
                f"{what} declares a string of {n} bytes, more than the {self.cur.left} bytes left"
            )
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long, more than {limit}")
        if keep and n <= KEEP_STRING:
            try:
                return self.cur.take(n).decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail(f"{what} is not UTF-8 text") from None
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            while n:
                step = min(n, _CHUNK)
                decoder.decode(self.cur.take(step))
                n -= step
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None
        return None

    def value(self, key: str, vtype: int, depth: int = 0, keep: bool = True):
        """One value of type `vtype` (arrays checked entry by entry, recorded as `GGUFArray`)."""
        if vtype in _SCALARS:
            return self.cur.unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(f"the value of key '{shown(key)}'", keep=keep)
        if vtype != _ARRAY:
            raise self.fail(f"its key '{shown(key)}' has the unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"its key '{shown(key)}' nests arrays more than {MAX_ARRAY_DEPTH} deep")
        itype, count = self.cur.u32(), self.cur.u64()
        if itype not in _MIN_SIZE:
            raise self.fail(f"its key '{shown(key)}' holds an array of the unknown value type {itype}")
        if count * _MIN_SIZE[itype] > self.cur.left:
            raise self.fail(
                f"its key '{shown(key)}' declares an array of {count} entries, more than the "
                f"{self.cur.left} bytes left in the file hold"
            )
        if itype in _SCALARS:
            self.cur.skip(count * _MIN_SIZE[itype])
        else:
            for _ in range(count):
                self.value(key, itype, depth + 1, keep=False)
        return GGUFArray(itype, count)

    def counts(self) -> tuple[int, int]:
        tensors, kvs = self.cur.u64(), self.cur.u64()
        left = self.cur.left
        if kvs * _MIN_KV > left:
            raise self.fail(
                f"it declares {kvs} metadata keys, more than the {left} bytes left in the file hold"
            )
        if tensors * _MIN_TENSOR > left:
            raise self.fail(
                f"it declares {tensors} tensors, more than the {left} bytes left in the file hold"
            )
        return tensors, kvs

    def metadata(self, count: int) -> dict:
        out: dict = {}
        for i in range(count):
            key = self.string(f"the name of metadata key {i}", limit=MAX_NAME * 256)
            if key in out:
                raise self.fail(f"its key '{shown(key)}' appears twice")
            vtype = self.cur.u32()
            out[key] = self.value(key, vtype)
            if key == "general.alignment":
                value = out[key]
                if vtype != 4:
                    raise self.fail("its general.alignment is not a 32-bit unsigned integer")
                if value <= 0 or value & (value - 1):
                    raise self.fail(f"its general.alignment {value} is not a power of two")
        return out

    def tensor_infos(self, count: int, alignment: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        if count * _MIN_TENSOR > self.cur.left:
            raise self.fail(
                f"it declares {count} tensors, more than the {self.cur.left} bytes left in the file hold"
            )
        out, seen = [], set()
        for i in range(count):
            name = self.string(f"the name of tensor {i}", limit=MAX_NAME)
            if name in seen:
                raise self.fail(f"its tensor '{shown(name)}' appears twice")
            seen.add(name)
            n_dims = self.cur.u32()
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise self.fail(
                    f"its tensor '{shown(name)}' has {n_dims} dimensions, not 1 to {GGML_MAX_DIMS}"
                )
            dims = tuple(self.cur.u64() for _ in range(n_dims))
            if min(dims) == 0 or max(dims) >= 1 << 63:
                raise self.fail(f"its tensor '{shown(name)}' has a dimension of {min(dims) or max(dims)}")
            ggml_type, offset = self.cur.u32(), self.cur.u64()
            if offset % alignment:
                raise self.fail(
                    f"its tensor '{shown(name)}' starts at offset {offset}, not a multiple of the alignment "
                    f"{alignment}"
                )
            out.append((name, dims, ggml_type, offset))
        return out


def _tensors(walk: _Walk, infos, data_offset: int, size: int) -> dict[str, TensorInfo]:
    """The tensor infos with their byte sizes, each inside the file and overlapping none of the others."""
    import gguf

    sizes = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGML_QUANT_SIZES}
    out: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        if ggml_type not in sizes:
            raise walk.fail(f"its tensor '{shown(name)}' has the unknown ggml type {ggml_type}")
        type_name, block, type_size = sizes[ggml_type]
        if dims[0] % block:
            raise walk.fail(
                f"its tensor '{shown(name)}' is {dims[0]} wide, not a multiple of the {block}-element block of "
                f"its type {type_name}"
            )
        nbytes = dims[0] // block * type_size
        for d in dims[1:]:
            nbytes *= d
        start = data_offset + offset
        if start + nbytes > size:
            raise walk.fail(
                f"its tensor '{shown(name)}' declares {nbytes} bytes at byte {start}, past the file's end at "
                f"byte {size}"
            )
        out[name] = TensorInfo(name, dims, ggml_type, type_name, start, nbytes)
    ranges = sorted(out.values(), key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(ranges, ranges[1:]):
        if b.offset < a.offset + a.nbytes:
            raise walk.fail(f"its tensors '{shown(a.name)}' and '{shown(b.name)}' overlap")
    return out


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at `path`, every size in it checked against the file's (module docstring);
    one `MoECompressError` sentence for a file that is not a valid GGUF."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError:
        raise MoECompressError(f"{path} cannot be read; pass the directory a GGUF export wrote.") from None
    if not stat.S_ISREG(st.st_mode):
        raise _invalid(path, "it is not a regular file")
    try:
        with open(path, "rb") as f:
            cur = _Cursor(f, os.fstat(f.fileno()).st_size)
            walk = _Walk(path, cur)
            try:
                return _read(walk, cur, path)
            except _Short:
                raise _invalid(path, f"it ends at byte {cur.size}, inside its header") from None
    except OSError as exc:
        raise MoECompressError(f"{path} cannot be read ({exc.strerror or type(exc).__name__}).") from None


def _read(walk: _Walk, cur: _Cursor, path: Path) -> GGUFHeader:
    if cur.take(4) != GGUF_MAGIC:
        raise walk.fail("it does not start with the GGUF magic bytes")
    version = cur.u32()
    if version & 0xFFFF == 0 and version:  # written on a machine of the other byte order
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise walk.fail(f"it declares version {version}, and only versions 2 and 3 are read")
    n_tensors, n_kv = walk.counts()
    metadata = walk.metadata(n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    infos = walk.tensor_infos(n_tensors, alignment)
    data_offset = -(-cur.offset // alignment) * alignment
    tensors = _tensors(walk, infos, data_offset, cur.size)
    return GGUFHeader(path, version, cur.size, alignment, data_offset, metadata, tensors)


# ----------------------------------------------------------------------------- completeness
def expert_count(header: GGUFHeader) -> int | None:
    """``{arch}.expert_count`` (None for a dense model)."""
    return header.integer(f"{header.arch}.expert_count")


def check_complete(header: GGUFHeader) -> None:
    """Refuse a MoE GGUF lacking a tensor its own metadata implies, naming the first one missing.

    Blocks ``leading_dense_block_count`` to ``block_count - 1`` are MoE blocks: each needs
    ``ffn_{gate,up,down}_exps`` and the router ``ffn_gate_inp``, each holding ``expert_count`` experts, and every
    tensor any other MoE block has; the leading dense blocks all need what any of them has; the model needs
    ``token_embd`` and ``output_norm``. A dense GGUF (no expert count) is left to transformers' own report."""
    arch, path = header.arch, header.path
    experts = expert_count(header)
    if not experts:
        return
    blocks = header.integer(f"{arch}.block_count")
    if blocks is None:
        raise _invalid(path, f"it declares {experts} experts but no {arch}.block_count")
    dense = header.integer(f"{arch}.leading_dense_block_count") or 0
    if dense > blocks:
        raise _invalid(path, f"it declares {dense} leading dense blocks of {blocks}")
    if blocks > len(header.tensors):
        raise _invalid(path, f"it declares {blocks} blocks but holds {len(header.tensors)} tensors")
    kinds: tuple[set[str], set[str]] = (set(), set(_FUSED))  # dense blocks, MoE blocks
    for name in header.tensors:
        m = _BLOCK.fullmatch(name)
        if m and int(m.group(1)) < blocks:
            kinds[int(m.group(1)) >= dense].add(m.group(2))
    needed = ["token_embd.weight", "output_norm.weight"]
    for name in needed:
        if name not in header.tensors:
            _refuse_missing(header, name, blocks, experts)
    # stops at the first block missing anything, so it is bounded by the tensors the file holds
    for i in range(blocks):
        for kind in sorted(kinds[i >= dense]):
            name = f"blk.{i}.{kind}"
            if name not in header.tensors:
                _refuse_missing(header, name, blocks, experts)
    for i in range(dense, blocks):
        for kind in _FUSED:
            t = header.tensors[f"blk.{i}.{kind}"]
            held = t.dims[-1] if len(t.dims) == (2 if kind.startswith("ffn_gate_inp") else 3) else None
            if held != experts:
                raise MoECompressError(
                    f"{path} is inconsistent: its tensor '{t.name}' has dimensions {list(t.dims)}, not "
                    f"{experts} experts as its {arch}.expert_count says; re-export it or use the original file."
                )


def _refuse_missing(header: GGUFHeader, name: str, blocks: int, experts: int):
    raise MoECompressError(
        f"{header.path} is incomplete: it lacks the tensor '{name}', which its {header.arch} model of {blocks} "
        f"blocks and {experts} experts needs, so transformers would load zeros in its place; re-export it or use "
        "the original file."
    )
