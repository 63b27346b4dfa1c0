"""The wire format of every message between llamarl roles: authenticated frames.

A message (a dict of JSON-able values and tensors) becomes a binary frame that carries an
HMAC-SHA256 tag under the app's shared secret. ``decode`` checks the tag before it parses a
single byte, and the format holds only JSON and raw tensor bytes, so nothing that arrives
over the network can execute code (nothing is ever unpickled).

Frame layout (all integers little-endian)::

    magic b"LRL\\x00" (4) | format version (1) | HMAC-SHA256 tag (32) | header length (4)
    | header: UTF-8 JSON | tensor bytes, back to back

The tag covers every byte except itself. The header is ``{"msg": ..., "tensors": [...]}``
where each tensor in ``msg`` is replaced by ``{"__tensor__": i}`` and ``tensors[i]``
records its dtype, shape, offset and byte count in the payload.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import struct
from typing import Any

import numpy as np
import torch

from llamarl.app.errors import ConfigError

__all__ = ["AuthenticationError", "MAX_FRAME_BYTES", "SECRET_ENV", "SECRET_FILE_ENV", "check_secret", "decode",
           "encode", "new_secret", "read_secret"]

SECRET_ENV = "LLAMARL_SECRET"
SECRET_FILE_ENV = SECRET_ENV + "_FILE"

_MAGIC = b"LRL\x00"
_FORMAT_VERSION = 1
_TAG_BYTES = 32
_PREFIX = struct.Struct("<4sB32sI")  # magic, format version, tag, header length
_TENSOR_MARK = "__tensor__"

# The store's libuv server drops the connection of a client that sends a value over
# 8 MiB; refuse such frames before they reach it, with a message that says why.
MAX_FRAME_BYTES = 8 * 1024 * 1024 - 1024

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e5m2,
        torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.uint16, torch.uint32, torch.uint64, torch.bool,
    )
}


class AuthenticationError(Exception):
    """A frame's HMAC tag is missing or does not match: wrong secret or tampered bytes."""


# --------------------------------------------------------------------------- secrets


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def read_secret(secret_file: str = "", *, create: bool = True) -> bytes:
    """The app's shared secret (hex), from the first of: ``secret_file`` (a role's
    ``--secret-file``); the file named by ``$LLAMARL_SECRET_FILE`` (the component sets
    it; SLURM's scheduler and a mounted Kubernetes secret use it); ``$LLAMARL_SECRET``
    (a local run started by hand). A file must be private: refused when its group or
    other users may read or write it (a batch script, a job spec and ``ps`` are readable
    by others, a 0600 file is not). A file that does not exist yet is created with a
    fresh secret by the first role that looks, atomically, so the roles of one app on
    hosts that share the file system (local, a SLURM job directory) agree on it. Not with
    ``create=False`` (``llamarl.app.roles.stop``: a file that does not exist names no app that ran)."""
    path, source = ((secret_file, "--secret-file") if secret_file
                    else (os.environ.get(SECRET_FILE_ENV, ""), f"${SECRET_FILE_ENV}"))
    if path:
        value = _read_private_file(path, source, create=create)
    else:
        value, source = os.environ.get(SECRET_ENV, ""), f"${SECRET_ENV}"
    if not value:
        raise RuntimeError(
            f"no secret: every llamarl role needs the run's shared secret, from --secret-file, "
            f"${SECRET_FILE_ENV} or ${SECRET_ENV} (hex, from llamarl.app.control.frames.new_secret().hex())")
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        raise RuntimeError(f"{source} is not valid hex ({len(value)} characters)") from None
    if len(secret) < 16:
        raise RuntimeError(f"{source} holds {len(secret)} bytes; a secret needs at least 16")
    return secret


def _read_private_file(path: str, source: str, *, create: bool = True) -> str:
    """The text of ``path`` (created with a fresh secret when missing, if ``create``),
    refused when its group or other users may read or write it."""
    if not os.path.exists(path) and not create:
        raise RuntimeError(f"{source} names {path}, which does not exist")
    if not os.path.exists(path):
        try:
            _create_secret_file(path)
        except OSError as e:
            raise RuntimeError(f"{source} names {path}, which does not exist and cannot be made: "
                               f"{e.strerror}") from None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise ConfigError(
                    f"{source} names {path}, whose mode {mode & 0o777:o} lets other users read or "
                    f"change the run's secret; it must be 600")
            return f.read().decode()
    except OSError as e:
        raise ConfigError(f"{source} names {path}, which cannot be read: {e.strerror}") from None


