"""Reading the shipped manifests the way the cluster would: documents by kind and name, and the
DaemonSet's container with its configuration file resolved through its volume mounts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
# The two ways to install: each DaemonSet file is applied together with rbac.yaml.
INSTALLS = {"uproxy.yaml": "uproxy", "beside-kube-proxy.yaml": "uproxy-beside-kube-proxy"}

Obj = dict[str, Any]


def load(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def all_docs() -> list[tuple[str, Obj]]:
    return [(p.name, d) for p in MANIFESTS for d in load(p)]


def find(docs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    if len(found) != 1:
        raise LookupError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def container(daemonset: Obj) -> Obj:
    (c,) = daemonset["spec"]["template"]["spec"]["containers"]
    result: Obj = c
    return result


@dataclass
class Invocation:
    """The command line the DaemonSet runs, with its config file written where the test can
    read it (the mount path mapped into ``root``) and ``$(VAR)`` references expanded."""

    argv: list[str]
    config_text: str


def invocation(docs: list[Obj], daemonset: Obj, *, root: Path, env: dict[str, str]) -> Invocation:
    spec = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    volumes = {v["name"]: v for v in spec["volumes"]}
    argv = [_expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
    config_text = ""
    out = []
    for arg in argv:
        m = re.fullmatch(r"--config=(.+)", arg)
        if m is None:
            out.append(arg)
            continue
        path = m.group(1)
        mount = next(
            vm for vm in c["volumeMounts"] if path.startswith(vm["mountPath"].rstrip("/") + "/")
        )
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        source = volumes[mount["name"]]["configMap"]["name"]
        config_text = find(docs, "ConfigMap", source)["data"][key]
        local = root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(config_text, encoding="utf-8")
        out.append(f"--config={local}")
    return Invocation(out, config_text)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args (unknown references stay as they are)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)
