"""A front process checks a step's inputs (``node/checks.py``'s ``Checks``: ``/act``,
KServe over HTTP and gRPC, openpi frames) against the input check its core taught it
(``PolicyContract.input_check``), and the core takes inputs checked against its own
contract's check as they are (``node/inputs.py``'s ``Checked`` and ``trusted``); what a
front does not check reaches the core as one process reads it. Driven in one process: a
``FrontApp`` whose hop hands each request, packed and unpacked as the hop's header is, to
the core's ``serve_request`` of an in-process node."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import fakeredis
import hypothesis.extra.numpy as hnp
import numpy as np
import orjson
import pytest
import tritonclient.http as th
from hypothesis import given, settings
from hypothesis import strategies as st

from affinity import wire
from node import fronts, inputs
from node.checks import Checks
from node.contract import PolicyContract, TensorSpec, checking_contract, load_contract
from node.errors import HopError, InvalidInput, Uncarried, Undelivered
from node.front import FrontApp, _observed, _outputs
from node.front import request as front_request
from node.hop import (
    TICKETS,
    CoreHop,
    FrontHop,
    Region,
    contiguous,
    lift,
    lower,
    pack,
    unpack,
)
from node.models import DEMO_MODEL, resolve_model
from node.protocols import act
from node.protocols.kserve import request as kserve_request
from node.protocols.kserve.body import (
    InferRequest,
    Row,
    _carried,
    _carry,
    check_name,
    request_meta,
)
from node.protocols.kserve.pb import kserve_pb2 as pb
from node.step import Reply
from tests.inproc import cluster, config
from tests.rollout import reference_rollout

DEMO = load_contract(DEMO_MODEL)
VLA = load_contract(resolve_model("vla-demo"))
assert DEMO.input_check is not None and VLA.input_check is not None
KEY = DEMO.input_check.key


class LoopHop:
    """A front's hop whose core is this process' node: each request's header goes through
    the hop's own packing (what a slot carries), the arrays as they are."""

    slot_wait_s = 5.0

    def __init__(self, service: Any) -> None:
        self.service = service
        self.conns: fronts.Connections = {}  # (openpi's connections, as a front's in the core)
        self.sent: list[tuple[dict[str, Any], list[np.ndarray]]] = []
        self.replies: list[dict[str, Any]] = []
        self.ahead: list[bool] = []  # each request's: sent again at once, ahead of the queue

    async def call(
        self, kind: int, meta: dict[str, Any], arrays: list[np.ndarray], use: Any,
        gone: Any = None, deliver: Any = None, hold: bool = False, ahead: bool = False,
        **_: Any,
    ) -> Any:  # fmt: skip
        self.ahead.append(ahead)
        header, _, total = pack(dict(meta), arrays)
        carried, _ = unpack(header, total)
        self.sent.append((carried, arrays))
        copies = [a.copy() for a in arrays]
        for copy in copies:
            copy.flags.writeable = False  # (as the core reads them out of the slot)
        reply, out = await fronts.serve_request(self.service, kind, carried, copies, 0,
                                                self.conns)  # fmt: skip
        reply.pop("keep", None)
        header, _, total = pack(dict(reply), out)
        answered, _ = unpack(header, total)
        self.replies.append(answered)
        result = use(kind, answered, out)
        if hold:  # (gRPC's: the caller settles it; nothing kept here to undo)
            return result, lambda delivered: None
        if deliver is not None and await deliver(result, None) is not True:
            raise Undelivered()  # (as FrontHop.call: a reply not handed over)
        return result


@asynccontextmanager
async def front() -> AsyncIterator[tuple[FrontApp, LoopHop, Any]]:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        service = nodes[0].service
        hop = LoopHop(service)
        app = FrontApp(hop, "/nonexistent.sock", {"max_body_bytes": 1 << 24, "max_rows": 8})  # type: ignore[arg-type]
        try:
            yield app, hop, service
        finally:
            await app.client.aclose()


async def post(app: FrontApp, body: Any, binary: bool) -> tuple[int, Any]:
    """``POST /act`` to the front's app: (status, decoded body)."""
    content = wire.encode(body) if binary else orjson.dumps(body)
    kind = b"application/msgpack" if binary else b"application/json"
    status, headers, body_bytes = await asgi_post(
        app, "/act", [(b"content-type", kind), (b"accept", kind)], content
    )
    packed = (b"content-type", b"application/msgpack") in headers
    return status, wire.decode(body_bytes) if packed else orjson.loads(body_bytes)


