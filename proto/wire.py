"""Data-plane frame layout and typed errors shared by shards and workers.

A data-plane message is a ZeroMQ multipart: frame 0 is a serialized :class:`DataHeader`
(``proto/bitps.proto``), frames 1..n are payloads, one per key in ``header.keys``, each the key's
elements as raw little-endian values of ``header.dtype`` and at most :data:`MAX_FRAME_BYTES`.
Replies carry the request's ``request_id``; an ``ERROR`` reply carries an :class:`ErrorCode` and a
message naming the offending value and what was expected.
"""

from __future__ import annotations

import numpy as np

from bitps.proto import bitps_pb2 as pb

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL",
    "PSError",
    "ZMQ_BATCH_BYTES",
    "encode_header",
    "error_name",
    "parse_header",
]

PROTOCOL = pb.PROTOCOL_VERSION_CURRENT
# Frames over 32 MiB run at half speed (glibc mmap threshold); 16 MiB keeps every frame fast.
MAX_FRAME_BYTES = 16 << 20

ZMQ_BATCH_BYTES = 8192
"""libzmq's ``out_batch_size`` (``ZMQ_OUT_BATCH_SIZE``, a draft option pyzmq does not expose)."""
_ALIGN = 64
_PAD_TAG = b"\x92\x01"  # DataHeader field 18 (pad), wire type 2: varint (18 << 3) | 2



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


def encode_header(header: pb.DataHeader, bulk: np.ndarray | memoryview | None = None) -> bytes:
    """Serialize ``header`` as frame 0. ``bulk``: the first payload frame when it is sent
    zero-copy; the header is then padded so that the kernel's copy of that frame starts on a
    64-byte boundary of ``bulk``.

    Why: libzmq writes an idle connection's next message in two ``send`` calls. The first sends
    one batch of :data:`ZMQ_BATCH_BYTES`, copied together: frame 0 (flags, a 1- or 8-byte size,
    the header) and frame 1's 9-byte prefix and first bytes. The second sends the rest of frame
    1 straight from its buffer, at ``bulk + 8192 - prefix``. When that address lies in the last
    32 bytes below a 4 KiB boundary, the kernel's copy out of it runs at about half speed on
    the AMD EPYC we measured (most likely 4K aliasing: its loads match the low address bits of
    the page-aligned stores it has just made): a 1 MiB push+pull took 1.4-2.1 ms instead of 0.7.
    Padding with field 18 (``pad``: 3 + k bytes appended to the serialized header, which
    protobuf reads as one more field; k < 128) makes that address a multiple of 64. Later
    frames of the same message start their own batch at ``frame + 8183`` and are not affected
    by the header."""
    data = header.SerializeToString()
    if bulk is None or bulk.nbytes <= ZMQ_BATCH_BYTES:
        return data
    if not isinstance(bulk, np.ndarray):
        bulk = np.frombuffer(bulk, np.uint8)
    # Bytes before frame 1's bulk in the first batch: frame 0's prefix (1 flag byte and a size
    # of 1 byte up to 255, else 8) and body, then frame 1's prefix (flags + 8-byte size).
    address = bulk.ctypes.data + ZMQ_BATCH_BYTES
    n = len(data)
    if (address - n - (11 if n <= 255 else 18)) % _ALIGN == 0:
        return data
    base = n + len(_PAD_TAG) + 1  # a padded header: tag, 1-byte length, k zero bytes
    k = (address - base - 11) % _ALIGN
    if base + k > 255:  # frame 0's size takes 8 bytes: k must keep it there
        k = (address - base - 18) % _ALIGN
        k += _ALIGN if base + k <= 255 else 0
    return data + _PAD_TAG + bytes((k,)) + bytes(k)
