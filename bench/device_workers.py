"""``--device-workers process`` (issue 43's third slice) against the default ``thread``: two
nodes, ``--devices cpu:2``, one of each mode, each on its own Redis, driven in turn in every
round (which one goes first alternates), for each model in turn.

Per model (``demo``: an 8-float observation; ``vla-demo``: two 224x224 camera images), every
figure a median over ``--runs`` rounds of the process / thread ratio measured in the same
round, with both raw values (each the median of its own; on a busy machine the two medians'
quotient can differ from the median ratio):

1. load: 16 robots, each one episode stepped in lockstep on ``/act`` (msgpack bodies in
   the openpi array encoding; wrk with one thread and one connection per robot, so no two
   steps of an episode overlap), for ``--seconds``: steps/s, p50 and p99;
2. lockstep: one robot alone (wrk, one connection): p50 and p99, the latency a robot sees;
3. CPU per step under the load (``/proc/<pid>/stat`` utime + stime deltas): the core's
   alone, and every process of the node together (core, device worker processes, fronts);
4. context switches per step, under the load and of one robot alone
   (``/proc/<pid>/task/*/status``, every thread of every process of the node): the
   wake-ups a hop adds;
5. Redis commands per step under the load (``INFO commandstats`` deltas, INFO not counted,
   summed over every round): a sticky step sends none, so this is the background (lease
   renewals, the fleet view), the same for both;
6. RSS of every process once the rounds are over (core first, then each worker process,
   then any front), and the node's total.

``--front-doors 2`` gives both nodes two fronts: then the ratio is fronts + worker
processes / fronts alone. wrk runs beside the nodes on the same cores: the header gives the
machine's cores and load.

Usage: python -m bench.device_workers [--runs 3] [--seconds 4] [--lockstep-seconds 2]
       [--robots 16] [--models demo,vla-demo] [--front-doors 1]
(wrk: ``bash .ci/run --print-packages`` lists it; else ``apt-get install -y wrk``)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from affinity import wire
from bench.act import EXTRA
from bench.common import Node, RedisServer, cpu_seconds, median, options, report, tmpdir, wrk
from bench.fronts import family, rss_mib
from bench.gpu_act import sample
from node.contract import load_contract
from node.models import MODELS_DIR

MODES = ("thread", "process")
FILES = {"demo": "demo_policy", "vla-demo": "vla_demo"}
"""The node's --model name -> its ONNX file in node/models."""


def write_bodies(model: str, robots: int, into: Path) -> None:
    """``body-<i>.bin``: robot i's /act body (episode ``robot-<i>``), msgpack."""
    contract = load_contract(MODELS_DIR / f"{FILES[model]}.onnx")
    rng = np.random.default_rng(0)
    specs = {s.name: {"shape": s.shape, "dtype": s.dtype} for s in contract.observation_inputs}
    for i in range(robots):
        inputs = {name: sample(spec, rng) for name, spec in specs.items()}
        (into / f"body-{i}.bin").write_bytes(
            wire.encode({"episode_id": f"robot-{i}", "inputs": inputs})
        )


def robots_lua(bodies: Path) -> str:
    """wrk's script: thread i (one connection each) sends ``body-<i>.bin`` again and
    again, so each thread is one robot in lockstep."""
    return f"""
local threads = 0
setup = function(thread)
  thread:set("id", threads)
  threads = threads + 1
end
init = function(args)
  local f = assert(io.open("{bodies}/body-" .. id .. ".bin", "rb"))
  local body = f:read("*a")
  f:close()
  req = wrk.format("POST", "/act", {{["Content-Type"] = "application/msgpack",
                                     ["Accept"] = "application/json"}}, body)
end
request = function()
  return req
end
"""


def processes(node: Node) -> dict[str, list[int]]:
    """The node's processes: ``core`` (one), ``workers`` (``node.deviceproc``), ``fronts``."""
    assert node.proc.popen is not None
    core = node.proc.popen.pid
    found: dict[str, list[int]] = {"core": [core], "workers": [], "fronts": []}
    for pid in family(core)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        found["workers" if b"node.deviceproc" in argv else "fronts"].append(pid)
    return found


