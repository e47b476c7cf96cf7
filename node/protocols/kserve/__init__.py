"""KServe v2 with Triton's sequences.

``tensors``: datatypes, BYTES, JSON and binary tensors. ``request``: what HTTP and gRPC
share (the request, sequence ids, Triton's parameters and rules, the metadata). ``http``:
the HTTP wire and its route table. ``grpc``: the gRPC servicer, imported only where gRPC
is served. ``pb``: its generated messages."""

from node.protocols.kserve.http import decode_infer, encode_infer, handle
from node.protocols.kserve.request import (
    ANY_VERSION,
    EXTENSIONS,
    InferRequest,
    episode_of,
    model_metadata,
    not_live,
    service_step,
    to_step,
)

__all__ = [
    "ANY_VERSION",
    "EXTENSIONS",
    "InferRequest",
    "decode_infer",
    "encode_infer",
    "episode_of",
    "handle",
    "model_metadata",
    "not_live",
    "service_step",
    "to_step",
]
