"""``affinity-node``'s flags: one table, each row a flag, its variable, bounds and field.

``parse_args`` reads flags and ``AFFINITY_*`` variables (the flag wins) into a
``NodeConfig``. Every value is checked before anything starts; a bad one exits 2 naming
the flag. A new flag is one row here and one field of ``NodeConfig``, ``Settings`` or
``ProviderSettings``. Hazard: the cluster secret and admin token come from the environment
only, never a flag.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from affinity import Settings
from affinity.claims import PLACEMENTS
from affinity.config import ENV_VARS, MAX_REPLICAS
from affinity.connection import url_problem
from affinity.errors import InvalidArgument
from affinity.registry import MAX_WEIGHT, check_node_id
from node import VERSION
from node.catalog import ModelSpec, parse_model_arg
from node.chunks import ENSEMBLES
from node.config import NodeConfig
from node.providers import ProviderSettings

__all__ = ["EXIT_USAGE", "flag_message", "parse_args"]

EXIT_USAGE = 2
"""Exit status of a usage or configuration error (one line naming the flag)."""
LOG_LEVELS = ("debug", "info", "warning", "error")

HELP = """\
Serve a policy on this host's devices as one node of an affinity fleet: episodes stick to
one device across hosts, with Redis as the source of truth. Every flag also reads the
environment variable named in its help (the flag wins). Without --redis the node runs on an
embedded single-host store.

Exit codes: 0 after a graceful stop (SIGTERM: episodes handed over, deregistered), 2 for a
usage or configuration error (one line naming the flag), 3 when Redis cannot be reached at
start-up, 4 when another running process holds this node id, 5 when GPUs are found that
CUDA cannot run (one line naming the missing library), 6 when the node cannot listen on
--host/--port or --grpc-port (checked before it registers)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag (no usage dump), exit code 2."""
        self.exit(EXIT_USAGE, f"affinity-node: {message} (see affinity-node --help)\n")


@dataclass(frozen=True)
class _Flag:
    """One flag: its variable, default, help, how its text converts, what it allows, and
    the configuration field it sets. ``into`` is empty for the field named as the flag;
    ``settings.<field>`` and ``providers.<field>`` for the two nested settings."""

    name: str
    env: str
    default: Any
    help: str
    kind: Callable[[str], Any] = str
    low: float | None = None  # the lowest value allowed (with high: inclusive)
    high: float | None = None
    positive: bool = False  # seconds: more than 0
    choices: tuple[str, ...] = ()  # the words allowed (case-insensitive)
    many: bool = False  # given once per value; the variable's values are comma-separated
    into: str = ""

    @property
    def key(self) -> str:
        """The flag's name as a Python identifier (``--lease-ttl``: ``lease_ttl``)."""
        return self.name[2:].replace("-", "_")

    @property
    def target(self) -> str:
        """The field it sets, dotted for a nested setting (``settings.lease_ttl_s``)."""
        return self.into or self.key

    @property
    def bounds(self) -> str:
        """The allowed values for ``--help`` (empty: any value of the kind)."""
        if self.low is not None and self.high is not None:
            return f"{self.low}-{self.high}; "
        return "more than 0; " if self.positive else ""

    def problem(self, value: Any) -> str | None:
        """What is wrong with a converted value (``None``: nothing)."""
        if self.low is not None and self.high is not None and not self.low <= value <= self.high:
            return f"must be {self.low}-{self.high}"
        if self.positive and not value > 0:
            return "must be more than 0 seconds"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return None


