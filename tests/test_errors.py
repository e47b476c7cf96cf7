"""node/errors.py: every node exception lives there, and outcome() maps each to what a
client sees (status, code, Retry-After, the rejection metric's label)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import affinity
from affinity import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    ModelConflict,
    NoCapacity,
    NotReplicated,
    PoolExhausted,
    Recovering,
    UnknownEpisode,
    UnknownField,
    UnknownModel,
)
from affinity.wire import WireError
from node import errors
from node.errors import (
    AdminRefused,
    AmbiguousModel,
    BadRequest,
    BodyError,
    ClaimEnded,
    ClientGone,
    DeviceDown,
    ForwardCancelled,
    ForwardError,
    InvalidInput,
    ModelFailure,
    ModelNotServed,
    NotKept,
    NotServed,
    Outcome,
    Refused,
    SeqConflict,
    TransferError,
    Unavailable,
    WorkerGone,
    outcome,
)

NODE = Path(__file__).resolve().parents[1] / "node"

# (exception, status, code, retry_after, reject_reason, invalid)
TABLE: list[tuple[BaseException, int, str, float | None, str | None, bool]] = [
    (Unavailable("full", "no device", 2.0), 503, "full", 2.0, None, False),
    (Refused(403, "bad_secret", "wrong secret"), 403, "bad_secret", None, "forbidden", False),
    (Refused(409, "seq_conflict", "seq 3"), 409, "seq_conflict", None, None, False),
    (Refused(500, "model_failure", "boom"), 500, "model_failure", None, None, False),
    (BodyError(413, "too_large", "big"), 413, "too_large", None, "too_large", True),
    (BodyError(400, "malformed", "bad"), 400, "malformed", None, "malformed", True),
    (BadRequest("no such output"), 400, "bad_input", None, "bad_input", True),
    (BadRequest("not JSON", "malformed"), 400, "malformed", None, "malformed", True),
    (WireError("not msgpack"), 400, "malformed", None, "malformed", True),
    (InvalidInput("obs", "must be a list"), 422, "bad_input", None, "bad_input", True),
    (InvalidArgument("seq", 0, "must be >= 1"), 422, "bad_input", None, "bad_input", True),
    (UnknownField("episodeId", ["episode_id"]), 422, "bad_input", None, "bad_input", True),
    (UnknownEpisode("ep"), 400, "bad_input", None, "bad_input", True),
    (NotServed("no model m"), 404, "unknown_model", None, None, True),
    (AmbiguousModel(["a", "b"]), 422, "model_required", None, None, False),
    (AdminRefused(401, "unauthorized", "no token", "Bearer"), 401, "unauthorized", None,
     "unauthorized", False),
    (AdminRefused(403, "admin_disabled", "off"), 403, "admin_disabled", None, "forbidden", False),
    (ClientGone(), 499, "client_gone", None, None, False),
    (SeqConflict("ep", 3, 7), 409, "seq_conflict", None, None, False),
    (ClaimEnded("ep", "c1"), 409, "ended", None, None, False),
    (NotKept("ep"), 503, "fenced", 1.0, None, False),
    (ForwardCancelled("o1"), 503, "deadline", 1.0, None, False),
    (ForwardError("refused"), 503, "owner_unreachable", 1.0, None, False),
    (TransferError("not a map"), 422, "bad_record", None, None, False),
    (ModelNotServed("m@v2 is not served here"), 421, "not_owner", None, None, False),
    (ModelFailure("cpu/0", RuntimeError("x")), 500, "model_failure", None, None, False),
    (ModelFailure("cpu/0", WorkerGone("cpu/0", "died")), 503, "model_failure", 1.0, None, False),
    (DeviceDown("cpu/0"), 503, "device_down", 5.0, None, False),
    (ModelConflict("ep", "m@1", "m@2"), 409, "model_conflict", None, None, False),
    (UnknownModel("m", ["demo"]), 404, "unknown_model", None, None, False),
    (NoCapacity("ep"), 503, "full", 2.0, None, False),
    (NoCapacity("ep", "no_nodes"), 503, "no_nodes", 1.0, None, False),
    (Recovering("ep", 0.2), 503, "recovering", 1.0, None, False),
    (Recovering("ep", 4.5), 503, "recovering", 4.5, None, False),
    (PoolExhausted(8, 0.5), 503, "busy", 1.0, None, False),
    (NotReplicated("claim", 1, 2, 0.1), 503, "not_replicated", 1.0, None, False),
    (BackendUnavailable("down"), 503, "redis", 1.0, None, False),
    (AffinityError("odd"), 503, "affinity", 1.0, None, False),
]  # fmt: skip


@pytest.mark.parametrize("case", TABLE, ids=lambda case: type(case[0]).__name__)
def test_outcome_maps_each_failure(
    case: tuple[BaseException, int, str, float | None, str | None, bool],
) -> None:
    exc, status, code, retry_after, reject_reason, invalid = case
    got = outcome(exc)
    assert (got.status, got.code, got.retry_after) == (status, code, retry_after)
    assert (got.reject_reason, got.invalid) == (reject_reason, invalid)
    assert got.message == str(exc)


def test_outcome_names_the_field_at_fault() -> None:
    assert outcome(InvalidInput("state_in.h", "wrong shape")).field == "inputs.state_in.h"
    assert outcome(InvalidInput("", "must be a map")).field == "inputs"
    assert outcome(InvalidArgument("episode id", 1, "must be a string")).field == "episode_id"


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert outcome(Unavailable("busy", "b", 0.2)).retry_header == "1"
    assert outcome(Unavailable("recovering", "r", 7.6)).retry_header == "8"


def test_a_subclass_takes_its_base_entry() -> None:
    class Late(Unavailable):
        pass

    assert outcome(Late("owner_unreachable", "x")).status == 503


def test_an_unknown_exception_is_a_500() -> None:
    got = outcome(KeyError("k"))
    assert got == Outcome(500, "internal", "internal error: KeyError: 'k'")
    assert outcome(RuntimeError("boom")).status == 500


def _exception_classes(tree: ast.Module, known: set[str]) -> list[str]:
    """Classes in ``tree`` whose bases name a known exception class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name in known:
                    found.append(node.name)
                    break
    return found


