"""The safetensors checks (`contract/safetensors_checks.py`) over generated headers: the same verdict as the
safetensors library itself on valid files of every dtype and on damaged ones (overlaps, gaps, trailing and missing
bytes, wrong sizes, wrong types), never anything but SafetensorsError; and one refusal, the same words, at every
entry point that takes a safetensors file in: adapter registration (the API's), the worker's adapter load, a
diffusers folder's import, a single file's import (the command line), and the worker's weights download."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
import safetensors
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from contract.safetensors_checks import (
    DTYPE_BITS,
    METADATA,
    SafetensorsError,
    bytes_reader,
    read_header,
    tensor_bytes,
)

DTYPES = sorted(DTYPE_BITS)
# Derandomized: the same examples every run, so the suite never fails on a draw it had not made before (a wider run:
# raise max_examples and drop derandomize: over 20,000 examples of each property agreed with the library here).
_SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}
PROPERTY = settings(max_examples=300, **_SETTINGS)
PER_DTYPE = settings(max_examples=25, **_SETTINGS)
ENTRY_POINTS = settings(max_examples=60, **_SETTINGS)


def file_bytes(header: object, data: bytes = b"", raw: bytes | None = None, length: int | None = None) -> bytes:
    """A safetensors file: the header's length, the header (`raw`, or `header` as JSON), the data."""
    text = raw if raw is not None else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def ours(data: bytes) -> str | None:
    """None when the checks accept the file, else their message; any other exception fails the test."""
    try:
        read_header(bytes_reader(data), len(data))
    except SafetensorsError as exc:
        return str(exc)
    return None


def library_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except Exception:  # noqa: BLE001 - SafetensorsError, or a JSON error raised through it
        return False
    return True


def _no_duplicates(pairs: list) -> dict:
    if len({key for key, _ in pairs}) < len(pairs):
        raise KeyError("a key written twice")
    return dict(pairs)


def format_accepts(data: bytes) -> bool:
    """The library's verdict, and the two rules of the format's specification the 0.8 library no longer keeps: the
    header begins with `{`, and no key is written twice."""
    if not library_accepts(data):
        return False
    header = data[8 : 8 + int.from_bytes(data[:8], "little")]
    try:
        json.loads(header, object_pairs_hook=_no_duplicates)
    except KeyError:
        return False
    return header.startswith(b"{")


# --- generated files ---------------------------------------------------------------------------------------------

NAMES = st.text(min_size=1, max_size=12).filter(lambda name: name != METADATA)


@st.composite
def layouts(draw) -> tuple[dict, bytes]:
    """A valid file: up to five tensors of any dtype (shapes with zeros, scalars; sub-byte dtypes filling bytes),
    laid out contiguously in an order of their own, optional metadata, and their data."""
    names = draw(st.lists(NAMES, max_size=5, unique=True))
    tensors = []
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        if math.prod(shape) * DTYPE_BITS[dtype] % 8:
            shape = [*shape, 8]
        tensors.append((name, dtype, shape))
    header: dict = {}
    metadata = draw(st.one_of(st.just("absent"), st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=8))))
    if metadata != "absent":
        header[METADATA] = metadata
    position = 0
    for index in draw(st.permutations(range(len(tensors)))):
        name, dtype, shape = tensors[index]
        size = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    return header, draw(st.binary(min_size=position, max_size=position))


def _tensor_names(header: dict) -> list[str]:
    return [name for name in header if name != METADATA]


def _by_offset(header: dict) -> list[str]:
    return sorted(_tensor_names(header), key=lambda name: tuple(header[name]["data_offsets"]))


WRONG_TYPES = {
    "dtype": st.one_of(
        st.sampled_from([["F32"], 4, None, {"F32": 1}, "f32", "F8", "C128", "E8M0", "", " F32"]),
        st.text(max_size=6).filter(lambda text: text not in DTYPE_BITS),
    ),
    "shape": st.one_of(
        st.sampled_from([4, "4", None, {"0": 4}, [-1], [1.0], [True], [[2]], [None], [2**64], [2.5], [-0.0]]),
        st.lists(
            st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False), st.booleans(), st.text()),
            min_size=1,
            max_size=3,
        ),
    ),  # fmt: skip
    "data_offsets": st.one_of(
        st.sampled_from(
            [
                0,
                "0,4",
                None,
                {"begin": 0, "end": 4},
                [0],
                [0, 4, 4],
                [0.0, 4.0],
                [-1, 3],
                [False, True],
                ["0", "4"],
                [0, 2**64],
            ]
        ),  # fmt: skip
        st.lists(st.integers(0, 64), min_size=3, max_size=4),
    ),
}