async def asgi_post(
    app: FrontApp, path: str, headers: list[tuple[bytes, bytes]], content: bytes
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``POST path`` to the front's ASGI app: the response's status, headers and body."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": headers}  # fmt: skip
    sent: list[dict[str, Any]] = []
    given = [{"type": "http.request", "body": content, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return given.pop() if given else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], sent[0]["headers"], body_bytes


def obs(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)


def said_by_one_process(contract: PolicyContract, raw: Any, binary: bool) -> str:
    try:
        (inputs.from_arrays if binary else inputs.from_json)(contract, raw)
    except InvalidInput as exc:
        return str(exc)
    raise AssertionError("taken")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_a_front_checks_inputs_once_taught_and_the_core_takes_them_as_they_are(
    binary: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step teaches the front its model's check (nothing checked there yet); the
    next are checked and converted in the front (float32, whatever JSON made of them), and
    the core serves them without checking them again: with its checks made to fail, the
    episode still steps, exactly once each, its outputs those of the model. A bad input is
    sent as it came, and the core refuses it in one process' words."""

    async def run() -> None:
        async with front() as (app, hop, _):
            xs = [obs(i) for i in range(4)]

            def body(i: int, value: Any = None) -> dict[str, Any]:
                x = xs[i] if value is None else value
                return {"episode_id": f"e-{binary}", "seq": i + 1,
                        "inputs": {"obs": x if binary else x.tolist()}}  # fmt: skip

            status, got = await post(app, body(0), binary)
            assert status == 200, got
            first = hop.sent[-1][0]
            assert "ok" not in first and "ck" not in first  # nothing known yet
            assert app.checks._known[None][0] == KEY  # taught by the reply

            def unused(*_: Any) -> Any:
                raise AssertionError("the core checked inputs the front had checked")

            # the core's input rule alone (the front's is node.front's own reference to it)
            monkeypatch.setattr(act, "inputs", SimpleNamespace(from_json=unused,
                                                               from_arrays=unused))  # fmt: skip
            for i in (1, 2):
                status, got = await post(app, body(i), binary)
                assert status == 200, got
                meta, arrays = hop.sent[-1]
                assert meta["ok"] is True and meta["ck"] == KEY and "chk" not in hop.replies[-1]
                assert [a.dtype for a in arrays] == [np.float32]
                assert got["seq"] == i + 1 and not got["replayed"]
                want = reference_rollout(DEMO_MODEL, xs[: i + 1])[-1]["actions"]
                np.testing.assert_allclose(
                    np.asarray(got["outputs"]["actions"]).reshape(want.shape), want, rtol=1e-5
                )
            monkeypatch.setattr(act, "inputs", inputs)
            short = np.zeros((1, 2), np.float32)
            status, got = await post(app, body(3, short), binary)
            meta, _ = hop.sent[-1]
            assert "ok" not in meta and meta["ck"] == KEY  # sent as it came
            raw = {"obs": short if binary else short.tolist()}
            assert status == 422 and got["error"]["message"] == said_by_one_process(
                DEMO, raw, binary
            )
            status, got = await post(app, body(3), binary)  # the episode goes on
            assert status == 200 and got["seq"] == 4, got

    asyncio.run(run())


def test_a_check_the_model_no_longer_has_is_refused_and_the_message_sent_again_unchecked() -> None:
    """A front holding a check that is not its model's any more (a rollout to a version of
    other inputs) sends rows checked against it: the core refuses the whole message before
    anything of it is applied or counted, teaches the front the model's check, and the
    front sends the message again unchecked. Each row is applied once, the degraded row
    counted once; the next message is checked against the new check."""

    async def run() -> None:
        async with front() as (app, hop, service):
            stale = {"batch_axis": True, "inputs": [["obs", "float64", ["batch", 8]]]}
            app.checks.learn([[None, "0123456789abcdef", stale]])
            degraded = service.metrics.degraded._value.get()
            name = next(iter(service.models))  # (named: not known to the front, not checked)
            rows = [
                {"session_id": "stale-b", "model": name, "inputs": {"obs": obs(2).tolist()}},
                {"episode_id": "stale-a", "seq": 1, "inputs": {"obs": obs(1).tolist()}},
            ]
            status, got = await post(app, {"steps": rows}, False)
            assert status == 200, got
            assert [r["seq"] for r in got["steps"]] == [1, 1], got
            checked, again = (meta for meta, _ in hop.sent[-2:])
            assert hop.replies[-2]["recheck"] and hop.ahead[-2:] == [False, True]
            assert sorted(lesson[1] for lesson in hop.replies[-2]["chk"]) == [KEY, KEY]
            assert ["ok" in r for r in checked["rows"]] == [False, True]
            assert all("ok" not in r and "ck" not in r for r in again["rows"])
            assert service.metrics.degraded._value.get() == degraded + 1  # (decoded twice)
            assert app.checks._known[None][0] == KEY == app.checks._known[name][0]
            rows[1]["seq"] = 2
            status, got = await post(app, {"steps": rows}, False)
            assert status == 200 and [r["seq"] for r in got["steps"]] == [2, 2], got
            meta, _ = hop.sent[-1]
            assert [r["ok"] for r in meta["rows"]] == [True, True] and len(hop.sent) == 3

    asyncio.run(run())


def test_a_model_whose_check_keeps_changing_is_not_checked_in_the_front_for_a_while() -> None:
    """Versions of different inputs stepped through one front in turn would cost every
    other step a second trip: at ``Checks.CHANGES`` changes within ``CHANGES_S``, the front
    stops checking that model (and only it), its rows saying the key it holds (so the core
    teaches it nothing more while that key is the model's), until that time has passed.
    The same lesson twice (replies of steps sent before it) is no change."""
    now = [0.0]
    checks = Checks(clock=lambda: now[0])
    docs = [{"batch_axis": True, "inputs": [["obs", dtype, ["batch", 8]]]}
            for dtype in ("float32", "float64")]  # fmt: skip
    body = {"model": "m", "inputs": {"obs": [[0.0] * 8]}}
    for turn in range(Checks.CHANGES + 1):  # the first lesson, then CHANGES changes
        for _ in range(3):  # (the same lesson again changes nothing)
            checks.learn([["m", f"key{turn % 2}", docs[turn % 2]], ["n", "keyn", docs[0]]])
        arrays: list[np.ndarray] = []
        checked = checks.row(body, False, arrays)
        assert checked is not None and bool(checked.get("ok")) is (turn < Checks.CHANGES), turn
    assert checked == {"ck": f"key{Checks.CHANGES % 2}"} and not arrays
    assert checks.row({"model": "n", "inputs": {"obs": [[0.0] * 8]}}, False, arrays) == {
        "in": [["n", "obs"]], "ck": "keyn", "ok": True,
    }  # fmt: skip
    now[0] = Checks.CHANGES_S + 1  # a change after that time: checked again
    checks.learn([["m", "key9", docs[0]]])
    assert checks.row(body, False, []) == {"in": [["n", "obs"]], "ck": "key9", "ok": True}


def test_pixels_that_conversion_would_grow_are_converted_in_the_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uint8 pixels sent to a float input would fill four times the slot converted, and
    so would msgpack lists of small integers: the front sends them as they came (``ck``
    only), the core converts them (a body that fits a slot still fits it)."""
    contract = PolicyContract((TensorSpec("image", ("batch", 4, 4, 3), "float32"),), (), {},
                              batch_axis=True)  # fmt: skip
    assert contract.input_check is not None
    checks = Checks()
    checks.learn([[None, contract.input_check.key, contract.input_check.doc]])
    arrays: list[np.ndarray] = []
    image = np.zeros((1, 4, 4, 3), np.uint8)
    real = inputs.from_arrays

    def unused(*_: Any) -> Any:
        raise AssertionError("converted in the front, to be thrown away")

    monkeypatch.setattr(inputs, "from_arrays", unused)
    assert checks.row({"inputs": {"image": image}}, True, arrays) == {
        "ck": contract.input_check.key
    }
    monkeypatch.setattr(inputs, "from_arrays", real)
    assert not arrays
    listed = {"inputs": {"image": image.tolist()}}
    assert checks.row(listed, True, arrays) == {"ck": contract.input_check.key} and not arrays
    assert checks.row(listed, False, arrays) is not None and arrays  # (JSON: 8 bytes a number)
    arrays.clear()
    same = checks.row({"inputs": {"image": image.astype(np.float64)}}, True, arrays)
    assert same is not None and same["ok"] and arrays[0].dtype == np.float32


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [],
        {"inputs": []},
        {"batch_axis": 1, "inputs": []},
        {"batch_axis": True, "inputs": [["obs", "float32"]]},
        {"batch_axis": True, "inputs": [["obs", "nope", [1]]]},
        {"batch_axis": True, "inputs": [["obs", "object", [1]]]},
        {"batch_axis": True, "inputs": [["obs", "float32", [1.5]]]},
        {"batch_axis": True, "inputs": [["obs", "float32", [-1]]]},
        {"batch_axis": True, "inputs": [["obs", "float32", []]]},
        {"batch_axis": False, "inputs": [["a", "int8", [2]], ["a", "int8", [2]]]},
        {"batch_axis": False, "inputs": [["control.start", "bool", [1]]]},
    ],
)
def test_an_input_check_a_front_cannot_read_is_refused_and_not_checked_against(
    doc: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A check the front cannot read is said once and held as its key alone: the rows of
    that model are sent unchecked, saying the key (so the core does not teach it again)."""
    with pytest.raises(ValueError):
        checking_contract(doc)
    checks = Checks()
    with caplog.at_level(logging.WARNING, logger="affinity.node"):
        checks.learn([[None, "k", doc]])
        checks.learn([[None, "k", doc]])
    assert len(caplog.records) == 1
    checks.learn([None, [1], [[], "k", doc], "junk"])  # (lessons of no shape: skipped)
    assert checks.row({"inputs": {"obs": [[0.0]]}}, False, []) == {"ck": "k"}
    checks.learn([[None, None, None]])  # the model is not checked here: forgotten
    assert checks.row({"inputs": {"obs": [[0.0]]}}, False, []) is None


def test_a_contract_with_a_string_input_has_no_front_check() -> None:
    contract = PolicyContract((TensorSpec("prompt", (1,), "object"),), (), {})
    assert contract.input_check is None


# --- the front's contract checks as the whole one ---------------------------------------

SYNTHETIC = PolicyContract(
    (
        TensorSpec("state_in.h", ("batch", 4), "float32"),
        TensorSpec("pos", ("batch", 3), "float64"),
        TensorSpec("grip", ("batch", "n"), "int16"),
        TensorSpec("flag", ("batch", 1), "bool"),
        TensorSpec("control.start", ("batch", 1), "bool"),
    ),
    (TensorSpec("state_out.h", ("batch", 4), "float32"),),
    {"state_in.h": "state_out.h"},
    batch_axis=True,
)
UNBATCHED = PolicyContract((TensorSpec("x", (2,), "uint8"), TensorSpec("y", (), "float16")), (), {})
CONTRACTS = [DEMO, VLA, SYNTHETIC, UNBATCHED]

_dtypes = st.sampled_from(["float16", "float32", "float64", "int8", "int16", "int64",
                           "uint8", "uint64", "bool"])  # fmt: skip
_values = st.one_of(
    hnp.arrays(_dtypes, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)),
    st.lists(st.one_of(st.floats(), st.integers(-(2**70), 2**70), st.booleans()), max_size=4),
    st.lists(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=4), min_size=1, max_size=2),
    st.none(),
    st.text(max_size=3),
)