def test_every_node_exception_is_defined_in_errors() -> None:
    known = {
        name
        for source in (builtins, affinity, errors)
        for name, value in vars(source).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    trees = {
        path: ast.parse(path.read_text(), str(path))
        for path in NODE.rglob("*.py")
        if "pb" not in path.relative_to(NODE).parts
    }
    while True:  # a class deriving from one found here is an exception too
        more = {name for tree in trees.values() for name in _exception_classes(tree, known)}
        if more <= known:
            break
        known |= more
    elsewhere = sorted(
        f"{path.relative_to(NODE.parent)}: {name}"
        for path, tree in trees.items()
        if path.name != "errors.py"
        for name in _exception_classes(tree, known)
        if name not in errors.PRIVATE
    )
    assert elsewhere == [], "define these in node/errors.py (or list them in errors.PRIVATE)"
    assert {
        "_NotSent",
        "_Stale",
        "_LetGo",
        "_Lost",
        "_Fenced",
        "Abort",
        "StartupError",
    } == errors.PRIVATE


def test_errors_imports_nothing_from_node() -> None:
    tree = ast.parse((NODE / "errors.py").read_text())
    imported = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert not [name for name in imported if name == "node" or name.startswith("node.")]


def test_node_errors_are_imported_from_errors_only() -> None:
    """One module per exception: no other module hands a node error on (``__all__``), and
    the node, the tests and the benchmarks import each from ``node.errors``."""
    names = {name for name, value in vars(errors).items() if isinstance(value, type)}
    found = []
    for folder in ("node", "tests", "bench"):
        for path in (NODE.parent / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(NODE.parent)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("node"):
                    if node.module != "node.errors":
                        found += [f"{where}: {a.name} from {node.module}" for a in node.names
                                  if a.name in names]  # fmt: skip
                elif (
                    isinstance(node, ast.Assign)
                    and path.name != "errors.py"
                    and any(getattr(t, "id", "") == "__all__" for t in node.targets)
                ):
                    listed = ast.literal_eval(node.value)
                    found += [f"{where}: {n} in __all__" for n in listed if n in names]
    assert found == [], "import node errors from node.errors only"


@pytest.mark.parametrize(
    ("exc", "kind", "status", "code", "retry_after"),
    [
        (SeqConflict("e", 3, 5), Refused, 409, "seq_conflict", None),
        (ClaimEnded("e", "c-1"), Refused, 409, "ended", None),
        (NotKept("e"), Unavailable, 503, "fenced", 1.0),
        (ForwardCancelled("f-1"), Unavailable, 503, "deadline", 1.0),
        (ModelFailure("n/0", RuntimeError("boom")), Refused, 500, "model_failure", None),
        (DeviceDown("n/0"), Unavailable, 503, "device_down", 5.0),
    ],
)
def test_a_refused_step_is_answered_as_the_table_says(
    exc: errors.StepRefused, kind: type, status: int, code: str, retry_after: float | None
) -> None:
    """The owner turns what its record or device refused into the step's error through
    ``refusal``: one table, no second mapping in the owner."""
    got = errors.refusal(exc)
    assert type(got) is kind and str(got) == str(exc)
    assert errors.outcome(got).status == status
    assert got.reason == code
    if retry_after is not None:
        assert isinstance(got, Unavailable) and got.retry_after == retry_after
