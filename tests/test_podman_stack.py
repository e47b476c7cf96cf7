"""Issue 42 item 21: the image and the compose stack, run for real with Podman.

The node image is built from ``docker/Dockerfile`` on a Debian bookworm base made here with
``debootstrap`` and ``podman import`` (no registry is reachable; the base is cached under
``/var/tmp/affinity-podman-base`` and in Podman's storage, keyed by a hash of what goes into
it). ``docker/compose.yaml`` (Redis, fleet-init, two nodes, Prometheus) then runs under each
of two compose runners, ``podman-compose`` and ``docker-compose`` through Podman's Docker API,
with an override of this test's own: the images of Docker Hub replaced by that
base, a ulimit Podman may set without ``CAP_SYS_RESOURCE``, and free ports on 127.0.0.1. An
unmodified ``openpi-client`` robot steps an episode across a ``podman stop`` of its owner's
container; the nodes run as the Kubernetes manifests run them. Podman is configured by a
``containers.conf`` of the test's own (runc, cgroupfs, ``default_ulimits`` cleared). Every
container, network and volume of the run is removed at the end, also on failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Keys
from node.models import DEMO_MODEL
from tests.procs import ROOT, free_port, wait_until
from tests.rollout import reference_rollout

pytestmark = [
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() outside a with block
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kubernetes" / "base" / "node.yaml"
CACHE = Path(os.environ.get("AFFINITY_PODMAN_CACHE", "/var/tmp/affinity-podman-base"))
MIRROR = os.environ.get("AFFINITY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
# python3.11-venv for the Dockerfile's venv (debootstrap's resolver needs its distutils named);
# redis-server and prometheus stand in for the redis and prom/prometheus images; wget for
# Prometheus' health check.
PACKAGES = (
    "python3.11", "python3.11-venv", "python3-distutils", "python3-lib2to3", "ca-certificates",
    "redis-server", "redis-tools", "prometheus", "wget",
)  # fmt: skip
NODE_IMAGE = "localhost/affinity-node:podman-test"
ULIMITS = {"nofile": {"soft": 4096, "hard": 4096}, "nproc": {"soft": 4096, "hard": 4096}}
ULIMIT_ARGS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
log_driver = "k8s-file"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
"""
SERVICES = ("redis", "node-a", "node-b", "prometheus")  # what the test runs (no Grafana image)
STEPS, STOP_AT = 8, 3  # the owner's container is stopped before step 3 (counting from 0)
KEYS = Keys()


def compose_file() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text(encoding="utf-8")))


def base_tag() -> str:
    recipe = json.dumps(["v1", SUITE, MIRROR, "minbase", sorted(PACKAGES)]).encode()
    return "localhost/affinity-podman-base:" + hashlib.sha256(recipe).hexdigest()[:16]


