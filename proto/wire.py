"""Data-plane frame layout and typed errors shared by shards and workers.

A data-plane message is a ZeroMQ multipart: frame 0 is a serialized :class:`DataHeader`
(``proto/bitps.proto``), frames 1..n are payloads, one per key in ``header.keys``, each the key's
elements as raw little-endian values of ``header.dtype`` and at most :data:`MAX_FRAME_BYTES`.
Replies carry the request's ``request_id``; an ``ERROR`` reply carries an :class:`ErrorCode` and a
message naming the offending value and what was expected.
"""

from __future__ import annotations

from proto import bitps_pb2 as pb

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL",
    "PSError",
    "error_name",
    "parse_header",
]

PROTOCOL = pb.PROTOCOL_VERSION_CURRENT
# Frames over 32 MiB run at half speed (glibc mmap threshold); 16 MiB keeps every frame fast.
MAX_FRAME_BYTES = 16 << 20



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
