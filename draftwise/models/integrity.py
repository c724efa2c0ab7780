"""Model files checked before use (issue 55): a GGUF's header read and checked field by field, a registry file's
SHA-256, and the offline switches that keep draftwise from downloading.

- `check_header(path)`: every field of a GGUF header (magic, version, counts, each metadata key, type and value,
  each tensor's name, shape, type and offset) is read and checked against the file's size; the first that cannot
  be right is reported as one line, "GGUF header is corrupt at offset N: <field> (<why>)" (`CorruptFileError`),
  before transformers or the codes loader read the file (they reported such a file as "config file ... is not a
  valid JSON file").
- `verify_file(path, sha256)`: a registry file is hashed on its first use in a process unless a stamp in
  `<cache>/verified/` says it was hashed when it had its present size, modification and change times and inode
  (then the use is one `stat`); a file that does not match raises `CorruptFileError` naming the fix. A hash that
  matches writes the stamp (atomically). `draftwise models --verify` hashes every file whatever the stamps say.
- `offline()`: the variable that forbids downloads (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, DRAFTWISE_OFFLINE or
  PIP_NO_INDEX set to a true value), or None.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

from draftwise.errors import ModelNotAvailableError

OFFLINE_VARIABLES = ("DRAFTWISE_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PIP_NO_INDEX")
_TRUE = ("1", "true", "yes", "on")


class CorruptFileError(ModelNotAvailableError):
    """A model file that is damaged: its header cannot be right, or its bytes do not match the SHA-256 known for
    it. One line; the CLI exits with 2."""


def offline() -> str | None:
    """'NAME=value' of the first offline variable set to a true value, else None."""
    for name in OFFLINE_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip().lower() in _TRUE:
            return f"{name}={value}"
    return None


# ----------------------------------------------------------------------------------------------- the header

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
MAX_KEY = 1 << 16  # GGUF's limit on a key's length
MAX_DIMS = 4  # GGML_MAX_DIMS


class _Corrupt(Exception):
    def __init__(self, offset: int, field: str, why: str) -> None:
        super().__init__(offset, field, why)
        self.offset, self.field, self.why = offset, field, why


class _Reader:
    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.at = buf, size, 0

    def scalar(self, fmt: str, field: str):
        width = struct.calcsize("<" + fmt)
        if self.at + width > self.size:
            raise _Corrupt(self.at, field, f"the file ends at byte {self.size}")
        value = struct.unpack_from("<" + fmt, self.buf, self.at)[0]
        self.at += width
        return value

    def string(self, field: str, *, limit: int | None = None) -> str:
        start = self.at
        length = self.scalar("Q", field + " length")
        if limit is not None and length > limit:
            raise _Corrupt(start, field + " length", f"{length} bytes, at most {limit}")
        if self.at + length > self.size:
            raise _Corrupt(start, field + " length", f"{length} bytes, past the end of the file ({self.size} bytes)")
        raw = bytes(self.buf[self.at: self.at + length])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise _Corrupt(self.at + error.start, field, "not UTF-8") from None
        self.at += length
        return text

    def value(self, kind: int, field: str, *, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], field)
        if kind == _STRING:
            return self.string(field)
        if kind == _ARRAY and depth == 0:
            start = self.at
            inner = self.scalar("I", f"{field} element type")
            if inner not in _SCALARS and inner not in (_STRING, _ARRAY):
                raise _Corrupt(start, f"{field} element type", f"{inner} is not a GGUF value type")
            count_at = self.at
            count = self.scalar("Q", f"{field} length")
            least = struct.calcsize("<" + _SCALARS[inner]) if inner in _SCALARS else 8
            if count * least > self.size - self.at:
                raise _Corrupt(count_at, f"{field} length", f"{count} elements cannot fit in the "
                                                           f"{self.size - self.at} bytes left")
            if inner in _SCALARS:
                self.at += count * least
                return None
            if inner == _STRING:  # (a vocabulary: 150k strings) one tight loop; the slow path names a failure
                buf, at, size, length = self.buf, self.at, self.size, struct.Struct("<Q").unpack_from
                try:
                    for _ in range(count):
                        n = length(buf, at)[0]
                        if at + 8 + n > size:
                            break
                        str(buf[at + 8: at + 8 + n], "utf-8")
                        at += 8 + n
                    else:
                        self.at = at
                        return None
                except (UnicodeDecodeError, struct.error):
                    pass
            for i in range(count):
                self.value(inner, f"{field}[{i}]", depth=depth + 1)
            return None
        raise _Corrupt(self.at - 4, f"type of {field}", f"{kind} is not a GGUF value type")


def check_header(path: str | os.PathLike) -> None:
    """Raise CorruptFileError naming the offset and the field of the first header field of the GGUF file `path`
    that cannot be right (see the module docstring); None when the header is sound."""
    from gguf import GGML_QUANT_SIZES

    path = Path(path)
    sizes = {int(kind): value for kind, value in GGML_QUANT_SIZES.items()}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptFileError(f"{path}: GGUF header is corrupt at offset 0: magic (the file is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                _check(_Reader(buf, size), sizes)
            except _Corrupt as error:
                what = "this is not a GGUF file, or a damaged one" if error.field == "magic" else "the file is damaged"
                raise CorruptFileError(f"{path}: GGUF header is corrupt at offset {error.offset}: {error.field} "
                                       f"({error.why}); {what}") from None


def _check(r: _Reader, sizes: dict[int, tuple[int, int]]) -> None:
    magic = bytes(r.buf[:4])
    if magic != GGUF_MAGIC:
        raise _Corrupt(0, "magic", f"{magic!r}, not {GGUF_MAGIC!r}")
    r.at = 4
    version = r.scalar("I", "version")
    if version not in (2, 3):
        raise _Corrupt(4, "version", f"{version}; GGUF versions 2 and 3 are read")
    n_tensors = r.scalar("Q", "tensor count")
    if n_tensors * 24 > r.size:  # a tensor's entry takes at least 24 bytes
        raise _Corrupt(8, "tensor count", f"{n_tensors} tensors cannot fit in {r.size} bytes")
    n_kv = r.scalar("Q", "metadata count")
    if n_kv * 12 > r.size:  # a key length and a type at least
        raise _Corrupt(16, "metadata count", f"{n_kv} entries cannot fit in {r.size} bytes")
    alignment = 32
    for i in range(n_kv):
        start = r.at
        key = r.string(f"metadata key #{i}", limit=MAX_KEY)
        if not key or not key.isprintable():
            raise _Corrupt(start, f"metadata key #{i}", f"{key!r} is not a key")
        kind_at = r.at
        kind = r.scalar("I", f"type of {key!r}")
        if kind not in _SCALARS and kind not in (_STRING, _ARRAY):
            raise _Corrupt(kind_at, f"type of {key!r}", f"{kind} is not a GGUF value type")
        value_at = r.at
        value = r.value(kind, repr(key))
        if key == "general.alignment":
            if kind != 4 or not value or value & (value - 1):
                raise _Corrupt(value_at, repr(key), f"{value!r} is not a power of two")
            alignment = value
    tensors = []
    for i in range(n_tensors):
        name = r.string(f"tensor #{i} name", limit=MAX_KEY)
        dims_at = r.at
        n_dims = r.scalar("I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Corrupt(dims_at, f"dimension count of tensor {name!r}", f"{n_dims}, not 1 to {MAX_DIMS}")
        shape_at = r.at
        shape = [r.scalar("Q", f"shape of tensor {name!r}") for _ in range(n_dims)]
        type_at = r.at
        kind = r.scalar("I", f"type of tensor {name!r}")
        if kind not in sizes:
            raise _Corrupt(type_at, f"type of tensor {name!r}", f"{kind} is not a GGML type")
        block, block_bytes = sizes[kind]
        count = 1
        for d in shape:
            count *= d
        if any(d == 0 for d in shape) or shape[0] % block or count > r.size * 8:
            raise _Corrupt(shape_at, f"shape of tensor {name!r}", f"{shape} for type {kind} in {r.size} bytes")
        offset_at = r.at
        offset = r.scalar("Q", f"offset of tensor {name!r}")
        if offset % alignment:
            raise _Corrupt(offset_at, f"offset of tensor {name!r}", f"{offset} is not a multiple of {alignment}")
        tensors.append((name, offset_at, offset, count // block * block_bytes))
    data = -(-r.at // alignment) * alignment
    for name, offset_at, offset, nbytes in tensors:
        if data + offset + nbytes > r.size:
            raise _Corrupt(offset_at, f"offset of tensor {name!r}",
                           f"its {nbytes} bytes at {data + offset} run past the end of the file ({r.size} bytes)")


# ------------------------------------------------------------------------------------------- SHA-256 stamps

_CHECKED: dict[tuple, str] = {}  # (path, size, mtime_ns, ctime_ns, inode) -> SHA-256 checked in this process


def _identity(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def stamp_path(path: Path) -> Path:
    from draftwise.models.cache import cache_root

    resolved = str(Path(path).resolve())
    return cache_root() / "verified" / f"{Path(path).name}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}.json"


def _read_stamp(path: Path) -> tuple | None:
    try:
        stamp = json.loads(stamp_path(path).read_text())
        return (stamp["path"], stamp["size"], stamp["mtime_ns"], stamp["ctime_ns"], stamp["inode"]), stamp["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_stamp(identity: tuple, sha256: str) -> None:
    from draftwise.atomic import write_json

    path, size, mtime_ns, ctime_ns, inode = identity
    try:
        write_json({"path": path, "size": size, "mtime_ns": mtime_ns, "ctime_ns": ctime_ns, "inode": inode,
                    "sha256": sha256}, stamp_path(Path(path)))
    except OSError:  # a read-only cache: the file is hashed again next time, nothing worse
        pass


def stamped(path: Path, sha256: str) -> bool:
    """Whether `path` is known to hash to `sha256` as it is now (this process or a stamp checked it), no hashing."""
    identity = _identity(path)
    if _CHECKED.get(identity) == sha256:
        return True
    found = _read_stamp(path)
    return found is not None and found == (identity, sha256)


def verify_file(path: str | os.PathLike, sha256: str, *, fix: str, size: int | None = None,
                full: bool = False, log=None) -> None:
    """Raise CorruptFileError unless `path` hashes to `sha256` (see the module docstring). `fix` says how to get a
    good copy; `full` hashes whatever the stamps say (`models --verify`). When the hash does not match, a GGUF's
    header is checked too, so that a damaged header is reported as such (offset and field)."""
    path = Path(path)
    identity = _identity(path)
    if size is not None and identity[1] != size:
        raise CorruptFileError(f"{path} has {identity[1]} bytes, expected {size}: the file is damaged; {fix}")
    if not full and stamped(path, sha256):
        _CHECKED[identity] = sha256
        return
    if log is not None:
        log(f"draftwise: checking the SHA-256 of {path} (once: its size and times are stamped after)")
    from draftwise.models.cache import sha256_file

    actual = sha256_file(path)
    if actual != sha256:
        header = ""
        if path.suffix == ".gguf":  # a damaged header is named as such: where, and which field
            try:
                check_header(path)
            except CorruptFileError as error:
                header = str(error).removeprefix(f"{path}: ").rpartition("; ")[0] + "; "
        raise CorruptFileError(f"{path}: {header}the file does not match its SHA-256 (it has {actual}, expected "
                               f"{sha256}): it is damaged; {fix}")
    identity = _identity(path)
    _CHECKED[identity] = sha256
    _write_stamp(identity, sha256)


def record(path: str | os.PathLike, sha256: str) -> None:
    """`path` was hashed to `sha256` just now (an assembly): stamp it."""
    identity = _identity(Path(path))
    _CHECKED[identity] = sha256
    _write_stamp(identity, sha256)


def forget() -> None:
    """Drop this process's record of checked files (tests)."""
    _CHECKED.clear()