@dataclass
class Podman:
    """``podman`` and a compose runner (``podman-compose``, or ``docker-compose`` talking to
    Podman's Docker API) with the test's containers.conf, every call bounded."""

    conf: Path
    project: str = ""
    runner: str = "podman-compose"
    env: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf), **self.env}

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, stdin: Any = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args], env=self.environ(), capture_output=True, text=True,
            timeout=timeout, stdin=stdin,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
        return done

    def compose(self, *args: str, override: Path, timeout: float = 300) -> str:
        argv = [self.runner, "-p", self.project, "-f", str(COMPOSE), "-f", str(override)]
        done = subprocess.run(
            [*argv, *args], env=self.environ(), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, f"{self.runner} {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"  # both runners' naming

    def label(self) -> str:
        return f"label=com.docker.compose.project={self.project}"  # both runners set it

    def inspect(self, service: str) -> dict[str, Any]:
        (info,) = json.loads(self("inspect", self.container(service)).stdout)
        return dict(info)

    def exec(self, service: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return self("exec", self.container(service), *argv, check=False, timeout=60)

    def logs(self) -> str:
        names = self("ps", "-a", "--format", "{{.Names}}", "--filter", self.label(), check=False)
        out = []
        for name in names.stdout.split():
            done = self("logs", "--tail", "40", name, check=False, timeout=30)
            out.append(f"--- {name}\n{done.stdout}{done.stderr}")
        return "\n".join(out)


def unusable() -> str | None:
    """Why Podman cannot run this stack here, or None."""
    if os.geteuid() != 0:
        return "Podman runs these containers as root here (rootless needs subuids and slirp)"
    helpers = "/usr/lib/podman:/usr/libexec/podman"  # the bridge network and its DNS
    for tool in ("podman", "podman-compose", "runc", "debootstrap", "netavark", "aardvark-dns"):
        if shutil.which(tool) is None and shutil.which(tool, path=helpers) is None:
            return (
                f"{tool} is not installed (bash .ci/run installs podman, podman-compose, runc, "
                "netavark, aardvark-dns and debootstrap)"
            )
    return None


def ensure_base(podman: Podman) -> str:
    """The base image: Debian bookworm from debootstrap, imported once and cached (Podman's
    storage, and the root file system's tar under CACHE should that storage be wiped)."""
    tag = base_tag()
    if podman("image", "exists", tag, check=False).returncode == 0:
        return tag
    CACHE.mkdir(parents=True, exist_ok=True)
    name = tag.rsplit(":", 1)[1]
    tarball = CACHE / f"{name}.tar"
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second run waits for the first's debootstrap
        if podman("image", "exists", tag, check=False).returncode == 0:
            return tag
        if not tarball.exists():
            rootfs = CACHE / f"{name}.rootfs"
            shutil.rmtree(rootfs, ignore_errors=True)
            done = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                 str(rootfs), MIRROR],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            assert done.returncode == 0, f"debootstrap failed:\n{done.stdout[-3000:]}"
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "debootstrap"):
                for path in (rootfs / junk).glob("*"):
                    if path.is_file():
                        path.unlink()
            shutil.rmtree(rootfs / "debootstrap", ignore_errors=True)
            partial = tarball.with_suffix(".partial")
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True,
                           timeout=300)  # fmt: skip
            partial.rename(tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
        with tarball.open("rb") as stream:
            podman("import", "--change", 'CMD ["/bin/bash"]', "--change",
                   "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "-", tag, stdin=stream, timeout=300)  # fmt: skip
    return tag


def build_node_image(podman: Podman, base: str, tmp: Path) -> None:
    """docker/Dockerfile's runtime stage on that base. pip inside the build reaches PyPI
    through whatever TLS proxy the host trusts: the host's CA bundle is mounted for the
    build's RUN steps only (not kept in the image)."""
    bundle = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    pip_conf = tmp / "pip.conf"
    pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    mounts = []
    if bundle.is_file():
        mounts = ["-v", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro",
                  "-v", f"{pip_conf}:/etc/pip.conf:ro"]  # fmt: skip
    podman(
        "build", "--format", "docker", *ULIMIT_ARGS, *mounts, "--build-arg",
        f"BASE_IMAGE={base}", "--target", "runtime", "-f", str(DOCKERFILE), "-t", NODE_IMAGE,
        str(ROOT), timeout=600,
    )  # fmt: skip


def override(base: str) -> dict[str, Any]:
    """What differs from docker/compose.yaml here: Debian's redis-server and prometheus on
    the debootstrap base instead of Docker Hub's images (Debian's redis-server keeps its
    protected mode unless told; the official image builds without it), the node image built
    above, and a ulimit Podman may set without CAP_SYS_RESOURCE."""
    redis_entry = ["sh", "-c", 'exec "$$0" "$$@" --protected-mode no']
    services: dict[str, Any] = {
        "redis": {"image": base, "entrypoint": redis_entry},
        "fleet-init": {"image": NODE_IMAGE},
        "node-a": {"image": NODE_IMAGE},
        "node-b": {"image": NODE_IMAGE},
        "prometheus": {"image": base, "entrypoint": ["/usr/bin/prometheus"]},
    }
    for service in services.values():
        service["ulimits"] = ULIMITS
    return {"services": services}


@dataclass
class Stack:
    podman: Podman
    urls: dict[str, str]  # node id -> http://127.0.0.1:port
    prometheus: str


def healthy(podman: Podman, service: str) -> bool:
    """Runs the container's health check (Podman's timers need systemd, absent here) and
    says whether Podman now reports it healthy."""
    state = podman.inspect(service)["State"]
    assert state["Running"], f"{service} is not running:\n{podman.logs()}"
    if podman("healthcheck", "run", podman.container(service), check=False).returncode != 0:
        return False
    return str(podman.inspect(service)["State"]["Health"]["Status"]) == "healthy"


@dataclass
class Images:
    conf: Path  # the test's containers.conf
    base: str


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    """The base and the node image, built once for both runners."""
    reason = unusable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("podman")
    conf = tmp / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    podman = Podman(conf)
    info = podman("info", "--format", "json", check=False, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {info.stderr.strip()[-300:]}")
    assert json.loads(info.stdout)["host"]["ociRuntime"]["name"] == "runc"
    base = ensure_base(podman)
    build_node_image(podman, base, tmp)
    return Images(conf, base)


class HealthPump:
    """Runs the project's health checks every second, as Podman's systemd timers would:
    docker-compose waits on ``condition: service_healthy`` for a status nobody updates
    on a host without systemd."""

    def __init__(self, podman: Podman) -> None:
        self.podman, self.stop = podman, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            ids = self.podman("ps", "-q", "--filter", self.podman.label(), check=False)
            for cid in ids.stdout.split():
                self.podman("healthcheck", "run", cid, check=False, timeout=30)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def docker_api(podman: Podman, tmp: Path) -> subprocess.Popen[bytes]:
    """``podman system service`` on a socket of the test's own, for docker-compose."""
    sock = tmp / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=podman.environ(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    podman.env["DOCKER_HOST"] = f"unix://{sock}"
    wait_until(sock.exists, 30, "podman system service listening", interval=0.2)
    return service


@pytest.fixture(scope="module", params=["podman-compose", "docker-compose"])
def stack(
    request: pytest.FixtureRequest, images: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """docker/compose.yaml running under either runner: podman-compose (Debian 12's 1.0.3,
    which ignores depends_on's conditions: the test starts the services in their order) or
    Debian's docker-compose 1.29 through Podman's Docker API (which waits on them itself)."""
    runner = str(request.param)
    if shutil.which(runner) is None:
        pytest.skip(f"{runner} is not installed (bash .ci/run installs it)")
    tmp = tmp_path_factory.mktemp(runner)
    ports = {"a": free_port(), "b": free_port(), "prom": free_port()}
    podman = Podman(
        images.conf,
        f"affinity-podman-{uuid.uuid4().hex[:8]}",
        runner,
        {
            "AFFINITY_NODE_A_PORT": str(ports["a"]),
            "AFFINITY_NODE_B_PORT": str(ports["b"]),
            "AFFINITY_PROMETHEUS_PORT": str(ports["prom"]),
        },
    )
    extra = tmp / "compose.podman.yaml"
    extra.write_text(yaml.safe_dump(override(images.base)))
    service: subprocess.Popen[bytes] | None = None
    pump: HealthPump | None = None
    try:
        if runner == "docker-compose":
            service = docker_api(podman, tmp)
            pump = HealthPump(podman)
            podman.compose("up", "-d", "--no-build", "node-a", "node-b", "prometheus",
                           override=extra)  # fmt: skip
        else:
            # It ignores --no-deps too: the last `up` starts redis, running already, and
            # fleet-init, which finds its marker there and writes nothing, again.
            podman.compose("up", "-d", "--no-build", "redis", override=extra)
            wait_until(lambda: healthy(podman, "redis"), 60, "redis healthy", interval=1)
            podman.compose("up", "-d", "--no-build", "--no-deps", "fleet-init", override=extra)
            done = podman("wait", podman.container("fleet-init"), timeout=120)
            assert done.stdout.strip() == "0", podman.logs()
            podman.compose(
                "up", "-d", "--no-build", "--no-deps", "node-a", "node-b", "prometheus",
                override=extra,
            )  # fmt: skip
        done = podman("wait", podman.container("fleet-init"), timeout=120)
        assert done.stdout.strip() == "0", podman.logs()
        for name in SERVICES:
            wait_until(lambda s=name: healthy(podman, s), 120, f"{name} healthy", interval=1)
        yield Stack(
            podman,
            {
                "node-a": f"http://127.0.0.1:{ports['a']}",
                "node-b": f"http://127.0.0.1:{ports['b']}",
            },
            f"http://127.0.0.1:{ports['prom']}",
        )
    finally:
        print(podman.logs())  # shown by pytest when a test failed
        try:
            podman.compose("down", "-v", override=extra, timeout=180)
        finally:
            if pump is not None:
                pump.close()
            left = podman("ps", "-a", "-q", "--filter", podman.label(), check=False).stdout
            if left.split():
                podman("rm", "-f", "-t", "0", *left.split(), check=False)
            volumes = podman("volume", "ls", "-q", "--filter", podman.label(), check=False).stdout
            if volumes.split():
                podman("volume", "rm", "-f", *volumes.split(), check=False)
            podman("network", "rm", "-f", f"{podman.project}_default", check=False)
            if service is not None:
                service.terminate()
                service.wait(30)


def test_the_health_checks_report_healthy_and_prometheus_scrapes_both_nodes(stack: Stack) -> None:
    for service in SERVICES:
        assert healthy(stack.podman, service), service
        check = stack.podman.inspect(service)["Config"]["Healthcheck"]["Test"]
        assert check and check != ["NONE"], f"{service} has no health check"

    def targets_up() -> bool:
        r = httpx.get(stack.prometheus + "/api/v1/targets", timeout=10).json()
        active = r["data"]["activeTargets"]
        return {t["labels"]["node"]: t["health"] for t in active} == {
            "node-a": "up",
            "node-b": "up",
        }

    wait_until(
        targets_up, 60, "Prometheus scrapes node-a and node-b over the compose network", interval=1
    )
    rules = httpx.get(stack.prometheus + "/api/v1/rules", timeout=10).json()
    assert rules["data"]["groups"], "alert rules loaded from docker/prometheus"
    for url in stack.urls.values():  # published on 127.0.0.1 only
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200


def k8s_node_container() -> tuple[dict[str, Any], dict[str, Any]]:
    """deploy/kubernetes/base/node.yaml: the pod's and the node container's specs."""
    for doc in yaml.safe_load_all(MANIFEST.read_text(encoding="utf-8")):
        if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            (container,) = [c for c in pod["containers"] if c.get("volumeMounts")]
            return pod, container
    raise AssertionError(f"no workload in {MANIFEST}")


def test_the_node_image_runs_as_the_kubernetes_manifests_require(stack: Stack) -> None:
    """Non-root as the manifests' runAsUser, a read-only root file system with only the
    manifests' emptyDir mounts writable, no capabilities: and healthy so (test above)."""
    pod, container = k8s_node_container()
    security = {**pod["securityContext"], **container["securityContext"]}
    assert security["readOnlyRootFilesystem"] is True and security["runAsNonRoot"] is True
    image = json.loads(stack.podman("image", "inspect", NODE_IMAGE).stdout)[0]
    assert image["Config"]["User"] not in ("", "root", "0")
    for service in ("node-a", "node-b"):
        info = stack.podman.inspect(service)
        assert info["HostConfig"]["ReadonlyRootfs"] is True
        assert "no-new-privileges" in " ".join(info["HostConfig"]["SecurityOpt"] or [])
        assert info["EffectiveCaps"] in (None, [])
        ids = stack.podman.exec(service, "id", "-u").stdout.strip()
        gid = stack.podman.exec(service, "id", "-g").stdout.strip()
        assert (int(ids), int(gid)) == (security["runAsUser"], security["runAsGroup"])
        denied = stack.podman.exec(service, "touch", "/app/x")
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr
        for mount in container["volumeMounts"]:
            wrote = stack.podman.exec(service, "touch", f"{mount['mountPath']}/x")
            assert wrote.returncode == 0, (mount, wrote.stderr)


@dataclass
class Robot:
    """The README's robot loop with the unmodified openpi-client: on an error it reconnects
    to the next node at once and sends the step again with the same seq."""

    urls: list[str]  # ws://127.0.0.1:port/?episode_id=...
    at: int = 0
    policy: WebsocketClientPolicy | None = None
    errors: list[str] = field(default_factory=list)

    def infer(self, obs: np.ndarray, seq: int) -> dict[str, Any]:
        for attempt in range(10):
            try:
                if self.policy is None:
                    self.policy = WebsocketClientPolicy(self.urls[self.at % len(self.urls)])
                return dict(self.policy.infer({"obs": obs, "seq": seq}))
            except Exception as error:  # the node stopped (close 1012), a lost link
                self.errors.append(repr(error))
                self.close()
                self.at += 1
                if attempt:
                    time.sleep(0.5)
        raise AssertionError(f"step {seq} failed 10 times: {self.errors}")

    def close(self) -> None:
        if self.policy is not None:
            self.policy._ws.close()
            self.policy = None


def test_an_openpi_robot_rides_a_podman_stop_of_its_owners_container(stack: Stack) -> None:
    """The owner's container gets ``podman stop`` (SIGTERM): it hands the episode over with
    its state and exits 0; the robot reconnects to the other node and its next replies
    continue the episode's history (no state_reset, seq counting on)."""
    episode = f"podman-robot-{uuid.uuid4().hex[:6]}"
    ws = {
        n: u.replace("http://", "ws://") + f"/?episode_id={episode}" for n, u in stack.urls.items()
    }
    rng = np.random.default_rng(42)
    obs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(STEPS)]
    robot = Robot([ws["node-a"], ws["node-b"]])
    replies: list[dict[str, Any]] = []
    owner = ""
    try:
        for i in range(STEPS):
            if i == STOP_AT:
                owner = str(replies[-1]["node"])
                assert {r["node"] for r in replies} == {owner}
                # the compose file's stop_grace_period, as `docker compose stop` gives it
                grace = str(compose_file()["services"][owner]["stop_grace_period"]).rstrip("s")
                stack.podman("stop", "-t", grace, stack.podman.container(owner), timeout=120)
                state = stack.podman.inspect(owner)["State"]
                assert (state["Running"], state["ExitCode"]) == (False, 0), stack.podman.logs()
            replies.append(robot.infer(obs[i][0], seq=i + 1))
            if i == 0 and replies[0]["node"] != "node-a":  # ride the owner's own connection
                robot.close()
                robot.at = 1
    finally:
        robot.close()
    assert [r["state_reset"] for r in replies] == [False] * STEPS, replies
    assert [r["seq"] for r in replies] == list(range(1, STEPS + 1))
    other = ({"node-a", "node-b"} - {owner}).pop()
    assert [r["node"] for r in replies] == [owner] * STOP_AT + [other] * (STEPS - STOP_AT)
    assert robot.errors, "the stop closed the robot's connection to its owner"
    want = reference_rollout(DEMO_MODEL, obs)
    for i, (got, w) in enumerate(zip(replies, want, strict=True)):
        np.testing.assert_allclose(
            np.asarray(got["actions"]).reshape(w["actions"].shape), w["actions"], rtol=1e-5,
            err_msg=f"step {i}",
        )  # fmt: skip
    events = stack.podman.exec("redis", "redis-cli", "--json", "XRANGE", KEYS.events, "-", "+")
    assert events.returncode == 0, events.stderr
    stream = [dict(zip(f[::2], f[1::2], strict=True)) for _, f in json.loads(events.stdout)]
    moved = [(e["episode"], e["reason"]) for e in stream if e.get("type") == "moved"]
    assert moved == [(episode, "stop")], stream