def _raw(contract: PolicyContract, data: st.DataObject) -> dict[str, Any]:
    names = [s.name for s in contract.observation_inputs]
    extra = [n for n in (s.name for s in contract.inputs) if n not in names] + ["other"]
    chosen = data.draw(st.lists(st.sampled_from(names + extra), unique=True, max_size=5))
    if data.draw(st.booleans()):
        chosen = names  # (mostly the right names: the values are what is checked)
    raw: dict[str, Any] = {}
    for name in chosen:
        spec = next((s for s in contract.observation_inputs if s.name == name), None)
        if spec is not None and data.draw(st.booleans()):
            sizes = contract.step_spec(spec).shape
            shape = tuple(d if isinstance(d, int) else data.draw(st.integers(1, 3)) for d in sizes)
            dtype = data.draw(st.one_of(st.just(spec.dtype), _dtypes))
            raw[name] = np.full(shape, data.draw(st.integers(0, 300))).astype(dtype)
            if data.draw(st.booleans()):
                raw[name] = raw[name].tolist()
        else:
            raw[name] = data.draw(_values)
    return raw


@settings(max_examples=300, deadline=None)
@given(data=st.data(), which=st.integers(0, len(CONTRACTS) - 1), binary=st.booleans())
def test_the_fronts_contract_takes_and_converts_what_the_whole_contract_does(
    data: st.DataObject, which: int, binary: bool
) -> None:
    """What the core would take as the front checked it must be what it takes itself: the
    contract rebuilt from the check accepts exactly the inputs the whole contract accepts
    (state and control inputs named, wrong names, shapes, dtypes, values), converted alike."""
    contract = CONTRACTS[which]
    check = contract.input_check
    assert check is not None
    rebuilt = checking_contract(check.doc)
    assert rebuilt.input_check == check
    raw = _raw(contract, data)
    rule = inputs.from_arrays if binary else inputs.from_json
    if not binary:
        raw = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in raw.items()}
    results = []
    for c in (contract, rebuilt):
        try:
            results.append(rule(c, raw))
        except InvalidInput:
            results.append(None)
    whole, front_side = results
    assert (whole is None) == (front_side is None)
    if whole is not None and front_side is not None:
        assert list(whole) == list(front_side)
        for name, array in whole.items():
            assert array.dtype == front_side[name].dtype
            np.testing.assert_array_equal(array, front_side[name])


def test_a_stale_check_of_one_step_is_refused_and_the_step_sent_again_unchecked() -> None:
    """One msgpack step checked against a check no longer its model's (float16 then, float32
    now): the core answers ``recheck`` with the model's check, nothing applied, and the
    front sends it again as the client sent it; it is applied once."""

    async def run() -> None:
        async with front() as (app, hop, _):
            stale = {"batch_axis": True, "inputs": [["obs", "float16", ["batch", 8]]]}
            app.checks.learn([[None, "0123456789abcdef", stale]])
            x = obs(5)
            status, got = await post(app, {"episode_id": "one", "seq": 1, "inputs": {"obs": x}},
                                     True)  # fmt: skip
            assert status == 200 and got["seq"] == 1 and not got["replayed"], got
            (checked, arrays), (again, sent) = hop.sent
            assert checked["ok"] and arrays[0].dtype == np.float16  # as the stale check made it
            assert "ok" not in again and sent[0].dtype == np.float32  # as the client sent it
            assert hop.replies[0]["recheck"] and hop.replies[0]["chk"] == [
                [None, KEY, DEMO.input_check.doc]  # type: ignore[union-attr]
            ]
            want = reference_rollout(DEMO_MODEL, [x])[-1]["actions"]
            np.testing.assert_allclose(
                np.asarray(got["outputs"]["actions"]).reshape(want.shape), want, rtol=1e-5
            )

    asyncio.run(run())


def test_a_scalar_input_stays_a_scalar() -> None:
    """A 0-d input given as an array or a numpy scalar is a 0-d array of the model's dtype
    (``np.ascontiguousarray`` alone makes it 1-d, which the model refuses as a failed run)."""
    for value in (np.float64(1.5), np.array(1.5), np.array(2, np.int32)):
        got = inputs.from_arrays(UNBATCHED, {"x": np.zeros(2, np.uint8), "y": value})["y"]
        assert got.shape == () and got.dtype == np.float16


def test_the_input_check_key_names_every_dtype_shape_and_batch_axis() -> None:
    """Contracts whose observation inputs differ only in a dtype, a size, a symbolic name,
    the batch axis or the order have different keys: a front's check of one is never
    trusted for another."""
    specs = [
        ((TensorSpec("obs", ("batch", 8), "float32"),), True),
        ((TensorSpec("obs", ("batch", 8), "float16"),), True),
        ((TensorSpec("obs", ("batch", 9), "float32"),), True),
        ((TensorSpec("obs", ("b", 8), "float32"),), True),
        ((TensorSpec("obs", ("batch", 8), "float32"),), False),
        ((TensorSpec("a", ("batch", 1), "int8"), TensorSpec("b", ("batch", 1), "int8")), True),
        ((TensorSpec("b", ("batch", 1), "int8"), TensorSpec("a", ("batch", 1), "int8")), True),
    ]
    keys = set()
    for inputs_, batch in specs:
        check = PolicyContract(inputs_, (), {}, batch_axis=batch).input_check
        assert check is not None
        keys.add(check.key)
    assert len(keys) == len(specs)
    same = PolicyContract(specs[0][0], (TensorSpec("out", ("batch", 2), "float32"),), {},
                          batch_axis=True).input_check  # fmt: skip
    assert same is not None and same.key in keys  # (outputs are not the rule's)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_rows_teach_and_each_rows_word_is_its_own(binary: bool) -> None:
    """A front that only sends messages of rows learns the check from them; in a message
    of a row that is not a map, a short input and a good one, each row's check is read for
    that row: the short one is refused in one process' words, the good one served. A
    step refused is taught too. A model named as no string is refused as in one process."""

    async def run() -> None:
        async with front() as (app, hop, _):

            def row(episode: str, x: np.ndarray) -> dict[str, Any]:
                return {"episode_id": episode, "inputs": {"obs": x if binary else x.tolist()}}

            status, got = await post(app, {"episode_id": "bad", "inputs": {"obs": [[1.0]]}},
                                     binary)  # fmt: skip
            assert status == 422 and app.checks._known[None][0] == KEY  # taught by a refusal
            app.checks._known.clear()
            status, got = await post(app, {"steps": [row("r0", obs(0))]}, binary)
            assert status == 200 and app.checks._known[None][0] == KEY  # taught by rows
            short = np.zeros((1, 2), np.float32)
            for order in ([5, row("r1", short), row("r2", obs(2))],
                          [row("r3", obs(3)), row("r4", short)]):  # fmt: skip
                status, got = await post(app, {"steps": order}, binary)
                assert status == 200, got
                meta, _ = hop.sent[-1]
                results = got["steps"]
                for at, entry in enumerate(order):
                    if entry == 5:
                        assert results[at]["error"]["code"] == "malformed"
                    elif entry["episode_id"] in ("r1", "r4"):
                        said = said_by_one_process(DEMO, {"obs": short if binary else
                                                          short.tolist()}, binary)  # fmt: skip
                        assert results[at]["error"]["message"] == said
                        assert "ok" not in meta["rows"][at]
                    else:
                        assert results[at]["seq"] == 1 and meta["rows"][at]["ok"]
            status, got = await post(app, {"model": [1], "inputs": {"obs": [[0.0] * 8]}}, binary)
            assert status == 422 and got["error"]["field"] == "model", got

    asyncio.run(run())