_FLAGS = (
    _Flag("--redis", "AFFINITY_REDIS_URL", None,
          "Redis URL: redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// "
          "(none: the embedded single-host store)", into="settings.redis_url"),
    _Flag("--namespace", "AFFINITY_NAMESPACE", "affinity", "prefix of every Redis key",
          into="settings.namespace"),
    _Flag("--redis-replicas", "AFFINITY_REDIS_REPLICAS", 0,
          "replicas that must acknowledge (WAIT) every claim, renewal and slide before the "
          "node serves on it (0: no WAIT; needs --redis, not Redis Cluster)", int,
          low=0, high=MAX_REPLICAS, into="settings.redis_replicas"),
    _Flag("--redis-wait", "AFFINITY_REDIS_WAIT", 0.1,
          "seconds a write waits for --redis-replicas acknowledgements (at most half of "
          "AFFINITY_REDIS_TIMEOUT)", float, positive=True, into="settings.redis_wait_s"),
    _Flag("--node-id", "AFFINITY_NODE_ID", None, "this node's id (none: the host name)"),
    _Flag("--host", "AFFINITY_HOST", "127.0.0.1", "address to listen on"),
    _Flag("--port", "AFFINITY_PORT", 8000, "port to listen on", int, low=1, high=65535),
    _Flag("--advertise-url", "AFFINITY_ADVERTISE_URL", None,
          "URL other nodes forward to (none: http://<host>:<port>)"),
    _Flag("--devices", "AFFINITY_DEVICES", "auto",
          "auto | cpu:N | GPU indices or UUIDs such as 0,2"),
    _Flag("--model", "AFFINITY_MODEL", "demo",
          "ONNX policy: a packaged name (demo, vla-demo) or a file, as [NAME=]FILE[@VERSION]; "
          "give it once per model the node serves (env: comma-separated)",
          many=True, into="models"),
    _Flag("--shadow-model", "AFFINITY_SHADOW_MODEL", "",
          "a candidate version this node may run as ghost episodes beside its live ones "
          "(affinity shadow), as NAME=FILE@VERSION; repeatable (env: comma-separated)",
          many=True, into="shadow_models"),
    _Flag("--model-name", "AFFINITY_MODEL_NAME", None,
          "the model's name for KServe v2 clients (none: the model file's stem)"),
    _Flag("--capacity", "AFFINITY_CAPACITY", 64, "live episodes per device", int,
          low=1, high=1_000_000),
    _Flag("--weight", "AFFINITY_WEIGHT", 1, "share of new episodes per device", int,
          low=1, high=MAX_WEIGHT),
    _Flag("--episode-ttl", "AFFINITY_EPISODE_TTL", 300.0,
          "seconds idle before an episode's owner ends it", float, positive=True,
          into="settings.episode_ttl_s"),
    _Flag("--lease-ttl", "AFFINITY_LEASE_TTL", 10.0,
          "seconds of the node's lease (renewed every third)", float, positive=True,
          into="settings.lease_ttl_s"),
    _Flag("--act-deadline", "AFFINITY_ACT_DEADLINE", 5.0,
          "seconds within which every step answers", float, positive=True,
          into="act_deadline_s"),
    _Flag("--drain-timeout", "AFFINITY_DRAIN_TIMEOUT", 20.0,
          "seconds: the most a graceful stop (SIGTERM) spends handing episodes over before "
          "it deregisters", float, positive=True, into="drain_timeout_s"),
    _Flag("--max-body-bytes", "AFFINITY_MAX_BODY_BYTES", 1 << 24,
          "bytes of one request body or websocket message", int, low=1, high=1 << 31),
    _Flag("--max-rows", "AFFINITY_MAX_ROWS", 256,
          "rows (episodes' steps) of one message; more are refused 413 before any decoding",
          int, low=1, high=65_536),
    _Flag("--keep-alive", "AFFINITY_KEEP_ALIVE", 5.0,
          "seconds an idle client connection is kept open", float, positive=True,
          into="keep_alive_s"),
    _Flag("--trt-cache", "AFFINITY_TRT_CACHE", "~/.cache/affinity/trt",
          "TensorRT engine cache root", Path, into="providers.trt_cache_root"),
    _Flag("--max-batch", "AFFINITY_MAX_BATCH", None,
          "steps of different episodes per model run (none: 8 when the model's batch axis "
          "is dynamic, else 1; 1 turns batching off)", int, low=1, high=4096),
    _Flag("--batch-delay", "AFFINITY_BATCH_DELAY", 500.0,
          "microseconds a device waits for more steps once one waits (only while another "
          "recently active episode may send one)", float, low=0, high=60_000_000,
          into="batch_delay_us"),
    _Flag("--inline-under", "AFFINITY_INLINE_UNDER", 500.0,
          "microseconds: a device whose model runs take less on average runs a step on the "
          "event loop when nothing else is running (no thread hand-off); 0 turns it off",
          float, low=0, high=1_000_000, into="inline_under_us"),
    _Flag("--execute-steps", "AFFINITY_EXECUTE_STEPS", None,
          "action-chunk execution: run the policy every k steps, serve the buffer between "
          "(none: every step runs the model)", int, low=1, high=4096),
    _Flag("--ensemble", "AFFINITY_ENSEMBLE", "none",
          "none | exp: temporal ensembling of overlapping chunks (ACT)", choices=ENSEMBLES),
    _Flag("--ensemble-decay", "AFFINITY_ENSEMBLE_DECAY", 0.01,
          "m in ACT's weights w_i = exp(-m*i), oldest prediction first", float,
          low=0, high=1000),
    _Flag("--control-hz", "AFFINITY_CONTROL_HZ", None,
          "the robots' control rate, for real-time chunking's estimates of executed and "
          "inference_delay when a step does not send them (none: steps send them or "
          "control_hz)", float, low=0.001, high=10_000),
    _Flag("--placement", "AFFINITY_PLACEMENT", "round-robin",
          "scored | round-robin: a new episode takes the device with the lowest predicted "
          "step time (scored), or the next of the weighted round-robin (docs/policies.md)",
          choices=PLACEMENTS),
    _Flag("--placement-headroom", "AFFINITY_PLACEMENT_HEADROOM", 0.8,
          "scored placement: a device whose predicted step time exceeds this share of a new "
          "episode's control period (its control_hz, else --control-hz) is not chosen; none "
          "left: 503 slo", float, low=0.01, high=100),
    _Flag("--fleet-view-every", "AFFINITY_FLEET_VIEW_EVERY", 10.0,
          "seconds between reads of the fleet's load per model version for the "
          "affinity_fleet_* gauges (one node of the fleet reads the devices each period, "
          "the others its result; 0: off)", float, low=0, high=3600,
          into="fleet_view_every_s"),
    _Flag("--failure-threshold", "AFFINITY_FAILURE_THRESHOLD", 3,
          "consecutive model failures before a device goes down", int, low=1, high=1_000_000),
    _Flag("--cooldown", "AFFINITY_COOLDOWN", 30.0,
          "seconds a down device waits before its probe", float, low=0, high=86_400,
          into="cooldown_s"),
    _Flag("--embedded-port", "AFFINITY_EMBEDDED_PORT", None,
          "with the embedded store: also answer the Redis protocol on this port", int,
          low=1, high=65535),
    _Flag("--admission-wait", "AFFINITY_ADMISSION_WAIT", 0.0,
          "seconds a new episode that finds every device full waits in a first-come backlog "
          "for a slot (within --act-deadline; 0: 503 at once)", float,
          into="admission_wait_s"),
    _Flag("--front-doors", "AFFINITY_FRONT_DOORS", 1,
          "processes that accept and decode HTTP requests on --port, sharing its socket; "
          "/act and openpi steps cross to the node's process over shared memory (1: that "
          "process alone; N > 1 is slower than 1 until the worker processes come: "
          "docs/operations.md)",
          int, low=1, high=64),
    _Flag("--front-hang-timeout", "AFFINITY_FRONT_HANG_TIMEOUT", 30.0,
          "seconds a front door process's event loop may go without running (paused, or "
          "blocked) before the node kills and restarts it: the connections the kernel "
          "queues on its socket wait for the new one (0: never)", float, low=0,
          high=86_400, into="front_hang_s"),
    _Flag("--device-workers", "AFFINITY_DEVICE_WORKERS", "thread",
          "where each device's model sessions run: thread (a thread of the node's process) "
          "| process (a worker process per device, restarted when it dies: "
          "docs/operations.md)", choices=("thread", "process")),
    _Flag("--grpc-port", "AFFINITY_GRPC_PORT", None,
          "also serve KServe v2 over gRPC (Triton's GRPCInferenceService) on this port "
          "(none: off)", int, low=1, high=65535),
    _Flag("--api-key", "AFFINITY_API_KEY", None,
          "when set, clients must send Authorization: Api-Key <key> (openpi-client's api_key)"),
    _Flag("--record", "AFFINITY_RECORD", None,
          "record the episodes `affinity record` selects as LeRobot dataset segments "
          "under this directory or fsspec URL (none: off; needs the record extra)"),
    _Flag("--log-level", "AFFINITY_LOG_LEVEL", "info", "debug | info | warning | error",
          choices=LOG_LEVELS),
    _Flag("--log-format", "AFFINITY_LOG_FORMAT", "plain", "plain | json (every log line)",
          choices=("plain", "json")),
    _Flag("--access-log", "AFFINITY_ACCESS_LOG", "on", "on | off: one line per request",
          choices=("on", "off")),
)  # fmt: skip
"""Every flag that takes a value, in ``--help``'s order."""
_SWITCHES = (
    _Flag("--tensorrt", "AFFINITY_TENSORRT", False, "put TensorRT first on GPUs",
          into="providers.tensorrt"),
    _Flag("--cuda-graph", "AFFINITY_CUDA_GRAPH", False, "capture one CUDA graph per device",
          into="providers.cuda_graph"),
    _Flag("--kserve-claim-unknown", "AFFINITY_KSERVE_CLAIM_UNKNOWN", False,
          "KServe: a request for an unknown sequence starts it (Triton refuses it)"),
)  # fmt: skip
"""Every flag that is on or off (its variable: ``1``, ``true``, ``yes`` or ``on``)."""


