"""What the safetensors format requires of a file, checked from its header alone: no torch, no safetensors library.

Every safetensors file that enters the service passes here first: an adapter at registration (the API) and at
the worker's load, every weights file of a diffusers folder at import and at the worker's download, and a
single-file checkpoint before it is converted. A file is

    8 bytes: N, the header's length (little-endian u64) | N bytes: the header, UTF-8 JSON | the data buffer

and, as the format's specification (the safetensors README, "Format") and the safetensors library (0.8, which
refuses to load anything else) require:

- N is at most 100,000,000 and the header lies inside the file; it is UTF-8 JSON, one object, beginning with `{`,
  no key written twice in one object;
- `__metadata__`, when present, is null or maps strings to strings;
- every other key names a tensor: an object with `dtype` (one safetensors knows: `DTYPE_BITS`), `shape` (a list
  of non-negative integers) and `data_offsets` (`[begin, end]`, non-negative integers, begin <= end), where
  end - begin is exactly the tensor's size: its elements times its dtype's size, whole bytes (sub-byte dtypes
  pack), the products within 64 bits;
- the tensors, in the order of their offsets, are contiguous and do not overlap, and cover the data buffer
  exactly: the first starts at 0 and the last ends where the file ends.

As the library's JSON parser (serde_json) does, a lone UTF-16 surrogate escape and nesting deeper than 127
levels are refused anywhere in the header. Two rules of the specification the 0.8 library no longer enforces are
kept: the header begins with `{` (no leading whitespace), and no key is written twice (two readers could disagree
on which one counts); the tests compare every other verdict with the library's.

`SafetensorsError` names the problem (the tensor, the offsets); each caller says what the file was (a 422 at
registration, `refused: FILE: ...` at import, `/readyz` on the worker). Nothing else is ever raised for a
malformed header: every value is type-checked before it is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

# safetensors' own limit on N (`MAX_HEADER_SIZE`).
MAX_HEADER_BYTES = 100_000_000
# Every dtype safetensors 0.8 knows, with its size in bits (F4 and the F6 pack: their tensors must fill bytes).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# Sizes and offsets are usize in safetensors (64 bits here): a larger number, or a product past it, is refused.
USIZE_MAX = 2**64 - 1
# Weight files that are pickles (loading one runs code from the file): refused wherever weights are taken in.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
METADATA = "__metadata__"
# serde_json's recursion limit, as the nesting of arrays and objects it takes (the header's own object counted).
MAX_NESTING = 127
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")

# Reads bytes [start, end] (inclusive, like GCS ranged downloads) of a file.
RangeReader = Callable[[int, int], bytes]


class SafetensorsError(ValueError):
    """Not a valid safetensors file; the message says why (which tensor, which bytes)."""


class _Negative:
    """A negative JSON integer: kept apart from int, so that it is never taken for a size (`-0` included)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def read_header(read: RangeReader, size: int) -> dict[str, dict]:
    """The tensors of a `size`-byte file ({name: {dtype, shape, data_offsets}}), checked as the format requires.

    Reads the 8-byte length first and the header only when it fits the file and the limit, never the data."""
    if size < 8:
        raise SafetensorsError(f"not a safetensors file: too short ({size} bytes; the header's length alone takes 8)")
    length = int.from_bytes(read(0, 7), "little")
    if length > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"not a safetensors file: bad header length ({length} bytes, over safetensors' limit of {MAX_HEADER_BYTES})"
        )
    if 8 + length > size:
        raise SafetensorsError(
            f"not a safetensors file: bad header length ({length} bytes, past the end of the {size}-byte file)"
        )
    return check_header(read(8, 7 + length), size - 8 - length)


def check_header(raw: bytes, data_bytes: int) -> dict[str, dict]:
    """The tensors of a header `raw` followed by `data_bytes` bytes of data, checked as `read_header` says."""
    tensors, _ = parse_header(raw, data_bytes)
    return tensors


def parse_header(raw: bytes, data_bytes: int) -> tuple[dict[str, dict], dict[str, str] | None]:
    """(tensors, metadata) of a header followed by `data_bytes` bytes of data; SafetensorsError if malformed.

    Each tensor comes back as exactly {dtype: str, shape: [int], data_offsets: [begin, end]} (fields safetensors
    ignores are dropped), in the file's order."""
    header = _json_object(raw)
    metadata = header.pop(METADATA, None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values())
    ):
        raise SafetensorsError(
            f"not a safetensors file: {METADATA} must map strings to strings, not {_brief(metadata)}"
        )
    tensors = {name: _tensor(name, entry) for name, entry in header.items()}
    _check_layout(tensors, data_bytes)
    return tensors, metadata


def tensor_bytes(dtype: str, shape: list[int]) -> int | None:
    """The bytes a tensor of `dtype` and `shape` takes, as safetensors computes it; None when the product overflows
    64 bits (safetensors refuses those) or leaves a partly filled byte (ditto)."""
    elements = 1
    for dim in shape:  # in the file's order, each partial product within 64 bits, as safetensors checks it
        elements *= dim
        if elements > USIZE_MAX:
            return None
    bits = elements * DTYPE_BITS[dtype]
    if bits > USIZE_MAX or bits % 8:
        return None
    return bits // 8


