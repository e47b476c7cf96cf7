"""The node's wiring, read from its source (issue 42 item 20): parts receive their
collaborators in their constructors, the dispatcher takes a few settings objects, and the
doors of ``/internal/*`` are the one place that checks the cluster secret and decodes what
another node sends."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from node import dispatcher
from node.config import NodeConfig
from node.startup import _step_settings

NODE = Path(__file__).resolve().parent.parent / "node"

COLLABORATORS = {
    "listener", "placement", "recorder", "scores",
    "carry", "moved_away", "adopt", "ghost_contracts",  # the mover's ghost hooks once
}  # fmt: skip
"""Attributes that hold a collaborator (besides hooks, named ``on_*``)."""
SETTINGS = ("CrashSettings", "BatchSettings", "ChunkSettings", "WorkerHooks")


def _sources() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(NODE.parent)): ast.parse(path.read_text(), str(path))
        for path in sorted(NODE.rglob("*.py"))
        if "/pb/" not in str(path)
    }


def _connected_afterwards(tree: ast.Module) -> list[str]:
    """``obj.attr = ...`` where ``obj`` is not ``self`` and ``attr`` names a collaborator
    or a hook: a part connected after it was built."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                targets.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets.append(node.target)
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            own = isinstance(target.value, ast.Name) and target.value.id == "self"
            hook = target.attr.startswith("on_") or target.attr in COLLABORATORS
            if not own and hook:
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def test_no_node_module_connects_a_part_after_building_it() -> None:
    """Settings at the top, parts built whole (docs: STYLE.md): nothing in ``node/`` sets
    another object's hook or collaborator (``lease.listener = ...``, ``dev.on_run = ...``,
    ``resolver.placement = ...``); each is a constructor argument."""
    found = {
        path: where for path, tree in _sources().items() if (where := _connected_afterwards(tree))
    }
    assert found == {}


def test_the_check_finds_a_part_connected_afterwards() -> None:
    tree = ast.parse(
        "def wire(self, lease, owner):\n"
        "    lease.listener = owner.flusher\n"
        "    self._records.recorder = owner\n"
        "    self.on_x = owner\n"
        "    record.doubt = True\n"
    )
    assert _connected_afterwards(tree) == [
        "line 2: lease.listener",
        "line 3: self._records.recorder",
    ]


def test_the_dispatcher_takes_a_few_settings_objects() -> None:
    """``MultiGpuDispatcher`` takes its flags as four small frozen objects, not 20 keyword
    arguments; ``node/startup.py`` builds the shared ones once for the live and the
    candidate dispatchers."""
    named = [
        p.name
        for p in inspect.signature(dispatcher.MultiGpuDispatcher).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert named == [
        "crashes",
        "batching",
        "chunks",
        "hooks",
        "recorder",
        "table",
        "arrivals",
        "clock",
        "model",
    ]
    settings = [getattr(dispatcher, name, None) for name in SETTINGS]
    for one in settings:
        assert dataclasses.is_dataclass(one) and one.__dataclass_params__.frozen  # type: ignore[attr-defined]
    config = NodeConfig(
        "n", "http://n.test", failure_threshold=5, cooldown_s=7.0, max_batch=2, batch_delay_us=9.0,
        execute_steps=3, ensemble="none", ensemble_decay=0.5, control_hz=20.0,
    )  # fmt: skip
    crashes, batching, chunks, _ = settings
    assert _step_settings(config) == (
        crashes(5, 7.0),
        batching(2, 9.0),
        chunks(3, "none", 0.5, 20.0),
    )


def _functions_comparing_a_secret(tree: ast.Module) -> list[str]:
    """Functions that call ``compare_digest`` and read a name with ``secret`` in it."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names = {
            n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Attribute | ast.Name)
        }
        if "compare_digest" in names and any("secret" in n.lower() for n in names):
            found.append(fn.name)
    return found


def test_one_place_checks_the_cluster_secret() -> None:
    """The doors of ``/internal/*`` check the cluster secret in one function
    (``node/protocols/internal.py``'s ``admit``), not each handler and part its own copy."""
    found = {
        path: names
        for path, tree in _sources().items()
        if (names := _functions_comparing_a_secret(tree))
    }
    assert found == {"node/protocols/internal.py": ["admit"]}
    refusals = [
        path
        for path, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == "bad_secret"
        if path != "node/router.py"  # the router reads the code in an owner's answer
    ]
    assert refusals == ["node/protocols/internal.py"]


def test_only_the_door_decodes_what_another_node_sends() -> None:
    """A forward (``Forward.decode``), a ghost step (``GhostStep.decode``) and a hand-over's
    message (``decode_move``) are decoded by the door, ``node/protocols/internal.py``; the
    owner, the shadow runner and the mover take them decoded."""
    calls = sorted(
        {
            path
            for path, tree in _sources().items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and ast.unparse(node.func)
            in ("Forward.decode", "GhostStep.decode", "decode_move", "decode_install")
        }
    )
    assert calls == ["node/protocols/internal.py"]


def test_the_front_doors_check_a_steps_options_in_one_place() -> None:
    """``/act``, openpi and KServe take a step's chunk mode and real-time-chunking values
    through one ``NodeService.options_for``, not each its own copy of "the local
    dispatcher's ``mode_for``, then ``rtc_for``"."""
    calls = sorted(
        f"{path}: {ast.unparse(node.func)}"
        for path, tree in _sources().items()
        if path.startswith("node/protocols/")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("mode_for", "rtc_for", "options_for")
    )
    assert calls == [
        "node/protocols/act.py: service.options_for",
        "node/protocols/kserve/request.py: service.options_for",
        "node/protocols/openpi.py: service.options_for",
    ]


def test_the_affinity_package_loads_its_names_on_first_use() -> None:
    """``import affinity`` (what ``node.errors`` and so every front and device worker
    imports) loads no submodule; each public name is found where ``_WHERE`` says."""
    code = (
        "import sys, affinity; "
        "print(sorted(m for m in sys.modules if m.startswith(('affinity.', 'redis', 'httpx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    import affinity

    assert sorted(affinity._WHERE) == sorted(affinity.__all__)
    for name in affinity.__all__:
        value = getattr(affinity, name)
        assert getattr(value, "__module__", "").startswith("affinity."), name
    with pytest.raises(AttributeError):
        affinity.NoSuchName  # noqa: B018


def test_a_front_process_loads_no_redis_client_nor_onnxruntime_to_start() -> None:
    """What a front runs (the fork server loads it before it forks one, and a front shares
    it) imports neither redis-py (an episode id is checked by ``affinity.keys``), nor ONNX
    Runtime (it checks inputs against a contract its core taught it; ``node.contract``
    imports ONNX Runtime where a model is read: 17 MiB of RSS a front). (httpx it needs at
    once: the forwards from other nodes reach the core through it, and made lazily it
    slowed the first forward of each front.)"""
    code = (  # what the fork server loads before it forks a front (node/forkserver.py)
        "import sys; from node.forkserver import _preload; _preload(); "
        "print(sorted(m for m in sys.modules if m.startswith(('redis', 'onnxruntime'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from affinity import check_episode
    from affinity.claims import check_episode as claims_check

    assert check_episode is claims_check  # still importable where it was
