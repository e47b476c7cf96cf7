"""``affinity``: the operator's command line, a thin shell over :class:`Registry`,
:class:`Inventory`, :class:`EventStream`, :class:`Models` and :class:`Claims`.

Exit codes: 0 ok, 1 not found (episode, device, node, no node registered at all in the
namespace, or a move target that does not serve the episode's model; a ``drain --move`` that
left an episode where it was), 2 usage, 3 Redis
unreachable or failing. ``--json`` (before or after the
subcommand) prints machine-readable output instead of tables; ``events --json`` prints one
JSON object per line. JSON says ``episode`` for an episode id everywhere, and tokens and
counts are numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisError

from affinity import __version__
from affinity.claims import Claims
from affinity.config import Settings
from affinity.connection import close, connect
from affinity.dataset import Selection
from affinity.errors import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
    UnknownModel,
    UnknownNode,
)
from affinity.events import Event, EventStream, event_json
from affinity.inventory import Inventory, ModelStatus, NodeStatus
from affinity.models import Models
from affinity.registry import MoveRequest, NodeProcesses, Registry
from affinity.scripts import failure
from affinity.shadows import Shadow, Shadows
from affinity.shadows import status as shadow_rows

__all__ = ["main"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
FOLLOW_BLOCK_MS = 1000
EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_REDIS = 0, 1, 2, 3
_STREAM_ID = re.compile(r"^(-|\d+(-\d+)?)$")


class NothingRegistered(AffinityError):
    """The namespace holds no node and no device: probably the wrong Redis."""

    def __init__(self, url: str, namespace: str) -> None:
        super().__init__(
            f"no node is registered in namespace {namespace!r} at {url}. A node started "
            "without --redis keeps its own embedded store: start it with --embedded-port "
            "PORT and point this command at it with --redis redis://127.0.0.1:PORT/0"
        )


class TargetServesOther(AffinityError):
    """A move's target does not serve the episode's model: nothing was asked."""

    def __init__(self, episode: str, model: str, target: str, served: Sequence[str]) -> None:
        self.episode = episode
        self.model = model
        self.target = target
        self.served = tuple(served)
        serves = f"it serves {', '.join(self.served)}" if self.served else "it serves no model"
        super().__init__(
            f"{target} does not serve {model}, the model of episode {episode!r}: {serves} "
            "(affinity models shows who serves it)"
        )


@dataclass
class Context:
    registry: Registry
    inventory: Inventory
    events: EventStream
    models: Models
    claims: Claims
    json: bool
    out: TextIO
    url: str  # as shown (no password)

    async def require_deployment(self) -> None:
        """Raise :class:`NothingRegistered` when the namespace is empty."""
        if await self.inventory.empty():
            raise NothingRegistered(self.url, self.inventory.keys.namespace)


Command = Callable[[argparse.Namespace, Context], Awaitable[int]]


# -- output ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; the header row first."""
    cells = [list(headers), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def seconds(ms: int) -> str:
    return f"{ms / 1000:.1f}s"


def utc_time(ms: int) -> str:
    """ms since the epoch in UTC to the ms: ``2026-12-01T16:07:58.123Z``."""
    at = datetime.fromtimestamp(ms / 1000, UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def event_time(event_id: str) -> str:
    """When the event was written, from its stream id (Redis time in ms), in UTC."""
    return utc_time(int(event_id.split("-", 1)[0]))


def event_line(event: Event) -> str:
    """``<id> <UTC time> <type> key=value ...``; values with spaces or quotes are
    shell-quoted, empty fields (a first claim's ``from``) are left out."""
    event_id, fields = event
    parts = [event_id, event_time(event_id), fields.get("type", "?")]
    parts += [f"{k}={shlex.quote(v)}" for k, v in fields.items() if k != "type" and v]
    return " ".join(parts)


def emit(ctx: Context, text: str) -> None:
    print(text, file=ctx.out, flush=True)


def emit_json(ctx: Context, value: Any) -> None:
    emit(ctx, json.dumps(value, indent=2))


# -- commands -------------------------------------------------------------------------------


async def cmd_devices(args: argparse.Namespace, ctx: Context) -> int:
    await ctx.require_deployment()
    devices = await ctx.inventory.devices()
    if ctx.json:
        # a dead node's load is stale (its episodes move on their next step): none is shown
        emit_json(ctx, [{**d.to_json(), "load": d.load if d.alive else None} for d in devices])
        return EXIT_OK
    rows = [
        (
            d.device,
            d.node,
            d.kind,
            d.name,
            d.state,
            yes_no(d.alive),
            f"{d.load if d.alive else '-'}/{d.capacity}",
            d.weight,
            "-" if d.score is None else f"{d.score:.1f}",
            d.provider,
            ",".join(d.models),
            d.reason,
        )
        for d in devices
    ]
    headers = ("DEVICE", "NODE", "KIND", "NAME", "STATE", "ALIVE", "LIVE/CAP", "WEIGHT")
    emit(ctx, table((*headers, "SCORE_MS", "PROVIDER", "MODELS", "REASON"), rows))
    return EXIT_OK


def processes_cell(p: NodeProcesses) -> str:
    """A node's processes in a word: ``1`` for one process, else the core and what it
    supervises (``core+4 fronts``, ``core+2 device workers``, ``core+4 fronts+2 device
    workers``), then what is wrong: processes not running now (``1 down``; with fronts and
    workers both, each kind apart: ``1 front down, 2 workers down``), restarts."""
    if p.fronts == 1 and not p.workers:
        return "1"
    text = "core"
    if p.fronts > 1:
        text += f"+{p.fronts} fronts"
    if p.workers:
        text += f"+{p.workers} device worker{plural(p.workers)}"
    fronts, workers = p.fronts_down, p.workers_down
    if p.fronts > 1 and p.workers:
        if fronts:
            text += f", {fronts} front{plural(fronts)} down"
        if workers:
            text += f", {workers} worker{plural(workers)} down"
    elif fronts or workers:
        text += f", {fronts or workers} down"
    if p.restarts:
        text += f", {p.restarts} restart{plural(p.restarts)}"
    return text


def plural(n: int) -> str:
    return "s" if n != 1 else ""


def lag_cell(lag_ms: float | None) -> str:
    if lag_ms is None:
        return "-"
    return ">2500ms" if math.isinf(lag_ms) else f"{lag_ms:g}ms"


PROCESS_HEADERS = ("NODE", "PROCESS", "PID", "SINCE", "RESTARTS", "LAG P99")


def process_rows(nodes: Sequence[NodeStatus]) -> list[tuple[object, ...]]:
    """A row per process of each node: the core first, then its fronts and its device
    workers (role ``dev<index>``) as the node listed them, then its helpers (the fronts'
    fork server, role ``forksrv``: no loop lag is read from it)."""
    return [
        (
            n.node,
            p.role,
            p.pid,
            utc_time(p.since_ms),
            p.restarts,
            lag_cell(p.lag_p99_ms),
        )
        for n in nodes
        for p in (*n.processes.processes, *n.processes.helpers)
    ]


async def cmd_nodes(args: argparse.Namespace, ctx: Context) -> int:
    await ctx.require_deployment()
    nodes = await ctx.inventory.nodes()
    if ctx.json:
        emit_json(ctx, [n.to_json() for n in nodes])
        return EXIT_OK
    if args.processes:
        emit(ctx, table(PROCESS_HEADERS, process_rows(nodes)))
        return EXIT_OK
    rows = [
        (
            n.node,
            n.url,
            n.state,
            yes_no(n.alive),
            seconds(n.lease_ms),
            processes_cell(n.processes),
            ",".join(n.devices),
            ",".join(n.models),
        )
        for n in nodes
    ]
    headers = ("NODE", "URL", "STATE", "ALIVE", "LEASE LEFT", "PROCESSES", "DEVICES", "MODELS")
    emit(ctx, table(headers, rows))
    return EXIT_OK


def model_rows(models: Sequence[ModelStatus]) -> list[tuple[object, ...]]:
    return [
        (
            m.name,
            m.version,
            "newest" if m.weight is None and m.newest else "-" if m.weight is None else m.weight,
            ",".join(m.nodes) or "-",
            m.devices,
        )
        for m in models
    ]


MODEL_HEADERS = ("MODEL", "VERSION", "NEW EPISODES", "LIVE NODES", "DEVICES")


def emit_models(ctx: Context, models: Sequence[ModelStatus]) -> None:
    if ctx.json:
        emit_json(ctx, [m.to_json() for m in models])
    else:
        emit(ctx, table(MODEL_HEADERS, model_rows(models)))


async def cmd_models(args: argparse.Namespace, ctx: Context) -> int:
    await ctx.require_deployment()
    models = await ctx.inventory.models()
    emit_models(ctx, models)
    return EXIT_OK


async def cmd_rollout(args: argparse.Namespace, ctx: Context) -> int:
    await ctx.require_deployment()
    models = await ctx.inventory.models()
    served = [f"{m.name}@{m.version}" for m in models if m.nodes]
    if not any(m.name == args.name for m in models):
        raise UnknownModel(args.name, served)
    if args.reset:
        await ctx.models.clear_rollout(args.name)
    elif args.version is not None:
        if args.weight is None:
            raise InvalidArgument("rollout weight", None, "give VERSION and WEIGHT")
        if f"{args.name}@{args.version}" not in served:  # a weight no node could honour
            raise UnknownModel(f"{args.name}@{args.version}", served)
        await ctx.models.rollout(args.name, args.version, args.weight)
    models = [m for m in await ctx.inventory.models() if m.name == args.name]
    emit_models(ctx, models)
    return EXIT_OK


async def cmd_record(args: argparse.Namespace, ctx: Context) -> int:
    """Which episodes of a model version the fleet records (``node/recorder.py``)."""
    name, _, version = args.model.partition("@")
    if not name or not version:
        raise InvalidArgument("record model", args.model, "give NAME@VERSION")
    await ctx.require_deployment()
    served = [f"{m.name}@{m.version}" for m in await ctx.inventory.models() if m.nodes]
    if args.model not in served:
        raise UnknownModel(args.model, served)
    if args.off:
        selection = None
    elif args.episodes:
        episodes = frozenset(e for e in args.episodes.split(",") if e)
        selection = Selection("named", 1.0, episodes)
    elif args.reset or args.errors:  # all written; dataset finalize keeps these
        modes = [m for m, on in (("reset", args.reset), ("error", args.errors)) if on]
        selection = Selection("+".join(modes))
    elif args.fraction is not None:
        if not 0.0 <= args.fraction <= 1.0:
            raise InvalidArgument("record fraction", args.fraction, "must be 0-1")
        selection = Selection("fraction", args.fraction)
    else:
        selection = Selection("all")
    await ctx.models.set_recording(
        name, version, None if selection is None else selection.to_json()
    )
    state = "off" if selection is None else selection.to_json()
    emit(ctx, f"recording {args.model}: {state} (nodes read it at their next lease renewal)")
    return EXIT_OK


async def cmd_dataset(args: argparse.Namespace, ctx: Context) -> int:
    """Join a recording's segments into one LeRobotDataset v3."""
    from affinity.dataset import finalize

    out = args.out or args.url.rstrip("/") + "/dataset"
    info = finalize(args.url, out, args.model, args.task, args.fps)
    meta = info["affinity"]
    emit(ctx, f"{out}: {info['total_episodes']} episode(s), {info['total_frames']} frame(s) "
              f"of {meta['model']}, {meta['dropped_frames']} dropped")  # fmt: skip
    return EXIT_OK


async def cmd_replay(args: argparse.Namespace, ctx: Context) -> int:
    """Replay a recorded dataset in process and compare actions: run by the node's package
    (``python -m node.replay``: its own model loading and dispatcher), in a process of its
    own, so that this library never imports the node."""
    argv = [args.dataset, "--model", args.model, *(["--check"] if args.check else []),
            *(["--json"] if ctx.json else [])]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "node.replay", *argv)
    return await proc.wait()


async def cmd_shadow(args: argparse.Namespace, ctx: Context) -> int:
    """``shadow NAME@CANDIDATE --of NAME@LIVE``, ``shadow stop NAME@CANDIDATE``, ``shadow
    status`` (``affinity/shadows.py``)."""
    shadows = Shadows(ctx.models.redis, ctx.models.settings)
    what = list(args.what)
    if what == ["status"]:
        return await shadow_status(ctx, shadows)
    if len(what) == 2 and what[0] == "stop":
        stopped = await shadows.stop(what[1])
        if stopped is None:
            raise UnknownModel(what[1], sorted(await shadows.all()))
        if ctx.json:
            emit_json(ctx, {"candidate": what[1], "live": str(stopped.live), "stopped": True})
        else:
            emit(ctx, f"stopped the shadow of {what[1]} (its figures stay)")
        return EXIT_OK
    if len(what) != 1 or args.of is None:
        raise InvalidArgument(
            "shadow",
            " ".join(what),
            "give NAME@CANDIDATE --of NAME@LIVE, stop NAME@CANDIDATE or status",
        )
    shadow = Shadow.checked(what[0], args.of, args.fraction)
    for other in (await shadows.all()).values():  # one candidate beside a live version
        if other.live == shadow.live and other.candidate != shadow.candidate and not other.stopped:
            raise InvalidArgument(
                "shadow",
                str(shadow.candidate),
                f"{other.candidate} shadows {other.live} "
                f"already: affinity shadow stop {other.candidate} first",
            )
    await ctx.require_deployment()
    served = [f"{m.name}@{m.version}" for m in await ctx.inventory.models() if m.nodes]
    if str(shadow.live) not in served:  # nothing to shadow
        raise UnknownModel(str(shadow.live), served)
    await shadows.start(shadow)
    if ctx.json:
        emit_json(ctx, {"candidate": str(shadow.candidate), "live": str(shadow.live),
                        "fraction": shadow.fraction})  # fmt: skip
    else:
        emit(ctx, f"{shadow.candidate} shadows {shadow.fraction:g} of the episodes of "
                  f"{shadow.live} from each owner's next renewal")  # fmt: skip
    return EXIT_OK


async def shadow_status(ctx: Context, shadows: Shadows) -> int:
    rows = await shadow_rows(shadows)
    if ctx.json:
        emit_json(ctx, rows)
        return EXIT_OK
    headers = ["CANDIDATE", "LIVE", "FRACTION", "STATE", "COMPARED", "SKIPPED", "RESTARTS",
               "MAX_ABS", "L2_MAX", "RESTARTED_MAX_ABS"]  # fmt: skip
    emit(ctx, table(headers, [
        (r["candidate"], r["live"], f"{r['fraction']:g}", r["state"], r["compared"],
         r["skipped"], r["restarts"], f"{r['max_abs']:.6g}", f"{r['l2_max']:.6g}",
         f"{r['restarted_max_abs']:.6g}")
        for r in rows
    ]))  # fmt: skip
    return EXIT_OK


async def cmd_forget(args: argparse.Namespace, ctx: Context) -> int:
    await ctx.registry.forget(args.node)
    if ctx.json:
        emit_json(ctx, {"node": args.node, "forgotten": True})
    else:
        emit(ctx, f"forgot node {args.node} and its devices")
    return EXIT_OK


async def cmd_new_fleet(args: argparse.Namespace, ctx: Context) -> int:
    written = await ctx.registry.new_fleet()
    if ctx.json:
        emit_json(ctx, {"new_fleet": written})
    elif written:
        emit(ctx, "marked as a new fleet: its first claims need not wait for the grace period")
    else:
        emit(ctx, "the fleet marker is there already: nothing written")
    return EXIT_OK


async def cmd_episodes(args: argparse.Namespace, ctx: Context) -> int:
    if args.device is None:
        await ctx.require_deployment()
    rows = await ctx.inventory.episodes(device=args.device, node=args.node)
    if ctx.json:
        emit_json(ctx, [r.to_json() for r in rows])
        return EXIT_OK
    emit(
        ctx,
        table(
            ("EPISODE", "DEVICE", "TOKEN", "IDLE END", "BACKSTOP", "MOVED", "MODEL"),
            [
                (
                    r.episode,
                    r.device,
                    r.token,
                    seconds(r.idle_ms),
                    seconds(r.ttl_ms),
                    yes_no(r.moved),
                    r.model,
                )
                for r in rows
            ],
        ),
    )
    return EXIT_OK


async def cmd_show(args: argparse.Namespace, ctx: Context) -> int:
    info = await ctx.claims.lookup(args.episode)
    if info is None:
        raise UnknownEpisode(args.episode)
    idle_ms = await ctx.inventory.idle_left(info.node, info.ttl_ms)
    if ctx.json:
        emit_json(ctx, {**info.to_json(), "idle_ms": idle_ms})
        return EXIT_OK
    rows = [
        ("episode", info.episode),
        ("device", info.device),
        ("node", info.node),
        ("url", info.url),
        ("token", info.token),
        ("idle end", f"in {seconds(idle_ms)} if no step comes (its owner ends it)"),
        ("backstop", f"in {seconds(info.ttl_ms)} (Redis drops it then if nobody slid it)"),
        ("state", info.state),
        ("alive", yes_no(info.alive)),
        ("moved", "yes (handed over: its next step is reassigned)" if info.moved else "no"),
        *(
            [("revoked", "yes (released: its owner lets go at its next renewal)")]
            if info.revoked
            else []
        ),
        *([("model", info.model)] if info.model else []),
    ]
    emit(ctx, "\n".join(f"{k + ':':<10}{v}" for k, v in rows))
    return EXIT_OK


async def check_devices(ctx: Context, devices: Sequence[str]) -> None:
    """Raises :class:`UnknownDevice` for the first of ``devices`` that is not registered,
    before any of them changes (a typo in one changes nothing)."""
    states = await ctx.registry.states(devices)
    for device in devices:
        if states[device] == "removed":
            raise UnknownDevice(device)


@dataclass
class DrainMoves:
    """What became of the episodes a ``drain --move`` asked to move, read off the event
    stream: ``moved`` (episode -> its new device), ``kept`` (episode -> why it stayed: the
    ``move-kept`` event's ``why``), ``ended`` (released or expired meanwhile), and
    ``waiting``: not heard of when the wait ended."""

    moved: dict[str, str]
    kept: dict[str, str]
    ended: list[str]  # no longer on the drained devices, without a move
    waiting: list[str]

    def to_json(self) -> dict[str, object]:
        return {
            "moved": len(self.moved),
            "kept": [{"episode": e, "why": w} for e, w in sorted(self.kept.items())],
            "ended": sorted(self.ended),
            "waiting": sorted(self.waiting),
        }


KEPT_WHY = {
    "none": "no other device serving its model has room",
    "unreachable": "the chosen device's node did not answer",
    "refused": "the chosen device's node refused it",
    "redis": "Redis failed during the move",
}


async def follow_moves(
    ctx: Context, episodes: set[str], devices: set[str], cursor: str, wait_s: float
) -> DrainMoves:
    """Follow the event stream from ``cursor`` until each of ``episodes`` (on ``devices``)
    was moved, kept where it is, or left the devices otherwise, or until ``wait_s`` seconds
    have passed. Whenever the stream is quiet, the devices' assignments are read: an episode
    no longer on them without a move (released, expired, claimed elsewhere, handed over by a
    stop) is ``ended``."""
    moves = DrainMoves({}, {}, [], [])
    left = set(episodes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s

    def seen(batch: list[Event]) -> str:
        last = cursor
        for event_id, fields in batch:
            last = event_id
            episode, kind = fields.get("episode", ""), fields.get("type")
            if episode not in left:
                continue
            if kind == "moved" and fields.get("from") in devices:
                moves.moved[episode] = fields.get("to", "")
            elif kind == "move-kept" and fields.get("device") in devices:
                moves.kept[episode] = fields.get("why", "")
            else:
                continue
            left.discard(episode)
        return last

    while left:
        remaining_ms = (deadline - loop.time()) * 1000
        if remaining_ms <= 0:
            break
        batch = await ctx.events.wait(cursor, min(FOLLOW_BLOCK_MS, int(remaining_ms) + 1))
        cursor = seen(batch)
        if batch or not left:
            continue
        # quiet: which are still on the devices? (then the events once more, so that a
        # move committed between the two reads counts as moved)
        still = {r.episode for d in devices for r in await ctx.inventory.episodes(d) if not r.moved}
        cursor = seen(await ctx.events.events(cursor, 1000))
        for episode in sorted(left - still):
            moves.ended.append(episode)
            left.discard(episode)
    moves.waiting = sorted(left)
    return moves


def moves_summary(moves: DrainMoves, asked: int, wait_s: float) -> str:
    lines = [f"moved {len(moves.moved)} of {asked} episodes with their state"]
    if moves.ended:
        lines.append(
            f"{len(moves.ended)} left the devices otherwise (ended, expired or claimed anew)"
        )
    for episode, why in sorted(moves.kept.items()):
        lines.append(f"kept {episode} where it is: {KEPT_WHY.get(why, why)}")
    if moves.waiting:
        lines.append(
            f"{len(moves.waiting)} not moved within {wait_s:g} s (is the node up? affinity "
            f"events shows a later move): {', '.join(moves.waiting)}"
        )
    return "\n".join(lines)


async def cmd_drain(args: argparse.Namespace, ctx: Context) -> int:
    # every device drains before any move is asked: a move never lands on a device that
    # drains next (draining a node's devices together moves each episode once)
    await check_devices(ctx, args.device)
    watch = args.move and args.wait > 0
    if watch:  # the cursor first: no move can land before it
        _, cursor = await ctx.events.latest(0)
        on_them = [  # (not those a graceful stop handed over: their next step claims anew)
            r.episode for d in args.device for r in await ctx.inventory.episodes(d) if not r.moved
        ]
    changes = [await ctx.registry.drain(device, args.reason) for device in args.device]
    if args.move:  # each node moves them with their state at its next renewal
        for device in args.device:
            node = device.rpartition("/")[0]
            await ctx.registry.request_move(node, MoveRequest(device=device))
    if not watch:
        for device, change in zip(args.device, changes, strict=True):
            report_state(ctx, device, change.state, change.previous)
        return EXIT_OK
    moves = await follow_moves(ctx, set(on_them), set(args.device), cursor, args.wait)
    if ctx.json:
        states = [
            {"device": d, "state": c.state, "previous": c.previous}
            for d, c in zip(args.device, changes, strict=True)
        ]
        emit_json(ctx, {"devices": states, "episodes": len(on_them), **moves.to_json()})
    else:
        for device, change in zip(args.device, changes, strict=True):
            report_state(ctx, device, change.state, change.previous)
        emit(ctx, moves_summary(moves, len(on_them), args.wait))
    return EXIT_OK if not moves.kept and not moves.waiting else EXIT_NOT_FOUND


async def cmd_move(args: argparse.Namespace, ctx: Context) -> int:
    info = await ctx.claims.lookup(args.episode)
    if info is None:
        raise UnknownEpisode(args.episode)
    if not info.alive:
        raise InvalidArgument(
            "episode", args.episode, f"its owner {info.node} holds no lease: its next step moves it"
        )
    target = args.to or ""
    if target:  # a typo, or another model's device, is refused, not a move that finds nowhere
        served = await ctx.inventory.served_by(target)  # UnknownNode / UnknownDevice
        if info.model and info.model not in served:
            raise TargetServesOther(args.episode, info.model, target, served)
    await ctx.registry.request_move(info.node, MoveRequest(episode=args.episode, target=target))
    where = f" to {target}" if target else ""
    if ctx.json:
        emit_json(ctx, {"episode": args.episode, "owner": info.node, "to": target, "asked": True})
    else:
        emit(
            ctx,
            f"asked {info.node} to move {args.episode}{where} with its state, at its next lease "
            "renewal (affinity events shows the move)",
        )
    return EXIT_OK


async def cmd_undrain(args: argparse.Namespace, ctx: Context) -> int:
    # only a draining device is undrained; a down one comes back through its node's probe
    await check_devices(ctx, args.device)
    for device in args.device:
        change = await ctx.registry.undrain(device)
        report_state(ctx, device, change.state, change.previous)
    return EXIT_OK


def report_state(ctx: Context, device: str, state: str, previous: str) -> int:
    if ctx.json:
        emit_json(ctx, {"device": device, "state": state, "previous": previous})
    else:
        emit(
            ctx,
            f"{device}: {previous} -> {state}"
            if state != previous
            else f"{device}: {state} (unchanged)",
        )
    return EXIT_OK


async def cmd_release(args: argparse.Namespace, ctx: Context) -> int:
    info = await ctx.claims.lookup(args.episode)
    if info is None:
        raise UnknownEpisode(args.episode)
    done = await ctx.claims.release(args.episode, info.token, reason="operator")
    if ctx.json:
        emit_json(
            ctx,
            {
                "episode": args.episode,
                "device": done.device,
                "token": info.token,
                "released": True,
                "pending_owner": done.revoked,
            },
        )
    elif done.revoked:  # the owner serves it from memory: it lets go at its next renewal
        emit(
            ctx,
            f"released {args.episode} from {done.device} (token {info.token}): its owner "
            f"{info.node} drops it at its next lease renewal; its next step then starts "
            "afresh (state_reset)",
        )
    else:
        emit(ctx, f"released {args.episode} from {done.device} (token {info.token})")
    return EXIT_OK


async def cmd_events(args: argparse.Namespace, ctx: Context) -> int:
    if args.since is None:
        batch, cursor = await ctx.events.latest(args.count)
    else:
        batch = await ctx.events.events(args.since, args.count)
        cursor = "0-0" if args.since == "-" else args.since
    limit: int | None = args.max_events
    printed = 0
    while True:
        for event in batch:
            if limit is not None and printed >= limit:
                return EXIT_OK
            emit(ctx, json.dumps(event_json(*event)) if ctx.json else event_line(event))
            printed += 1
            cursor = event[0]
        if not args.follow or (limit is not None and printed >= limit):
            return EXIT_OK
        batch = await ctx.events.wait(cursor, FOLLOW_BLOCK_MS)


# -- parsing --------------------------------------------------------------------------------


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def stream_id(text: str) -> str:
    if not _STREAM_ID.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stream id (such as 1718000000000-0, or - for the oldest)"
        )
    return text


def common_options() -> argparse.ArgumentParser:
    """The global options, accepted before and after the subcommand; SUPPRESS keeps a
    subcommand's parser from overwriting a value given before it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis",
        default=argparse.SUPPRESS,
        metavar="URL",
        help=f"Redis URL (default: $AFFINITY_REDIS_URL, else {DEFAULT_REDIS_URL})",
    )
    common.add_argument(
        "--namespace",
        default=argparse.SUPPRESS,
        help="key namespace (default: $AFFINITY_NAMESPACE, else affinity)",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    return common


AddCommand = Callable[[str, Command, str], argparse.ArgumentParser]
"""Adds a subcommand: its name, what runs it and its help; returns its parser."""


def add_fleet_commands(command: AddCommand) -> None:
    """The subcommands about nodes, devices and models."""
    command("devices", cmd_devices, "every registered device: state, liveness, live load")
    p = command(
        "nodes", cmd_nodes, "every node with its lease and processes; dead ones until forgotten"
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="a row per process of each node (--front-doors): pid, start, restarts, loop lag",
    )
    command("models", cmd_models, "every registered model version: who serves it, its share")
    p = command(
        "rollout",
        cmd_rollout,
        "share a model's new episodes between its versions by weight (running episodes keep "
        "theirs); with NAME alone, show its versions",
    )
    p.add_argument("name", metavar="NAME", help="the model's name (as in affinity models)")
    p.add_argument("version", metavar="VERSION", nargs="?", help="one of its versions")
    p.add_argument(
        "weight",
        metavar="WEIGHT",
        nargs="?",
        type=non_negative,
        help="its share of new episodes, relative to the other versions' weights (0: none)",
    )
    p.add_argument(
        "--reset", action="store_true", help="drop the weights: the newest version takes all"
    )
    p = command(
        "record",
        cmd_record,
        "record a model version's episodes as LeRobot data on nodes run with --record: all, "
        "--fraction F, --episodes IDS, --reset and/or --errors, or --off",
    )
    p.add_argument("model", metavar="NAME@VERSION", help="the model version")
    p.add_argument("--fraction", type=float, help="this fraction of its episodes (0-1)")
    p.add_argument("--episodes", help="only these episode ids (comma-separated)")
    p.add_argument(
        "--reset",
        action="store_true",
        help="keep the episodes in which a step started from clean state after the first "
        "(all are written; dataset finalize keeps these)",
    )
    p.add_argument(
        "--errors",
        action="store_true",
        help="keep the episodes whose segment on a node ended in a failed step (a 5xx: "
        "model_failure, device_down); with --reset: either (all are written; dataset "
        "finalize keeps these)",
    )
    p.add_argument("--off", action="store_true", help="stop recording it")
    p = command("dataset", cmd_dataset, "join a recording's segments into a LeRobotDataset v3")
    p.add_argument("action", choices=("finalize",), help="finalize")
    p.add_argument("url", metavar="URL", help="the nodes' --record directory or fsspec URL")
    p.add_argument("--out", help="where the dataset goes (default: URL/dataset)")
    p.add_argument("--model", help="NAME@VERSION (default: the only one recorded)")
    p.add_argument("--task", default="", help="the dataset's task text")
    p.add_argument("--fps", type=int, help="frames per second (default: the recorded rate)")
    p = command(
        "replay", cmd_replay, "run a recorded dataset's episodes in process; compare actions"
    )
    p.add_argument("dataset", metavar="DATASET", help="a dataset affinity dataset finalize wrote")
    p.add_argument("--model", required=True, help="[NAME=]FILE[@VERSION] or a packaged model")
    p.add_argument("--check", action="store_true", help="exit 1 unless bit-for-bit parity")
    p = command(
        "shadow",
        cmd_shadow,
        "run a candidate version beside a live one on live episodes' inputs, never answering "
        "(NAME@CANDIDATE --of NAME@LIVE [--fraction F]; stop NAME@CANDIDATE; status)",
    )
    p.add_argument(
        "what",
        nargs="+",
        metavar="NAME@CANDIDATE | stop NAME@CANDIDATE | status",
        help="start the candidate's shadow (with --of), stop it at each owner's next lease "
        "renewal (its figures stay), or show every shadow with the fleet's figures",
    )
    p.add_argument("--of", metavar="NAME@LIVE", help="the live version it runs beside")
    p.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="the share of the live version's episodes shadowed, chosen by episode id (default: 1)",
    )
    p = command("forget", cmd_forget, "remove a dead node's record and its devices")
    p.add_argument("node", help="the node id (as in affinity nodes)")
    command(
        "new-fleet",
        cmd_new_fleet,
        "mark an empty Redis that never served a fleet as new (no grace period for its "
        "first claims); never after Redis lost a running fleet's data",
    )


def add_episode_commands(command: AddCommand) -> None:
    """The subcommands about episodes and the devices they run on, and the event stream."""
    p = command("episodes", cmd_episodes, "live assignments")
    p.add_argument("--device", help="only this device")
    p.add_argument("--node", help="only this node's devices")
    p = command("show", cmd_show, "one episode's assignment (exit 1 when it has none)")
    p.add_argument("episode", help="the episode id")
    p = command(
        "drain", cmd_drain, "stop new episodes on devices; their episodes stay (but --move)"
    )
    p.add_argument("device", nargs="+", help="one or more devices (a node's: drain them together)")
    p.add_argument("--reason", default="", help="recorded on the device and in the event")
    p.add_argument(
        "--move",
        action="store_true",
        help="and move its episodes to other devices with their state, at each node's next "
        "lease renewal (within a third of its lease); waits for the moves and says what "
        "became of each episode (exit 1 when one stayed)",
    )
    p.add_argument(
        "--wait",
        type=non_negative,
        default=30,
        metavar="SECONDS",
        help="with --move: how long to wait for the moves (default 30; 0 returns at once)",
    )
    p = command(
        "move",
        cmd_move,
        "move an episode to another device with its state, at its owner's next lease renewal",
    )
    p.add_argument("episode", help="the episode id")
    p.add_argument(
        "--to",
        metavar="TARGET",
        help="a node or a device serving the episode's model (default: any with room)",
    )
    p = command("undrain", cmd_undrain, "let devices take new episodes again")
    p.add_argument("device", nargs="+", help="one or more devices (as in affinity devices)")
    p = command("release", cmd_release, "end an episode's assignment (its next step claims anew)")
    p.add_argument("episode", help="the episode id")
    p = command("events", cmd_events, "the event stream: claim, release, drain, node-up, ...")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument(
        "--since",
        type=stream_id,
        help="events after this stream id (- for the oldest kept); default: the latest --count",
    )
    p.add_argument("--count", type=non_negative, default=20, help="how many (default: 20)")
    p.add_argument("--max-events", type=non_negative, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = argparse.ArgumentParser(
        prog="affinity",
        description="Inspect and operate an affinity deployment through its Redis.",
        epilog="exit codes: 0 ok, 1 not found, 2 usage, 3 Redis unreachable or failing",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"affinity {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(run=run)
        return p

    add_fleet_commands(command)
    add_episode_commands(command)
    return parser


# -- entry point ----------------------------------------------------------------------------


def shown_url(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


async def run(args: argparse.Namespace, settings: Settings, out: TextIO) -> int:
    assert settings.redis_url is not None
    client = connect(settings)
    try:
        ctx = Context(
            Registry(client, settings),
            Inventory(client, settings),
            EventStream(client, settings),
            Models(client, settings),
            Claims(client, settings),
            args.json,
            out,
            shown_url(settings.redis_url),
        )
        command: Command = args.run
        try:
            return await command(args, ctx)
        except (UnknownEpisode, UnknownDevice, UnknownNode):
            await ctx.require_deployment()  # say so when nothing is registered at all
            raise
    finally:
        await close(client)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``affinity`` command line; returns the exit code (``sys.exit(main())``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse exits 2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.json = getattr(args, "json", False)
    url = getattr(args, "redis", None) or os.environ.get("AFFINITY_REDIS_URL") or DEFAULT_REDIS_URL
    namespace = getattr(args, "namespace", None)

    def fail(code: int, message: str) -> int:
        print(f"affinity: {message}", file=sys.stderr)
        return code

    try:
        settings = Settings.from_env(redis_url=url, namespace=namespace)
        return asyncio.run(run(args, settings, sys.stdout))
    except KeyboardInterrupt:
        return EXIT_OK if args.command == "events" else 130
    except (
        UnknownEpisode,
        UnknownDevice,
        UnknownNode,
        UnknownModel,
        StaleToken,
        NothingRegistered,
        TargetServesOther,
    ) as exc:
        return fail(EXIT_NOT_FOUND, str(exc))
    except (InvalidArgument, ValueError) as exc:
        return fail(EXIT_USAGE, str(exc))
    except BrokenPipeError:
        # The reader went away (``affinity events -f | head``): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (BackendUnavailable, RedisError, OSError, TimeoutError) as exc:
        reason = str(exc) if isinstance(exc, BackendUnavailable) else failure(exc)
        return fail(EXIT_REDIS, f"cannot reach Redis at {shown_url(url)}: {reason}")


if __name__ == "__main__":
    sys.exit(main())
