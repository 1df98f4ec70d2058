"""The manifests are valid Kubernetes objects and say what the node needs, no more."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from uproxy import __version__
from uproxy.objects import SERVICE_PROXY_NAME_LABEL

from .dockerfile import parse_dockerfile
from .manifests import DEPLOY, INSTALLS, REPO, all_docs, container, find, load

# The newest schemas the validator bundles, and an older release still in wide use.
VERSIONS = ["1.28.0", kubernetes_validate.utils.latest_version()]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "doc", [pytest.param(d, id=f"{f}:{d['kind']}:{d['metadata']['name']}") for f, d in all_docs()]
)
def test_manifest_validates_offline(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_broken_daemonset() -> None:
    ds = copy.deepcopy(find(load(DEPLOY / "uproxy.yaml"), "DaemonSet"))
    ds["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrok"):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# kubernetes-asyncio method -> the (group, resource) it reads.
_API_CALLS = {
    "list_service_for_all_namespaces": ("", "services"),
    "list_endpoint_slice_for_all_namespaces": ("discovery.k8s.io", "endpointslices"),
    "list_node": ("", "nodes"),
    "read_node": ("", "nodes"),
}
_CALL = re.compile(r"\.((?:list|read|watch|create|patch|delete|replace)_[a-z_]+)\b")


def _used_access() -> set[tuple[str, str, str]]:
    """What the shipped code asks of the API server, from its client calls.

    A list call is followed by a watch (``watch=True`` on the same method) wherever the
    source follows a resource; a read is a get.
    """
    used: set[tuple[str, str, str]] = set()
    for path in (REPO / "uproxy").rglob("*.py"):
        for call in _CALL.findall(path.read_text(encoding="utf-8")):
            if call not in _API_CALLS:
                if call.endswith(("_for_all_namespaces", "_namespaced_event", "_node")):
                    raise AssertionError(f"{call}: add it to _API_CALLS and to the ClusterRole")
                continue  # not a Kubernetes client call (read_text, list_... of our own)
            group, resource = _API_CALLS[call]
            verbs = ("get",) if call.startswith("read_") else ("list", "watch")
            used.update((group, resource, verb) for verb in verbs)
    return used


def test_cluster_role_grants_exactly_what_the_code_uses() -> None:
    used = _used_access()
    assert ("", "services", "watch") in used, "found no API calls: the scan no longer matches"
    granted = _rules(find(load(DEPLOY / "rbac.yaml"), "ClusterRole", "uproxy"))
    assert granted == used, (
        f"granted, never used: {granted - used}; used, not granted: {used - granted}"
    )


def test_binding_grants_the_role_to_the_daemonsets_account() -> None:
    rbac = load(DEPLOY / "rbac.yaml")
    sa = find(rbac, "ServiceAccount")
    binding = find(rbac, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": find(rbac, "ClusterRole")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "uproxy", "namespace": sa["metadata"]["namespace"]}
    ]
    for file, name in INSTALLS.items():
        ds = find(load(DEPLOY / file), "DaemonSet", name)
        assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"]
        assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


@pytest.mark.parametrize(("file", "name"), INSTALLS.items())
def test_daemonset_runs_as_a_node_proxy(file: str, name: str) -> None:
    docs = load(DEPLOY / file)
    ds = find(docs, "DaemonSet", name)
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    config = yaml.safe_load(find(docs, "ConfigMap", name)["data"]["config.yaml"])

    assert pod["hostNetwork"] is True
    # uproxy is not its container's PID 1: as PID 1 it never reaped orphans (zombies).
    assert pod["shareProcessNamespace"] is True
    # Where uproxy is the node's proxy, the cluster's DNS service is reached through it: it
    # resolves with the node's resolver (beside kube-proxy, cluster DNS works already).
    beside = file == "beside-kube-proxy.yaml"
    assert pod.get("dnsPolicy", "ClusterFirst") == (
        "ClusterFirstWithHostNet" if beside else "ClusterFirst"
    )
    # No bindAddress: uproxy serves every IP family the node has (a set one limits it).
    assert not config.get("bindAddress")
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )

    sc = c["securityContext"]
    assert sc.get("privileged", False) is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {
        "drop": ["ALL"],
        "add": ["NET_ADMIN", "NET_RAW", "SYS_NICE", "SYS_RESOURCE", "NET_BIND_SERVICE"],
    }
    # The node's conntrack settings: raised by a privileged init container where uproxy is
    # the node's proxy (uproxy itself cannot write /proc/sys), left to kube-proxy beside it.
    inits = pod.get("initContainers", [])
    if config["conntrack"]["maxPerCore"]:
        (init,) = inits
        assert init["securityContext"] == {"privileged": True}
        assert init["image"] == c["image"]
        assert init["command"] == ["uproxy", "--config=/etc/uproxy/config.yaml", "--init-only"]
        assert init["volumeMounts"] == [m for m in c["volumeMounts"] if m["name"] == "config"]
    else:
        assert inits == []
        assert config["conntrack"]["tcpEstablishedTimeout"] == "0s"
        assert config["conntrack"]["tcpCloseWaitTimeout"] == "0s"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    lock = volumes[mounts["/run/xtables.lock"]["name"]]
    assert lock["hostPath"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    assert not mounts["/run/xtables.lock"].get("readOnly", False)

    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "--hostname-override=$(NODE_NAME)" in c["command"]
    assert "--config=/etc/uproxy/config.yaml" in c["command"]

    healthz_port = int(config["healthzBindAddress"].rpartition(":")[2])
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": healthz_port}
    # Ready by /livez: /healthz is 503 on a node being deleted, which would stall a rollout.
    assert c["readinessProbe"]["httpGet"] == {"path": "/livez", "port": healthz_port}
    assert c["ports"] == [{"name": "healthz", "containerPort": healthz_port, "protocol": "TCP"}]

    for section in ("requests", "limits"):
        assert set(c["resources"][section]) == {"cpu", "memory"}


@pytest.mark.parametrize(("file", "name"), INSTALLS.items())
def test_daemonset_runs_the_image_this_repo_builds(file: str, name: str) -> None:
    c = container(find(load(DEPLOY / file), "DaemonSet", name))
    assert c["image"].rpartition(":")[2] == __version__
    entrypoint = parse_dockerfile((REPO / "Dockerfile").read_text()).stages[-1].entrypoint
    assert c["command"][: len(entrypoint)] == entrypoint


def test_beside_kube_proxy_takes_only_labelled_services_on_its_own_ports() -> None:
    main = find(load(DEPLOY / "uproxy.yaml"), "ConfigMap", "uproxy")
    beside = find(load(DEPLOY / "beside-kube-proxy.yaml"), "ConfigMap", "uproxy-beside-kube-proxy")
    main_cfg = yaml.safe_load(main["data"]["config.yaml"])
    beside_cfg = yaml.safe_load(beside["data"]["config.yaml"])
    assert SERVICE_PROXY_NAME_LABEL == "service.kubernetes.io/service-proxy-name"
    assert beside_cfg["uproxy"]["serviceProxyName"] == "uproxy"
    assert "serviceProxyName" not in main_cfg["uproxy"]
    # kube-proxy's own ports on the same host network: uproxy must not take them.
    kube_proxy_ports = {"10256", "10249"}
    for field in ("healthzBindAddress", "metricsBindAddress"):
        assert main_cfg[field].rpartition(":")[2] in kube_proxy_ports
        assert beside_cfg[field].rpartition(":")[2] not in kube_proxy_ports
