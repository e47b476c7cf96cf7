"""What the fleet view behind the ``affinity_fleet_*`` gauges (``node/signals.py``) costs Redis.

Idle ``affinity-node`` processes on one real ``redis-server``, measured the same way twice:
with ``--fleet-view-every PERIOD`` and with the view off (0). Each measurement is the
``INFO commandstats`` delta over ``--seconds`` (calls and Redis CPU µs; the bench's own
``INFO`` excluded); the difference is what the view adds. Expected per period: 3 commands
from every node (``SET NX PX``, ``GET``, ``TIME`` in one round trip) and one read of the
fleet by that period's reader (the route, the live nodes, one ``HMGET`` per live node, one
``ZCOUNT`` per listed device, the ``SET`` of the result), 4N + D + 3 commands for N nodes
and D devices; were every node to read the fleet itself, N x (N + D + 6).

Usage: python -m bench.signals [--nodes 4] [--devices 4] [--period 1] [--seconds 20]
"""

from __future__ import annotations

import argparse
import time

import redis

from affinity import Keys
from bench.common import Node, RedisServer, report, tmpdir


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, Redis CPU µs) so far."""
    stats = r.info("commandstats")
    return {
        k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for k, v in stats.items()
        if k != "cmdstat_info"
    }


def measure(
    server: RedisServer, nodes: int, devices: int, period: float, seconds: float
) -> tuple[float, float, dict[str, float]]:
    """Commands/s, Redis CPU µs/s and commands/s by command of ``nodes`` idle nodes."""
    tmp = tmpdir()
    extra = ["--fleet-view-every", str(period), "--lease-ttl", "10"]
    started = [
        Node(tmp, f"v{i}", server.url, devices=f"cpu:{devices}", extra=extra) for i in range(nodes)
    ]
    r = server.client()
    try:
        for n in started:
            n.start(timeout=120)
        time.sleep(2.0)  # past the start-up's registrations and first reads
        before = commandstats(r)
        time.sleep(seconds)
        after = commandstats(r)
    finally:
        for n in started:
            n.stop()
        r.flushdb()  # the next nodes find a new fleet (no lease of these left to wait out)
        r.set(Keys().fleet, "0")
        r.close()
    delta = {k: (c - before.get(k, (0, 0))[0], u - before.get(k, (0, 0))[1])
             for k, (c, u) in after.items()}  # fmt: skip
    calls = sum(c for c, _ in delta.values()) / seconds
    usec = sum(u for _, u in delta.values()) / seconds
    by = {k: c / seconds for k, (c, _) in delta.items() if c}
    return calls, usec, by


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--devices", type=int, default=4, help="devices per node")
    p.add_argument("--period", type=float, default=1.0, help="--fleet-view-every (s)")
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    server = RedisServer(tmpdir()).start()
    try:
        on, on_usec, on_by = measure(server, a.nodes, a.devices, a.period, a.seconds)
        off, off_usec, off_by = measure(server, a.nodes, a.devices, 0, a.seconds)
    finally:
        server.stop()
    n, d = a.nodes, a.nodes * a.devices
    added = on - off
    expected = (4 * n + d + 3) / a.period
    each_reads = n * (n + d + 6) / a.period
    by = {k: round(on_by.get(k, 0) - off_by.get(k, 0), 2) for k in sorted(on_by | off_by)}
    print(f"commands/s by command, view on - off: {by}")
    report(
        "signals",
        [
            {
                "figure": f"Redis commands/s the fleet view adds, {n} nodes x {a.devices} "
                f"devices, every {a.period:g} s (view on - off, same run)",
                "result": f"{added:.1f}/s ({on:.1f} vs {off:.1f}); expected "
                f"(4N + D + 3)/period = {expected:.1f}/s; were every node to read the "
                f"fleet: {each_reads:.1f}/s",
                "goal": "within 10% of 4N + D + 3 a period",
                "ok": abs(added - expected) <= 0.1 * expected,
            },
            {
                "figure": "Redis CPU the fleet view adds (INFO commandstats usec)",
                "result": f"{on_usec - off_usec:.0f} µs/s ({on_usec:.0f} vs {off_usec:.0f})",
                "goal": "reported",
                "ok": True,
            },
        ],
        {"by_command": by},
    )


if __name__ == "__main__":
    main()
