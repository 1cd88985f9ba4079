"""Wire schema and shared layouts: generated gRPC/protobuf stubs (``make proto``), the data-plane
frame layout and typed errors (:mod:`bitps.proto.wire`), and the key plan
(:mod:`bitps.proto.keyplan`)."""

from bitps.proto import bitps_pb2, bitps_pb2_grpc
from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES, Key, KeyPlan, ParamSpec, make_plan
from bitps.proto.wire import MAX_FRAME_BYTES, PROTOCOL, PSError, error_name, parse_header

__all__ = [
    "DEFAULT_PARTITION_BYTES",
    "MAX_FRAME_BYTES",
    "PROTOCOL",
    "Key",
    "KeyPlan",
    "PSError",
    "ParamSpec",
    "bitps_pb2",
    "bitps_pb2_grpc",
    "error_name",
    "make_plan",
    "parse_header",
]
