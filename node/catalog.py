"""The models a node serves and the models its fleet serves.

A node serves one or more models (``--model`` given several times). Every device gets
one session per model. Each model has a dispatcher of its own: its sessions and its
batching. The episodes' records are node-wide (``node/episodes.py``). A step names its
model and runs on that model's dispatcher. :class:`Catalog` knows the models of the whole
fleet: name, version and contract, from Redis. So any node routes and checks a step of any
model, including one it does not serve itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from affinity import Inventory, ModelId, Registry, UnknownModel
from affinity.models import Models, check_model_part
from node.contract import PolicyContract, TensorSpec
from node.errors import AmbiguousModel
from node.models import resolve_model

__all__ = [
    "Catalog",
    "ModelSpec",
    "contract_from_record",
    "contract_record",
    "file_version",
    "parse_model_arg",
]

log = logging.getLogger("affinity.node")

REFRESH_S = 10.0
"""How long a node trusts its view of the fleet's models before reading Redis again (a step
that names a model the view does not know, or none among several, reads at once)."""
REFRESH_WAIT_S = 0.02
"""How long a step waits for a due refresh before going on with the view it has (the read
goes on in the background): a Redis pause never stalls a step for longer."""


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` argument: the file, the name clients use, the version (None: the
    digest of the file, :func:`file_version`)."""

    path: Path
    name: str
    version: str | None = None

    def identity(self) -> ModelId:
        return ModelId(self.name, self.version or file_version(self.path))


