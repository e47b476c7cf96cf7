"""Runs through I/O binding with fixed, preallocated device buffers.

ONNX Runtime replays a captured CUDA graph only for runs made with ``run_with_iobinding``
on the same bound buffers (``enable_cuda_graph``): the first run captures, later runs copy
the new inputs into the bound device buffers and replay. :class:`BoundSession` does that
behind the plain ``run(output_names, feed)`` the dispatcher uses. One instance per device,
used only from that device's worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime

from node.policy import PolicyContract, TensorSpec

__all__ = ["BoundSession"]


def _fixed(contract: PolicyContract, spec: TensorSpec) -> tuple[int, ...]:
    spec = contract.step_spec(spec)  # the batch axis is 1: one episode's step per run
    if not all(isinstance(d, int) for d in spec.shape):
        raise ValueError(
            f"CUDA graphs need fixed shapes; {spec.name} is {spec.describe()} "
            "(export the model with static dimensions or run without --cuda-graph)"
        )
    return tuple(int(d) for d in spec.shape if isinstance(d, int))


class BoundSession:
    """``session`` run through one I/O binding on ``device_type:device_id`` buffers."""

    def __init__(
        self,
        session: onnxruntime.InferenceSession,
        contract: PolicyContract,
        device_type: str,
        device_id: int,
    ) -> None:
        self.session = session
        self.binding = session.io_binding()
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        for spec in contract.inputs:
            value = onnxruntime.OrtValue.ortvalue_from_shape_and_type(
                _fixed(contract, spec), np.dtype(spec.dtype), device_type, device_id
            )
            self.binding.bind_ortvalue_input(spec.name, value)
            self.inputs[spec.name] = (value, np.dtype(spec.dtype))
        for spec in contract.outputs:
            value = onnxruntime.OrtValue.ortvalue_from_shape_and_type(
                _fixed(contract, spec), np.dtype(spec.dtype), device_type, device_id
            )
            self.binding.bind_ortvalue_output(spec.name, value)
            self.outputs[spec.name] = value

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        for name, array in input_feed.items():
            value, dtype = self.inputs[name]
            value.update_inplace(np.ascontiguousarray(array, dtype=dtype))
        self.session.run_with_iobinding(self.binding)
        names = list(self.outputs) if output_names is None else output_names
        # .numpy() of a host buffer is a view of it, which the next run overwrites: copy
        return [np.array(self.outputs[name].numpy(), copy=True) for name in names]
