"""KServe v2 with Triton's sequences.

``tensors``: datatypes, BYTES, JSON and binary tensors. ``body``: the HTTP infer body's
decode and its reply's encoding, with no service (a front door process runs them).
``request``: what HTTP and gRPC share (sequences, Triton's rules, the step a request
becomes, the metadata). ``http``: the HTTP door and its route table. ``grpc``: the gRPC
servicer, imported only where gRPC is served. ``pb``: its generated messages.

Nothing is imported here: importing ``body`` must not load the node's service, ONNX
Runtime or FastAPI (a front door process imports it).
"""