def test_a_model_the_core_has_no_check_for_is_taught_as_none() -> None:
    """A front holding a key for a model whose contract has no check now (a string input)
    is taught ``[model, None, None]`` and its inputs are the core's to check."""
    checked = inputs.Checked("k", False)
    strings = PolicyContract((TensorSpec("prompt", (1,), "object"),), (), {})
    assert not inputs.trusted(checked, "m", strings, {"prompt": ["x"]})
    assert checked.lesson == ("m", None)
    assert inputs.taught({}, [checked]) == {"chk": [["m", None, None]]}
    none = inputs.Checked(None, False)  # (no key held, no check here: nothing to teach)
    assert not inputs.trusted(none, "m", strings, {}) and none.lesson is None


def test_a_fronts_checks_stay_within_max() -> None:
    """What a front keeps of the models' checks is bounded (``Checks.MAX``), changes and
    forgotten models alike: past it, everything is forgotten and taught again."""
    checks = Checks()
    checks.MAX = 2
    doc = {"batch_axis": True, "inputs": [["obs", "float32", ["batch", 8]]]}
    for n in range(5):
        for key in ("k", "k2", None):
            checks.learn([[f"m{n}", key, doc]])
            assert len(checks._known) <= 2 and len(checks._changes) <= 2
        checks.learn([[f"m{n}", "k", doc]])
    assert len(checks._known) <= 2 and len(checks._changes) <= 2


# --- openpi: each frame's observation checked in the front ------------------------------


