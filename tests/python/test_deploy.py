"""The deployment files of deploy/: the Kubernetes manifests validated strictly by
kubernetes-validate against the oldest and newest Kubernetes it bundles, the Swarm stack
rendered by `docker stack config`, and both checked for what cluster mode needs (the
cluster flags the gateway knows, the runtime directory at the same path on host and in the
container, shared mounts, the certificates of mutual TLS between nodes and their port). Nothing is deployed: no cluster, no swarm."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
STACK = REPO / "deploy" / "swarm" / "kernelgate.yml"
BINARY = Path(os.environ.get("KERNELGATE_BIN", REPO / "target" / "debug" / "kernelgate"))
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
CLUSTER_FLAGS = [
    "--etcd",
    "--node-id",
    "--advertise",
    "--cluster-secret-file",
    "--lease-ttl",
    "--cluster-listen",
    "--cluster-ca-file",
    "--cluster-cert-file",
    "--cluster-key-file",
]
TLS_FLAGS = ["--cluster-listen", "--cluster-ca-file", "--cluster-cert-file", "--cluster-key-file"]


def bundled_versions() -> list[str]:
    import kubernetes_validate

    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = sorted(
        (d.name[1:].removesuffix("-local") for d in schemas.iterdir() if d.name.endswith("-local")),
        key=lambda v: tuple(int(p) for p in v.split(".")),
    )
    return [versions[0], versions[-1]]


def validate(paths: list[Path], version: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VALIDATE), "--strict", "--quiet", "-k", version, *map(str, paths)],
        capture_output=True,
        text=True,
    )


def manifests() -> list[dict]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def kind(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("version", bundled_versions())
def test_the_kubernetes_manifests_are_valid_strictly(version: str, tmp_path: Path) -> None:
    files = sorted(KUBERNETES.glob("*.yaml"))
    assert len(files) >= 3
    done = validate(files, version)
    assert done.returncode == 0, done.stdout + done.stderr
    # The validator is strict: a field Kubernetes does not know fails it.
    daemonset = copy.deepcopy(kind(manifests(), "DaemonSet", "kernelgate"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["privilegd"] = True
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(daemonset))
    assert validate([broken], version).returncode != 0


def gateway_flags() -> str:
    done = subprocess.run([str(BINARY), "serve", "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_kubernetes_gateways_are_cluster_nodes_on_every_docker_node() -> None:
    docs = manifests()
    ds = kind(docs, "DaemonSet", "kernelgate")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "serve"
    known = gateway_flags()
    for arg in args[1:]:
        flag = arg.split("=", 1)[0]
        assert flag in known, f"{flag} is not a flag of kernelgate serve"
    for flag in ["--etcd", "--node-id", "--advertise", "--cluster-secret-file", "--keys", *TLS_FLAGS]:
        assert any(a.startswith(flag + "=") for a in args), flag
    # The runtime directory: a hostPath at the same path, its mounts shared both ways.
    runtime_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--runtime-dir="))
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == runtime_dir)
    assert mount["mountPropagation"] == "Bidirectional"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == runtime_dir
    assert container["securityContext"]["privileged"] is True
    socket = next(v for v in pod["volumes"] if v["name"] == "docker-socket")
    assert socket["hostPath"] == {"path": "/var/run/docker.sock", "type": "Socket"}
    # The node's address for the others, and secrets for the keys and the cluster secret.
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"kernelgate-keys", "kernelgate-cluster", "kernelgate-cluster-tls"}
    # Calls between nodes over mutual TLS: each node's own certificate, named by its node id,
    # from the Secret mounted where the flags look.
    flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    assert flag["--node-id"] == "$(NODE_NAME)"
    assert flag["--cluster-cert-file"].endswith("/$(NODE_NAME).pem")
    assert flag["--cluster-key-file"].endswith("/$(NODE_NAME).key")
    tls = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "kernelgate-cluster-tls")
    tls_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == tls["name"])
    for f in ["--cluster-ca-file", "--cluster-cert-file", "--cluster-key-file"]:
        assert flag[f].startswith(tls_dir + "/"), f
    cluster_port = int(flag["--cluster-listen"].rsplit(":", 1)[1])
    assert {"name": "cluster", "containerPort": cluster_port} in container["ports"]
    nodes = kind(docs, "Service", "kernelgate-nodes")["spec"]
    assert {"name": "cluster", "port": cluster_port, "targetPort": "cluster"} in nodes["ports"]
    # Clients and probes keep the plain port; the Service for clients has no cluster port.
    assert all(p["port"] != cluster_port for p in kind(docs, "Service", "kernelgate")["spec"]["ports"])
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    assert kind(docs, "Service", "kernelgate-nodes")["spec"]["clusterIP"] == "None"
    assert kind(docs, "Service", "kernelgate")["spec"]["ports"][0]["port"] == 8888
    assert kind(docs, "PodDisruptionBudget", "kernelgate")["spec"]["maxUnavailable"] == 1
    assert kind(docs, "StatefulSet", "etcd")["spec"]["serviceName"] == "etcd"


def test_the_gvisor_gateways_run_kernels_without_docker_and_keep_them_on_the_host() -> None:
    docs = manifests()
    ds = kind(docs, "DaemonSet", "kernelgate-gvisor")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "serve"
    known = gateway_flags()
    for arg in args[1:]:
        assert arg.split("=", 1)[0] in known, f"{arg} is not a flag of kernelgate serve"
    flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    assert flag["--engine"] == "gvisor"
    assert flag["--cgroup-parent"] == "sibling"
    assert container["image"] == "kernelgate-gateway-gvisor:latest"
    # Privileged, in the host's PID namespace, on nodes without a Docker label or socket.
    assert container["securityContext"]["privileged"] is True
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"kernelgate.org/gvisor": "true"}
    assert not any("docker" in str(v).lower() for v in pod["volumes"])
    assert not any("docker" in m["mountPath"] for m in container["volumeMounts"])
    # runsc's root (in the runtime directory), the image store and the hibernated kernels
    # on host paths at the same paths; the runtime directory's mounts reach the host.
    for f in ["--runtime-dir", "--image-store", "--hibernate-dir"]:
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == flag[f])
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["hostPath"]["path"] == flag[f], f
    runtime = next(m for m in container["volumeMounts"] if m["mountPath"] == flag["--runtime-dir"])
    assert runtime["mountPropagation"] == "Bidirectional"
    # The cluster of kernelgate.yaml: its Services and budget select these pods too.
    labels = ds["spec"]["template"]["metadata"]["labels"]
    for service in ["kernelgate", "kernelgate-nodes"]:
        selector = kind(docs, "Service", service)["spec"]["selector"]
        assert selector.items() <= labels.items(), service
    for f in ["--etcd", "--node-id", "--advertise", "--cluster-secret-file", *TLS_FLAGS]:
        assert f in flag, f


def test_the_swarm_stack_renders_with_global_gateways_on_host_ports(tmp_path: Path) -> None:
    done = subprocess.run(
        ["docker", "stack", "config", "-c", str(STACK)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    stack = yaml.safe_load(done.stdout)
    gateway = stack["services"]["kernelgate"]
    assert gateway["deploy"]["mode"] == "global"
    assert gateway["deploy"]["endpoint_mode"] == "dnsrr"
    ports = [{**p, "published": int(p["published"])} for p in gateway["ports"]]
    assert ports == [
        {"mode": "host", "target": 8888, "published": 8888, "protocol": "tcp"},
        {"mode": "host", "target": 8889, "published": 8889, "protocol": "tcp"},
    ]
    known = gateway_flags()
    for arg in gateway["command"][1:]:
        assert arg.split("=", 1)[0] in known, arg
    # Calls between nodes over mutual TLS on the second port: the CA from a config, each
    # node's own certificate and key from its host (a global service's secrets are the same
    # on every node).
    flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in gateway["command"][1:] if "=" in a}
    assert flag["--cluster-listen"].endswith(":8889")
    assert [c["target"] for c in gateway["configs"]] == [flag["--cluster-ca-file"]]
    host_tls = next(v for v in gateway["volumes"] if v["target"] == "/etc/kernelgate/tls")
    assert host_tls["read_only"] is True
    for f in ["--cluster-cert-file", "--cluster-key-file"]:
        assert flag[f].startswith(host_tls["target"] + "/"), f
    assert "kernelgate-cluster-ca" in stack["configs"]
    assert gateway["environment"]["KERNELGATE_NODE_ID"] == "{{.Node.Hostname}}"
    assert "KERNELGATE_NODE_ID" in known and "KERNELGATE_ADVERTISE" in known
    runtime = next(v for v in gateway["volumes"] if v["target"] == "/run/kernelgate")
    assert runtime["source"] == "/run/kernelgate"
    assert runtime["bind"]["propagation"] == "rshared"
    assert "etcd" in stack["services"]
    # docker stack config refuses what the compose format does not know.
    broken = yaml.safe_load(STACK.read_text())
    broken["services"]["kernelgate"]["deploy"]["endpoint_modes"] = "dnsrr"
    bad = tmp_path / "broken.yml"
    bad.write_text(yaml.safe_dump(broken))
    refused = subprocess.run(
        ["docker", "stack", "config", "-c", str(bad)], capture_output=True, text=True
    )
    assert refused.returncode != 0


def test_every_cluster_flag_has_its_variable() -> None:
    known = gateway_flags()
    for flag in CLUSTER_FLAGS:
        assert flag in known, flag
        variable = "KERNELGATE_" + flag[2:].upper().replace("-", "_")
        assert variable in known, variable
