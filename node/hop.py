"""The hop from a front door process to the node's core (issue 43): shared memory and two
doorbells per front.

A front (``node/front.py``) decodes a ``POST /act`` body and writes the step's inputs once
into a *slot* of its region: raw tensor bytes, after a small msgpack header (the body's other
fields, each tensor's name, dtype, shape and place). Never pickled. It marks the slot asked
and rings the core's doorbell (an ``eventfd``). The core reads on its event loop
(``add_reader`` on the doorbell), copies the inputs out of the slot, runs the step through
the node's own path, writes the reply the same way (facts in the header, outputs as raw
bytes) and rings the front's doorbell. The front encodes the reply (JSON or msgpack). An
openpi frame crosses the same way (:data:`WS_STEP`): the front's decoded map with each array
written raw (:func:`lift`), rebuilt by the core (:func:`lower`).

The region is a ``memfd`` (no file anywhere, gone with the last process holding it), passed
to the front with the two ``eventfd`` at its start. Its first page is the control block: a
magic number, the slot count and size, and the front's event-loop lag histogram, which the
front writes and the core's ``/metrics`` reads (:class:`SharedLoopBuckets`). Then the slots,
each a 64-byte head (state, kind, length) and its data.

A slot's state moves FREE → ASKED (the front) → TAKEN → ANSWERED (the core) → DELIVERING →
FREE (the front: DELIVERING while it hands the reply to its client, FREE once the client's
socket took it). A doorbell says which slots to look at: each ring adds ``1 << slot`` for the slots
it is about, and a slot is rung at most once before the other side drains the counter (it is
not asked again before it was answered, nor answered twice), so the drained count is the set
of those slots and rings that coincide are one wake-up. A side rings at once when that
request is its only one in flight (no wait for a turn of the loop), and once per turn of its
loop for every slot of that turn while others are in flight (under load, one wake-up of the
other process for many requests). The front holds at most ``slots`` requests in flight; one
more waits its turn for a slot (first come, first served) up to ``slot_wait_s`` (the node's
``--act-deadline``), then is refused 503 ``busy`` (:class:`HopFull`); a refusal's note to the
core never waits (dropped when every slot is in flight). A reply is kept by the core until the
front's next request on that slot: the kind :data:`UNDELIVERED` says the client had gone,
and the core undoes the step as it does for a client of its own that left; :data:`DOUBTED`
says the hand-over failed midway, and the core undoes it in doubt. A front that dies
leaves each kept reply's slot saying how far it got: never read back (ANSWERED, or its word
that it was not delivered unserved), the step is undone; read back and being handed over
(DELIVERING), whether it reached the client is unknown, so the step is undone *in doubt*: the
episode's next step starts clean and says ``state_reset`` (DESIGN rule 6); FREE, it was
handed to the kernel and stands, as a reply a node of one process wrote.

A hand-over the kernel does not take at once (a client that reads slowly) leaves its slot
for a *ticket* (:class:`Handing`, :data:`PARK`): a word of the control block per ticket
(its state and its use), which the front sets and the core reads when the front dies, with
the same three outcomes. So the front's slots serve calls while up to :data:`TICKETS`
clients read slowly.

The core copies a step's inputs out of the slot (one copy) because the owner may keep them
past the step (the recorder, a ghost step, a replay); the worker processes the issue plans
will read them in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import mmap
import os
import select
import signal
import struct
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from node.errors import CoreLapsed, HopError, HopFull, Uncarried, Undelivered

Array = npt.NDArray[Any]

__all__ = [
    "ACT",
    "ANSWERED",
    "DELIVERING",
    "DOUBTED",
    "KSERVE",
    "NOTE",
    "REPLY",
    "ROWS",
    "UNDELIVERED",
    "WS_CLOSE",
    "WS_OPEN",
    "WS_STEP",
    "Array",
    "FrontHop",
    "Handing",
    "Region",
    "SharedLoopBuckets",
    "contiguous",
    "deaf_children",
    "die_with_parent",
    "lift",
    "lower",
    "pack",
    "unpack",
]

MAGIC = 0xAFF1_4301
CONTROL = 4096
"""Bytes of the control block, before the first slot."""
SLOT_HEAD = 64
ALIGN = 64
FREE, ASKED, TAKEN, ANSWERED, DELIVERING = 0, 1, 2, 3, 4
ACT, ROWS, UNDELIVERED, NOTE, KSERVE = 1, 2, 3, 4, 5
"""Request kinds: one step; a message of rows; the slot's last reply was not delivered; a
note (a refusal the front answered itself, counted by the core); a KServe v2 infer request
(``node/protocols/kserve/body.py``)."""
WS_OPEN, WS_STEP, WS_CLOSE = 6, 7, 8
"""openpi's websocket (``node/protocols/openpi.py``): a connection accepted (its query; the
reply is its metadata frame), one observation frame (decoded by the front, its arrays
carried raw: :func:`lift`), the connection closed."""
REPLY = 9
PARK, SETTLE = 15, 16
"""A reply still being handed over moves off its slot to a *ticket* (``k``, its use ``u``),
so a client that reads slowly holds no slot (:class:`Handing`): the core keeps the step
under the ticket and answers at once, freeing the slot. Should that hand-over fail, a
SETTLE note names the ticket (``d``: in doubt, else never delivered) and the core undoes
the step."""
DOUBTED = 14
"""The slot's last reply was being handed to the client when that failed or stopped (the
connection lost with bytes of it unsent, a send cut off): whether it arrived is unknown, so
its step is undone in doubt (the next step says ``state_reset``)."""
_NOTES = frozenset((UNDELIVERED, DOUBTED, PARK, SETTLE))
"""The kinds that settle an earlier step (its reply's fate): the core serves them ahead of
the steps read with them."""
_STEPS = frozenset((ACT, ROWS, KSERVE, WS_STEP, WS_OPEN))
"""The kinds a stuck core's front refuses itself (:meth:`Region.lapsed`): the steps, and an
openpi connection opened for steps. A note, and a connection's close, wait for the core."""
PR_SET_PDEATHSIG = 1
log = logging.getLogger("affinity.node")

MAX_QUEUED = 4096
"""Calls that may wait for a slot of a front's hop at once; one more is refused at once."""
MAX_SLOTS = 63
"""A doorbell's count is a set of slots (``1 << slot``), under the eventfd's largest count."""
LAG_AT = 64
"""Offset of the loop-lag histogram in the control block: ``LAG_BUCKETS`` + 1 counts, the sum."""
LAG_BUCKETS = 16
CORE_AT = 256
"""Offset of what the core tells its fronts in the control block (:meth:`Region.tell`): when
its event loop last ran and until when its lease lets it serve (``time.monotonic_ns``), and
how many steps the front refused because neither was current (:meth:`Region.lapsed`)."""
STUCK_NS = 500_000_000
"""How long the core's loop may go without running (its writes every 50 ms, node/fronts.py)
before a front whose core's lease has also run out answers a step itself (503 ``fenced``)."""
NEVER_NS = 2**63 - 1
"""A lease that never runs out (a node that left: it routes its stragglers' steps)."""
GENERATION_AT = CORE_AT + 24
"""Offset of the node's lease generation in the control block (:meth:`Region.tell_generation`):
``EpisodeTable.generation``, bumped each time the node dropped every record (a fence, a
registration anew). A device's worker process drops every state it kept under an older one."""
HELD_AT = 512
"""Offset of what a device's worker process says it holds (:meth:`Region.say_held`): per
model (its slot), the states and their bytes."""
TICKETS_AT = 2048
"""Offset of the tickets in the control block, a 32-bit word each (:meth:`Region.ticket`):
its state in the low byte, FREE (handed to the kernel, or never used), DELIVERING (being
handed over), UNDELIVERED or DOUBTED (the hand-over failed; its SETTLE note on the way),
and above it the ticket's use, counted by the front (what the core keeps under an earlier
use was settled)."""
TICKETS = 512
"""Replies a front may be handing over at once off their slots (:data:`PARK`); past them a
slow reply keeps its slot (and is shed while other calls wait for one)."""
PARKED_BYTES = 1 << 30
"""Bytes of replies a front may hold for clients that read slowly off its slots (each
parked reply counts what was left in the front's buffer): past them a slow reply keeps its
slot, as past :data:`TICKETS`, so clients that read nothing cannot pin a front's memory
without bound."""
_TICKET = struct.Struct("<I")
_HEAD = struct.Struct("<IIII")  # state, kind, header length, total length
_REST = struct.Struct("<III")  # the head after its state: kind, header length, total length
_CONTROL = struct.Struct("<IIII")  # magic, slots, slot size, spare
_CORE = struct.Struct("<qq")  # the core's loop last ran, its lease's end (monotonic ns)
_REFUSED = struct.Struct("<Q")  # steps the front refused as fenced (at CORE_AT + 16)
_GENERATION = struct.Struct("<Q")  # the node's lease generation (at GENERATION_AT)
_HELD = struct.Struct("<QQ")  # a model's states held by a worker process, their bytes
_DTYPES = frozenset("biufcUS")
"""The dtype kinds a tensor may have in a slot (never objects)."""


def region_size(slots: int, slot_size: int) -> int:
    return CONTROL + slots * (SLOT_HEAD + slot_size)


Place = tuple[np.dtype[Any], tuple[int, ...], int, int]
"""Where an array lies in a slot's data: dtype, shape, offset from the first aligned byte
after the header, length in bytes."""


class Region:
    """A front's shared memory: the control block and ``slots`` slots of ``slot_size``
    bytes each (header and tensors together). Made by the core (:meth:`create`), opened
    by the front from the inherited descriptor (:meth:`open`)."""

    def __init__(self, fd: int, slots: int, slot_size: int) -> None:
        self.fd = fd
        self.slots = slots
        self.slot_size = slot_size
        self.mm = mmap.mmap(fd, region_size(slots, slot_size))
        self.heads = [CONTROL + k * (SLOT_HEAD + slot_size) for k in range(slots)]
        self._state = struct.Struct("<I")

    @classmethod
    def create(cls, slots: int, slot_size: int) -> Region:
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"a region has 1 to {MAX_SLOTS} slots, not {slots}")
        fd = os.memfd_create("affinity-front", 0)  # close-on-exec unless passed on
        os.ftruncate(fd, region_size(slots, slot_size))  # sparse: pages exist once written
        region = cls(fd, slots, slot_size)
        _CONTROL.pack_into(region.mm, 0, MAGIC, slots, slot_size, 0)
        return region

    @classmethod
    def open(cls, fd: int) -> Region:
        with mmap.mmap(fd, CONTROL) as head:
            magic, slots, slot_size, _ = _CONTROL.unpack_from(head, 0)
        if magic != MAGIC:
            raise HopError("not a front's region")
        return cls(fd, slots, slot_size)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)

    # ---- the core's lease, for a front (issue 43: every process sees it) ----------------

    def tell(self, now_ns: int, serves_until_ns: int) -> None:
        """The core: its loop runs now, and its lease lets it serve until then."""
        _CORE.pack_into(self.mm, CORE_AT, now_ns, serves_until_ns)

    def lapsed(self, now_ns: int) -> bool:
        """The front: whether the core's lease has run out while its loop has not run for
        :data:`STUCK_NS` (paused or hung): a step would wait on it, then be refused
        ``fenced``, so the front refuses it at once. While its loop runs the core answers
        every step itself (it may be routed elsewhere, or the lease renewed meanwhile).
        Nothing is refused before the core first said anything."""
        ran: int
        until: int
        ran, until = _CORE.unpack_from(self.mm, CORE_AT)
        return ran != 0 and now_ns - ran > STUCK_NS and now_ns >= until

    def expired(self, now_ns: int) -> bool:
        """A device's worker process: whether the node's lease has run out, as the core last
        said (every 50 ms; it never says a later end than its own). Nothing has run out
        before the core first said anything."""
        ran: int
        until: int
        ran, until = _CORE.unpack_from(self.mm, CORE_AT)
        return ran != 0 and now_ns >= until

    def tell_generation(self, generation: int) -> None:
        """The core: the node's lease generation now (``EpisodeTable.generation``)."""
        _GENERATION.pack_into(self.mm, GENERATION_AT, generation)

    def generation(self) -> int:
        """The node's lease generation, as the core last said (0 before it said one)."""
        value: int = _GENERATION.unpack_from(self.mm, GENERATION_AT)[0]
        return value

    def say_held(self, slot: int, states: int, nbytes: int) -> None:
        """A device's worker process: the states ``slot``'s model holds there, their bytes."""
        _HELD.pack_into(self.mm, HELD_AT + slot * _HELD.size, states, nbytes)

    def held(self) -> tuple[int, int]:
        """The states every model holds in the worker process, and their bytes."""
        states = nbytes = 0
        for slot in range(self.slots):
            n, b = _HELD.unpack_from(self.mm, HELD_AT + slot * _HELD.size)
            states, nbytes = states + n, nbytes + b
        return states, nbytes

    def count_refused(self) -> None:
        """The front refused a step itself: because :meth:`lapsed`, or with every slot in
        flight (``busy``, or its deadline passed while it waited for one). The core counts
        it, as one of its own refusals, once it runs."""
        at = CORE_AT + _CORE.size
        _REFUSED.pack_into(self.mm, at, _REFUSED.unpack_from(self.mm, at)[0] + 1)

    def refused(self) -> int:
        """How many steps the front refused itself (:meth:`count_refused`)."""
        value: int = _REFUSED.unpack_from(self.mm, CORE_AT + _CORE.size)[0]
        return value

    def ticket(self, ticket: int) -> tuple[int, int]:
        """The state of a parked reply's hand-over and the ticket's use (:data:`TICKETS_AT`)."""
        word: int = _TICKET.unpack_from(self.mm, TICKETS_AT + 4 * ticket)[0]
        return word & 0xFF, word >> 8

    def parked(self) -> int:
        """How many tickets are in use now (not FREE): replies being handed over off their
        slots, or whose failed hand-over the core is being told of."""
        words = np.frombuffer(self.mm, np.uint32, TICKETS, TICKETS_AT)
        return int(np.count_nonzero(words & 0xFF))

    def failed_tickets(self) -> list[int]:
        """The tickets whose hand-over the front marked failed (UNDELIVERED or DOUBTED), in
        one read of every word."""
        states = np.frombuffer(self.mm, np.uint32, TICKETS, TICKETS_AT) & 0xFF
        return [int(t) for t in np.flatnonzero((states == UNDELIVERED) | (states == DOUBTED))]

    def set_ticket(self, ticket: int, state: int, use: int) -> None:
        """One aligned 32-bit store: the core never reads a state of one use with another."""
        _TICKET.pack_into(self.mm, TICKETS_AT + 4 * ticket, (use & 0xFF_FFFF) << 8 | state)

    def head(self, slot: int) -> int:
        return self.heads[slot]

    def state(self, slot: int) -> int:
        value: int = self._state.unpack_from(self.mm, self.heads[slot])[0]
        return value

    def kind(self, slot: int) -> int:
        """The kind of the request or reply last written into ``slot``."""
        value: int = _HEAD.unpack_from(self.mm, self.heads[slot])[1]
        return value

    def set_state(self, slot: int, state: int) -> None:
        self._state.pack_into(self.mm, self.heads[slot], state)

    def write(
        self, slot: int, state: int, kind: int, meta: dict[str, Any], arrays: list[Array]
    ) -> None:
        """Write ``meta`` (msgpack) and ``arrays`` (raw bytes, their places added to meta
        as ``t``) into ``slot``, then its state. Raises :class:`HopError` when they do not
        fit (the slot is left as it was)."""
        header, places, total = pack(meta, arrays)
        if total > self.slot_size:
            raise HopError(f"{total} bytes do not fit a slot of {self.slot_size}")
        head = self.heads[slot]
        data = head + SLOT_HEAD
        mm = self.mm
        length = len(header)
        mm[data : data + length] = header
        start = data + _aligned(length)
        for (_, _, offset, nbytes), array in zip(places, arrays, strict=True):
            if nbytes:
                at = start + offset
                mm[at : at + nbytes] = memoryview(array).cast("B")  # type: ignore[arg-type]
        _REST.pack_into(mm, head + 4, kind, length, total)
        self._state.pack_into(mm, head, state)  # last: the other side reads it first

    def read(self, slot: int, copy: bool) -> tuple[int, dict[str, Any], list[Array]]:
        """(kind, meta, arrays) of ``slot``: copies (``copy``: independent of the region)
        or views over it. Raises :class:`HopError` for anything malformed."""
        mm = self.mm
        head = self.heads[slot]
        _, kind, length, total = _HEAD.unpack_from(mm, head)
        if not 0 < length <= total <= self.slot_size:
            raise HopError(f"slot lengths {length}/{total} out of bounds")
        data = head + SLOT_HEAD
        meta, places = unpack(mm[data : data + length], total)
        start = data + _aligned(length)
        arrays: list[Array] = []
        for dtype, shape, offset, nbytes in places:
            at = start + offset
            if copy:
                array = np.frombuffer(mm[at : at + nbytes], dtype=dtype)
            else:
                array = np.frombuffer(mm, dtype, nbytes // dtype.itemsize, at)
            arrays.append(array if len(shape) == 1 else array.reshape(shape))
        return kind, meta, arrays


def _ticket(meta: dict[str, Any]) -> tuple[int, int] | None:
    """The ticket a PARK or SETTLE names, and its use."""
    ticket, use = meta.get("k"), meta.get("u")
    if isinstance(ticket, int) and 0 <= ticket < TICKETS and isinstance(use, int):
        return ticket, use
    return None


def _slots(bits: int, slots: int) -> list[int]:
    """The slots a drained doorbell count names (every slot if it names one past them)."""
    if not bits & (bits - 1):  # one slot (the usual ring), or none
        return [bits.bit_length() - 1] if bits else []
    if bits >> slots:
        return list(range(slots))
    named = []
    while bits:
        low = bits & -bits
        named.append(low.bit_length() - 1)
        bits ^= low
    return named


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(meta: dict[str, Any], arrays: list[Array]) -> tuple[bytes, list[Place], int]:
    """The header bytes of ``meta`` with the arrays' places (``t``: dtype, shape, offset from
    the first aligned byte after the header, length), the places, and the total length
    (header, padding, tensors). Arrays must be C-contiguous."""
    places: list[Place] = []
    at = 0
    for array in arrays:
        nbytes = array.nbytes
        places.append((array.dtype, array.shape, at, nbytes))
        at += -(-nbytes // ALIGN) * ALIGN
    meta["t"] = [(d.str, shape, offset, n) for d, shape, offset, n in places]
    try:
        header: bytes = _PACKER.pack(meta)
    except (OverflowError, TypeError, ValueError) as exc:  # a client's integer past 64 bits
        raise Uncarried(f"the hop cannot carry this request: {exc}") from None
    return header, places, _aligned(len(header)) + at


def contiguous(array: Array) -> Array:
    """``array`` as the slot takes it (C-contiguous), of its own shape: a 0-d array stays
    0-d (``np.ascontiguousarray`` makes it 1-d, so a scalar would cross as ``[x]``)."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _plain(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    raise TypeError(f"cannot carry {type(obj).__name__} over the hop")


_PACKER = msgpack.Packer(default=_plain)
"""One packer for every header (``packb`` makes one a call); it keeps no state between
calls (``autoreset``)."""


_DTYPES_SEEN: dict[str, np.dtype[Any]] = {}
"""The dtypes read so far by their ``str`` (a few: the models' inputs and outputs)."""


def _dtype(name: object) -> np.dtype[Any]:
    """``name`` (a ``numpy.dtype.str``) checked as a dtype a slot may carry."""
    seen = _DTYPES_SEEN.get(name) if isinstance(name, str) else None
    if seen is not None:
        return seen
    try:
        dtype: np.dtype[Any] = np.dtype(name)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise HopError(f"bad tensor dtype: {exc}") from None
    if dtype.kind not in _DTYPES or dtype.hasobject or dtype.str != name:
        raise HopError(f"dtype {name!r} is not carried")
    if len(_DTYPES_SEEN) < 64:  # a front that sends odd dtypes does not grow it
        _DTYPES_SEEN[dtype.str] = dtype
    return dtype


def unpack(header: bytes, total: int) -> tuple[dict[str, Any], list[Place]]:
    """Meta and tensor places of a header; every place checked against ``total``."""
    try:
        meta = msgpack.unpackb(header, strict_map_key=False)
    except Exception as exc:  # msgpack raises several kinds
        raise HopError(f"header is not msgpack: {exc}") from None
    if not isinstance(meta, dict):
        raise HopError("header is not a map with a list of tensors")
    entries = meta.pop("t", [])
    if not isinstance(entries, list):
        raise HopError("header is not a map with a list of tensors")
    room = total - _aligned(len(header))
    places: list[Place] = []
    for entry in entries:
        try:
            name, shape_l, offset, nbytes = entry
            shape = tuple(shape_l)
        except (TypeError, ValueError) as exc:
            raise HopError(f"bad tensor entry: {exc}") from None
        dtype = _dtype(name)
        count = dtype.itemsize
        for n in shape:
            if type(n) is not int or n < 0:
                raise HopError("bad tensor shape")
            count *= n
        if count != nbytes:
            raise HopError("tensor shape does not match its length")
        if not (type(offset) is int and offset >= 0 and offset + nbytes <= room):
            raise HopError("tensor lies outside the slot")
        places.append((dtype, shape, offset, nbytes))
    return meta, places


TENSOR, SCALAR, STRINGS, EXT = 1, 2, 3, 4
"""msgpack extension codes of :func:`lift`: an array carried raw (its index), a numpy
scalar carried as a 0-d array (its index), a string array (its shape and strings), and
an extension value of the message itself (its code and data, as it came)."""
_INDEX = struct.Struct("<I")


def lift(obj: Any, arrays: list[Array]) -> Any:
    """``obj`` (maps, lists, scalars, numpy arrays and scalars: a decoded msgpack message
    such as an openpi observation, or a reply) for a slot's header: each numeric array
    appended to ``arrays`` (its bytes go raw into the slot, never into the header) and
    replaced by an extension naming it. :func:`lower` undoes it."""
    if isinstance(obj, dict):
        return {k: lift(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [lift(v, arrays) for v in obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _DTYPES:  # strings (an object array of str): by value
            try:
                data = msgpack.packb([list(obj.shape), obj.reshape(-1).tolist()])
            except (TypeError, ValueError, OverflowError) as exc:  # not str or bytes
                raise HopError(
                    f"cannot carry a tensor of {obj.dtype} over the hop: {exc}"
                ) from None
            return msgpack.ExtType(STRINGS, data)
        arrays.append(contiguous(obj))
        return msgpack.ExtType(TENSOR, _INDEX.pack(len(arrays) - 1))
    if isinstance(obj, np.generic):
        arrays.append(np.asarray(obj))
        return msgpack.ExtType(SCALAR, _INDEX.pack(len(arrays) - 1))
    if isinstance(obj, msgpack.ExtType):
        return msgpack.ExtType(EXT, msgpack.packb([obj.code, obj.data]))
    return obj


def lower(obj: Any, arrays: list[Array]) -> Any:
    """What :func:`lift` made of ``obj``, its arrays taken from ``arrays`` (as read from
    the slot). Raises :class:`HopError` for an extension that names nothing."""
    if isinstance(obj, dict):
        return {k: lower(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [lower(v, arrays) for v in obj]
    if not isinstance(obj, msgpack.ExtType):
        return obj
    try:
        if obj.code in (TENSOR, SCALAR):
            array = arrays[_INDEX.unpack(obj.data)[0]]
            return array if obj.code == TENSOR else array[()]
        if obj.code == STRINGS:
            shape, strings = msgpack.unpackb(obj.data)
            out = np.empty(len(strings), dtype=object)
            out[:] = strings
            return out.reshape(shape)
        if obj.code == EXT:
            code, data = msgpack.unpackb(obj.data)
            return msgpack.ExtType(code, data)
    except (IndexError, ValueError, TypeError, struct.error, msgpack.UnpackException) as exc:
        raise HopError(f"bad carried value: {exc}") from None
    raise HopError(f"unknown extension {obj.code}")


def readable(fd: int, timeout_s: float = 0.0) -> bool:
    """Whether ``fd`` has bytes (or its peer's close) to read, within ``timeout_s``,
    consuming nothing: a poll object of its own (``select.select`` refuses descriptors
    past 1023, which a node holding a thousand robots' connections has; another thread
    may be polling a doorbell's own object)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, round(timeout_s * 1000))))


@contextlib.contextmanager
def deaf_children() -> Iterator[None]:
    """Start child processes (fronts, device workers) inside this: they are born with
    SIGINT and SIGTERM blocked (a signal mask survives ``exec``), and keep them blocked.
    Those signals are the core's to act on: a ^C in a terminal, or a service manager that
    signals the node's whole group, must not end a child (even one still importing,
    before it could set a handler) while the core hands its episodes over. Signals that
    reach the core meanwhile wait until this ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before prctl: nobody would kill us
        os._exit(0)


class SharedLoopBuckets:
    """A front's event-loop lag histogram in its region's control block: the front
    observes (:meth:`observe`), the core's scrape reads (:attr:`counts`, :attr:`sum`). The
    core adds what earlier regions of the same front counted (``base``), so a restarted
    front's series does not go back."""

    def __init__(self, mm: mmap.mmap | None, bounds: tuple[float, ...] = ()) -> None:
        self.mm = mm
        self.bounds = bounds
        self.base_counts = [0] * (LAG_BUCKETS + 1)
        self.base_sum = 0.0
        self.created = time.time()
        self._fmt = struct.Struct(f"<{LAG_BUCKETS + 1}Qd")

    def observe(self, value: float) -> None:
        assert self.mm is not None
        at = LAG_AT + 8 * bisect_left(self.bounds, value)
        count: int = struct.unpack_from("<Q", self.mm, at)[0]
        struct.pack_into("<Q", self.mm, at, count + 1)
        sum_at = LAG_AT + 8 * (LAG_BUCKETS + 1)
        total: float = struct.unpack_from("<d", self.mm, sum_at)[0]
        struct.pack_into("<d", self.mm, sum_at, total + value)

    def _read(self) -> tuple[list[int], float]:
        if self.mm is None or self.mm.closed:
            return [0] * (LAG_BUCKETS + 1), 0.0
        *counts, total = self._fmt.unpack_from(self.mm, LAG_AT)
        return list(counts), float(total)

    def samples(self) -> int:
        """How many times the front's loop sampled its lag so far (50 a second while the
        loop runs; still, the loop has not run): this region's alone."""
        return sum(self._read()[0])

    def detach(self) -> None:
        """The front is gone: keep what its region counted, and read it no more."""
        counts, total = self._read()
        self.base_counts = [a + b for a, b in zip(self.base_counts, counts, strict=True)]
        self.base_sum += total
        self.mm = None

    def view(self) -> tuple[list[int], float]:
        """Every count (one per bound, then +Inf) and the sum, the earlier regions' added."""
        counts, total = self._read()
        merged = [a + b for a, b in zip(self.base_counts, counts, strict=True)]
        at = len(self.bounds)
        return [*merged[:at], sum(merged[at:])], self.base_sum + total

    @property
    def counts(self) -> list[int]:
        return self.view()[0]

    @property
    def sum(self) -> float:
        return self.view()[1]


PARK_HELD_S = 0.25
"""How long a held call (:meth:`FrontHop.call` with ``hold``: gRPC) keeps its slot before
its reply's hand-over moves to a ticket."""


class Handing:
    """A reply being handed to its client (the ``deliver`` of :meth:`FrontHop.call`, or a
    held call). Its slot says DELIVERING. A hand-over the kernel does not take at once (a
    client that reads slowly) is parked (:meth:`park`): it moves to a ticket, the core keeps the
    step under the ticket (:data:`PARK`), and the slot is freed for other calls. So
    clients that read nothing hold tickets, never the front's slots. Once every ticket is
    taken, the slot stays held, and :meth:`starved` says whether other calls wait for it."""

    __slots__ = ("answered", "failed", "handed", "hop", "nbytes", "slot", "ticket", "use")

    def __init__(self, hop: FrontHop, slot: int) -> None:
        self.hop = hop
        self.slot = slot
        self.ticket: int | None = None
        self.use = 0
        self.answered = False  # the core took the park (the slot is free)
        self.failed: bool | None = None  # the hand-over failed before that (True: in doubt)
        self.handed = False  # it reached the kernel before that
        self.nbytes = 0  # of the front's parked bytes, this reply's

    def park(self, nbytes: int = 0) -> bool:
        """Move the hand-over off its slot (once; tried again while it could not), ``nbytes``
        of its reply still in the front: whether it holds a ticket now."""
        if self.ticket is None:
            self.hop._park(self, nbytes)
        return self.ticket is not None

    def starved(self) -> bool:
        """Whether this hand-over holds a slot that other calls wait for."""
        return self.ticket is None and self.hop.starved()


class FrontHop:
    """The front's end of the hop: at most ``region.slots`` calls in flight; a call past
    them waits its turn for a slot (first come, first served) for up to ``slot_wait_s``
    (the node's ``--act-deadline``: no step waits longer), as a step waits its turn in a
    node of one process."""

    def __init__(self, region: Region, ask: int, answer: int, slot_wait_s: float = 10.0) -> None:
        self.region = region
        self.ask = ask
        self.answer = answer
        self.slot_wait_s = slot_wait_s
        self.queued: deque[asyncio.Future[int]] = deque()  # calls waiting for a slot
        self.free = list(range(region.slots - 1, -1, -1))
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.abandoned: set[int] = set()
        self.loop = asyncio.get_running_loop()
        self.ringing = 0
        """The slots to ring for at the end of this turn of the loop (``1 << slot`` each)."""
        self.tickets = deque(range(TICKETS))  # free tickets (PARK), the longest free first
        self.uses = [0] * TICKETS
        self.parked_bytes = 0  # what parked replies left in the front (PARKED_BYTES)
        self.loop.add_reader(answer, self._rung)
        self.on_core_gone: Callable[[], None] | None = None

    def _rung(self) -> None:
        try:
            bits = os.eventfd_read(self.answer)
        except BlockingIOError:
            return
        for slot in _slots(bits, self.region.slots):
            waiting = self.waiting.get(slot)
            if waiting is not None and self.region.state(slot) == ANSWERED:
                del self.waiting[slot]
                if slot in self.abandoned:  # the caller left: say so, then free it
                    self.abandoned.discard(slot)
                    self._undeliver(slot)
                elif not waiting.done():
                    waiting.set_result(None)

    def _undeliver(self, slot: int, doubt: bool = False) -> None:
        """The reply in ``slot`` has no reader (or, ``doubt``, may have reached it: its
        hand-over failed midway): tell the core, free the slot once it has answered that."""
        self._send(slot, DOUBTED if doubt else UNDELIVERED, {}, [])
        told = self.loop.create_future()
        told.add_done_callback(lambda _: self._release(slot))
        self.waiting[slot] = told

    def starved(self) -> bool:
        """Whether calls wait for a slot now (every one is in flight)."""
        return bool(self.queued)

    def _settler(self, handing: Handing, nbytes: int) -> Callable[[bool | None], None]:
        """How a held call's caller says whether its reply (``nbytes``) reached the client:
        True frees the slot, False undoes the step, None leaves it in doubt; once. Not said
        within :data:`PARK_HELD_S`, the hand-over moves to a ticket (:meth:`Handing.park`;
        tried again as often while every ticket is taken, or its bytes would pass
        :data:`PARKED_BYTES`)."""
        settled = False
        timer: asyncio.TimerHandle | None = None

        def park() -> None:  # again while no ticket is free
            nonlocal timer
            timer = None if handing.park(nbytes) else self.loop.call_later(PARK_HELD_S, park)

        timer = self.loop.call_later(PARK_HELD_S, park)

        def settle(delivered: bool | None) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            if timer is not None:
                timer.cancel()
            self._handed(handing, delivered)

        return settle

    def _handed(self, handing: Handing, delivered: bool | None) -> None:
        """A hand-over ended: the slot (or the ticket it moved to) freed when ``delivered``
        is True, else the core told to undo the step (in doubt when None)."""
        if handing.ticket is not None:
            self._settle_ticket(handing, delivered)
        elif delivered is True:
            self._release(handing.slot)
        else:
            self._undeliver(handing.slot, doubt=delivered is None)

    def _park(self, handing: Handing, nbytes: int) -> None:
        """:meth:`Handing.park`: a free ticket says DELIVERING (its next use), then the slot
        asks the core to keep its step under it (:data:`PARK`); the slot is freed once the
        core answered, unless the hand-over failed meanwhile: then that slot carries the
        SETTLE at once, so no later request of anyone's overtakes it."""
        if not self.tickets or self.parked_bytes + nbytes > PARKED_BYTES:
            return
        ticket = self.tickets.popleft()
        self.uses[ticket] += 1
        use = self.uses[ticket]
        slot = handing.slot
        self.region.set_ticket(ticket, DELIVERING, use)  # before the core may read the park
        try:
            self._send(slot, PARK, {"k": ticket, "u": use}, [])
        except BaseException:  # (never sent: the ticket is free again, its slot still held)
            self.region.set_ticket(ticket, FREE, use)
            self.tickets.appendleft(ticket)
            raise
        self.parked_bytes += nbytes
        handing.nbytes = nbytes
        answered = self.loop.create_future()
        answered.add_done_callback(lambda _: self._parked(handing))
        self.waiting[slot] = answered
        handing.ticket, handing.use = ticket, use

    def _parked(self, handing: Handing) -> None:
        """The core took ``handing``'s park: its slot is free, or carries its SETTLE."""
        handing.answered = True
        if handing.failed is not None:
            self._settle_on(handing.slot, handing, handing.failed)
            return
        self._release(handing.slot)
        if handing.handed and handing.ticket is not None:
            self.tickets.append(handing.ticket)

    def _settle_ticket(self, handing: Handing, delivered: bool | None) -> None:
        ticket = handing.ticket
        assert ticket is not None
        self.parked_bytes -= handing.nbytes  # left the front: sent, or dropped with its client
        if delivered is True:  # it stands: the ticket is free once the core took the park
            self.region.set_ticket(ticket, FREE, handing.use)
            if handing.answered:
                self.tickets.append(ticket)
            else:  # freed with the slot (_parked)
                handing.handed = True
            return
        doubt = delivered is None
        self.region.set_ticket(ticket, DOUBTED if doubt else UNDELIVERED, handing.use)
        if not handing.answered:  # the park's slot carries it (_parked)
            handing.failed = doubt
        elif self.free:  # the first free slot, before any call of this turn can take it
            self._settle_on(self.free.pop(), handing, doubt)
        else:  # the next slot released, ahead of every call waiting for one
            head: asyncio.Future[int] = self.loop.create_future()
            head.add_done_callback(lambda got: self._settle_on(got.result(), handing, doubt))
            self.queued.appendleft(head)

    def _settle_on(self, slot: int, handing: Handing, doubt: bool) -> None:
        """Send ``handing``'s SETTLE in ``slot``; once answered, the slot and the ticket are
        free."""
        ticket = handing.ticket
        assert ticket is not None
        try:
            self._send(slot, SETTLE, {"k": ticket, "u": handing.use, "d": doubt}, [])
        except BaseException:
            self._release(slot)
            raise
        told = self.loop.create_future()

        def done(_: Any) -> None:
            self.region.set_ticket(ticket, FREE, handing.use)
            self.tickets.append(ticket)
            self._release(slot)

        told.add_done_callback(done)
        self.waiting[slot] = told

    def _release(self, slot: int) -> None:
        self.region.set_state(slot, FREE)
        while self.queued:  # the first call waiting takes it
            waiter = self.queued.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self.free.append(slot)

    async def _slot(
        self, wait: bool, wait_s: float | None, urgent: bool = False, ahead: bool = False
    ) -> int:
        """A free slot: at once, or once one is released to this call (its turn, in order
        of arrival; ``urgent``: first, without limit; ``ahead``: first, within its budget);
        :class:`HopFull` past ``slot_wait_s`` (or ``wait_s``, the call's own budget, when
        shorter), at once without ``wait`` or with :data:`MAX_QUEUED` calls waiting (but
        ``urgent`` or ``ahead``)."""
        if self.free and not self.queued:
            return self.free.pop()
        if not (urgent or ahead) and (not wait or len(self.queued) >= MAX_QUEUED):
            raise HopFull()
        budget = self.slot_wait_s if wait_s is None else max(0.0, min(wait_s, self.slot_wait_s))
        if urgent:
            budget = math.inf
        elif budget <= 0:  # (what a deadline refusal names: the node's, as one process says)
            raise HopFull(self.slot_wait_s)
        waiter: asyncio.Future[int] = self.loop.create_future()
        if urgent or ahead:
            self.queued.appendleft(waiter)
        else:
            self.queued.append(waiter)
        try:
            async with asyncio.timeout(None if budget == math.inf else budget):
                return await waiter
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():  # given one as it left: pass it on
                self._release(waiter.result())
            with contextlib.suppress(ValueError):
                self.queued.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise HopFull(self.slot_wait_s) from None
            raise

    def _send(self, slot: int, kind: int, meta: dict[str, Any], arrays: list[Array]) -> None:
        self.region.write(slot, ASKED, kind, meta, arrays)
        if self.ringing:  # a ring is due this turn: this slot joins it
            self.ringing |= 1 << slot
        elif self.waiting:  # others in flight: one ring for every request of this turn
            self.ringing = 1 << slot
            self.loop.call_soon(self._ring)
        else:  # alone: no turn of the loop to wait for
            os.eventfd_write(self.ask, 1 << slot)

    def _ring(self) -> None:
        bits, self.ringing = self.ringing, 0
        os.eventfd_write(self.ask, bits)

    async def call(
        self,
        kind: int,
        meta: dict[str, Any],
        arrays: list[Array],
        use: Callable[[int, dict[str, Any], list[Array]], Any],
        gone: Callable[[], bool] | None = None,
        deliver: Callable[[Any, Handing], Awaitable[bool | None]] | None = None,
        wait: bool = True,
        wait_s: float | None = None,
        hold: bool = False,
        size: Callable[[Any], int] | None = None,
        urgent: bool = False,
        ahead: bool = False,
    ) -> Any:
        """Send a request, await its reply and return ``use(kind, meta, views)``, run while the
        reply's arrays are views of the slot (they must not outlive it). Raises
        :class:`HopFull` when no slot came free within ``slot_wait_s`` (or ``wait_s``: what
        is left of the client's own timeout or deadline, when shorter), :class:`HopError`
        when the request does not fit a slot, :class:`~node.errors.CoreLapsed` for a step
        while the core is stuck past its lease (:meth:`Region.lapsed`). ``deliver`` hands the
        result to the client (a response's write, a websocket's send): while it runs the
        slot says DELIVERING, so a front that dies then leaves the step in doubt rather than
        undone or standing (the module doc). Cancelled, the slot
        stays the core's until it answers; the core is then told the reply was not
        delivered. So is it when ``gone()`` says, once the reply is used, that the client
        has left, or when ``deliver(result, handing)`` (awaited before the slot is freed: a
        websocket's send) says False (nothing of it reached the client): this raises
        :class:`Undelivered`. ``deliver`` saying None (the connection lost with the reply
        in part unsent), raising or cancelled leaves the step in doubt (:data:`DOUBTED`),
        and raises :class:`Undelivered` too. ``hold`` (a server that hands the reply to the
        client after this returns: gRPC) returns ``(result, settle)`` with the slot left
        DELIVERING until ``settle(delivered)`` says how that went (True, False or None, as
        ``deliver`` would; only its first call counts). ``size(result)``: the bytes of a held
        reply the front's server holds until it is sent, counted against
        :data:`PARKED_BYTES` while it is parked. ``urgent``: a note that must reach the
        core however busy the hop is (a websocket's close, which ends its episode there):
        it waits for the next slot released, ahead of the calls waiting, for as long as
        it takes, never refused. ``ahead``: a request sent again at once, which had its
        turn (a step whose input check the core refused as out of date, sent again with
        its inputs unchecked): it waits ahead of the calls waiting too, but within its
        budget."""
        if kind in _STEPS and self.region.lapsed(time.monotonic_ns()):
            self.region.count_refused()
            raise CoreLapsed()
        waits = not self.free or bool(self.queued)
        try:
            slot = await self._slot(wait, wait_s, urgent, ahead)
        except HopFull:
            if kind in _STEPS:  # refused here: counted by the core as its own refusals
                self.region.count_refused()
            raise
        if waits:  # the core may have lapsed, or the client left, meanwhile
            if kind in _STEPS and self.region.lapsed(time.monotonic_ns()):
                self._release(slot)
                self.region.count_refused()
                raise CoreLapsed()
            if gone is not None and gone():  # never sent: nothing to undo
                self._release(slot)
                raise Undelivered()
        try:
            self._send(slot, kind, meta, arrays)
        except BaseException:
            self._release(slot)
            raise
        waiting = self.loop.create_future()
        self.waiting[slot] = waiting
        try:
            await waiting
        except asyncio.CancelledError:
            if waiting.done() and not waiting.cancelled():  # answered as it was cancelled
                self._undeliver(slot)
            else:
                self.abandoned.add(slot)
            raise
        delivered: bool | None = False  # never reached the client, until known otherwise
        handing: Handing | None = None  # the hand-over, once the result is used
        held = False  # the caller settles it (hold)
        try:
            kind, reply, views = self.region.read(slot, copy=False)
            try:
                result = use(kind, reply, views)
            finally:
                del views
            handing = Handing(self, slot)
            if gone is not None and gone():
                delivered = False
            elif hold:  # settled by the caller (_settler)
                settle = self._settler(handing, 0 if size is None else size(result))
                self.region.set_state(slot, DELIVERING)
                held = True  # (only once nothing can raise: else the slot is undone below)
                return result, settle
            elif deliver is None:
                delivered = True
            else:  # from here, dying, raising or being cancelled leaves it in doubt
                self.region.set_state(slot, DELIVERING)
                delivered = None
                delivered = await deliver(result, handing)
        finally:
            if held:
                pass
            elif handing is None:  # the reply could not be used: never delivered
                self._undeliver(slot)
            else:
                self._handed(handing, delivered)
        if delivered is not True:
            raise Undelivered()
        return result


Answer = tuple[dict[str, Any], list[Array]]
Handler = Callable[[int, dict[str, Any], list[Array], int], Awaitable[Answer]]
"""The core's handler of one request: (kind, meta, arrays copied out, slot) → the reply's
(meta, arrays)."""


@dataclass
class CoreHop:
    """The core's end of one front's hop: reads requests on the event loop, runs
    ``handler`` in a task per request, answers into the slot. :meth:`drop` (the front
    died) stops it at once: tasks still running finish, and their steps are undone as a
    client's that left (held instead when they named ``seq``); a reply the front was
    handing over when it died is given to ``on_doubt`` instead."""

    region: Region
    ask: int
    answer: int
    handler: Handler
    on_undelivered: Callable[[Any], Awaitable[None]]
    on_doubt: Callable[[Any], Awaitable[None]]
    lighten: Callable[[Any], Any] = lambda keep: keep
    """What of a kept step the core holds while it is parked (``keep`` less what its undo
    does not need: a reply's outputs), for as long as its client takes."""
    kept: dict[int, Any] = field(default_factory=dict)
    parked: dict[int, tuple[int, Any]] = field(default_factory=dict)
    """The steps kept under a ticket (:data:`PARK`), with the ticket's use: an entry of a
    ticket handed over stays until :meth:`forget_handed` or the ticket's next park."""
    running: set[asyncio.Task[None]] = field(default_factory=set)
    alive: bool = True
    ringing: int = 0
    """The slots to ring for at the end of this turn of the loop (``1 << slot`` each)."""
    loop: asyncio.AbstractEventLoop = field(init=False)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.ask, self._rung)

    def _rung(self) -> None:
        """Serve what the front asked. An undo goes ahead of any step read with it, or after
        it: the notes of a doorbell (a reply not delivered, a park, a SETTLE) before its
        steps, which a slot's number does not order (a client's retry may sit in a slot
        below its failed step's note); and a parked step whose ticket the front already
        marked failed, its SETTLE still to come (the front sends it once its park was
        answered), is undone now, before the steps of this doorbell."""
        try:
            bits = os.eventfd_read(self.ask)
        except BlockingIOError:
            return
        asked = [s for s in _slots(bits, self.region.slots) if self.region.state(s) == ASKED]
        notes = [s for s in asked if self.region.kind(s) in _NOTES]
        if self.parked:
            self._settle_failed()
        for slot in notes + [s for s in asked if s not in notes]:
            self.region.set_state(slot, TAKEN)
            self._track(self._serve(slot))

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def _failed(self, ticket: int, use: int) -> int | None:
        """UNDELIVERED or DOUBTED when the front marked ``ticket``'s use ``use`` failed (its
        SETTLE sent or still to come), else None (handed over, or still being handed)."""
        state, now = self.region.ticket(ticket)
        if now == use & 0xFF_FFFF and state in (UNDELIVERED, DOUBTED):
            return state
        return None

    def _settle_failed(self) -> None:
        """Undo now each parked step whose ticket says its hand-over failed: its SETTLE,
        when it comes, finds nothing left to undo (one read of the tickets' words)."""
        for ticket in self.region.failed_tickets():
            entry = self.parked.get(ticket)
            fate = None if entry is None else self._failed(ticket, entry[0])
            if entry is not None and fate is not None:
                del self.parked[ticket]
                self._track(self._undo_one(entry[1], fate))

    async def _serve(self, slot: int) -> None:
        if not self.alive:
            return
        kept = self.kept.pop(slot, None)
        try:
            kind, meta, arrays = self.region.read(slot, copy=True)
        except HopError as exc:
            if kept is not None and self.region.kind(slot) in _NOTES:  # a note of its
                await self._undo_one(kept, DOUBTED)  # reply's fate, unreadable: in doubt
            # (a step asked in the slot says the reply before it was handed over: it stands)
            self._answer(slot, {"err": [400, "malformed", f"hop: {exc}", None, None]}, [])
            return
        if kind == PARK:  # the reply is still being handed over: kept under its ticket
            named = _ticket(meta)
            fate = None if named is None else self._failed(*named)
            if named is not None and kept is not None and fate is not None:
                # failed already, its SETTLE to come: undone now, ahead of the steps read
                # with this park (their tasks start after this one); the SETTLE finds nothing
                self.parked.pop(named[0], None)
                await self._undo_one(kept, fate)
            elif named is not None and kept is not None:
                self.parked[named[0]] = (named[1], self.lighten(kept))
            elif named is not None:
                self.parked.pop(named[0], None)
            self._answer(slot, {}, [])
            return
        if kind == SETTLE:  # a ticket's hand-over failed: its step undone, as below
            named = _ticket(meta)
            entry = None if named is None else self.parked.get(named[0])
            kept = None
            if named is not None and entry is not None and entry[0] == named[1]:
                kept = self.parked.pop(named[0])[1]
            kind = DOUBTED if meta.get("d") else UNDELIVERED
        if kind in (UNDELIVERED, DOUBTED):
            try:
                if kept is not None:
                    await self._undo_one(kept, kind)
            finally:
                self._answer(slot, {}, [])
            return
        try:
            reply, out = await self.handler(kind, meta, arrays, slot)
        except HopError as exc:
            reply, out = {"err": [400, "malformed", f"hop: {exc}", None, None]}, []
        except Exception as exc:  # a bug: answered, never a slot the front waits on forever
            log.exception("serving a front's request failed")
            reply, out = {"err": [500, "internal", f"{type(exc).__name__}: {exc}", None, None]}, []
        keep = reply.pop("keep", None)
        if not self.alive:  # the front died with the client's connection: as a client gone
            if keep is not None:
                await self.on_undelivered(keep)
        elif self._answer(slot, reply, out):
            if keep is not None:
                self.kept[slot] = keep
        elif keep is not None:  # too big for the slot: answered 500, undone
            await self.on_undelivered(keep)

    def _answer(self, slot: int, meta: dict[str, Any], arrays: list[Array]) -> bool:
        if not self.alive:
            return True
        ok = True
        try:
            self.region.write(slot, ANSWERED, REPLY, meta, arrays)
        except HopError as exc:
            ok = False
            self.region.write(slot, ANSWERED, REPLY, {"err": [500, "internal", str(exc), None,
                                                              None]}, [])  # fmt: skip
        if self.ringing:  # a ring is due this turn: this slot joins it
            self.ringing |= 1 << slot
        elif len(self.running) > 1:  # others in flight: one ring for every answer of this turn
            self.ringing = 1 << slot
            self.loop.call_soon(self._ring)
        else:  # alone: no turn of the loop to wait for
            os.eventfd_write(self.answer, 1 << slot)
        return ok

    def _ring(self) -> None:
        bits, self.ringing = self.ringing, 0
        if self.alive:
            os.eventfd_write(self.answer, bits)

    def _fate(self, slot: int) -> int:
        """What became of the reply kept for ``slot``, as far as the front said before it
        died: UNDELIVERED (never read back: still answered, or its word that it was not
        delivered still unserved here), DOUBTED (being handed over: DELIVERING, its word
        that the hand-over failed midway unserved, or its move to a ticket unserved while
        the ticket says it is still being handed over) or FREE (it reached the kernel)."""
        state = self.region.state(slot)
        if state == ANSWERED:
            return UNDELIVERED
        if state == DELIVERING:
            return DOUBTED
        if state in (ASKED, TAKEN):
            kind = self.region.kind(slot)
            if kind in (UNDELIVERED, DOUBTED):
                return kind
            if kind == PARK:
                try:
                    named = _ticket(self.region.read(slot, copy=True)[1])
                except HopError:
                    named = None
                return DOUBTED if named is None else self._ticket_fate(*named)
        return FREE

    def forget_handed(self) -> None:
        """Let go of what is kept under tickets handed over since (the front says FREE, or
        the ticket is on a later use): never undone. Called every 50 ms, so a reply's
        outputs are not held long past its hand-over."""
        if self.alive and self.parked:
            for ticket in [t for t, (use, _) in self.parked.items()
                           if self._ticket_fate(t, use) == FREE]:  # fmt: skip
                del self.parked[ticket]

    def _ticket_fate(self, ticket: int, use: int) -> int:
        """What the front's ticket says of its use ``use``: DOUBTED (still being handed over,
        or failed in doubt), UNDELIVERED, or FREE (handed over; or the ticket has moved on
        to a later use, which the front begins only once this one was settled)."""
        state, now = self.region.ticket(ticket)
        if now != use & 0xFF_FFFF:
            return FREE
        if state == DELIVERING:
            return DOUBTED
        return state if state in (UNDELIVERED, DOUBTED) else FREE

    async def _undo(self, kept: list[Any], doubted: list[Any]) -> None:
        for keep in kept:
            await self._undo_one(keep, UNDELIVERED)
        for keep in doubted:
            await self._undo_one(keep, DOUBTED)

    async def _undo_one(self, keep: Any, fate: int) -> None:
        """Undo a step whose reply did not reach its client (``fate`` UNDELIVERED), or may
        not have (DOUBTED: the episode's next step says ``state_reset``)."""
        try:
            await (self.on_doubt(keep) if fate == DOUBTED else self.on_undelivered(keep))
        except Exception:  # a bug: logged; whatever else is undone all the same
            log.exception("undoing a step whose reply a front did not deliver failed")

    def drop(self) -> None:
        """The front is gone: stop reading. Its clients' connections went with it, so a
        reply it never read back (its slot still answered) reached nobody, and neither will
        the replies of steps still running: each is undone as for a client that left (a
        step that named its ``seq`` is held for the retry instead). A reply it was handing
        to its client (DELIVERING) may or may not have reached it: ``on_doubt`` (undone,
        and the episode's next step says ``state_reset``). A reply it handed over (its slot
        freed) stands, as one a node handed to the kernel."""
        if not self.alive:
            return
        self.alive = False
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.ask)
        fates = [(self._fate(slot), keep) for slot, keep in self.kept.items()]
        fates += [(self._ticket_fate(t, use), keep) for t, (use, keep) in self.parked.items()]
        unread = [keep for fate, keep in fates if fate == UNDELIVERED]
        doubted = [keep for fate, keep in fates if fate == DOUBTED]
        self.kept.clear()
        self.parked.clear()
        if unread or doubted:
            self._track(self._undo(unread, doubted))
        for fd in (self.ask, self.answer):
            os.close(fd)
        self.region.close()
