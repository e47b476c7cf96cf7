"""docker/compose.yaml and docker/Dockerfile: the stack they describe is the one the
stack test expects, every setting they pass is one the node reads, and its Prometheus
and Grafana see both nodes and the files in docker/prometheus and docker/grafana."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.procs import ROOT, RedisServer, free_port

COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"
NODES = ("node-a", "node-b")


def load() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


def services() -> dict[str, Any]:
    return dict(load()["services"])


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def healthcheck_command(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return [str(t) for t in test]


def compose_cli() -> list[str] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        try:
            done = subprocess.run([*argv, "version"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return argv
    return None


def test_docker_compose_accepts_the_file() -> None:
    argv = compose_cli()
    if argv is None:
        pytest.skip("neither `docker compose` nor `docker-compose` works here; YAML checked below")
    done = subprocess.run(
        [*argv, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_services() -> None:
    assert {"redis", "fleet-init", *NODES, "prometheus", "grafana", "stack-test"} <= set(services())


def test_fleet_init_marks_the_empty_redis_a_new_fleet_before_any_node() -> None:
    """The stack's Redis starts empty; without the marker its first claims would wait out
    the grace period of a Redis that lost its data (docs/guarantees.md)."""
    all_services = services()
    init = all_services["fleet-init"]
    assert init["entrypoint"] == ["affinity", "new-fleet"]
    assert init["build"]["target"] == "runtime"
    assert init["depends_on"]["redis"]["condition"] == "service_healthy"
    node_urls = {environment(all_services[n])["AFFINITY_REDIS_URL"] for n in NODES}
    assert node_urls == {environment(init)["AFFINITY_REDIS_URL"]}
    for name in NODES:
        assert all_services[name]["depends_on"]["fleet-init"]["condition"] == (
            "service_completed_successfully"
        )


def test_redis_service() -> None:
    redis = services()["redis"]
    assert str(redis["image"]).startswith("docker.io/library/redis:7")
    command = redis["command"]
    command = command if isinstance(command, list) else command.split()
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] in ("", '""')
    assert command[command.index("--appendonly") + 1] == "no"
    kind, *rest = healthcheck_command(redis)
    assert kind == "CMD-SHELL" and "PONG" in rest[0] and "redis-cli ping" in rest[0]


@pytest.mark.integration
def test_redis_healthcheck_really_tests_pong(tmp_path: Path) -> None:
    """The healthcheck's shell line, pointed at a live and at a dead port."""
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is not installed (bash .ci/run installs it)", pytrace=False)
    _, line = healthcheck_command(services()["redis"])

    def run(port: int) -> int:
        shell = line.replace("redis-cli", f"redis-cli -p {port}")
        return subprocess.run(["sh", "-c", shell], capture_output=True, timeout=30).returncode

    server = RedisServer(tmp_path).start()
    try:
        assert run(server.port) == 0
    finally:
        server.stop()
    assert run(free_port()) != 0


