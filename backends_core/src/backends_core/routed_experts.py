"""Decoding MoE routed experts (router replay), shared by every backend.

Servers send routing as base64, either raw little-endian bytes (SGLang: int32) or a ``.npy`` file (vLLM), or
as an object holding raw bytes with their shape (prime-rl's vLLM server, Dynamo's vLLM worker), read by
:func:`decode_routed_object`.
:func:`decode_routed_experts` base64-decodes once and views the bytes with ``np.frombuffer``: no second
copy of the payload, whatever its size. The returned array is read-only (it views the decoded bytes).
The payload may be a ``memoryview`` into the raw response body (``Server.request(large_strings=...)``), so the
base64 text is never copied either; such a view is the raw JSON text, so JSON escapes in it (``\\/``) are undone
before decoding when the text does not decode as it is. Decoding uses pybase64's validating SIMD path (an order
of magnitude faster than ``binascii``); what it refuses is handed to ``binascii`` in strict mode, which decides
(and words the error).
:func:`align_routed_experts` checks the row count against the sequence and trims to the requested start
even when the server ignored it.
"""

from __future__ import annotations

import ast
import binascii
import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pybase64

from backends_core.errors import ResponseParseError
from backends_core.jsonnode import Node
from backends_core.types import RoutedExperts

__all__ = [
    "ALLOWED_DTYPES",
    "OBJECT_DEFAULT_DTYPE",
    "align_routed_experts",
    "decode_routed_experts",
    "decode_routed_object",
    "npy_base64_length",
]

#: Integer dtypes servers use for expert ids.
ALLOWED_DTYPES = frozenset({np.dtype("uint8"), np.dtype("uint16"), np.dtype("int16"), np.dtype("int32")})
#: The dtype of an object-form payload that names none. prime-rl's vLLM server sent uint8 without naming it (first
#: ``{"data", "shape"}``, then with ``"start"``) and names it since it also sends uint16 (models of more than 256
#: experts). A wider payload read as uint8 has more rows than its shape says, so a wrong default is refused by the
#: row check, never misread.
OBJECT_DEFAULT_DTYPE = np.dtype("uint8")
_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAGIC_B64 = pybase64.b64encode(_NPY_MAGIC)  # 6 bytes: 8 characters, whatever follows
#: Longest ``.npy`` header read to size a payload (numpy writes 64-byte aligned headers of a few hundred bytes).
_NPY_HEADER_MAX = 1 << 16


def _npy_preamble(head: bytes) -> tuple[int, int]:
    """Where a ``.npy`` file's header dictionary starts and how long it is, from its first 12 bytes (magic,
    version, header length: 2 bytes in version 1, 4 in versions 2 and 3).

    :raises ValueError: an unknown version.
    :raises IndexError: fewer bytes than the preamble.
    """
    major = head[6]
    if major == 1:
        return 10, int.from_bytes(head[8:10], "little")
    if major in (2, 3):
        return 12, int.from_bytes(head[8:12], "little")
    raise ValueError(f"unknown .npy version {major}")


@functools.lru_cache(maxsize=256)
def _npy_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """dtype, shape and Fortran order of a ``.npy`` header dictionary (read once per distinct header: a server
    sends the same one for every answer of the same length)."""
    fields = ast.literal_eval(header.decode("latin1"))
    return np.dtype(fields["descr"]), tuple(int(d) for d in fields["shape"]), bool(fields["fortran_order"])


