"""The one internal step and reply every wire protocol decodes into and encodes from.

An adapter (``node/protocols/*``) turns its wire format into a :class:`Step`. Its inputs
are already validated against the policy contract, as numpy arrays. It turns a
:class:`Reply` back into its wire format. Routing, leases, forwarding, state and metrics
live once behind them (``node/router.py``). ``Unavailable`` and ``Refused`` (from
``node/errors.py``) are what routing raises. Each adapter renders ``node.errors.outcome``
in its wire shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from node.rtc import Ask

__all__ = ["Array", "Reply", "Step", "TimeLimit"]

Array = np.ndarray[Any, Any]


@dataclass(slots=True)
class Step:
    """One step of an episode, as any front door received it.

    ``episode`` is None for a stateless request (no episode id, no session id).
    ``deadline`` is an absolute ``time.monotonic()`` by which the reply must be sent.
    ``client_token`` is the token of the client's previous reply, if it echoes one.
    ``restart`` starts the episode over (a fresh token, clean state) before serving.
    ``execute_steps`` and ``ensemble`` override the node's action-chunk mode for this step
    (validated by the adapter with ``dispatcher.mode_for`` before anything is claimed).
    ``seq`` is the step number the client expects to be applied (its last reply's ``seq``
    + 1), if it sends one. ``live_only`` serves only an episode Redis already holds (a
    KServe step without ``sequence_start``): routing raises ``UnknownEpisode`` otherwise.
    ``origin`` names the forward a step came in (owner side only). ``model`` is the name
    of the model the step is for, as the adapter chose it (``node.catalog.Catalog``).
    It is None only in code that serves one model. ``version`` is the version it named
    (None: the episode's own, or the one the rollout picks). ``rtc`` is what the step says
    for real-time chunking (``node/rtc.py``). The adapter validates it with
    ``dispatcher.rtc_for``; None for a model without ``rtc.*`` inputs. ``arrived`` is
    when it reached the node the client sent it to, on this node's ``time.monotonic()``
    (set by routing). ``door`` is the front door it came in by (``node.metrics.DOORS``).
    ``received`` is when that door began to read it (``time.monotonic()``; None: when
    routing began). ``control_hz`` is the control rate it named. None means the node's
    ``--control-hz``, if any; a step's time over the period counts as a deadline miss.
    ``timing`` says whether the client asked for the split of its time in the reply.
    """

    episode: str | None
    inputs: dict[str, Array]
    deadline: float
    end: bool = False
    client_token: int | None = None
    degraded: bool = False
    restart: bool = False
    execute_steps: int | None = None
    ensemble: str | None = None
    seq: int | None = None
    origin: str = ""
    live_only: bool = False
    model: str | None = None
    version: str | None = None
    rtc: Ask | None = None
    arrived: float | None = None
    client_claim: str | None = None
    door: str = "act"
    received: float | None = None
    control_hz: float | None = None
    timing: bool = False


@dataclass(slots=True)
class Reply:
    """What the node answers for one step; ``outputs`` are the model outputs a client sees.

    ``url`` is the owner's advertise URL: a client may send the episode's next steps there
    directly. ``source`` is ``model`` when the policy ran, ``buffer`` when the action came
    from the episode's action-chunk buffer. ``timing`` holds times measured by the owner:
    ``device_ms``, the time the step spent on its device (queue and run). Also
    ``queue_ms`` and ``run_ms``, its wait for the device and its model run; none for a step
    the model did not run. It holds times measured by the node the step came in by
    (:meth:`split`). ``forward_ms`` is what the forward to the owner added: the round trip
    less ``device_ms``. ``total_ms`` is request to reply at that node. ``seq`` is the step's
    number under its claim, ``replayed`` says it is the stored reply of a step already
    applied. ``origin`` is the id of the forward that carried it (router side; empty for a
    step served here). The router names it when it tells the owner to undo the step.
    ``rtc`` is what a real-time-chunking step ran with: ``executed``, ``delay``,
    ``prefix_len`` (None for other models). ``model`` is the ``name@version`` that served
    it (as registered; empty where nodes register none). ``claim`` is the claim id the step
    was served under (a client may echo it, as it echoes ``token``).
    """

    outputs: dict[str, Array]
    episode: str | None
    device: str
    node: str
    token: int
    routing: str
    state_reset: bool
    degraded: bool
    url: str = ""
    source: str = "model"
    timing: dict[str, float] = field(default_factory=dict)
    seq: int = 0
    replayed: bool = False
    origin: str = ""
    rtc: dict[str, int] | None = None
    model: str = ""
    claim: str = ""
    held: bool = False  # the step named its seq: never undone, held for the client's retry

    def split(self) -> dict[str, float]:
        """The split of the step's time a client may ask for (milliseconds, 0 for a part
        it did not have): ``total_ms``, ``queue_ms``, ``run_ms``, ``forward_ms``."""
        t = self.timing
        return {
            k: round(t.get(k, 0.0), 3) for k in ("total_ms", "queue_ms", "run_ms", "forward_ms")
        }

    def facts(self, *, flat: bool = False) -> dict[str, Any]:
        """Everything but the outputs, with the wire names every protocol uses; ``rtc``
        (when set) as a map, or ``flat`` (KServe's scalar parameters) as ``rtc_executed``,
        ``rtc_delay``, ``rtc_prefix_len``."""
        facts: dict[str, Any] = {
            "episode_id": self.episode,
            "device": self.device,
            "node": self.node,
            "token": self.token,
            "routing": self.routing,
            "state_reset": self.state_reset,
            "degraded": self.degraded,
            "source": self.source,
            "seq": self.seq,
            "replayed": self.replayed,
        }
        if self.model:
            facts["model"] = self.model
        if self.claim:
            facts["claim"] = self.claim
        if self.rtc is not None:
            if flat:
                facts.update({f"rtc_{k}": v for k, v in self.rtc.items()})
            else:
                facts["rtc"] = dict(self.rtc)
        return facts


class TimeLimit:
    """``asyncio.timeout(delay)`` for the step path at a third of its cost. It uses one
    timer handle and no state machine; ``asyncio.timeout`` costs ~6 µs a step. When
    ``delay`` seconds pass before the ``with`` block ends, its task is cancelled and the
    block raises :class:`TimeoutError`. A cancellation from elsewhere passes through
    unchanged. The task's ``cancelling()`` count tells them apart, as ``asyncio.timeout``
    does."""

    __slots__ = ("_cancelling", "_delay", "_expired", "_handle", "_task")

    def __init__(self, delay: float) -> None:
        self._delay = delay

    def __enter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "a time limit needs a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle = task.get_loop().call_later(self._delay, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        self._handle.cancel()
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from exc
