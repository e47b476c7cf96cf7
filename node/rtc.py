"""Real-time chunking (RTC) kept with the episode: the node fills a model's ``rtc.*`` inputs.

While the robot executes chunk k, chunk k+1 is computed from a fresh observation. Its first
d actions (those the robot executes while inference runs) must equal chunk k's. The rest
of the overlap is guided towards them (Black et al., *Real-Time Execution of Action Chunking
Flow Policies*, 2025). The server side of that is per-episode state: the chunk last sent and
where the robot is in it. A model may declare these inputs.

* ``rtc.prefix`` float ``[B, H, D]`` (``[H, D]`` without a batch axis): the previous chunk's
  actions from the one the robot reached when this observation was taken, zero-padded to H.
* ``rtc.prefix_len`` integer ``[B]``: how many rows of ``rtc.prefix`` are real (H - executed).
* ``rtc.delay`` integer ``[B]``: d, the control steps the robot executes while this step's
  inference runs (at most ``prefix_len``).

The node fills them from the episode's record (``node/episodes.py``: the chunk it last sent
and when). They are hidden from clients like ``state_in.*``. There is no prefix
(``prefix_len`` 0, ``delay`` 0) on an episode's first step. Nor on any step whose state was
reset: a new claim, a reassignment, a hand-over, ``sequence_start``, a token change. The
chunk lives and dies with the recurrent state.

A step may say ``executed`` (how many actions of the last chunk the robot had executed when
it took the observation, 0..H) and ``inference_delay`` (d, 0..H). What it leaves out is
estimated at ``control_hz`` (the step's, else the node's ``--control-hz``):

* d = ceil(p90 of this episode's last :data:`LATENCY_WINDOW` receive-to-reply latencies x
  rate), capped at ``prefix_len``. A latency runs from the step's arrival at the node the
  client sent it to, up to the owner's reply. When forwarded, it starts at the router's
  arrival: the router sends how long it had the step. So the forward hop and the owner's
  queue and model run are in it. The way back to the router and the network to the robot
  are not. Replayed and buffered steps add no sample.
* executed = floor(seconds from the last chunk's reply to this step's arrival x rate),
  capped at H.

A step of an RTC model that leaves either out when there is no rate is refused (422).

After a crash nothing of the episode is left to take the prefix from. A step may then send
``pending``, the actions the robot has not executed yet (``[k, D]``, k at most H). A step
that starts from clean state takes its prefix from them (``prefix_len`` k). So the motion
does not jump even though the state was lost. A step that has a chunk of its own episode
ignores it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from affinity.errors import InvalidArgument
from node.contract import RTC_DELAY, RTC_PREFIX, RTC_PREFIX_LEN, PolicyContract

__all__ = [
    "LATENCY_PERCENTILE",
    "LATENCY_WINDOW",
    "MAX_CONTROL_HZ",
    "Ask",
    "RtcSpec",
    "Used",
    "control_rate",
    "delay_estimate",
    "executed_estimate",
    "rtc_of",
]

Array = np.ndarray[Any, Any]

LATENCY_WINDOW = 16
"""How many of an episode's latest step latencies the delay estimate reads."""
LATENCY_PERCENTILE = 0.9
"""The percentile of those latencies the delay estimate takes (nearest rank)."""
MAX_CONTROL_HZ = 10_000.0
"""The highest control rate a step or ``--control-hz`` may give."""


@dataclass(frozen=True, slots=True)
class Ask:
    """What one step says about the robot (each None: estimated; see the module doc)."""

    executed: int | None = None
    delay: int | None = None
    control_hz: float | None = None
    pending: Array | None = None  # the robot's unexecuted actions [k, D] (after a crash)


@dataclass(frozen=True, slots=True)
class Used:
    """The RTC values a step ran with, as its reply reports them."""

    executed: int
    delay: int
    prefix_len: int

    def to_json(self) -> dict[str, int]:
        return {"executed": self.executed, "delay": self.delay, "prefix_len": self.prefix_len}


def control_rate(control_hz: object) -> float | None:
    """A step's ``control_hz`` checked (``InvalidArgument``: not a number from more than
    0 to :data:`MAX_CONTROL_HZ`), as a float; None when not given. Any model's step may
    name its rate: its period is the step's deadline (``node/timing.py``)."""
    if control_hz is None:
        return None
    if isinstance(control_hz, bool) or not isinstance(control_hz, int | float):
        raise InvalidArgument("control_hz", control_hz, "must be a number")
    hz = float(control_hz)
    if not (math.isfinite(hz) and 0 < hz <= MAX_CONTROL_HZ):
        raise InvalidArgument(
            "control_hz", control_hz, f"must be more than 0 and at most {MAX_CONTROL_HZ:g}"
        )
    return hz


def delay_estimate(latencies: Sequence[float], hz: float) -> int:
    """ceil(p90 of ``latencies`` (seconds) x ``hz``); 0 without a sample."""
    if not latencies:
        return 0
    ordered = sorted(latencies)
    high = ordered[math.ceil(LATENCY_PERCENTILE * len(ordered)) - 1]
    return max(0, math.ceil(high * hz - 1e-9))  # 0.1 s at 50 Hz is 5 steps, not 6


def executed_estimate(since_s: float, hz: float, horizon: int) -> int:
    """The actions a robot at ``hz`` executed in ``since_s`` seconds, 0..``horizon``."""
    return min(horizon, max(0, math.floor(since_s * hz + 1e-9)))