def file_version(path: Path) -> str:
    """The version of a model file given none: the first 12 hex digits of its SHA-256."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


_NAMED = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})=(.+)")


def parse_model_arg(text: str, default_name: str | None = None) -> ModelSpec:
    """``--model`` as given: ``[NAME=]FILE_OR_PACKAGED[@VERSION]``. The name defaults to
    ``default_name`` (``--model-name``) or the file's stem, the version to the file's
    digest. Raises ``ValueError`` naming what is wrong."""
    name = default_name
    named = _NAMED.fullmatch(text)
    if named:
        name, text = named.group(1), named.group(2)
    version = None
    where, at, tail = text.rpartition("@")
    if at and where and not Path(text).expanduser().is_file():
        version, text = tail, where
        check_model_part("version", version)
    path = resolve_model(text)
    name = name or path.stem
    check_model_part("name", name)
    return ModelSpec(path, name, version)


# ---- contracts in Redis -------------------------------------------------------------


def contract_record(contract: PolicyContract) -> str:
    """The contract as routers that do not serve the model read it from Redis: every
    input and output in the model's own shapes, and the sidecar's declarations."""
    return json.dumps(
        {
            "inputs": [s.to_json() for s in contract.inputs],
            "outputs": [s.to_json() for s in contract.outputs],
            "state": dict(contract.state),
            "chunk": contract.chunk,
            "batch_axis": contract.batch_axis,
            "observations": dict(contract.observations),
            "metadata": dict(contract.metadata),
        },
        sort_keys=True,
    )


def contract_from_record(text: str) -> PolicyContract:
    """:func:`contract_record` back; raises ``ValueError`` for a malformed record."""
    try:
        doc = json.loads(text)

        def specs(key: str) -> tuple[TensorSpec, ...]:
            return tuple(
                TensorSpec(str(s["name"]), tuple(s["shape"]), str(s["dtype"])) for s in doc[key]
            )

        return PolicyContract(
            inputs=specs("inputs"),
            outputs=specs("outputs"),
            state=MappingProxyType(dict(doc["state"])),
            chunk=doc["chunk"],
            batch_axis=bool(doc["batch_axis"]),
            observations=MappingProxyType(dict(doc["observations"])),
            metadata=MappingProxyType(dict(doc["metadata"])),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed model contract record: {exc}") from None


# ---- the fleet's models ---------------------------------------------------------------


class Catalog:
    """The models of the fleet as this node last read them (live nodes' registrations)
    and their contracts; the local ones always known. Reads on ``registry``'s Redis client
    (None: the local models only). Event loop only."""

    def __init__(
        self,
        local: Mapping[str, tuple[ModelId, PolicyContract]],
        registry: Registry | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = dict(local)
        self.inventory = Inventory(registry.redis, registry.settings) if registry else None
        self.registered = Models(registry.redis, registry.settings) if registry else None
        self.clock = clock
        # name -> versions served by a live node (newest last); read from Redis
        self._fleet: dict[str, list[str]] = {m.name: [m.version] for m, _ in self.local.values()}
        self._contracts: dict[ModelId, PolicyContract] = {m: c for m, c in self.local.values()}
        self._read_at = -float("inf")
        self._refreshing: asyncio.Task[None] | None = None

    def local_ids(self) -> list[ModelId]:
        """The (name, version) of the models this node serves."""
        return [m for m, _ in self.local.values()]

    def served(self) -> list[str]:
        """The model names the fleet serves now, sorted."""
        return sorted(self._fleet)

    async def refresh(self, *, force: bool = False) -> None:
        """Read the fleet's models from Redis (at most every :data:`REFRESH_S` unless
        ``force``). A failure keeps the last view (logged)."""
        if self.inventory is None or (not force and self.clock() - self._read_at < REFRESH_S):
            return
        self._read_at = self.clock()
        try:
            rows = await self.inventory.models()
        except Exception as exc:
            log.warning("could not read the fleet's models: %s", exc)
            return
        fleet: dict[str, list[str]] = {}
        for row in rows:  # by name, then oldest registration first
            if row.nodes:
                fleet.setdefault(row.name, []).append(row.version)
        for m, _ in self.local.values():  # known before Redis is
            if m.version not in fleet.setdefault(m.name, []):
                fleet[m.name].append(m.version)
        self._fleet = fleet

    async def _refresh_due(self) -> None:
        """Read the fleet's models when the view is older than :data:`REFRESH_S`. Wait
        :data:`REFRESH_WAIT_S` at most. A read Redis does not answer goes on in the
        background, and the step goes on with the view it has."""
        task = self._refreshing
        if task is None:
            if self.inventory is None or self.clock() - self._read_at < REFRESH_S:
                return
            self._refreshing = task = asyncio.ensure_future(self.refresh())
            task.add_done_callback(self._refreshed)
        await asyncio.wait({task}, timeout=REFRESH_WAIT_S)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._refreshing = None
        if not task.cancelled():
            task.exception()  # refresh() logs its own failures

    async def choose(self, name: str | None, version: str | None = None) -> str:
        """The model name a step is for: ``name`` when some live node serves it, the
        fleet's only one when ``name`` is None. Raises :class:`AmbiguousModel` (None with
        several served) and :class:`UnknownModel` (none serves it)."""
        await self._refresh_due()
        if name is None:
            if len(self._fleet) == 1:
                return next(iter(self._fleet))
            await self.refresh(force=True)
            if len(self._fleet) == 1:
                return next(iter(self._fleet))
            raise AmbiguousModel(self.served())
        check_model_part("name", name)
        if version is not None:
            check_model_part("version", version)
        if name not in self._fleet or (version and version not in self._fleet[name]):
            await self.refresh(force=True)
        if name not in self._fleet:
            raise UnknownModel(name, self.served())
        if version and version not in self._fleet[name]:
            raise UnknownModel(f"{name}@{version}", self.served())
        return name

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` live nodes serve, oldest registration first."""
        return list(self._fleet.get(name) or [])

    def newest(self, name: str) -> str:
        """The newest version of ``name`` a live node serves ("" when none)."""
        versions = self._fleet.get(name) or []
        return versions[-1] if versions else ""

    async def contract(self, name: str, version: str | None = None) -> PolicyContract:
        """The contract inputs of model ``name`` are checked against: the local model's,
        else the registered one of ``version`` (else of the newest version served). Raises
        :class:`UnknownModel` when no contract is registered."""
        local = self.local.get(name)
        if local is not None and version in (None, "", local[0].version):
            return local[1]
        versions = self._fleet.get(name) or []
        chosen = version or (versions[-1] if versions else "")
        model = ModelId(name, chosen)
        known = self._contracts.get(model)
        if known is not None:
            return known
        text = await self.registered.contract(model) if self.registered and chosen else None
        if text is None:
            raise UnknownModel(str(model) if chosen else name, self.served())
        self._contracts[model] = contract = contract_from_record(text)
        return contract
