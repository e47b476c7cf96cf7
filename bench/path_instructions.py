"""The node's request path in CPU instructions: what one sticky ``POST /act`` costs, counted
by callgrind, so that two versions of the node compare to a fraction of 1% on a busy machine.

``bench/path.py`` times the same steps by the clock; on a shared 2-core machine its rounds
move by a few µs, more than a 1% budget. An instruction count does not depend on the load.
This runs itself under ``valgrind --tool=callgrind`` (``PYTHONHASHSEED=0``): the node's
ASGI app of ``bench/asgi.py`` in process, 64 episodes in turn, warmed up, then ``--steps``
sticky steps through the node and as many through the minimal app of
``bench/baseline_app.py``. Counting starts at a call of ``getppid(2)`` and each loop's
count is written out at a call of ``getpgrp(2)`` (libc functions the node never calls), so
start-up and warm-up are not counted. Only the event loop's thread is counted
(``--separate-threads``): every step runs there, inline, and the other threads only wait.
It prints instructions (callgrind's ``Ir``) per step of the node, of the minimal app, and
their difference. Repeated runs of one version agree to ~0.3% (the garbage collector's
rarer passes fall in one run's loop and not in another's); compare several.

Under callgrind a step takes ~50x as long, so what the node does by the clock would be
counted ~50x as often per step. The driver keeps it out: every step runs inline
(``inline_under_us`` at its most; else the worker's hand-off would be counted instead), a
step may take 600 s, nothing lapses (lease and episode TTLs of an hour), and the fleet's
model list is not re-read (``node.catalog.REFRESH_S``). So no measured step lets the event
loop turn, and no timer's work (the lease, the once-a-second upkeep) is counted. A loop that
turned anyway is named in a warning.

To compare with an older commit, run this same file there: ``git worktree add --detach
/tmp/before COMMIT``, copy ``bench/path_instructions.py`` and ``bench/asgi.py`` in (at
2f4ab4d ``build_service`` was imported from ``node.main``, and ``bench.common`` had no
``options``) and run it with that tree on ``PYTHONPATH``.

Usage: python -m bench.path_instructions [--steps 2000] [--warmup 640] [--dumps DIR]
(``--dumps``: keep callgrind's files there, for ``callgrind_annotate``)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop

import node.catalog as catalog
from affinity import Settings
from bench.asgi import Connection, post, running_node
from bench.common import options, report

BODY = b'{"episode_id":"ep-%d","inputs":{"obs":[[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]]}}'
EPISODES = 64
JSON = [(b"content-type", b"application/json")]
COUNTED = "AFFINITY_BENCH_COUNTED"  # in the child callgrind runs: where to say what turned


async def _steps(app: Any, steps: int, connection: Connection) -> None:
    for n in range(steps):
        await post(app, "/act", BODY % (n % EPISODES), JSON, connection)


async def _counted(steps: int, warmup: int, turned_to: Path) -> None:
    import bench.baseline_app as baseline  # builds its session on import

    connection = Connection()
    settings = Settings(lease_ttl_s=3600, episode_ttl_s=3600, redis_deadline_s=600)
    config = {"inline_under_us": 1_000_000, "act_deadline_s": 600.0, "settings": settings}
    loop = asyncio.get_running_loop()
    async with running_node(**config) as app:
        await _steps(app, warmup, connection)
        await _steps(baseline.app, warmup, connection)
        catalog.REFRESH_S = float("inf")
        turned: list[str] = []
        os.getppid()  # callgrind: counts from zero
        for name, served in (("node", app), ("minimal app", baseline.app)):
            mark: list[bool] = []
            loop.call_soon(mark.append, True)  # runs only if the loop turns
            await _steps(served, steps, connection)
            turned += [name] if mark else []
            os.getpgrp()  # callgrind: these steps' count written out, counts from zero
    turned_to.write_text(", ".join(turned))


def _instructions(path: Path) -> int:
    """The ``Ir`` of one callgrind dump (its ``summary``)."""
    for line in path.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {path}")


def main() -> None:
    a = options(steps=2000, warmup=10 * EPISODES, dumps="")
    if os.environ.get(COUNTED):
        uvloop.run(_counted(a.steps, a.warmup, Path(os.environ[COUNTED])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.dumps or tmp).resolve() / "callgrind.out"
        subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                "--zero-before=getppid", "--dump-before=getpgrp", "--dump-instr=no",
                "--separate-threads=yes", f"--log-file={out.parent / 'valgrind.log'}",
                sys.executable, "-m", "bench.path_instructions",
                f"--steps={a.steps}", f"--warmup={a.warmup}",
            ],
            env={**os.environ, COUNTED: str(out.parent / "turned"), "PYTHONHASHSEED": "0"},
            check=True,
        )  # fmt: skip
        # callgrind.out.PART-THREAD: the node's loop is part 1, the minimal app's part 2
        node, base = (_instructions(out.with_name(f"{out.name}.{p}-01")) / a.steps for p in (1, 2))
        turned = (out.parent / "turned").read_text()
    if turned:
        print(f"warning: the event loop turned during the steps of: {turned}")
    report(
        "path_instructions",
        [
            {
                "figure": "sticky /act in process, instructions per step, node's ASGI app",
                "value": node,
                "result": f"{node:,.0f} Ir ({base:,.0f} Ir the minimal app)",
                "goal": "reported",
                "ok": True,
            },
            {
                "figure": "what the node's request path adds per step (node - minimal app)",
                "value": node - base,
                "result": f"{node - base:+,.0f} Ir",
                "goal": "reported",
                "ok": True,
            },
        ],
        {"steps": a.steps, "warmup": a.warmup, "node_ir": node, "base_ir": base, "turned": turned},
    )


if __name__ == "__main__":
    main()