def _row(shape: tuple[Any, ...], value: int, dtype: str) -> Array:
    return np.full(tuple(d if isinstance(d, int) else 1 for d in shape), value, dtype)


@dataclass(frozen=True)
class RtcSpec:
    """A model's ``rtc.*`` inputs (checked at load by ``node.contract``)."""

    horizon: int
    size: int
    prefix_shape: tuple[Any, ...]  # one step's: the batch axis as 1
    prefix_dtype: str
    len_shape: tuple[Any, ...]
    len_dtype: str
    delay_shape: tuple[Any, ...]
    delay_dtype: str

    def ask(
        self,
        executed: object = None,
        inference_delay: object = None,
        control_hz: object = None,
        node_hz: float | None = None,
        pending: object = None,
    ) -> Ask:
        """A step's RTC values checked; ``InvalidArgument`` names the bad one. Integers
        0..H, a rate from more than 0 to :data:`MAX_CONTROL_HZ`. A rate (the step's or
        ``node_hz``) whenever one of the two is left to estimate. ``pending`` a finite
        numeric ``[k, D]`` with k at most H."""
        for name, value in (("executed", executed), ("inference_delay", inference_delay)):
            if value is not None and (type(value) is not int or not 0 <= value <= self.horizon):
                raise InvalidArgument(
                    name, value, f"must be an integer from 0 to the chunk's horizon {self.horizon}"
                )
        hz = control_rate(control_hz)
        if (executed is None or inference_delay is None) and hz is None and node_hz is None:
            missing = "executed" if executed is None else "inference_delay"
            raise InvalidArgument(
                missing, None, "needed (or control_hz, or the node's --control-hz, to estimate it)"
            )
        return Ask(
            cast(int | None, executed),
            cast(int | None, inference_delay),
            hz,
            None if pending is None else self._pending(pending),
        )

    def _pending(self, value: object) -> Array:
        try:
            actions = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgument("pending", "(array)", "must be numbers [k, D]") from None
        if actions.ndim == 3 and actions.shape[0] == 1:
            actions = actions[0]  # one row with its batch axis
        if actions.ndim != 2 or actions.shape[1] != self.size or actions.shape[0] > self.horizon:
            raise InvalidArgument(
                "pending",
                f"shape {list(actions.shape)}",
                f"must be [k, {self.size}] with k at most the chunk's horizon {self.horizon}",
            )
        if not np.isfinite(actions).all():
            raise InvalidArgument("pending", "(array)", "must be finite numbers")
        return actions.astype(self.prefix_dtype)

    def none(self) -> dict[str, Array]:
        """The inputs of a step without a prefix."""
        return self._feed(np.zeros(self._prefix_rows(), self.prefix_dtype), 0, 0)

    def feed(
        self,
        sent: tuple[Array, float] | None,
        ask: Ask,
        arrived: float,
        latencies: Sequence[float],
        node_hz: float | None,
    ) -> tuple[dict[str, Array], Used]:
        """The inputs of one step and what it used. ``sent`` is the chunk (``[H, D]``) the
        episode's last reply carried and the clock then. None: no prefix, the state was
        reset or nothing was sent. ``arrived`` is the clock when the step arrived.
        ``latencies`` are the episode's recent step latencies (seconds)."""
        if sent is None and ask.pending is not None:  # after a crash: the robot's own actions
            k = len(ask.pending)
            delay = min(k, ask.delay if ask.delay is not None else 0)
            prefix = np.zeros((self.horizon, self.size), self.prefix_dtype)
            prefix[:k] = ask.pending
            return self._feed(prefix.reshape(self._prefix_rows()), k, delay), Used(
                self.horizon - k, delay, k
            )
        if sent is None:
            return self.none(), Used(0, 0, 0)
        chunk, at = sent
        hz = ask.control_hz or node_hz
        if ask.executed is not None:
            executed = ask.executed
        else:
            assert hz is not None  # Ask checked that a rate exists
            executed = executed_estimate(arrived - at, hz, self.horizon)
        prefix_len = self.horizon - executed
        if ask.delay is not None:
            delay = ask.delay
        else:
            assert hz is not None
            delay = delay_estimate(latencies, hz)
        delay = min(delay, prefix_len)
        prefix = np.zeros((self.horizon, self.size), self.prefix_dtype)
        prefix[:prefix_len] = chunk[executed:]
        return self._feed(prefix.reshape(self._prefix_rows()), prefix_len, delay), Used(
            executed, delay, prefix_len
        )

    def _prefix_rows(self) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else 1 for d in self.prefix_shape)

    def _feed(self, prefix: Array, prefix_len: int, delay: int) -> dict[str, Array]:
        return {
            RTC_PREFIX: prefix,
            RTC_PREFIX_LEN: _row(self.len_shape, prefix_len, self.len_dtype),
            RTC_DELAY: _row(self.delay_shape, delay, self.delay_dtype),
        }


def rtc_of(contract: PolicyContract) -> RtcSpec | None:
    """The ``rtc.*`` inputs of ``contract``, or None for a model without them."""
    by_name = {spec.name: contract.step_spec(spec) for spec in contract.rtc_inputs}
    if not by_name or contract.chunk_shape is None:
        return None
    horizon, size = contract.chunk_shape
    prefix, length, delay = by_name[RTC_PREFIX], by_name[RTC_PREFIX_LEN], by_name[RTC_DELAY]
    return RtcSpec(
        horizon, size, prefix.shape, prefix.dtype, length.shape, length.dtype,
        delay.shape, delay.dtype,
    )  # fmt: skip