def _json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"not a safetensors file: the header is not UTF-8 (byte {exc.start})") from exc
    if not text.startswith("{"):
        raise SafetensorsError(f"not a safetensors file: the header begins with {_brief(text[:8])}, not '{{'")
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_integer, parse_constant=_no_constant)
    except SafetensorsError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; so are over-long integers
        raise SafetensorsError(f"not a safetensors file: the header is not JSON ({_brief(str(exc), 120)})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(
            f"not a safetensors file: the header is JSON but not an object ({type(header).__name__})"
        )
    _check_values(header)
    return header


def _check_values(header: dict) -> None:
    """What serde_json refuses and Python's parser takes: a lone surrogate in any string, deep nesting."""
    pending: list[tuple[object, int]] = [(header, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str) and not _encodable(value):
            raise SafetensorsError(f"not a safetensors file: the header holds {_brief(value)}, a lone UTF-16 "
                                   "surrogate (not Unicode)")  # fmt: skip
        if isinstance(value, dict | list) and depth > MAX_NESTING:
            raise SafetensorsError(f"not a safetensors file: the header nests deeper than {MAX_NESTING} levels")
        if isinstance(value, dict):
            pending += [(key, depth) for key in value] + [(item, depth + 1) for item in value.values()]
        elif isinstance(value, list):
            pending += [(item, depth + 1) for item in value]


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise SafetensorsError(f"not a safetensors file: the header writes {_name(key)} twice in one object")
        seen[key] = value
    return seen


def _integer(text: str) -> int | _Negative:
    return _Negative(text) if text.startswith("-") else int(text)


def _no_constant(text: str) -> None:
    raise SafetensorsError(f"not a safetensors file: the header is not JSON ({text} is not a JSON value)")


def _tensor(name: str, entry: object) -> dict:
    label = f"not a safetensors file: tensor {_name(name)}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{label} is {_brief(entry)}, not an object with dtype, shape and data_offsets")
    missing = [field for field in TENSOR_FIELDS if field not in entry]
    if missing:
        raise SafetensorsError(f"{label} has no {' and no '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SafetensorsError(
            f"{label} has dtype {_brief(dtype)}, not one safetensors knows ({', '.join(DTYPE_BITS)})"
        )
    if not isinstance(shape, list) or not all(_usize(dim) for dim in shape):
        raise SafetensorsError(f"{label} has shape {_brief(shape)}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(offset) for offset in offsets):
        raise SafetensorsError(
            f"{label} has data_offsets {_brief(offsets)}, not two non-negative integers [begin, end]"
        )
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"{label} has data_offsets [{begin}, {end}]: it ends before it begins")
    size = tensor_bytes(dtype, shape)
    if size is None:
        raise SafetensorsError(f"{label}: shape {_brief(shape)} of {dtype} does not fill a whole number of bytes "
                               "within 64 bits")  # fmt: skip
    if end - begin != size:
        raise SafetensorsError(
            f"truncated or inconsistent safetensors file at {_name(name)}: shape {_brief(shape)} of {dtype} takes "
            f"{size} bytes, its data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _check_layout(tensors: dict[str, dict], data_bytes: int) -> None:
    """The tensors, by offset, contiguous and not overlapping, covering the data buffer exactly."""
    position, previous = 0, None
    for name, entry in sorted(tensors.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin < position:
            raise SafetensorsError(
                f"truncated or inconsistent safetensors file at {_name(name)}: its data_offsets [{begin}, {end}] "
                f"overlap {_name(previous)}'s, which end at {position} (tensors may not share bytes)"
            )
        if begin > position:
            raise SafetensorsError(
                f"truncated or inconsistent safetensors file at {_name(name)}: bytes {position} to {begin} of the "
                "data before it belong to no tensor (tensors must be contiguous)"
            )
        position, previous = end, name
    if position > data_bytes:
        raise SafetensorsError(
            f"truncated or inconsistent safetensors file at {_name(previous)}: its data ends at byte {position}, "
            f"but the file holds {data_bytes} bytes of data"
        )
    if position < data_bytes and previous is None:
        raise SafetensorsError(f"not a safetensors file: the header names no tensor, but {data_bytes} bytes of data "
                               "follow it")  # fmt: skip
    if position < data_bytes:
        raise SafetensorsError(
            f"not a safetensors file: {data_bytes - position} bytes after the last tensor's data belong to no "
            f"tensor (the tensors must cover the data exactly: {position} of {data_bytes} bytes)"
        )


def _usize(value: object) -> bool:
    return type(value) is int and 0 <= value <= USIZE_MAX  # bool is an int subclass: `type` keeps it out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _brief(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a hostile header's values go into messages and logs."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _name(name: object) -> str:
    """A tensor's name for a message: whole up to 200 characters (real names run to about 120)."""
    return _brief(name, 200)


def bytes_reader(data: bytes) -> RangeReader:
    return lambda start, end: data[start : end + 1]


def read_file_header(path: Path) -> dict[str, dict]:
    """`read_header` of a local file, reading only its header."""
    size = path.stat().st_size
    with path.open("rb") as handle:

        def read(start: int, end: int) -> bytes:
            handle.seek(start)
            return handle.read(end - start + 1)

        return read_header(read, size)


def is_pickle(name: str) -> bool:
    """A file name with a pickle's suffix (in any case)."""
    return name.lower().endswith(PICKLE_SUFFIXES)