@st.composite
def damaged(draw) -> bytes:
    """A file damaged in one way, each way the format can be broken."""
    header, data = draw(layouts())
    names = _tensor_names(header)
    sized = [name for name in names if header[name]["data_offsets"][1] > header[name]["data_offsets"][0]]
    ways = ["trailing", "root", "metadata", "json", "length"]
    ways += ["truncated", "overlap", "swap", "size"] if sized else []
    ways += ["gap", "entry", "missing", "wrong-type", "lookalike", "dtype-size"] if names else []
    way = draw(st.sampled_from(ways))
    if way == "trailing":  # bytes after the last tensor's
        return file_bytes(header, data + draw(st.binary(min_size=1, max_size=9)))
    if way == "truncated":  # the last tensor's bytes cut
        return file_bytes(header, data[: -draw(st.integers(1, len(data)))])
    if way == "overlap":  # a tensor moved back into the bytes of the one before it (or to before 0: negative)
        name = draw(st.sampled_from(sized))
        begin, end = header[name]["data_offsets"]
        back = draw(st.integers(1, max(begin, 1)))
        header[name]["data_offsets"] = [begin - back, end - back]
        return file_bytes(header, data)
    if way == "gap":  # a tensor and everything after it moved on, the data grown to match
        order = _by_offset(header)
        start = draw(st.integers(0, len(order) - 1))
        shift = draw(st.integers(1, 9))
        for name in order[start:]:
            header[name]["data_offsets"] = [offset + shift for offset in header[name]["data_offsets"]]
        return file_bytes(header, data + bytes(shift))
    if way == "swap":  # data_offsets [end, begin]
        name = draw(st.sampled_from(sized))
        header[name]["data_offsets"].reverse()
        return file_bytes(header, data)
    if way == "size":  # offsets that hold one byte more or less than the shape in its dtype
        name = draw(st.sampled_from(sized))
        header[name]["data_offsets"][1] += draw(st.sampled_from([-1, 1]))
        return file_bytes(header, data)
    if way == "dtype-size":  # another dtype for the same offsets: a different size (or refused outright)
        name = draw(st.sampled_from(names))
        entry = header[name]
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        other = [d for d in DTYPES if (math.prod(entry["shape"]) * DTYPE_BITS[d] % 8 or
                                       tensor_bytes(d, entry["shape"]) != size)]  # fmt: skip
        assume(other)
        entry["dtype"] = draw(st.sampled_from(other))
        return file_bytes(header, data)
    if way == "wrong-type":
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(sorted(WRONG_TYPES)))
        header[name][field] = draw(WRONG_TYPES[field])
        return file_bytes(header, data)
    if way == "lookalike":  # the same number as another JSON type: 2.0, "2", true
        entry = header[draw(st.sampled_from(names))]
        values = entry[draw(st.sampled_from(["shape", "data_offsets"] if entry["shape"] else ["data_offsets"]))]
        index = draw(st.integers(0, len(values) - 1))
        number = values[index]
        values[index] = draw(st.sampled_from([float(number), str(number), *([bool(number)] if number < 2 else [])]))
        return file_bytes(header, data)
    if way == "entry":  # a tensor that is not an object
        header[draw(st.sampled_from(names))] = draw(st.sampled_from([[0, 4], "F32", 4, None, True]))
        return file_bytes(header, data)
    if way == "missing":
        name = draw(st.sampled_from(names))
        del header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
        return file_bytes(header, data)
    if way == "metadata":  # values that are not strings, or not a map
        bad = draw(st.sampled_from([{"a": 1}, {"a": None}, {"a": ["b"]}, {"a": {"b": "c"}}, ["a"], "a", 1, True]))
        header[METADATA] = bad
        return file_bytes(header, data)
    if way == "root":
        return file_bytes(draw(st.sampled_from([[header], "header", 1, None, True])), data)
    if way == "json":  # not JSON: cut, a NaN, a leading byte-order mark, Latin-1
        raw = json.dumps(header).encode()
        raw = draw(st.sampled_from([raw[:-1], raw + b"}", b"\xef\xbb\xbf" + raw, raw.replace(b"{", b"{\xff", 1),
                                    b'{"x": NaN}', b"", b"{} {}"]))  # fmt: skip
        return file_bytes(None, data, raw=raw)
    raw = json.dumps(header).encode()  # "length": the header's length wrong
    length = draw(st.sampled_from([len(raw) + len(data) + 1, 100_000_001, 2**64 - 1]))
    return file_bytes(None, data, raw=raw, length=length)


