"""The Kubernetes manifests (deploy/) and the image they name (Dockerfile), checked
offline: every object against the Kubernetes API's own schema (kubernetes-validate,
strict: an unknown field is an error), the containers' arguments by the parsers of the
programs that will read them (llamastream's and smg's), and the pieces against each
other: probes on the ports the server listens on, a grace period that covers the
drain, selectors that find the pods, pins that match the project's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as k8s
from smg.launch_router import parse_router_args

from server import package_version
from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSIONS = ["1.32", "1.37"]  # preStop's sleep action is GA from 1.32


def documents() -> list[dict]:
    return [d for path in sorted((ROOT / "deploy").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def named(kind: str, component: str | None = None) -> dict:
    (found,) = [d for d in documents() if d["kind"] == kind and (
        component is None or d["metadata"]["labels"]["app.kubernetes.io/component"] == component)]
    return found


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_kubernetes(version):
    kinds = [k8s.validate(d, version, strict=True) and d["kind"] for d in documents()]
    assert sorted(kinds) == sorted(["Deployment", "Deployment", "Service", "Service", "ServiceAccount", "Role",
                                    "RoleBinding"])


def test_a_misspelt_field_is_caught():
    engine = named("Deployment", "engine")
    container(engine)["readinessProbe"]["grcp"] = {"port": 50051}
    with pytest.raises(k8s.ValidationError):
        k8s.validate(engine, KUBERNETES_VERSIONS[0], strict=True)


def test_the_replicas_are_probed_where_the_server_listens_and_drain_before_they_are_killed():
    engine = named("Deployment", "engine")
    c, pod = container(engine), engine["spec"]["template"]["spec"]
    args = build_parser().parse_args(c["args"])  # (exits on an argument llamastream does not take)
    assert args.command == "serve" and args.device == "cuda"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    # gRPC health (NOT_SERVING while loading and draining) decides readiness; liveness
    # asks /healthz, which stays up during a drain
    assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == args.port
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert pod["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + args.grace + 5
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"] == named("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]["image"] \
        == f"llamastream:{package_version()}"


def test_the_services_and_the_gateways_discovery_find_the_replicas():
    engine, gateway = named("Deployment", "engine"), named("Deployment", "gateway")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert engine["spec"]["selector"]["matchLabels"] == labels
    service = named("Service", "engine")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == labels
    engine_args = build_parser().parse_args(container(engine)["args"])
    smg = container(gateway)
    assert smg["command"] == ["smg"] and smg["args"][0] == "launch"
    router = parse_router_args(smg["args"][1:])  # smg's own parser
    assert router.service_discovery and router.selector == labels
    assert router.service_discovery_port == engine_args.port and router.model_path == engine_args.model
    assert router.policy == "cache_aware"
    role = named("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == named("ServiceAccount")["metadata"]["name"]
    assert named("RoleBinding")["roleRef"]["name"] == role["metadata"]["name"]


def test_the_image_pins_what_the_project_pins():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pinned = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\\]*)", dockerfile))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    locks = dict(line.split("==") for f in ("requirements.lock", "requirements-test.lock")
                 for line in (ROOT / f).read_text().splitlines() if "==" in line and not line.startswith("#"))
    for requirement in project["cuda"] + project["gateway"]:
        name, version = requirement.split("==")
        assert pinned[name] == version
    assert all(locks.get(name, version) == version for name, version in pinned.items())
    assert "-r requirements.lock" in dockerfile and re.search(r"^USER llamastream$", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["llamastream"\]$', dockerfile, re.M)
