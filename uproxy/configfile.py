"""``--config FILE``: a KubeProxyConfiguration, plus a ``uproxy:`` block for uproxy's own settings.

Fields are mapped through the same table as the flags (``Settings`` metadata), so the file
and the command line mean the same thing. Fields of KubeProxyConfiguration that do not apply
to a userspace proxy are accepted and ignored (logged at -v 2); fields that exist nowhere
are warned about (a typo should not pass silently); a value of the wrong type fails with one
line naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import yaml

from uproxy.log import V2, kv
from uproxy.settings import Settings, SettingsError, convert, setting_fields

log = logging.getLogger("uproxy.configfile")

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# KubeProxyConfiguration fields uproxy reads elsewhere or that do not apply to it.
NOT_APPLICABLE = {
    "featureGates",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "ipvs",
    "nftables",
    "winkernel",
    "oomScoreAdj",
    "conntrack",
    "linux",
    "windows",
    "iptables.masqueradeAll",
    "iptables.masqueradeBit",
    "iptables.localhostNodePorts",
    "clientConnection.acceptContentTypes",
    "clientConnection.contentType",
    "clientConnection.qps",
    "clientConnection.burst",
    "logging.flushFrequency",
    "logging.options",
    "logging.vmodule",
}


def load_config(path: str, settings: Settings) -> Settings:
    """Apply the file's values to ``settings``; raises SettingsError with one clear line."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise SettingsError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SettingsError(f"--config {path}:{where}: not valid YAML") from None
    return apply_config(doc, settings, source=path)


def apply_config(doc: Any, settings: Settings, *, source: str = "--config") -> Settings:
    if not isinstance(doc, Mapping):
        raise SettingsError(f"{source}: expected a {KIND} mapping")
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise SettingsError(
            f"{source}: expected apiVersion {API_VERSION} and kind {KIND}, "
            f"got {doc.get('apiVersion')!r} {doc.get('kind')!r}"
        )
    mode = doc.get("mode")
    if mode not in (None, "", "userspace"):
        raise SettingsError(f"{source}: mode: uproxy is the userspace mode, got {mode!r}")
    by_path = {f.metadata["config"]: f for f in setting_fields() if f.metadata["config"]}
    for path, value in _flatten(doc):
        if path in ("apiVersion", "kind", "mode"):
            continue
        f = by_path.get(path)
        if f is not None:
            if value is None:
                continue
            try:
                setattr(settings, f.name, convert(f, value))
            except SettingsError as e:
                raise SettingsError(
                    f"{source}: {path}: {e}".replace(f"invalid {f.metadata['flag']}: ", "")
                ) from None
        elif path in NOT_APPLICABLE or path.split(".")[0] in NOT_APPLICABLE:
            log.log(V2, "Ignoring configuration field that does not apply", extra=kv(field=path))
        else:
            log.warning("Unknown configuration field", extra=kv(file=source, field=path))
    return settings


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path not in NOT_APPLICABLE and value:
            out.extend(_flatten(value, path + "."))
        else:
            out.append((path, value))
    return out