# --- the checks against the library ----------------------------------------------------------------------------


@PROPERTY
@given(layouts())
def test_every_valid_layout_of_every_dtype_is_accepted_as_the_library_accepts_it(layout):
    header, data = layout
    file = file_bytes(header, data)
    assert format_accepts(file)
    assert ours(file) is None
    tensors = read_header(bytes_reader(file), len(file))
    assert tensors == {name: header[name] for name in _tensor_names(header)}


@PROPERTY
@given(damaged())
@example(file_bytes({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                     "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(6)))  # fmt: skip
@example(file_bytes({"alpha": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}}, bytes(4)))
@example(file_bytes({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)))
@example(file_bytes({"t": {"dtype": "U8", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}))
@example(file_bytes(None, bytes(1), raw=b'{"t":{"dtype":"U8","shape":[-0],"data_offsets":[0,1]}}'))
@example(file_bytes({"t": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, bytes(1)))
@example(file_bytes({"t": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, bytes(1)))
@example(file_bytes({"t": {"dtype": "U8", "shape": [0, 2**64], "data_offsets": [0, 0]}}))
@example(file_bytes(None, raw=b'{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":"\\ud800"}}'))
@example(
    file_bytes(None, raw=b'{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":%s}}' % (b"[" * 126 + b"]" * 126))
)
@example(
    file_bytes(None, raw=b'{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":%s}}' % (b"[" * 125 + b"]" * 125))
)
@example(b"\x00" * 7)
def test_a_damaged_file_gets_the_libraries_verdict_and_only_a_safetensors_error(file):
    assert (ours(file) is None) == format_accepts(file)


@PROPERTY
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
        max_leaves=20,
    ),
    st.binary(max_size=16),
)
def test_any_json_at_all_is_refused_or_accepted_never_crashes(header, data):
    file = file_bytes(None, data, raw=json.dumps(header).encode())
    assert (ours(file) is None) == format_accepts(file)


@pytest.mark.parametrize("dtype", DTYPES)
@PER_DTYPE
@given(shape=st.lists(st.integers(0, 6), max_size=3), delta=st.integers(-3, 3), before=st.integers(0, 2))
def test_every_dtype_takes_exactly_its_size_and_nothing_else(dtype, shape, delta, before):
    """One tensor of `dtype` behind `before` bytes of a U8 tensor, its offsets holding its size plus `delta`."""
    size = tensor_bytes(dtype, shape)
    held = (size if size is not None else math.prod(shape) * DTYPE_BITS[dtype] // 8) + delta
    assume(held >= 0)
    header = {"pad": {"dtype": "U8", "shape": [before], "data_offsets": [0, before]},
              "t": {"dtype": dtype, "shape": shape, "data_offsets": [before, before + held]}}  # fmt: skip
    file = file_bytes(header, bytes(before + held))
    assert (ours(file) is None) == format_accepts(file) == (size is not None and delta == 0)


@PROPERTY
@given(layouts(), st.data())
def test_a_header_damaged_byte_by_byte_gets_the_libraries_verdict(layout, data):
    """The JSON text itself damaged: a byte replaced, inserted or deleted, one to three times."""
    header, body = layout
    raw = bytearray(json.dumps(header, ensure_ascii=data.draw(st.booleans())).encode())
    for _ in range(data.draw(st.integers(1, 3))):
        way = data.draw(st.sampled_from(["replace", "insert", "delete"]))
        index = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        byte = data.draw(st.sampled_from([*b' \t\n{}[],:"\\-.eE019tfnu', 0, 0xFF, 0xC3]))
        if way == "insert":
            raw.insert(index, byte)
        elif raw:
            raw[index : index + 1] = [byte] if way == "replace" else []
    file = file_bytes(None, body, raw=bytes(raw))
    assert (ours(file) is None) == format_accepts(file)


def test_the_refusals_say_which_tensor_and_which_bytes():
    def refusal(header: object, data: bytes = b"", **raw) -> str:
        message = ours(file_bytes(header, data, **raw))
        assert message is not None
        return message

    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert refusal({"a": a, "b": {**a, "data_offsets": [4, 12]}}, bytes(12)) == (
        "truncated or inconsistent safetensors file at 'b': its data_offsets [4, 12] overlap 'a''s, which end at 8 "
        "(tensors may not share bytes)"
    )
    assert "bytes 8 to 10 of the data before it belong to no tensor" in refusal(
        {"a": a, "b": {**a, "data_offsets": [10, 18]}}, bytes(18)
    )
    assert "4 bytes after the last tensor's data belong to no tensor" in refusal({"a": a}, bytes(12))
    assert "the header names no tensor, but 3 bytes of data follow it" in refusal({}, bytes(3))
    assert refusal({"a": a}, bytes(4)) == (
        "truncated or inconsistent safetensors file at 'a': its data ends at byte 8, but the file holds 4 bytes of data"
    )
    assert "shape [3] of F32 takes 12 bytes, its data_offsets [0, 8] hold 8" in refusal(
        {"a": {**a, "shape": [3]}}, bytes(8)
    )
    assert refusal({"a": {**a, "data_offsets": 8}}, bytes(8)) == (
        "not a safetensors file: tensor 'a' has data_offsets 8, not two non-negative integers [begin, end]"
    )
    assert "tensor 'a' has shape 2, not a list of non-negative integers" in refusal({"a": {**a, "shape": 2}}, bytes(8))
    assert "tensor 'a' has shape [True], not a list" in refusal({"a": {**a, "shape": [True]}}, bytes(8))
    assert "tensor 'a' has dtype ['F32'], not one safetensors knows (BOOL, F4" in refusal(
        {"a": {**a, "dtype": ["F32"]}}, bytes(8)
    )
    assert "tensor 'a' has no shape" in refusal({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8))
    assert "__metadata__ must map strings to strings, not {'k': 1}" in refusal({METADATA: {"k": 1}})
    assert "writes 'a' twice in one object" in refusal(None, raw=b'{"a": {}, "a": {}}')
    assert "writes 'k' twice in one object" in refusal(None, raw=b'{"__metadata__": {"k": "v", "k": "v"}}')
    assert "the header begins with ' {}', not '{'" in refusal(None, raw=b" {}")
    assert "does not fill a whole number of bytes" in refusal({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
                                                              bytes(2))  # fmt: skip
    assert "bad header length (100000001 bytes, over safetensors' limit" in refusal({}, length=100_000_001)
    assert "too short (7 bytes" in ours(bytes(7))
    # A hostile header's values reach messages and logs cut short.
    assert len(refusal({"a": {**a, "shape": ["x" * 10_000]}}, bytes(8))) < 200


def test_fields_safetensors_ignores_are_dropped_and_null_metadata_is_none():
    from contract.safetensors_checks import parse_header

    raw = json.dumps({METADATA: None, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "extra": [-1]}})
    tensors, metadata = parse_header(raw.encode(), 1)
    assert tensors == {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}} and metadata is None


# --- one refusal at every entry point ---------------------------------------------------------------------------


def refusal_at_registration(file: bytes) -> str:
    """The API's registration (`PUT /v1/models/{model}/adapters/{name}`): its service and the registry's check."""
    from api_server.core.errors import ApiError
    from api_server.predict.adapters import AdapterService
    from contract import naming
    from contract.stores.adapter_registry import AdapterRegistry
    from emulators.stack import local_catalog
    from tests.unit.test_adapter_parts import FakeBucket

    spec = local_catalog().get("sd15-txt2img")
    bucket = FakeBucket({naming.adapter_prefix(spec.name, "style", "1") + naming.ADAPTER_FILE: file})
    with pytest.raises(ApiError) as refused:
        AdapterService(AdapterRegistry(bucket)).register(spec, "style", "1")
    assert refused.value.status == 422 and refused.value.field == "file"
    return refused.value.message.removeprefix("adapter file of style@1: ")


def refusal_at_the_workers_adapter_load(file: bytes) -> str:
    from emulators.stack import local_catalog
    from tests.unit.test_adapter_parts import loaded_by_the_worker

    with tempfile.TemporaryDirectory() as base:
        adapters, _ = loaded_by_the_worker(local_catalog().get("sd15-txt2img"), "style", file, Path(base))
    with pytest.raises(ValueError) as refused:
        adapters.weights()
    return str(refused.value).removeprefix("adapter could not be loaded: style@1: ")


def refusal_at_folder_import(file: bytes) -> str:
    from model_worker.weights.importer import ImportRefusedError, check_folder

    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
        (folder / "unet").mkdir()
        (folder / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(file)
        with pytest.raises(ImportRefusedError) as refused:
            check_folder(folder)
    return str(refused.value).removeprefix("unet/diffusion_pytorch_model.safetensors: ")


def refusal_at_single_file_import(file: bytes) -> str:
    """`python -m model_worker.weights import FILE --base DIR ...`, in this process: exit 2, `refused: FILE: ...`."""
    from model_worker.weights.cli import main

    with tempfile.TemporaryDirectory() as work, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # never reached: nothing is uploaded
        source = Path(work) / "fine-tune.safetensors"
        source.write_bytes(file)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            status = main(["import", str(source), "--model", "sdxl-txt2img", "--version", "2", "--base", work,
                           "--bucket", "models"])  # fmt: skip
    assert status == 2, stderr.getvalue()
    line = stderr.getvalue()
    assert line.startswith("refused: fine-tune.safetensors: ") and line.count("\n") == 1, line
    return line.removeprefix("refused: fine-tune.safetensors: ").removesuffix("\n")


def refusal_at_the_workers_download(file: bytes) -> str:
    from model_worker.weights.store import WeightsIntegrityError, download_weights

    client = FakeStorage({"m/1/model_index.json": b"{}", "m/1/unet/diffusion_pytorch_model.safetensors": file})
    with tempfile.TemporaryDirectory() as cache, pytest.raises(WeightsIntegrityError) as refused:
        download_weights(client, "models", "m/1", Path(cache))
    assert refused.value.file == "unet/diffusion_pytorch_model.safetensors"
    return refused.value.reason


ENTRY = [
    refusal_at_registration,
    refusal_at_the_workers_adapter_load,
    refusal_at_folder_import,
    refusal_at_single_file_import,
    refusal_at_the_workers_download,
]


@ENTRY_POINTS
@given(damaged())
@example(file_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)))  # fmt: skip
@example(file_bytes({"lora_unet_x.alpha": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}}, bytes(4)))
@example(file_bytes({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, bytes(8)))
@example(file_bytes({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, bytes(8)))
@example(file_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": 8}}, bytes(8)))
def test_a_malformed_file_is_refused_in_the_same_words_at_every_entry_point(file):
    expected = ours(file)
    assume(expected is not None)
    for entry in ENTRY:
        assert entry(file) == expected, entry.__name__


# --- the worker's download: names that lead out of its directory --------------------------------------------------


class FakeBlob:
    def __init__(self, client: FakeStorage, name: str) -> None:
        self.client, self.name = client, name

    def download_as_bytes(self) -> bytes:
        return self.client.objects[self.name]

    def download_to_filename(self, path: str) -> None:
        self.client.written.append(path)
        Path(path).write_bytes(self.client.objects[self.name])


class FakeStorage:
    """The storage client calls `download_weights` makes, over a dict of objects."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects, self.written = objects, []

    def list_blobs(self, _bucket: str, prefix: str) -> list[FakeBlob]:
        return [FakeBlob(self, name) for name in sorted(self.objects) if name.startswith(prefix)]


@pytest.mark.parametrize("name", ["../escape.json", "unet/../../escape.json", "a//b.json", "./x.json", "a\\..\\b"])
def test_a_blob_name_that_leads_out_of_the_weights_directory_is_refused_before_anything_is_written(tmp_path, name):
    from model_worker.weights.store import WeightsIntegrityError, download_weights

    client = FakeStorage({"m/1/model_index.json": b"{}", f"m/1/{name}": b"x"})
    with pytest.raises(WeightsIntegrityError, match="leads out of the weights directory"):
        download_weights(client, "models", "m/1", tmp_path / "cache")
    assert client.written == []
    assert not (tmp_path / "escape.json").exists()


def test_a_manifest_naming_a_file_outside_the_directory_is_refused(tmp_path):
    from model_worker.weights.store import MANIFEST, WeightsIntegrityError, download_weights

    manifest = {"format": 1, "files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}}
    client = FakeStorage({"m/1/model_index.json": b"{}", f"m/1/{MANIFEST}": json.dumps(manifest).encode()})
    with pytest.raises(WeightsIntegrityError, match="leads out of the weights directory"):
        download_weights(client, "models", "m/1", tmp_path / "cache")
    client = FakeStorage({"m/1/model_index.json": b"{}", f"m/1/{MANIFEST}": b'{"files": ["x"]}'})
    with pytest.raises(WeightsIntegrityError, match="not a manifest"):
        download_weights(client, "models", "m/1", tmp_path / "cache")


def test_a_sound_download_lands_inside_its_directory(tmp_path):
    from model_worker.weights.store import download_weights

    sound = file_bytes({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, bytes(4))
    client = FakeStorage({"m/1/model_index.json": b"{}", "m/1/unet/diffusion_pytorch_model.safetensors": sound})
    target = download_weights(client, "models", "m/1", tmp_path / "cache")
    assert (target / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == sound
    assert all(Path(path).is_relative_to(tmp_path / "cache") for path in client.written)


# --- names: fullmatch, not match with `$` -------------------------------------------------------------------------


class NoRegistry:
    def register(self, *args):
        raise AssertionError("a name or version the route refuses reached the registry")


@pytest.mark.parametrize(("name", "version", "field"), [("ink\n", "1", "name"), ("ink", "1\n", "version"),
                                                        ("Ink", "1", "name"), ("ink", "1..2", "version")])  # fmt: skip
def test_an_adapter_name_or_version_with_a_trailing_newline_is_refused(name, version, field):
    from api_server.core.errors import ApiError
    from api_server.predict.adapters import AdapterService
    from emulators.stack import local_catalog

    with pytest.raises(ApiError) as refused:
        AdapterService(NoRegistry()).register(local_catalog().get("sd15-txt2img"), name, version)
    assert (refused.value.status, refused.value.field) == (422, field)


@pytest.mark.parametrize(
    ("model", "version", "message"),
    [
        ("Bad_Name", "2", "argument --model: model name 'Bad_Name' must be lowercase"),
        ("sdxl\n", "2", "argument --model: model name 'sdxl\\n' must be"),
        ("sdxl", "2\n", "argument --version: version '2\\n' must be"),
        ("sdxl", "../2", "argument --version: version '../2' must be"),
        ("x" * 51, "2", "at most 50 characters"),
    ],
)
def test_the_import_takes_only_names_the_catalog_takes(tmp_path, capsys, model, version, message):
    from model_worker.weights.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["import", str(tmp_path), "--model", model, "--version", version, "--bucket", "models"])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_import_function_checks_the_names_too(tmp_path):
    from model_worker.weights.importer import ImportRefusedError, import_model

    with pytest.raises(ImportRefusedError, match="version '1/2' must be"):
        import_model(None, "models", tmp_path, "sdxl", "1/2")


def test_the_catalog_refuses_the_names_the_import_refuses(tmp_path):
    from contract.catalog import ModelCatalog

    path = tmp_path / "models.yaml"
    path.write_text("schema_version: 1\nmodels:\n  Bad_Name: {runner: noop, task: txt2img}\n")
    with pytest.raises(ValueError, match="model name 'Bad_Name' must be lowercase"):
        ModelCatalog.from_yaml(path)