def _is_on(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> NodeConfig:
    """The node's configuration from flags and ``AFFINITY_*`` variables (flags win).

    Exits with code 2 and one line naming the flag on a bad value, and when a node on Redis
    has no ``AFFINITY_CLUSTER_SECRET``."""
    env = os.environ if env is None else env
    parser = _parser(env)
    given = parser.parse_args(argv)
    values = {f.key: _value(parser, f, getattr(given, f.key), env) for f in _FLAGS}
    values.update((f.key, getattr(given, f.key)) for f in _SWITCHES)
    _check_together(parser, values)
    values.update(_derived(parser, values))
    config = _config(parser, values, env)
    if config.settings.redis_url and not config.cluster_secret:
        # without it any host that reaches a node's port could install and confirm a
        # forged record through /internal/move (docs/security.md)
        parser.error(
            "AFFINITY_CLUSTER_SECRET is unset: a node on Redis (--redis) needs the fleet's "
            "cluster secret, the same on every node, to authenticate the calls between nodes "
            "(e.g. export AFFINITY_CLUSTER_SECRET=$(openssl rand -hex 32))"
        )
    return config


def _parser(env: Mapping[str, str]) -> _Parser:
    """The argument parser of the table, each default read from ``env`` first."""
    parser = _Parser(
        prog="affinity-node",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"affinity-node {VERSION}")
    for f in _FLAGS:
        raw = env.get(f.env)
        default = f.default if raw is None or raw == "" else raw
        parser.add_argument(
            f.name,
            **({"action": "append", "default": None} if f.many else {"default": default}),
            help=f"{f.help} ({f.bounds}default: "
            f"{f.default if f.default is not None else 'none'}; env {f.env})",
        )
    for f in _SWITCHES:
        parser.add_argument(f.name, action="store_true", default=_is_on(env.get(f.env)),
                            help=f"{f.help} (default: off; env {f.env}=1)")  # fmt: skip
    return parser


def _value(parser: _Parser, f: _Flag, value: Any, env: Mapping[str, str]) -> Any:
    """``f``'s value as given (or from ``env``, or its default), converted and checked."""
    if f.many:  # repeatable; the environment's is comma-separated
        value = value or (env.get(f.env) or f.default).split(",")
    if isinstance(value, str) and f.kind is not str:
        try:
            value = f.kind(value)
        except ValueError:
            parser.error(f"{f.name} {value!r}: must be {f.kind.__name__} (env {f.env})")
    if f.choices:
        value = value.lower()
    problem = None if value is None else f.problem(value)
    if problem is not None:
        parser.error(f"{f.name} {value!r}: {problem} (env {f.env})")
    return value


def _check_together(parser: _Parser, values: Mapping[str, Any]) -> None:
    """The rules between flags, and the Redis URL's form."""
    wait = values["admission_wait"]
    if not 0 <= wait < values["act_deadline"]:
        parser.error(f"--admission-wait {wait}: must be >= 0 and less than --act-deadline "
                     "(env AFFINITY_ADMISSION_WAIT)")  # fmt: skip
    if values["redis"]:
        problem = url_problem(values["redis"])
        if problem is not None:
            parser.error(f"--redis {values['redis']!r}: {problem} (env AFFINITY_REDIS_URL)")
    if values["grpc_port"] is not None and values["grpc_port"] == values["port"]:
        parser.error(f"--grpc-port {values['grpc_port']}: must differ from --port, where the "
                     "node serves HTTP (env AFFINITY_GRPC_PORT)")  # fmt: skip
    if values["model_name"] and len(values["model"]) > 1:
        parser.error("--model-name: only with one --model; name each model as NAME=FILE instead")


def _derived(parser: _Parser, values: Mapping[str, Any]) -> dict[str, Any]:
    """The values a flag's text does not give as such. The node id and advertise URL when
    not given. The models and their first one's name. The words made values."""
    node_id = values["node_id"] or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128]
    try:
        check_node_id(node_id)
    except InvalidArgument as exc:
        parser.error(f"--node-id {node_id!r}: {exc.limit} (env AFFINITY_NODE_ID)")
    host, given = values["host"], values["advertise_url"]
    if given and (urlsplit(given).scheme not in ("http", "https") or not urlsplit(given).netloc):
        parser.error(f"--advertise-url {given!r}: must be a URL such as http://host:8000 "
                     "(env AFFINITY_ADVERTISE_URL)")  # fmt: skip
    advertise = given or (
        f"http://{host if host != '0.0.0.0' else socket.gethostname()}:{values['port']}"
    )
    models = _models(parser, values["model"], values["model_name"])
    shadows = [_shadow_model(parser, text) for text in values["shadow_model"] if text]
    return {
        "shadow_model": tuple(shadows),
        "node_id": node_id,
        "advertise_url": advertise.rstrip("/"),
        "model": tuple(models),
        "model_name": models[0].name,
        "ensemble": None if values["ensemble"] == "none" else values["ensemble"],
        "access_log": values["access_log"] == "on",
        "api_key": values["api_key"] or None,
    }