def _make_private_dirs(directory: str) -> None:
    """``directory`` and every missing parent, each made 700 (``os.makedirs``' mode applies to
    the last one only; the others would be 755 and listable by anyone)."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o700)
        except FileExistsError:  # another role of the app made it first
            pass


def _create_secret_file(path: str) -> None:
    """A fresh secret at ``path`` (mode 600, its new directories 700), unless another
    process made one first: written to a private temporary name, then hard-linked, which
    fails when the name exists, so a reader never sees a half-written file."""
    _make_private_dirs(os.path.dirname(os.path.abspath(path)))
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, new_secret().hex().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)


# --------------------------------------------------------------------------- encoding


def check_secret(secret: bytes) -> None:
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ValueError("the message secret must be non-empty bytes")


def _tag(secret: bytes, frame: memoryview, header_start: int) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    mac.update(frame[:5])  # magic + format version
    mac.update(frame[5 + _TAG_BYTES:header_start])  # header length
    mac.update(frame[header_start:])
    return mac.digest()


def encode(msg: dict[str, Any], secret: bytes) -> bytes:
    """One frame for ``msg``: JSON-able values plus CPU or CUDA tensors, nested or not."""
    check_secret(secret)
    if not isinstance(msg, dict):
        raise TypeError(f"a message is a dict, got {type(msg).__name__}")
    tensors: list[torch.Tensor] = []
    meta: list[dict[str, Any]] = []
    offset = 0

    def lift(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"tensors of dtype {value.dtype} cannot be sent")
            t = value.detach().to("cpu").contiguous()
            nbytes = t.numel() * t.element_size()
            meta.append({"dtype": name, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            tensors.append(t)
            offset += nbytes
            return {_TENSOR_MARK: len(tensors) - 1}
        if isinstance(value, dict):
            if _TENSOR_MARK in value:
                raise ValueError(f"the key {_TENSOR_MARK!r} is reserved by the message format")
            for key in value:
                if not isinstance(key, str):
                    raise TypeError(f"message dict keys must be str, got {type(key).__name__}")
            return {k: lift(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [lift(v) for v in value]
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        raise TypeError(f"cannot encode a value of type {type(value).__name__} "
                        "(JSON-able values and torch.Tensor only)")

    header = json.dumps({"msg": lift(msg), "tensors": meta}, separators=(",", ":")).encode()
    header_start = _PREFIX.size
    frame = bytearray(header_start + len(header) + offset)
    view = memoryview(frame)
    view[header_start:header_start + len(header)] = header
    cursor = header_start + len(header)
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            # A uint8 view of the tensor's storage: one memcpy, no per-element Python.
            view[cursor:cursor + n] = t.reshape(-1).view(torch.uint8).numpy().data
        cursor += n
    _PREFIX.pack_into(frame, 0, _MAGIC, _FORMAT_VERSION, b"\0" * _TAG_BYTES, len(header))
    frame[5:5 + _TAG_BYTES] = _tag(secret, view, header_start)
    return bytes(frame)


def decode(data: bytes, secret: bytes) -> dict[str, Any]:
    """The message in ``data``; raises ``AuthenticationError`` before parsing if the tag is bad."""
    check_secret(secret)
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise ValueError(f"malformed frame: {len(view)} bytes is shorter than the "
                         f"{_PREFIX.size}-byte frame prefix")
    magic, version, tag, header_len = _PREFIX.unpack_from(view, 0)
    if magic != _MAGIC:
        raise ValueError(f"malformed frame: bad magic {bytes(magic)!r} (not a llamarl message)")
    if version != _FORMAT_VERSION:
        raise ValueError(f"malformed frame: format version {version}, expected {_FORMAT_VERSION}")
    if not hmac.compare_digest(tag, _tag(secret, view, _PREFIX.size)):
        raise AuthenticationError("message authentication failed: the frame was tampered with "
                                  "or signed with another secret")
    header_end = _PREFIX.size + header_len
    if header_end > len(view):
        raise ValueError("malformed frame: header runs past the end of the frame")
    try:
        header = json.loads(bytes(view[_PREFIX.size:header_end]))
        metas = header["tensors"]
        body = header["msg"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"malformed frame header: {e}") from None
    payload = view[header_end:]
    tensors = [_tensor_from(payload, m) for m in metas]

    def lower(value: Any) -> Any:
        if isinstance(value, dict):
            if _TENSOR_MARK in value:
                idx = value[_TENSOR_MARK]
                if not isinstance(idx, int) or not 0 <= idx < len(tensors):
                    raise ValueError(f"malformed frame: bad tensor reference {idx!r}")
                return tensors[idx]
            return {k: lower(v) for k, v in value.items()}
        if isinstance(value, list):
            return [lower(v) for v in value]
        return value

    msg = lower(body)
    if not isinstance(msg, dict):
        raise ValueError("malformed frame: the message is not a dict")
    return msg


def _tensor_from(payload: memoryview, meta: Any) -> torch.Tensor:
    try:
        dtype = _DTYPES[meta["dtype"]]
        shape = [int(s) for s in meta["shape"]]
        offset, nbytes = int(meta["offset"]), int(meta["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed frame: bad tensor record {meta!r} ({e})") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(s < 0 for s in shape) or math.prod(shape) * itemsize != nbytes:
        raise ValueError(f"malformed frame: tensor record {meta!r} is inconsistent")
    if offset < 0 or offset + nbytes > len(payload):
        raise ValueError(f"malformed frame: tensor record {meta!r} runs past the payload")
    raw = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        # Copy out of the (read-only) frame so the caller gets a writable tensor it owns.
        raw.numpy()[:] = np.frombuffer(payload[offset:offset + nbytes], dtype=np.uint8)
    return raw.view(dtype).reshape(shape)
