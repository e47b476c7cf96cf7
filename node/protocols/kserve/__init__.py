"""KServe v2 with Triton's sequences.

``tensors``: datatypes, BYTES, JSON and binary tensors. ``body``: the HTTP infer body's
decode and its reply's encoding, with no service (a front door process runs them).
``request``: what HTTP and gRPC share (sequences, Triton's rules, the step a request
becomes, the metadata). ``http``: the HTTP door and its route table. ``grpc``: the gRPC
servicer, imported only where gRPC is served. ``messages``: the gRPC request's decode and
the reply's encoding, with no service. ``grpc_front``: a front door process's gRPC server
(the infer RPCs over the hop, the rest passed to the core). ``pb``: the generated messages.

Nothing is imported here: importing ``body``, ``messages`` or ``grpc_front`` must not load
the node's service, ONNX Runtime or FastAPI (a front door process imports them).
"""