async def openpi_steps(app: FrontApp, frames: list[dict[str, Any]]) -> list[Any]:
    """An openpi connection to the front's app: its metadata frame, then each frame's
    reply (decoded), the connection closed once every frame is answered."""
    sent: list[dict[str, Any]] = []
    given = [{"type": "websocket.connect"}] + [
        {"type": "websocket.receive", "bytes": wire.encode(f)} for f in frames
    ]
    answered = asyncio.Event()  # the metadata frame and every reply sent

    async def receive() -> dict[str, Any]:
        if given:
            return given.pop(0)
        await answered.wait()  # then the robot closes
        return {"type": "websocket.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if sum(m["type"] == "websocket.send" for m in sent) > len(frames):
            answered.set()

    scope = {"type": "websocket", "path": "/", "query_string": b"", "headers": [],
             "extensions": {"websocket.http.response": {}}}  # fmt: skip
    await app.openpi(scope, receive, send)
    frames = [m for m in sent if m["type"] == "websocket.send"][1:]
    return [wire.decode(m["bytes"]) if "bytes" in m else m["text"] for m in frames]


def test_an_openpi_frame_is_checked_in_the_front_and_taken_as_it_is_by_the_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection's open gives the front its model's check; each one-environment
    frame's observation is then checked and converted in the front, the keys the model
    does not take (a prompt) named but not sent, and the core, its own check made to fail,
    serves the steps, the episode's state carried from one to the next. A frame the check
    refuses goes as it came and gets the core's error; so does a frame of rows."""
    from node.protocols import openpi

    async def run() -> None:
        async with front() as (app, hop, service):
            xs = [obs(i)[0].astype(np.float64) for i in range(3)]  # float64: converted here

            def unused(*_: Any) -> Any:
                raise AssertionError("the core checked an observation the front had checked")

            monkeypatch.setattr(openpi, "inputs", SimpleNamespace(from_observation=unused))
            replies = await openpi_steps(app, [{"obs": x, "prompt": "go"} for x in xs])
            steps = [meta for meta, _ in hop.sent if "ok" in meta]
            assert len(steps) == 3 and all(m["ig"] == ["prompt"] for m in steps)
            assert all("prompt" not in m["o"] and "obs" not in m["o"] for m in steps)
            for i, reply in enumerate(replies):
                assert "error" not in reply, reply
                want = reference_rollout(DEMO_MODEL, [x[np.newaxis] for x in xs[: i + 1]])
                np.testing.assert_allclose(
                    np.asarray(reply["actions"]).reshape(want[-1]["actions"].shape),
                    want[-1]["actions"], rtol=1e-5,
                )  # fmt: skip
            monkeypatch.setattr(openpi, "inputs", inputs)
            sent = len(hop.sent)
            (bad,) = await openpi_steps(app, [{"obs": np.zeros(3)}])
            assert "ok" not in hop.sent[sent + 1][0]  # (after the open) as it came
            assert isinstance(bad, str) and "obs" in bad, bad  # openpi's error: the core's
            # the core trusts a check only under its connection's key (else: the hop's error)
            given = {"obs": xs[0][np.newaxis].astype(np.float32)}
            for key, trusted in (("0123456789abcdef", False), (KEY, True)):
                checked = openpi.FrontChecked(key, given, ("prompt",))
                args = (service, {"seq": 1}, None, "own", {}, 0.0, None, DEMO, checked)
                if trusted:
                    assert openpi.decode_observation(*args).inputs is given
                else:
                    with pytest.raises(HopError):
                        openpi.decode_observation(*args)
            for rows in (
                {"episode_ids": ["a", "b"], "obs": np.stack([xs[0], xs[1]])},
                {"episode_ids": ["c"], "obs": xs[0]},
            ):  # (one that passes one's check)
                sent = len(hop.sent)
                (both,) = await openpi_steps(app, [rows])
                assert "ok" not in hop.sent[sent + 1][0], hop.sent[sent + 1][0]
                assert isinstance(both, dict) and len(both["rows"]) == len(rows["episode_ids"])
                assert all("error" not in row for row in both["rows"]), both

    asyncio.run(run())


def test_a_frame_whose_inputs_would_grow_or_that_the_check_refuses_crosses_as_it_came() -> None:
    image = np.zeros((4, 4, 3), np.uint8)
    contract = PolicyContract((TensorSpec("image", ("batch", 4, 4, 3), "float32"),), (), {},
                              batch_axis=True, observations={"cam": "image"})  # fmt: skip
    assert contract.input_check is not None
    check = (contract.input_check.key, checking_contract(contract.input_check.doc))
    frame = {"cam": image, "seq": 3}
    assert _observed(check, frame) is None  # 4x its bytes converted
    floats = {"cam": image.astype(np.float64), "seq": 3}
    fields, converted, ignored = _observed(check, floats) or (
        None, None, None)  # fmt: skip
    assert fields == {"seq": 3} and ignored == []
    assert converted is not None and converted["image"].dtype == np.float32
    assert converted["image"].shape == (1, 4, 4, 3)
    assert _observed(check, {"cam": np.zeros(3)}) is None  # refused: the core's
    rows = {
        "episode_ids": np.array(["a"]),
        "cam": image.astype(np.float64),
    }  # (one env's check passes)
    assert _observed(check, rows) is None
    listed = {"cam": image.astype(np.float64).tolist()}
    assert _observed(check, listed) is None  # lists: as they came
    big = {"cam": image.astype(np.float64), "pending": np.zeros((50, 8), np.float32)}
    fields, converted, _ = _observed(check, big) or (None, None, None)
    assert fields is not None and "pending" in fields  # (fields cross as they came)


def test_an_openpi_frame_that_would_grow_is_not_converted_in_the_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uint8 cameras for a float input (nested, as openpi sends them) are never converted
    in the front only to be thrown away: the dtypes decide first (``observation_grows``),
    and the frame crosses as it came."""
    contract = PolicyContract(
        (TensorSpec("image", ("batch", 4, 4, 3), "float32"), TensorSpec("state", ("batch", 2),
                                                                        "float32")),
        (), {}, batch_axis=True, observations={"images/cam": "image", "state": "state"},
    )  # fmt: skip
    assert contract.input_check is not None
    check = (contract.input_check.key, checking_contract(contract.input_check.doc))
    frame = {"images": {"cam": np.zeros((4, 4, 3), np.uint8)}, "state": np.zeros(2)}
    assert inputs.observation_grows(contract, frame)
    assert not inputs.observation_grows(contract, {**frame, "images": {"cam": np.zeros((4, 4, 3))}})
    assert not inputs.observation_grows(contract, {"state": [1, 2]})  # (lists: not by dtype)
    assert not inputs.observation_grows(contract, "not a map")  # (the rule says what)
    monkeypatch.setattr(inputs, "from_observation", _unchecked)
    assert _observed(check, frame) is None


@pytest.mark.parametrize(
    "observation",
    [
        {"observation": {"image": "I", "wrist_image": "I", "state": "S"}, "prompt": "p"},
        {"observation/image": "I", "observation/wrist_image": "I", "observation/state": "S"},
        {"observation": {"image": "I", "wrist_image": "I"}},
        {"observation": {"image": "I", "wrist_image": "I", "state": "I"}},
        {"observation": {"image": "I", "wrist_image": "I", "state": "S"}, "observation/state": "S"},
        {"observation": {"image": "S", "wrist_image": "I", "state": "S"}},
        {"observation": {"image": "I", "wrist_image": "I", "state": [0.5] * 8}},
        {"observation": {"image": "I", "wrist_image": "I", "state": "S", "extra": {"x": "S"}}},
        [1, 2],
    ],
)
def test_the_fronts_contract_takes_an_observation_as_the_whole_contract_does(
    observation: Any,
) -> None:
    """``from_observation`` against the contract rebuilt from the check: the same verdict
    and the same arrays as against the whole contract (vla-demo: nested keys, a prompt)."""
    values = {"I": np.zeros((224, 224, 3), np.uint8), "S": np.linspace(0, 1, 8)}

    def filled(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: filled(v) for k, v in value.items()}
        return values.get(value, value) if isinstance(value, str) else value

    assert VLA.input_check is not None
    rebuilt = checking_contract(VLA.input_check.doc)
    results = []
    for contract in (VLA, rebuilt):
        try:
            results.append(inputs.from_observation(contract, filled(observation)))
        except InvalidInput as exc:
            results.append(str(exc))
    whole, front_side = results
    if isinstance(whole, str):
        assert whole == front_side  # (said by the core, in either case; the same verdict)
        return
    assert not isinstance(front_side, str) and whole.ignored == front_side.ignored
    assert list(whole.inputs) == list(front_side.inputs)
    for name, array in whole.inputs.items():
        assert array.dtype == front_side.inputs[name].dtype
        np.testing.assert_array_equal(array, front_side.inputs[name])


# ---- KServe v2: HTTP and gRPC, decoded and checked in the front -------------------------


def kserve_input(x: np.ndarray, binary: bool) -> Any:
    given = th.InferInput("obs", list(x.shape), th.np_to_triton_dtype(x.dtype))
    given.set_data_from_numpy(x, binary_data=binary)
    return given


async def kserve_post(
    app: FrontApp,
    x: np.ndarray,
    binary: bool,
    sequence: str,
    *,
    start: bool = False,
    parameters: dict[str, Any] | None = None,
    path: str = "/v2/models/demo_policy/infer",
) -> tuple[int, Any]:
    """A KServe v2 HTTP infer of one step, as ``tritonclient`` encodes it, to the front's
    app: (status, every output and parameter as ``tritonclient`` reads the reply, or the
    error's message)."""
    body, json_size = th.InferenceServerClient.generate_request_body(
        [kserve_input(x, binary)], sequence_id=sequence or 0, sequence_start=start,
        parameters=parameters,
    )  # fmt: skip
    headers = [(b"content-type", b"application/octet-stream")]
    if json_size is not None:
        headers.append((b"inference-header-content-length", str(json_size).encode()))
    status, answered, content = await asgi_post(app, path, headers, body)
    if status != 200:
        return status, orjson.loads(content)["error"]
    length = dict(answered).get(b"inference-header-content-length")
    result = th.InferenceServerClient.parse_response_body(
        content, header_length=None if length is None else int(length)
    )
    return status, result


def _unchecked(*_: Any) -> Any:
    raise AssertionError("the core checked inputs the front had checked")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_kserve_infer_is_checked_in_the_front_once_taught(
    binary: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KServe's inputs are checked and converted in the front as ``/act``'s are: the first
    request teaches the front its model's check (under the path's model), the next are
    checked there and served by the core without its own check (made to fail here), each
    step applied once, its outputs the model's. A request the check refuses (a shape, a
    missing input) crosses as it came, and the core says what is wrong as one process."""

    async def run() -> None:
        async with front() as (app, hop, _):
            xs = [obs(10 + i) for i in range(3)]
            status, got = await kserve_post(app, xs[0], binary, "kc", start=True)
            assert status == 200, got
            assert "ck" not in hop.sent[-1][0] and "ok" not in hop.sent[-1][0]
            assert app.kserve_checks._known["demo_policy"][0] == KEY
            assert not app.checks._known  # (KServe's lessons are its own)
            monkeypatch.setattr(kserve_request, "inputs", SimpleNamespace(from_arrays=_unchecked))
            monkeypatch.setattr(kserve_request, "_check_missing", _unchecked)
            for i in (1, 2):
                status, got = await kserve_post(app, xs[i], binary, "kc")
                assert status == 200, got
                meta, arrays = hop.sent[-1]
                assert meta["ok"] is True and meta["ck"] == KEY and "chk" not in hop.replies[-1]
                assert [a.dtype for a in arrays] == [np.float32]
                assert got.get_response()["parameters"]["seq"] == i + 1
                want = reference_rollout(DEMO_MODEL, xs[: i + 1])[-1]["actions"]
                np.testing.assert_allclose(got.as_numpy("actions"), want, rtol=1e-5)
            monkeypatch.undo()
            short = np.zeros((1, 2), np.float32)
            status, message = await kserve_post(app, short, binary, "kc")
            meta, _ = hop.sent[-1]
            assert "ok" not in meta and meta["ck"] == KEY  # sent as it came
            assert status == 400 and said_by_one_process(DEMO, {"obs": short}, True) in message

            status, message = await kserve_post(app, obs(1).astype(np.float64), binary, "kc")
            meta, arrays = hop.sent[-1]  # FP64 converted here: half the bytes cross
            assert status == 200 and meta["ok"] is True and arrays[0].dtype == np.float32
            status, got = await kserve_post(app, xs[0], binary, "kc")
            assert status == 200 and got.get_response()["parameters"]["seq"] == 5

    asyncio.run(run())


def test_a_stale_kserve_check_is_refused_and_the_request_sent_again_unchecked() -> None:
    """A KServe request checked against a check that is not its model's any more is
    refused by the core before anything of it counts (Triton's statistics, the step), the
    front is taught the model's check and sends it again unchecked: applied once."""

    async def run() -> None:
        async with front() as (app, hop, service):
            stale = {"batch_axis": True, "inputs": [["obs", "float32", [1, 8]]]}
            app.kserve_checks.learn([["demo_policy", "0123456789abcdef", stale]])
            stats = kserve_request.stats_for(service, "demo_policy")
            status, got = await kserve_post(app, obs(3), True, "ks", start=True)
            assert status == 200 and got.get_response()["parameters"]["seq"] == 1
            (checked, _), (again, _) = hop.sent[-2:]
            assert checked["ok"] is True and hop.replies[-2]["recheck"]
            assert "ok" not in again and "ck" not in again and len(hop.sent) == 2
            assert hop.ahead == [False, True]  # (it had its turn: ahead of the queue)
            assert stats.success_count == 1 and stats.fail_count == 0
            assert app.kserve_checks._known["demo_policy"][0] == KEY
            status, got = await kserve_post(app, obs(4), True, "ks")
            assert status == 200 and got.get_response()["parameters"]["seq"] == 2
            assert hop.sent[-1][0]["ok"] is True

    asyncio.run(run())


class _Context:
    """The little of a ``grpc.aio`` call's context the front's servicer reads."""

    def __init__(self) -> None:
        self.aborted: tuple[Any, str] | None = None
        self.done: list[Any] = []

    def time_remaining(self) -> float | None:
        return None

    def cancelled(self) -> bool:
        return False

    def invocation_metadata(self) -> tuple[Any, ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def add_done_callback(self, callback: Any) -> None:
        self.done.append(callback)

    def finish(self) -> None:
        """The call is done, its reply sent (what grpc.aio says to the callbacks)."""
        for callback in self.done:
            callback(SimpleNamespace(cancelled=lambda: False))

    async def abort(self, code: Any, details: str, *_: Any) -> None:
        self.aborted = (code, details)
        raise RuntimeError(details)


def test_a_grpc_infer_is_checked_in_the_front_with_the_lessons_of_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front's gRPC door checks as its HTTP door does, with the same lessons: taught
    by an HTTP request, a ``ModelInfer`` is checked in the front and served by the core
    without its own check; a stale check is sent again unchecked."""

    async def run() -> None:
        async with front() as (app, hop, _):
            servicer = app.grpc_servicer(None)  # (the front's own wiring)
            assert servicer.checks is app.kserve_checks

            def message(x: np.ndarray, start: bool) -> Any:
                msg = pb.ModelInferRequest(model_name="demo_policy")
                msg.inputs.add(name="obs", datatype="FP32", shape=list(x.shape))
                msg.raw_input_contents.append(x.tobytes())
                msg.parameters["sequence_id"].string_param = "kg"
                msg.parameters["sequence_start"].bool_param = start
                return msg

            status, _ = await kserve_post(app, obs(20), True, "other", start=True)
            assert status == 200 and app.kserve_checks._known["demo_policy"][0] == KEY
            monkeypatch.setattr(kserve_request, "inputs", SimpleNamespace(from_arrays=_unchecked))
            for i in range(2):
                reply = await servicer.model_infer(message(obs(21 + i), i == 0), _Context())
                assert hop.sent[-1][0]["ok"] is True and hop.sent[-1][0]["ck"] == KEY
                assert reply.parameters["seq"].int64_param == i + 1
            monkeypatch.undo()
            stale = {"batch_axis": True, "inputs": [["obs", "float32", [1, 8]]]}
            app.kserve_checks.learn([["demo_policy", "0123456789abcdef", stale]])
            sent = len(hop.sent)
            reply = await servicer.model_infer(message(obs(23), False), _Context())
            assert reply.parameters["seq"].int64_param == 3 and len(hop.sent) == sent + 2
            assert hop.replies[-2]["recheck"] and "ok" not in hop.sent[-1][0]
            assert hop.ahead[-2:] == [False, True]

    asyncio.run(run())


def test_checks_tensors_takes_what_the_rule_takes() -> None:
    """What ``Checks.tensors`` checks of a KServe request in the front: a model it knows,
    a request of rows when its inputs have the rows' axis (the core names the one
    without), every input the model takes given (a missing one is named by the core, in
    Triton's words), none that would grow converted; what passes is converted, and
    ``request_meta`` carries it with the word."""
    checks = Checks()
    given = {"obs": np.zeros((1, 8), np.float64)}
    assert checks.tensors("demo_policy", given, None) is None  # not taught
    checks.learn([["demo_policy", *DEMO.input_check]])
    taken, word = checks.tensors("demo_policy", given, None) or ({}, {})
    assert word == {"ck": KEY, "ok": True} and taken["obs"].dtype == np.float32
    assert given["obs"].dtype == np.float64  # (converted apart)
    for arrays in ({"other": np.zeros((1, 8), np.float32)},  # missing: the core names it
                   {"obs": np.zeros((1, 8), np.uint8)},  # would grow (uint8 to float32)
                   {"obs": np.zeros((1, 3), np.float32)}):  # refused  # fmt: skip
        assert checks.tensors("demo_policy", arrays, None) == (arrays, {"ck": KEY}), arrays
    each = checks.tensors("demo_policy", given, 1)  # a request of one row: checked
    assert each is not None and each[1] == {"ck": KEY, "ok": True}
    assert checks.tensors("demo_policy", given, 2) == (given, {"ck": KEY})  # no axis of 2
    assert checks.tensors(check_name("demo_policy", "2"), given, None) is None  # another name
    request = InferRequest(None, "s", "kserve:s:s", False, False, given, None, True, None)
    meta, arrays = request_meta(request, "demo_policy", None, checks)
    assert meta["ok"] is True and meta["ck"] == KEY and arrays[0].dtype == np.float32
    meta, arrays = request_meta(request, "demo_policy", "2", checks)  # (not known so)
    assert "ck" not in meta and arrays[0].dtype == np.float64


# ---- what a front does not check reaches the core's rule as one process has it ------------

SCALARS = PolicyContract(
    (TensorSpec("x", (), "int32"), TensorSpec("obs", ("batch", 3), "float32"),
     TensorSpec("u", (2,), "uint8")), (), {},
)  # fmt: skip
_NUMBER = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.sampled_from([0, 1, 255, 256, -1, 1.0, 3.0, 1.5, 1e39, 2**31, 2**63]),
)
_DTYPES = st.sampled_from([np.float64, np.float32, np.float16, np.int64, np.int32, np.int8,
                           np.uint8, np.bool_])  # fmt: skip
_VALUE = st.one_of(
    _NUMBER,
    st.lists(_NUMBER, max_size=3),
    st.lists(st.lists(_NUMBER, min_size=3, max_size=3), min_size=1, max_size=2),
)
_NUMPY_SCALAR = st.builds(
    lambda dtype, v: np.asarray(v).astype(dtype)[()], _DTYPES, st.integers(-300, 300)
)
_NUMPY_ARRAY = hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
_PACKED = st.one_of(
    _VALUE,
    _NUMPY_SCALAR,
    _NUMPY_ARRAY,
    st.lists(st.one_of(_NUMBER, _NUMPY_SCALAR), min_size=1, max_size=3),  # (numpy inside)
    st.lists(_NUMPY_ARRAY, min_size=1, max_size=2),
)


def _outcome_of(decode: Any) -> tuple[str, Any]:
    try:
        taken = decode()
    except InvalidInput as exc:
        return "refused", str(exc)
    return "taken", {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in taken.items()}


@settings(max_examples=300, deadline=None)
@given(
    binary=st.booleans(),
    raw=st.fixed_dictionaries({"x": _PACKED, "obs": _PACKED, "u": _PACKED}),
    data=st.data(),
)
def test_inputs_a_front_did_not_check_reach_the_core_as_one_process_reads_them(
    binary: bool, raw: dict[str, Any], data: st.DataObject
) -> None:
    """A step whose inputs a front did not check (its model's check not known yet, a
    resend after a stale check) crosses as it came, and the core's rule takes or refuses
    it exactly as one process does, in the same words: numpy scalars keep their dtype
    (np.float64(3.0) for an int32 input is refused, not taken as the number 3), a 0-d array
    stays 0-d, JSON lists are said as lists; a msgpack list holding numpy values, which a
    header would make plain numbers, is passed on to the core's own door whole."""
    if not binary:
        raw = orjson.loads(orjson.dumps({k: data.draw(_VALUE) for k in raw}))
    raw = wire.decode(wire.encode(raw)) if binary else raw  # as each door parses its body
    one = _outcome_of(lambda: (inputs.from_arrays if binary else inputs.from_json)(SCALARS, raw))
    try:
        _, meta, arrays = front_request({"episode_id": "e", "inputs": raw}, binary)
    except Uncarried:  # passed on whole: the core's own door reads the body, as one process
        assert binary and any(isinstance(v, list) for v in raw.values())
        return
    header, _, total = pack(dict(meta), arrays)
    carried, _ = unpack(header, total)
    doc, _ = fronts._feed(carried, [a.copy() for a in arrays], 0)

    def core() -> dict[str, np.ndarray]:  # act.decode_doc's rule for a front's row
        try:
            return inputs.from_arrays(SCALARS, doc["inputs"])
        except InvalidInput:
            if binary:
                raise
            return inputs.from_json(SCALARS, act._lists(doc["inputs"]))  # (said as lists)

    assert _outcome_of(core) == one


def test_a_0d_tensor_crosses_the_hop_0d() -> None:
    """A scalar (0-d) tensor crosses a slot as one: an openpi observation's value, a KServe
    tensor, a reply's output (``np.ascontiguousarray`` would make each ``[x]``)."""
    region = Region.create(2, 1 << 16)
    scalar = np.asarray(3.5, np.float32)
    arrays: list[np.ndarray] = []
    lifted = lift({"state": scalar, "n": np.int64(2)}, arrays)
    entries, carried = _carry({"t": scalar, "v": np.arange(3.0)})
    meta, out = fronts._reply_meta(Reply({"a": scalar}, "e", "cpu:0", "n", 1, "hit", False, False),
                                   False)  # fmt: skip
    region.write(0, 1, 1, {"l": lifted, "e": entries, "r": meta},
                 [contiguous(scalar), *arrays, *carried, *out])  # fmt: skip
    _, got, views = region.read(0, copy=False)
    assert views[0].shape == () and views[0] == scalar
    assert lower(got["l"], views[1:3]) == {"state": scalar, "n": 2}
    assert lower(got["l"], views[1:3])["state"].shape == ()
    assert _carried(got["e"], views[3:5])["t"].shape == ()
    assert _outputs(got["r"], views, 5)[0]["a"].shape == ()


ROWS = PolicyContract(
    (TensorSpec("x", ("batch",), "int32"), TensorSpec("obs", ("batch", 3), "float32"),
     TensorSpec("u", ("batch", 2), "uint8")), (), {},
)  # fmt: skip


FLAT_ROWS = PolicyContract(
    (TensorSpec("x", (), "int32"), TensorSpec("obs", (3,), "float32"),
     TensorSpec("u", (2,), "uint8")), (), {},
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    batch=st.booleans(),
    rows=st.integers(1, 4),
    dtypes=st.tuples(_DTYPES, _DTYPES, _DTYPES),
    data=st.data(),
)
def test_a_request_of_rows_checked_in_the_front_gives_each_row_what_the_core_would(
    batch: bool, rows: int, dtypes: tuple[Any, Any, Any], data: st.DataObject
) -> None:
    """A KServe request of rows checked in the front (``Checks.tensors``): when it crosses
    checked, each row the core cuts from it (``row_requests``) and takes as it is
    (``to_step``) is what the rule makes of that row's own slice: an array (a scalar
    input's cut ``a[i]`` is a numpy scalar), its dtype, shape and values; it crosses
    unchecked exactly when the rule refuses some row."""
    contract = ROWS if batch else FLAT_ROWS
    widths = {"x": (), "obs": (3,), "u": (2,)}
    arrays = {
        name: data.draw(
            hnp.arrays(np.int64, (rows, *widths[name]), elements=st.integers(-300, 300))
        ).astype(dtype)  # (wrapped into small dtypes: values in and out of each range)
        for name, dtype in zip(widths, dtypes, strict=True)
    }
    if data.draw(st.booleans()):
        arrays = {n: a.astype(contract.step_spec(s).dtype) for n, a in arrays.items()
                  for s in contract.observation_inputs if s.name == n}  # fmt: skip
    ids = [Row(f"r{i}", f"kserve:s:r{i}") for i in range(rows)]
    request = InferRequest(None, None, None, False, False, arrays, None, True, None, rows=ids)
    checks = Checks()
    assert contract.input_check is not None
    checks.learn([["m", *contract.input_check]])
    tensors, word = checks.tensors("m", arrays, rows) or ({}, {})
    sent = replace(request, arrays=tensors)
    one = [
        _outcome_of(lambda r=r: inputs.from_arrays(contract, r.arrays))
        for r in kserve_request.row_requests(contract, request)
    ]
    if word.get("ok"):
        assert all(o[0] == "taken" for o in one)
        cut = kserve_request.row_requests(contract, sent)
        fed = [kserve_request.to_step(contract, r, 0.0, checked=True).inputs for r in cut]
        assert all(type(v) is np.ndarray for row in fed for v in row.values())  # (not scalars)
        assert [("taken", {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in row.items()})
                for row in fed] == one  # fmt: skip
    else:
        grows = any(np.dtype(s.dtype).itemsize > arrays[s.name].itemsize
                    for s in contract.observation_inputs)  # fmt: skip
        assert grows or any(o[0] == "refused" for o in one)


def test_a_kserve_request_of_rows_is_checked_in_the_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KServe request of rows (``episode_ids``) is checked and converted in the front,
    row by row; the core serves each row's slice without its own check, each row stepped
    once with its own state, its outputs the model's."""

    async def run() -> None:
        async with front() as (app, hop, _):
            status, _ = await kserve_post(app, obs(30), True, "teach", start=True)
            assert status == 200
            monkeypatch.setattr(kserve_request, "inputs", SimpleNamespace(from_arrays=_unchecked))
            monkeypatch.setattr(kserve_request, "_check_missing", _unchecked)
            xs = [np.concatenate([obs(40 + 3 * t + i) for i in range(3)]) for t in range(2)]
            for t, x in enumerate(xs):
                status, got = await kserve_post(
                    app, x.astype(np.float64), True, "", start=t == 0,
                    parameters={"episode_ids": orjson.dumps(["r0", "r1", "r2"]).decode(),
                                "sequence_starts": orjson.dumps([t == 0] * 3).decode()},
                )  # fmt: skip
                assert status == 200, got
                meta, arrays = hop.sent[-1]
                assert meta["ok"] is True and meta["ck"] == KEY and arrays[0].dtype == np.float32
                facts = orjson.loads(got.get_response()["parameters"]["rows"])
                assert [f["seq"] for f in facts] == [t + 1] * 3, facts
            for i in range(3):
                want = reference_rollout(DEMO_MODEL, [x[i : i + 1] for x in xs])[-1]["actions"]
                np.testing.assert_allclose(got.as_numpy("actions")[i : i + 1], want, rtol=1e-5)

    asyncio.run(run())


def _grpc_message(x: np.ndarray, sequence: str, start: bool) -> Any:
    msg = pb.ModelInferRequest(model_name="demo_policy")
    msg.inputs.add(name="obs", datatype="FP32", shape=list(x.shape))
    msg.raw_input_contents.append(x.tobytes())
    msg.parameters["sequence_id"].string_param = sequence
    msg.parameters["sequence_start"].bool_param = start
    return msg


STALE = {"batch_axis": True, "inputs": [["obs", "float32", [1, 8]]]}
"""A check of other inputs than the demo's that its steps pass (a rollout's, as it were)."""


def test_kserve_lessons_come_with_refusals_versions_and_grpc_alone() -> None:
    """A refusal teaches too; a request naming the version learns under that name (and is
    checked the next time, with one trip); gRPC alone learns, and its resend after a
    stale check is still a gRPC request (its door, its client's deadline)."""

    async def run() -> None:
        async with front() as (app, hop, service):
            status, _ = await kserve_post(app, np.zeros((1, 2), np.float32), True, "kr",
                                          start=True)  # fmt: skip
            assert status == 400 and hop.replies[-1]["chk"][0][:2] == ["demo_policy", KEY]
            assert app.kserve_checks._known["demo_policy"][0] == KEY
            version = kserve_request.served_version(service, "demo_policy")
            path = f"/v2/models/demo_policy/versions/{version}/infer"
            for i in range(2):
                sent = len(hop.sent)
                status, got = await kserve_post(app, obs(50 + i), True, "kv", start=i == 0,
                                                path=path)  # fmt: skip
                assert status == 200 and len(hop.sent) == sent + 1, got
                assert ("ok" in hop.sent[-1][0]) is (i == 1)
            assert app.kserve_checks._known[check_name("demo_policy", version)][0] == KEY

        async with front() as (app, hop, _):
            servicer = app.grpc_servicer(None)
            await servicer.model_infer(_grpc_message(obs(60), "kg1", True), _Context())
            assert app.kserve_checks._known["demo_policy"][0] == KEY  # (taught over gRPC)
            app.kserve_checks.learn([["demo_policy", "0123456789abcdef", STALE]])
            reply = await servicer.model_infer(_grpc_message(obs(61), "kg1", False), _Context())
            assert reply.parameters["seq"].int64_param == 2
            assert hop.replies[-2]["recheck"] and "grpc" in hop.sent[-1][0]
            assert app.kserve_checks._known["demo_policy"][0] == KEY

    asyncio.run(run())


def test_a_grpc_recheck_over_a_real_hop_frees_its_slot() -> None:
    """Over a real hop (shared memory, doorbells), a gRPC request refused for a stale
    check settles its empty answer before it is sent again: more stale requests than the
    hop has slots all succeed, nothing is undone, and every slot and ticket is free after
    (an answer left unsettled would be parked on a ticket for good)."""

    async def run() -> None:
        redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
        async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
            service = nodes[0].service
            undone: list[Any] = []

            async def handler(kind: int, meta: dict[str, Any], arrays: list[Any], slot: int) -> Any:
                return await fronts.serve_request(service, kind, meta, arrays, slot, {})

            async def gone(kept: Any) -> None:
                undone.append(kept)

            region = Region.create(2, 1 << 16)
            ask, answer = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
            core = CoreHop(region, ask, answer, handler, gone, gone)
            core.start()
            hop = FrontHop(Region.open(os.dup(region.fd)), os.dup(ask), os.dup(answer),
                           slot_wait_s=2.0)  # fmt: skip
            app = FrontApp(hop, "/nonexistent.sock", {"max_body_bytes": 1 << 24, "max_rows": 8})
            try:
                servicer = app.grpc_servicer(None)
                context = _Context()
                await servicer.model_infer(_grpc_message(obs(70), "kh", True), context)
                context.finish()
                for i in range(5):  # (past the 2 slots)
                    app.kserve_checks.learn([["demo_policy", f"{i:016x}", STALE]])
                    context = _Context()
                    reply = await servicer.model_infer(_grpc_message(obs(71 + i), "kh", False),
                                                       context)  # fmt: skip
                    context.finish()  # (the reply's slot: settled once the call is done)
                    assert reply.parameters["seq"].int64_param == i + 2
                for _ in range(2000):  # (a park under way settles once the core answers it)
                    if sorted(hop.free) == [0, 1] and len(hop.tickets) == TICKETS:
                        break
                    await asyncio.sleep(0.01)
                assert not undone and sorted(hop.free) == [0, 1] and not hop.waiting
                assert len(hop.tickets) == TICKETS  # (none parked: an unsettled answer is)
            finally:
                await app.client.aclose()
                asyncio.get_running_loop().remove_reader(hop.answer)
                core.drop()
                os.close(hop.ask)
                os.close(hop.answer)

    asyncio.run(run())


def test_a_msgpack_list_of_numpy_values_is_passed_on_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A msgpack ``/act`` body whose input is a list holding numpy scalars or arrays (which
    a slot's header would make plain numbers) is passed on whole to the core's own door,
    which reads it as one process does; nothing of it crosses the hop."""

    async def run() -> None:
        async with front() as (app, hop, _):
            passed: list[bytes] = []

            async def forward(scope: Any, body: bytes, send: Any) -> None:
                passed.append(body)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"{}"})

            monkeypatch.setattr(app, "forward", forward)
            body = {"episode_id": "np", "inputs": {"obs": [[np.float32(0.5)] * 8]}}
            status, _ = await post(app, body, True)
            assert status == 200 and len(passed) == 1 and not hop.sent
            assert wire.decode(passed[0])["inputs"]["obs"][0][0] == np.float32(0.5)
            status, _ = await post(app, {**body, "inputs": {"obs": [obs(1)[0]]}}, True)
            assert len(passed) == 2 and not hop.sent  # (an array inside a list too)
            status, got = await post(app, {**body, "inputs": {"obs": obs(1)}}, True)
            assert status == 200 and len(hop.sent) == 1 and len(passed) == 2, got

    asyncio.run(run())