def _models(parser: _Parser, given: Sequence[str], name: str | None) -> list[ModelSpec]:
    """The models of ``--model`` in order, each named once."""
    models = []
    for text in given:
        try:
            models.append(parse_model_arg(text, name))
        except ValueError as exc:  # InvalidArgument included
            parser.error(f"--model {text!r}: {getattr(exc, 'limit', exc)} (env AFFINITY_MODEL)")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        parser.error(f"--model: the names {', '.join(names)} repeat; name each model as NAME=FILE")
    return models


def _shadow_model(parser: _Parser, text: str) -> ModelSpec:
    """One ``--shadow-model``: a name and version are needed (it is named by them)."""
    try:
        spec = parse_model_arg(text)
    except ValueError as exc:  # InvalidArgument included
        parser.error(f"--shadow-model {text!r}: {getattr(exc, 'limit', exc)} "
                     "(env AFFINITY_SHADOW_MODEL)")  # fmt: skip
    if spec.version is None or "=" not in text:
        parser.error(f"--shadow-model {text!r}: give NAME=FILE@VERSION "
                     "(env AFFINITY_SHADOW_MODEL)")  # fmt: skip
    return spec


def _config(parser: _Parser, values: Mapping[str, Any], env: Mapping[str, str]) -> NodeConfig:
    """The configuration: each flag's value in the field its ``into`` names, and the two
    secrets that are read from the environment only."""
    fields: dict[str, dict[str, Any]] = {"": {}, "settings": {}, "providers": {}}
    for f in (*_FLAGS, *_SWITCHES):
        group, _, name = f.target.rpartition(".")
        fields[group][name] = values[f.key]
    try:
        return NodeConfig(
            settings=Settings.from_env(env, **fields["settings"]),
            providers=ProviderSettings(**fields["providers"]),
            model=fields[""]["models"][0].path,
            admin_token=env.get("AFFINITY_ADMIN_TOKEN") or None,
            cluster_secret=env.get("AFFINITY_CLUSTER_SECRET") or None,
            **fields[""],
        )
    except ValueError as exc:  # InvalidArgument included: it names the setting
        parser.error(flag_message(exc))


def _flag(key: str) -> _Flag:
    """The flag of a configuration key (``lease_ttl`` or ``lease_ttl_s``: ``--lease-ttl``)."""
    name = "--" + key.removesuffix("_s").replace("_", "-")
    return next(f for f in _FLAGS if f.name == name)


def flag_message(exc: ValueError) -> str:
    """``exc``'s message naming the flag or variable a person sets, never a field of the
    code (``invalid execute_steps 5``: ``--execute-steps 5``)."""
    if isinstance(exc, InvalidArgument):
        if any(f.name == "--" + exc.field.removesuffix("_s").replace("_", "-") for f in _FLAGS):
            flag = _flag(exc.field)
            return f"{flag.name} {exc.value!r}: {exc.limit} (env {flag.env})"
        if exc.field in ENV_VARS:
            return f"{ENV_VARS[exc.field]}={exc.value!r}: {exc.limit}"
    return str(exc)