def npy_base64_length(text: memoryview) -> int | None:
    """Length in characters of the padded base64 ``.npy`` payload ``text`` starts with, read from the ``.npy``
    header (magic, version, header length, dtype and shape) alone; ``None`` when ``text`` does not start with
    one or its header cannot be read (the decoder then reports what is wrong).

    Lets :func:`~backends_core.jsonio.loads_lifting` find the end of a payload of megabytes without scanning it.
    """
    if text[:8] != _NPY_MAGIC_B64:
        return None
    try:
        start, header_len = _npy_preamble(pybase64.b64decode(text[:16], validate=True))
        header_end = start + header_len
        chars = 4 * -(-header_end // 3)
        if header_len > _NPY_HEADER_MAX or chars > len(text):
            return None
        raw = pybase64.b64decode(text[:chars], validate=True)
        dtype, shape, _ = _npy_header(raw[start:header_end])
        size = math.prod(shape) * dtype.itemsize
    except (ValueError, KeyError, TypeError, SyntaxError, IndexError, binascii.Error):
        return None
    return 4 * -(-(header_end + size) // 3)


def _b64decode(payload: str | bytes | memoryview) -> bytes:
    """Strict base64 decode: pybase64 (validating, SIMD) for what it accepts, ``binascii`` strict mode for the
    rest (it accepts a few paddings pybase64 refuses, and raises the errors callers have always seen)."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return binascii.a2b_base64(payload, strict_mode=True)


def decode_routed_experts(
    payload: str | bytes | memoryview,
    *,
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: str | np.dtype[Any] = "int32",
    num_experts: int | None = None,
    field: str = "routed_experts",
    url: str | None = None,
) -> npt.NDArray[np.integer[Any]]:
    """Decode a base64 routing payload into ``[tokens, layers, top_k]``.

    ``.npy`` payloads carry their own dtype and shape; raw payloads use ``dtype`` and need ``num_layers``
    and ``top_k`` to infer the token count.

    :param payload: the base64 text from the JSON body (``str`` is decoded without re-encoding; a ``memoryview``
        of the raw body is decoded in place).
    :param num_layers: expected layers (checked against ``.npy`` shapes too).
    :param top_k: expected experts per token.
    :param dtype: dtype of raw payloads.
    :param num_experts: when given, every id must be in ``[0, num_experts)``.
    :param field: name used in error messages.
    :param url: the server the payload came from, named by every error.
    :raises ResponseParseError: bad base64, unsupported dtype, byte count not matching the shape, ids out
        of range.
    """
    try:
        return _decode(payload, num_layers, top_k, np.dtype(dtype), num_experts, field)
    except ResponseParseError as exc:
        if url is None or exc.url is not None:
            raise
        raise ResponseParseError(exc.detail, url=url) from exc


def _decode(
    payload: str | bytes | memoryview,
    num_layers: int | None,
    top_k: int | None,
    dtype: np.dtype[Any],
    num_experts: int | None,
    field: str,
) -> npt.NDArray[np.integer[Any]]:
    if not isinstance(payload, str | bytes | memoryview):
        raise ResponseParseError(f"{field} must be a base64 string, got {type(payload).__name__}")
    try:
        raw = _b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        unescaped = _unescaped(payload)  # a value lifted from the raw body, JSON escapes still in it
        if unescaped is None:
            raise ResponseParseError(f"{field} is not valid base64: {exc}") from exc
        raw = unescaped
    npy = raw.startswith(_NPY_MAGIC)
    array = _from_npy(raw, field) if npy else _from_raw(raw, dtype, num_layers, top_k, field)
    if array.ndim != 3:
        raise ResponseParseError(f"{field} must have 3 dimensions [tokens, layers, top_k], got shape {array.shape}")
    if num_layers is not None and array.shape[1] != num_layers:
        raise ResponseParseError(f"{field} has {array.shape[1]} layers, expected {num_layers}")
    if top_k is not None and array.shape[2] != top_k:
        raise ResponseParseError(f"{field} has top_k {array.shape[2]}, expected {top_k}")
    if array.size and (num_experts is not None or array.dtype.kind == "i"):
        lo = int(array.min())  # the maximum only when it matters: one pass over megabytes instead of two
        if lo < 0 or (num_experts is not None and int(array.max()) >= num_experts):
            hi = int(array.max())
            bound = f"[0, {num_experts})" if num_experts is not None else ">= 0"
            raise ResponseParseError(f"{field} has expert ids in [{lo}, {hi}], expected {bound}")
    return array


def decode_routed_object(record: Node) -> tuple[npt.NDArray[np.integer[Any]], int | None]:
    """Decode routing in its object form: ``{"data": base64 of the C-order little-endian array, "shape": [rows,
    layers, top_k], "start": first routed position, "dtype": "uint8" | "uint16" | "int16" | "int32"}`` (the dtype
    also as ``"torch.<name>"``).

    ``dtype`` may be absent (then :data:`OBJECT_DEFAULT_DTYPE`), and so may ``start`` (then ``None`` is returned,
    for the caller to infer the start from the row count as for a ``.npy`` payload). A key that is present must
    hold a valid value: ``null`` is refused like any other bad value.

    :param record: the object, with its JSON path and server (named by every error).
    :returns: the ``[rows, layers, top_k]`` array and the start the record names, ``None`` when it names none.
    :raises ResponseParseError: a bad shape, dtype or start, or data that does not decode to the shape.
    """
    present = record.obj()
    shape_node = record.get("shape")
    shape = [d.integer() for d in shape_node.items()]
    if len(shape) != 3 or min(shape) < 0:
        raise shape_node.fail(f"expected [rows, layers, top_k], got {shape}")
    rows, layers, top_k = shape
    if layers == 0 or top_k == 0:
        raise shape_node.fail(f"expected at least one layer and one expert per token, got {shape}")
    dtype = _named_dtype(record.get("dtype")) if "dtype" in present else OBJECT_DEFAULT_DTYPE
    start = None
    if "start" in present:
        start = record.get("start").integer()
        if start < 0:
            raise record.get("start").fail(f"start must be >= 0, got {start}")
    data = record.get("data")
    experts = decode_routed_experts(
        data.value, num_layers=layers, top_k=top_k, dtype=dtype, field=data.path, url=data.url
    )
    if experts.shape[0] != rows:
        read_as = "" if "dtype" in present else f" (it names no dtype: read as {OBJECT_DEFAULT_DTYPE})"
        raise data.fail(f"decodes to {experts.shape[0]} rows but shape says {rows}{read_as}")
    return experts, start


def _named_dtype(node: Node) -> np.dtype[Any]:
    """The dtype a routing object names (numpy's name, or torch's ``"torch.<name>"``), one of :data:`ALLOWED_DTYPES`."""
    name = node.string().removeprefix("torch.")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise node.fail(f"unknown dtype {name!r}") from exc
    if dtype not in ALLOWED_DTYPES:
        raise node.fail(f"unsupported dtype {name!r}; expected one of {sorted(map(str, ALLOWED_DTYPES))}")
    return dtype


def _unescaped(payload: str | bytes | memoryview) -> bytes | None:
    """The decoded bytes of a raw body's string value holding JSON escapes (``\\/``, which base64 does not
    need but JSON allows), as a JSON parser would have handed the string over; ``None`` when it holds none or is
    not valid base64 once unescaped either."""
    if isinstance(payload, str) or b"\\" not in bytes(payload):
        return None
    try:
        text = orjson.loads(b'"' + bytes(payload) + b'"')
        return _b64decode(text) if isinstance(text, str) else None
    except (orjson.JSONDecodeError, binascii.Error, ValueError):
        return None


def _from_raw(
    raw: bytes, dtype: np.dtype[Any], num_layers: int | None, top_k: int | None, field: str
) -> npt.NDArray[Any]:
    if dtype not in ALLOWED_DTYPES:
        raise ResponseParseError(
            f"{field}: unsupported dtype {dtype}; expected one of {sorted(map(str, ALLOWED_DTYPES))}"
        )
    if num_layers is None or top_k is None:
        raise ResponseParseError(f"{field} is raw bytes: num_layers and top_k are needed to know its shape")
    row = dtype.itemsize * num_layers * top_k
    if len(raw) % row:
        raise ResponseParseError(
            f"{field} has {len(raw)} bytes, not a multiple of {row} "
            f"(= {dtype.itemsize} B × {num_layers} layers × top_k {top_k})"
        )
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(len(raw) // row, num_layers, top_k)


def _from_npy(raw: bytes, field: str) -> npt.NDArray[Any]:
    try:
        start, header_len = _npy_preamble(raw)
        dtype, shape, fortran = _npy_header(raw[start : start + header_len])
    except (ValueError, KeyError, TypeError, SyntaxError, IndexError) as exc:
        raise ResponseParseError(f"{field} is not a readable .npy payload: {exc}") from exc
    if dtype not in ALLOWED_DTYPES and dtype.newbyteorder("=") not in ALLOWED_DTYPES:
        raise ResponseParseError(
            f"{field}: unsupported dtype {dtype}; expected one of {sorted(map(str, ALLOWED_DTYPES))}"
        )
    offset = start + header_len
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ResponseParseError(
            f"{field}: .npy shape {shape} × {dtype.itemsize} B needs {expected} bytes, payload has {len(raw) - offset}"
        )
    flat = np.frombuffer(raw, dtype=dtype, count=math.prod(shape), offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C")


def align_routed_experts(
    experts: npt.NDArray[np.integer[Any]],
    *,
    total_tokens: int,
    server_start: int,
    wanted_start: int,
    field: str = "routed_experts",
    url: str | None = None,
) -> RoutedExperts:
    """Check routing rows against the sequence and trim them to ``wanted_start``.

    A server routes every token it fed through the model, i.e. all but the last sampled one, so rows
    cover positions ``[server_start, total_tokens - 1)``. A server that ignored the requested start returns
    rows from 0; both cases are recognised by the row count and trimmed (a view, no copy).

    :param experts: decoded ``[rows, layers, top_k]``.
    :param total_tokens: ``len(prompt_ids) + len(completion_ids)``.
    :param server_start: the start the server was asked to honour.
    :param wanted_start: the start the caller wants.
    :param url: the server the rows came from, named by every error.
    :raises ResponseParseError: the row count fits neither reading, or rows before ``wanted_start`` are missing.
    """
    rows = experts.shape[0]
    if rows == total_tokens - 1 - server_start:
        first = server_start
    elif rows == total_tokens - 1:
        first = 0  # the server ignored the requested start and sent everything
    else:
        raise ResponseParseError(
            f"{field} has {rows} rows; a sequence of {total_tokens} tokens routed from position {server_start} "
            f"needs {total_tokens - 1 - server_start}",
            url=url,
        )
    if wanted_start < first:
        raise ResponseParseError(
            f"{field} starts at position {first}, after the requested start {wanted_start}", url=url
        )
    return RoutedExperts(experts=experts[wanted_start - first :], start=wanted_start)