def switches(pid: int) -> int:
    """Context switches so far of every thread of ``pid`` (voluntary: a wait for a wake-up;
    and not: preempted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except OSError:  # a thread that ended
            continue
        total += sum(int(ln.split()[1]) for ln in lines if "ctxt_switches:" in ln)
    return total


def commands(r: redis.Redis) -> int:
    """Commands Redis has run so far, INFO not counted."""
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def measure(node: Node, r: redis.Redis, script: str, robots: int, seconds: float,
            lockstep_s: float) -> dict[str, float]:  # fmt: skip
    """One round of one node: the load, then one robot alone."""
    pids = processes(node)
    every = [p for group in pids.values() for p in group]
    cpu0 = {p: cpu_seconds(p) for p in every}
    switches0 = sum(switches(p) for p in every)
    cmds0 = commands(r)
    run = wrk(node.url, script, duration_s=seconds, connections=robots, threads=robots)
    cmds = commands(r) - cmds0
    cpu = {p: cpu_seconds(p) - cpu0[p] for p in every}
    switched = sum(switches(p) for p in every) - switches0
    switches0 = sum(switches(p) for p in every)
    alone = wrk(node.url, script, duration_s=lockstep_s, connections=1, threads=1)
    switched_alone = sum(switches(p) for p in every) - switches0
    steps = max(run.requests, 1)
    return {
        "rps": run.rps,
        "p50": run.p50,
        "p99": run.p99,
        "cpu_core_us": cpu[pids["core"][0]] / steps * 1e6,
        "cpu_all_us": sum(cpu.values()) / steps * 1e6,
        "redis_commands": cmds,
        "steps": steps,
        "switches_per_step": switched / steps,
        "p50_1": alone.p50,
        "p99_1": alone.p99,
        "switches_per_step_1": switched_alone / max(alone.requests, 1),
    }


FIGURES = (
    # key, label, scale, unit, goal (issue 43's, where it sets one: the ratio's bound)
    ("rps", "throughput, {robots} robots in lockstep", 1, "steps/s", (">=", 1.0)),
    ("p50", "p50 under that load", 1e3, "ms", None),
    ("p99", "p99 under that load", 1e3, "ms", None),
    ("p50_1", "lockstep p50, one robot alone", 1e3, "ms", ("<=", 1.05)),
    ("p99_1", "lockstep p99, one robot alone", 1e3, "ms", None),
    ("cpu_core_us", "CPU per step under the load, the core alone", 1, "µs", None),
    ("cpu_all_us", "CPU per step under the load, every process of the node", 1, "µs", None),
    ("switches_per_step", "context switches per step under the load, every process", 1, "",
     None),
    ("switches_per_step_1", "context switches per step, one robot alone, every process", 1, "",
     None),
)  # fmt: skip
"""Goals: throughput not below the threads' (issue 43 asks 1.4x of the whole multi-process
shape; the worker processes alone are not its fronts), lockstep p50 within 1.05x."""


def bench_model(a: Any, model: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Both nodes serving ``model``, ``a.runs`` rounds: the figures and the raw rounds."""
    tmp = tmpdir()
    bodies = tmp / f"bodies-{model}"
    bodies.mkdir()
    write_bodies(model, a.robots, bodies)
    script = robots_lua(bodies)
    redises = {m: RedisServer(tmp).start() for m in MODES}  # a fleet each: no forwards
    extra = ["--model", model, "--capacity", "1000", "--lease-ttl", "30", "--access-log", "off",
             "--front-doors", str(a.front_doors), *EXTRA]  # fmt: skip
    nodes = {
        m: Node(tmp, f"{m}-{model}", redises[m].url, devices="cpu:2",
                extra=[*extra, "--device-workers", m])
        for m in MODES
    }  # fmt: skip
    rounds: list[dict[str, dict[str, float]]] = []
    rss: dict[str, dict[str, list[float]]] = {}
    try:
        for m, node in nodes.items():
            node.start(timeout=120)
            want = a.front_doors if a.front_doors > 1 else 0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the fronts and the worker processes up
                got = processes(node)
                if len(got["fronts"]) >= want and len(got["workers"]) >= 2 * (m == "process"):
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"node {m}: its processes did not all start: {got}")
        clients = {m: redises[m].client() for m in MODES}
        for node in nodes.values():  # warm: claims, sessions, connections
            wrk(node.url, script, duration_s=1, connections=a.robots, threads=a.robots)
        for k in range(a.runs):
            got_round = {}
            for m in MODES if k % 2 == 0 else MODES[::-1]:
                got_round[m] = measure(nodes[m], clients[m], script, a.robots, a.seconds,
                                       a.lockstep_seconds)  # fmt: skip
            rounds.append(got_round)
            print(model, k, {m: {x: round(y, 6) for x, y in v.items()}
                             for m, v in got_round.items()}, flush=True)  # fmt: skip
        for m, node in nodes.items():
            rss[m] = {g: [round(rss_mib(p), 1) for p in pids]
                      for g, pids in processes(node).items()}  # fmt: skip
    finally:
        for node in nodes.values():
            node.stop()
        for server in redises.values():
            server.stop()

    def med(mode: str, key: str) -> float:
        return median([r[mode][key] for r in rounds])

    fronts = f", {a.front_doors} fronts each" if a.front_doors > 1 else ""
    figures = []
    for key, label, scale, unit, goal in FIGURES:
        ratio = median([r["process"][key] / r["thread"][key] for r in rounds])
        p, t = med("process", key) * scale, med("thread", key) * scale
        ok = goal is None or (ratio >= goal[1] if goal[0] == ">=" else ratio <= goal[1])
        figures.append({
            "figure": f"{model}: {label.format(robots=a.robots)}, process / thread{fronts}",
            "value": ratio,
            "result": f"{ratio:.2f}x ({p:.4g} vs {t:.4g}{' ' + unit if unit else ''})",
            "goal": "reported" if goal is None else f"{goal[0]} {goal[1]:g}x",
            "ok": ok,
        })  # fmt: skip
    # a step on a sticky episode sends Redis nothing: what is counted is the background
    # (lease renewals, the fleet view), a few commands a second, so over every round's steps
    redis_per_step = {m: sum(r[m]["redis_commands"] for r in rounds) /
                      sum(r[m]["steps"] for r in rounds) for m in MODES}  # fmt: skip
    p, t = redis_per_step["process"], redis_per_step["thread"]
    figures.append({
        "figure": f"{model}: Redis commands per step under the load, every round's together, "
        f"process / thread{fronts}",
        "value": p / t if t else None,
        "result": (f"{p / t:.2f}x " if t else "") + f"({p:.4f} vs {t:.4f})",
        "goal": "unchanged: at most 0.01 per step more (none on a sticky step's path)",
        "ok": p - t <= 0.01,
    })  # fmt: skip
    totals = {m: sum(sum(v) for v in rss[m].values()) for m in MODES}
    shown = {
        m: "core " + "+".join(map(str, rss[m]["core"]))
        + "".join(f", {g} " + "+".join(map(str, rss[m][g])) for g in ("workers", "fronts")
                  if rss[m][g])
        + f" = {totals[m]:.0f}"
        for m in MODES
    }  # fmt: skip
    figures.append({
        "figure": f"{model}: RSS of every process (MiB), total process / thread{fronts}",
        "value": totals["process"] / totals["thread"],
        "result": f"{totals['process'] / totals['thread']:.2f}x (process: {shown['process']}; "
        f"thread: {shown['thread']})",
        "goal": "reported",
        "ok": True,
    })  # fmt: skip
    return figures, {"rounds": rounds, "rss_mib": rss}


def main() -> None:
    a = options(runs=3, seconds=4.0, lockstep_seconds=2.0, robots=16,
                models=("demo,vla-demo", "the node's --model names, in turn"),
                front_doors=(1, "both nodes' --front-doors"))  # fmt: skip
    load = os.getloadavg()
    print(f"cores {os.cpu_count()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"--devices cpu:2, --front-doors {a.front_doors}, {a.runs} rounds of "
          f"{a.seconds:g} s load + {a.lockstep_seconds:g} s lockstep", flush=True)  # fmt: skip
    figures: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for model in a.models.split(","):
        got, raw[model] = bench_model(a, model)
        figures += got
    name = "device_workers" if a.front_doors == 1 else f"device_workers_fronts{a.front_doors}"
    report(name, figures, {"raw": raw, "cores": os.cpu_count(), "load_before": load,
                           "load_after": os.getloadavg()})  # fmt: skip
    after = os.getloadavg()
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")


if __name__ == "__main__":
    main()
