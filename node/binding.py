"""Runs through I/O binding on fixed device buffers, with each episode's state kept on the device.

ONNX Runtime replays a captured CUDA graph only for runs made with ``run_with_iobinding`` on
the same bound buffers (``enable_cuda_graph``). The first run captures; ONNX Runtime repeats
the run internally until the graph is captured. Later runs copy the new inputs into the bound
buffers and replay. :class:`BoundSession` does that behind the plain
``run(output_names, feed)`` the dispatcher uses.

**One thread.** ONNX Runtime 1.31's CUDA provider keeps the captured graph in a per-thread
context (``CUDAExecutionProvider::PerThreadContext``). The CUDA EP documentation asks that a
captured session is not run from several threads. A graph captured on one thread is not
replayed on another, which captures again. So :meth:`BoundSession.warm_up` must run on the
thread that will run the steps: the device's worker (``MultiGpuDispatcher.warm_up``). Capture
uses ``cudaStreamCaptureModeGlobal``, during which another thread's ``cudaMalloc`` or
synchronous copy invalidates it, so devices are warmed up one after another, before traffic.

**State on the device.** A state output (an output fed back as an input on the next step) is
not copied to the host. It is copied, device to device, into a :class:`DeviceTensor` that
belongs to the episode (``OrtValue.update_inplace(OrtValue)``, ONNX Runtime >= 1.26).
The dispatcher feeds that handle back on the next step. That step copies it device to
device into the bound input buffer. Only the outputs a client receives are read back. A
handle also converts to a numpy array (``np.asarray``). So code that gathers states on the
host (batched runs) keeps working, with a host round trip. One instance per device, used
only from its worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnxruntime

from node.contract import PolicyContract, TensorSpec

__all__ = ["BoundSession", "DeviceTensor"]

Array = np.ndarray[Any, Any]


def _fixed(contract: PolicyContract, spec: TensorSpec, batch: int) -> tuple[int, ...]:
    """The spec's shape with the contract's batch axis (if any) of size ``batch``."""
    if contract.batch_axis:
        spec = replace(spec, shape=(batch, *spec.shape[1:]))
    if not all(isinstance(d, int) for d in spec.shape):
        raise ValueError(
            f"CUDA graphs need fixed shapes; {spec.name} is {spec.describe()} "
            "(only the batch axis may be dynamic: export the model with static dimensions or "
            "run without --cuda-graph)"
        )
    return tuple(int(d) for d in spec.shape if isinstance(d, int))


class DeviceTensor:
    """One state tensor of one episode, held in device memory.

    Three buffers of the tensor's size, used in turn. A step reads the handle it is fed and
    writes the new state into the next buffer, returning the handle of that one. The one it
    read is left as it was, and so is the one before it: an episode's record holds its
    current state and, until its next step is kept, the one before (``Episode.previous``,
    which an undo goes back to). So a step whose result is not kept (its caller gave up)
    leaves both intact, and an undo after it finds the earlier state as it was (with two
    buffers that step wrote over it). That holds as long as only a kept handle of an
    episode, or the one before it, is fed, and one step of an episode runs at a time. The
    dispatcher guarantees both.
    """

    __slots__ = ("_buffers", "_current", "dtype", "shape")

    def __init__(
        self,
        buffers: tuple[Any, Any, Any],
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        current: int = 0,
    ) -> None:
        self._buffers = buffers
        self._current = current
        self.shape = shape  # as an array's: the dispatcher groups steps by shape and dtype
        self.dtype = dtype

    @classmethod
    def allocate(
        cls, shape: Sequence[int], dtype: np.dtype[Any], device_type: str, device_id: int
    ) -> DeviceTensor:
        def one() -> Any:
            return onnxruntime.OrtValue.ortvalue_from_shape_and_type(
                list(shape), dtype, device_type, device_id
            )

        return cls((one(), one(), one()), tuple(shape), np.dtype(dtype))

    @property
    def value(self) -> Any:
        """The ``OrtValue`` holding this state."""
        return self._buffers[self._current]

    def successor(self) -> DeviceTensor:
        """A handle on the next buffer (the one the next state is written into)."""
        return DeviceTensor(self._buffers, self.shape, self.dtype, (self._current + 1) % 3)

    @property
    def device(self) -> str:
        return str(self.value.device_name())

    @property
    def buffers(self) -> tuple[Any, Any, Any]:
        """The three buffers the episode's states take turns in (shared by its handles)."""
        return self._buffers

    @property
    def nbytes(self) -> int:
        """The state's size in bytes, as an array's (read without a copy to the host)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Array:
        """A host copy (a device to host transfer)."""
        host = np.array(self.value.numpy(), copy=True)
        return host if dtype is None else host.astype(dtype, copy=False)


class BoundSession:
    """``session`` run through one I/O binding on ``device_type:device_id`` buffers.

    The contract's batch axis (if any) is pinned to ``batch`` (1: one episode's step). With
    ``state_on_device`` (the default), state outputs come back as :class:`DeviceTensor` handles
    (see the module doc). Without it, they come back as host arrays like every other output:
    the host round trip, kept to measure against.
    """

    def __init__(
        self,
        session: Any,
        contract: PolicyContract,
        device_type: str,
        device_id: int,
        *,
        batch: int = 1,
        state_on_device: bool = True,
    ) -> None:
        self.session = session
        self.device_type = device_type
        self.device_id = device_id
        # the dispatcher pads batched runs to these sizes: this binding holds one
        self.batch_sizes = (batch,)
        self.binding = session.io_binding()
        self.inputs: dict[str, tuple[Any, np.dtype[Any], tuple[int, ...]]] = {}
        self.outputs: dict[str, tuple[Any, np.dtype[Any], tuple[int, ...]]] = {}
        self._sync = onnxruntime.OrtValue.ortvalue_from_shape_and_type(
            [1], np.uint8, device_type, device_id
        )
        for specs, bind, bound in (
            (contract.inputs, self.binding.bind_ortvalue_input, self.inputs),
            (contract.outputs, self.binding.bind_ortvalue_output, self.outputs),
        ):
            for spec in specs:
                shape, dtype = _fixed(contract, spec, batch), np.dtype(spec.dtype)
                value = onnxruntime.OrtValue.ortvalue_from_shape_and_type(
                    shape, dtype, device_type, device_id
                )
                bind(spec.name, value)
                bound[spec.name] = (value, dtype, shape)
        # state output -> the state input it feeds
        self.fed_back = (
            {out: name for name, out in contract.state.items()} if state_on_device else {}
        )

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        """Run once; outputs in ``output_names`` order (all outputs when ``None``).

        Inputs may be host arrays or :class:`DeviceTensor` handles (copied device to device).
        """
        # Device copies first, host copies last: ORT copies device to device asynchronously on
        # CUDA's default stream, and host to device synchronously on it, which also waits for
        # the copies queued before; the run (on ORT's own stream) must see them finished.
        device = [(n, v) for n, v in input_feed.items() if isinstance(v, DeviceTensor)]
        host = [(n, v) for n, v in input_feed.items() if not isinstance(v, DeviceTensor)]
        for name, given in device:
            self.inputs[name][0].update_inplace(given.value)
        for name, given in host:
            slot, dtype, _ = self.inputs[name]
            slot.update_inplace(np.ascontiguousarray(given, dtype=dtype))
        if device and not host:
            self._sync.update_inplace(np.zeros(1, np.uint8))
        self.session.run_with_iobinding(self.binding)
        names = list(self.outputs) if output_names is None else output_names
        return [self._result(name, input_feed) for name in names]

    def _result(self, name: str, feed: Mapping[str, Any]) -> Any:
        value, dtype, shape = self.outputs[name]
        state_input = self.fed_back.get(name)
        if state_input is None:
            host = value.numpy()
            # .numpy() of a host buffer is a view of it, which the next run overwrites
            return np.array(host, copy=True) if self.device_type == "cpu" else host
        previous = feed.get(state_input)
        target = (
            previous.successor()
            if isinstance(previous, DeviceTensor)
            else DeviceTensor.allocate(shape, dtype, self.device_type, self.device_id)
        )
        target.value.update_inplace(value)
        return target

    def warm_up(self) -> None:
        """One run on zeros: with a CUDA graph enabled, this captures it on the calling thread.

        Call it on the thread that will run the steps (see the module doc).
        """
        zeros = {name: np.zeros(shape, dtype) for name, (_, dtype, shape) in self.inputs.items()}
        self.run(None, zeros)
