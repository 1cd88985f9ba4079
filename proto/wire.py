"""Data-plane frame layout and typed errors shared by shards and workers.

A data-plane message is a ZeroMQ multipart: frame 0 is a serialized :class:`DataHeader`
(``proto/bitps.proto``), frames 1..n are payloads, one per key in ``header.keys``, each the key's
elements as raw little-endian values of ``header.dtype`` and at most :data:`MAX_FRAME_BYTES`.
Replies carry the request's ``request_id``; an ``ERROR`` reply carries an :class:`ErrorCode` and a
message naming the offending value and what was expected.
"""

from __future__ import annotations

import numpy as np

from proto import bitps_pb2 as pb

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL",
    "PSError",
    "dtype_of",
    "error_name",
    "numpy_dtype",
    "parse_header",
]

PROTOCOL = pb.PROTOCOL_VERSION_CURRENT
# Frames over 32 MiB run at half speed (glibc mmap threshold); 16 MiB keeps every frame fast.
MAX_FRAME_BYTES = 16 << 20

_NUMPY = {
    pb.FLOAT32: np.dtype("<f4"), pb.FLOAT16: np.dtype("<f2"), pb.BFLOAT16: np.dtype("<u2")
}
_DTYPE = {np.dtype("<f4"): pb.FLOAT32, np.dtype("<f2"): pb.FLOAT16}


class PSError(RuntimeError):
    """A typed failure of a parameter-server operation.

    ``code`` is a ``bitps.ErrorCode`` value; ``message`` names what was wrong, the value received
    and what was expected; ``shard`` is the shard that answered (``None`` when raised locally).
    """

    def __init__(self, code: int, message: str, *, shard: int | None = None) -> None:
        self.code = int(code)
        self.message = message
        self.shard = shard
        where = "" if shard is None else f" (shard {shard})"
        super().__init__(f"{error_name(code)}{where}: {message}")


def error_name(code: int) -> str:
    """Symbolic name of an ``ErrorCode`` value (``"UNKNOWN_KEY"``), or ``"CODE_<n>"``."""
    try:
        return pb.ErrorCode.Name(int(code))
    except ValueError:
        return f"CODE_{int(code)}"


def parse_header(frame: bytes | memoryview) -> pb.DataHeader:
    """Decode frame 0; raises :class:`PSError` ``BAD_HEADER`` for bytes that do not parse. The
    receiver checks the fields (an ERROR reply can then echo the request id)."""
    header = pb.DataHeader()
    try:
        header.ParseFromString(frame)
    except Exception as exc:  # protobuf raises DecodeError and, on some inputs, others
        raise PSError(pb.BAD_HEADER,
                      f"frame 0 is not a DataHeader ({len(frame)} bytes): {exc}") from None
    return header


def numpy_dtype(dtype: int) -> np.dtype:
    """Numpy dtype of a wire ``DType`` (bfloat16 travels as its uint16 bit pattern)."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise PSError(pb.BAD_DTYPE,
                      f"dtype {dtype} is not one of FLOAT32, FLOAT16, BFLOAT16") from None


def dtype_of(array: np.ndarray) -> int:
    """Wire ``DType`` of a numpy array's element type."""
    try:
        return _DTYPE[array.dtype.newbyteorder("<")]
    except KeyError:
        raise ValueError(
            f"dtype {array.dtype} has no wire type; expected float32 or float16") from None