def test_nodes() -> None:
    all_services = services()
    ids, urls = set(), set()
    for name in NODES:
        node = all_services[name]
        env = environment(node)
        port = int(env.get("AFFINITY_PORT", "8000"))

        assert env["AFFINITY_DEVICES"] == "cpu:2"
        assert env["AFFINITY_HOST"] == "0.0.0.0"
        redis_url = urlsplit(env["AFFINITY_REDIS_URL"])
        assert (redis_url.scheme, redis_url.hostname, redis_url.port or 6379) == (
            "redis",
            "redis",
            6379,
        )
        advertise = urlsplit(env["AFFINITY_ADVERTISE_URL"])
        assert (advertise.hostname, advertise.port) == (name, port), "its own service name"
        ids.add(env["AFFINITY_NODE_ID"])
        urls.add(env["AFFINITY_ADVERTISE_URL"])
        assert env.get("AFFINITY_CLUSTER_SECRET"), "forwarding between nodes needs the secret"
        assert env.get("AFFINITY_ADMIN_TOKEN")

        assert node["depends_on"]["redis"]["condition"] == "service_healthy"
        probe = " ".join(healthcheck_command(node)[1:])
        assert re.search(rf"127\.0\.0\.1:{port}/(readyz|healthz)", probe), probe

        build = node["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert f":{port}" in " ".join(str(p) for p in node["ports"])
    assert len(ids) == len(NODES), f"node ids must differ: {ids}"
    assert len(urls) == len(NODES)
    secrets = {environment(all_services[n])["AFFINITY_CLUSTER_SECRET"] for n in NODES}
    assert len(secrets) == 1, "the nodes must share one cluster secret"


def published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port, a
    ``${VAR:-default}`` in it read as its default."""
    out = []
    for port in service.get("ports", []):
        text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(port))
        parts = text.split(":")
        assert len(parts) == 3, f"publish {port} as ADDRESS:HOST_PORT:PORT"
        out.append((parts[0], parts[1], parts[2]))
    return out


def test_published_ports_are_distinct_and_on_loopback_only() -> None:
    """Fixed default host ports, each one a variable away from another (the Podman test
    picks free ones), and only on 127.0.0.1: the stack's secrets are demo values."""
    ports = [p for service in services().values() for p in published(service)]
    assert ports and {address for address, _, _ in ports} == {"127.0.0.1"}
    host_ports = [host for _, host, _ in ports]
    assert all(h.isdigit() for h in host_ports) and len(host_ports) == len(set(host_ports))


def test_images_are_named_in_full() -> None:
    """Podman resolves no short name (``redis:7-alpine``) unless the host's registries.conf
    lists unqualified-search-registries; a full name works with Docker and Podman alike."""
    images = [str(s["image"]) for s in services().values() if "image" in s]
    assert images
    for image in images:
        assert "." in image.split("/")[0], f"{image}: name its registry (docker.io/...)"
    (base,) = re.findall(r"\$\{BASE_IMAGE:-([^}]+)\}", DOCKERFILE.read_text(encoding="utf-8"))
    assert base.startswith("docker.io/library/python:3.11"), base


def test_nodes_run_as_the_kubernetes_manifests_run_them() -> None:
    """Read-only root file system with the manifests' emptyDir mounts on tmpfs, no
    capabilities, no privilege gain, and the manifests' time to hand episodes over on a stop
    (tests/test_podman_stack.py checks this in running containers)."""
    (pod,) = [
        d["spec"]["template"]["spec"]
        for d in yaml.safe_load_all(
            (ROOT / "deploy" / "kubernetes" / "base" / "node.yaml").read_text(encoding="utf-8")
        )
        if d and d.get("kind") in ("Deployment", "StatefulSet")
    ]
    (container,) = [c for c in pod["containers"] if c.get("volumeMounts")]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    grace = f"{pod['terminationGracePeriodSeconds']}s"
    for name in NODES:
        node = services()[name]
        assert node["read_only"] is True
        assert set(node["tmpfs"]) == {m["mountPath"] for m in container["volumeMounts"]}
        assert node["cap_drop"] == ["ALL"]
        assert node["security_opt"] == ["no-new-privileges:true"]
        assert node["stop_grace_period"] == grace


def test_stack_test_service() -> None:
    all_services = services()
    test = all_services["stack-test"]
    for name in NODES:
        assert test["depends_on"][name]["condition"] == "service_healthy"
    urls = environment(test)["AFFINITY_STACK_URLS"].split(",")
    node_urls = {environment(all_services[n])["AFFINITY_ADVERTISE_URL"] for n in NODES}
    assert {urlsplit(u).hostname for u in urls} == set(NODES)
    assert set(urls) == node_urls
    prometheus = urlsplit(environment(test)["AFFINITY_STACK_PROMETHEUS"])
    assert (prometheus.hostname, prometheus.port) == ("prometheus", 9090)
    grafana = urlsplit(environment(test)["AFFINITY_STACK_GRAFANA"])
    assert (grafana.hostname, grafana.port) == ("grafana", 3000)
    for name in ("prometheus", "grafana"):
        assert test["depends_on"][name]["condition"] == "service_healthy"
    entrypoint = " ".join(test["entrypoint"])
    assert "pytest" in entrypoint and "tests/stack" in entrypoint
    target = test["build"]["target"]
    assert re.search(rf"^FROM \S+ AS {re.escape(target)}$", DOCKERFILE.read_text(), re.M)
    assert (ROOT / "tests" / "stack" / "test_stack.py").exists()


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE_IMAGE\b", text, re.M)
    assert re.search(r"^ARG GPU=0$", text, re.M)
    assert "python:3.11-slim" in text and re.search(r"^ARG ORT_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert "onnxruntime-gpu[cuda,cudnn]==${ORT_VERSION}" in text  # CUDA matching the ORT build
    assert re.search(r'^ENTRYPOINT \["affinity-node"\]$', text, re.M)
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\\\n.*python.*/healthz", text, re.M)
    stages = {
        m[1]: m[2]
        for m in re.finditer(r"^FROM \S+ AS (\S+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    }
    for stage in ("runtime", "test"):
        users = re.findall(r"^USER (\S+)$", stages[stage], re.M)
        assert users and users[-1] not in ("root", "0"), f"stage {stage} must run as non-root"
    assert 'pip install "/tmp/src' in text
    ignore = DOCKERIGNORE.read_text(encoding="utf-8").split()
    for needed in ("pyproject.toml", "README.md", "affinity", "node", "tests"):
        assert f"!{needed}" in ignore, f"{needed} must reach the build context"


def test_node_reads_every_variable_compose_passes() -> None:
    sources = "".join(
        (ROOT / path).read_text(encoding="utf-8") for path in ("node/cli.py", "affinity/config.py")
    )
    all_services = services()
    for name in NODES:
        for var in environment(all_services[name]):
            assert f'"{var}"' in sources, f"{name}: {var} is read by neither node/cli.py nor config"


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> the host path it mounts (short volume syntax, relative to the
    compose file)."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = str(volume).split(":")
        assert host.startswith("."), f"{volume}: mount files of the repository"
        out[container] = (COMPOSE.parent / host).resolve()
    return out


def pinned(image: str) -> bool:
    return ":" in image and not image.endswith(":latest")


def test_prometheus_scrapes_both_nodes_with_the_alert_rules() -> None:
    all_services = services()
    prom = all_services["prometheus"]
    assert str(prom["image"]).startswith("docker.io/prom/prometheus:") and pinned(prom["image"])
    config_dir = mounts(prom)["/etc/prometheus"]
    assert config_dir == ROOT / "docker" / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = yaml.safe_load((config_dir / "prometheus.yml").read_text(encoding="utf-8"))
    for rules in config["rule_files"]:
        assert (config_dir / rules).is_file(), rules  # relative to the config, as mounted
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "affinity"]
    scraped = {s["labels"]["node"]: s["targets"] for s in job["static_configs"]}
    expected = {}
    for name in NODES:
        env = environment(all_services[name])
        advertise = urlsplit(env["AFFINITY_ADVERTISE_URL"])
        expected[env["AFFINITY_NODE_ID"]] = [f"{advertise.hostname}:{advertise.port}"]
    assert scraped == expected, "each node by its service name, labelled with its node id"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert [(h, c) for _, h, c in published(prom)] == [("9090", "9090")]
    assert "/-/ready" in " ".join(healthcheck_command(prom))


def test_grafana_is_provisioned_with_the_dashboard_and_that_prometheus() -> None:
    grafana = services()["grafana"]
    image = str(grafana["image"])
    assert image.startswith("docker.io/grafana/grafana:") and pinned(image)
    mounted = mounts(grafana)
    provisioning = mounted["/etc/grafana/provisioning"]
    assert provisioning == ROOT / "docker" / "grafana" / "provisioning"
    (source,) = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yaml").read_text(encoding="utf-8")
    )["datasources"]
    url = urlsplit(source["url"])
    assert (source["type"], url.hostname, url.port) == ("prometheus", "prometheus", 9090)
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "affinity.yaml").read_text(encoding="utf-8")
    )["providers"]
    folder = provider["options"]["path"].rstrip("/")
    dashboards = {c: h for c, h in mounted.items() if c.startswith(folder + "/")}
    assert dashboards == {f"{folder}/affinity.json": ROOT / "docker" / "grafana" / "affinity.json"}
    env = environment(grafana)
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer", "anonymous users only look"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD")
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert [(h, c) for _, h, c in published(grafana)] == [("3000", "3000")]
