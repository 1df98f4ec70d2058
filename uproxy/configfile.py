"""``--config FILE``: a KubeProxyConfiguration, plus a ``uproxy:`` block for uproxy's own settings.

Fields are mapped through the same table as the flags (``Settings`` metadata), so the file
and the command line mean the same thing. Fields of KubeProxyConfiguration that do not apply
to a userspace proxy are accepted and ignored (logged at -v 2); fields that exist nowhere
are warned about (a typo should not pass silently); a value of the wrong type fails with one
line naming the field.

The file is read once, at start. As kube-proxy does, uproxy then watches it and stops when
its content changes (``watch_config``), so that the kubelet starts it again with the new
file: an edit of the DaemonSet's ConfigMap reaches every node without a rollout.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

import yaml

from uproxy.log import V2, kv
from uproxy.settings import (
    Settings,
    SettingsError,
    convert,
    format_duration,
    parse_duration,
    setting_fields,
)

log = logging.getLogger("uproxy.configfile")

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# KubeProxyConfiguration fields uproxy reads elsewhere or that do not apply to it.
NOT_APPLICABLE = {
    "featureGates",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "ipvs",
    "nftables",
    "winkernel",
    "windows",
    "windowsRunAsService",
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


# Fields whose zero value ("" or 0s) kube-proxy's defaulting reads as "not set". kubeadm
# writes every field of its configuration, most of them zero: such a file means the defaults
# (/healthz on 0.0.0.0:10256, a 30 s sync period), not /healthz turned off or a period of 0.
ZERO_IS_DEFAULT = {
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "configSyncPeriod",
    "udpIdleTimeout",
    "iptables.syncPeriod",
    "iptables.minSyncPeriod",
    "detectLocalMode",
    "hostnameOverride",
    "clientConnection.kubeconfig",
}


# ``uproxy.zeroValues``: those of the fields above whose zero value this file means as the
# zero (/healthz off, no minimum sync period), which kube-proxy's own file cannot say.
# ``--write-config-to`` writes it when a setting is at such a zero, so the file loads back
# to the same settings.
ZERO_VALUES = "uproxy.zeroValues"


def _zero(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == 0
    if not isinstance(value, str):
        return False
    if not value.strip():
        # "" only, as Go's defaulting compares: white space alone is a value, and a wrong
        # one (hostnameOverride: "  " fell back to the host's name without a word).
        return value == ""
    try:
        return parse_duration(value) == 0
    except ValueError:
        return False


# Newer kube-proxy configurations group the Linux-only fields under ``linux:``; the same
# fields at the top level are the older spelling. Both mean the same here.
_LINUX = "linux."
_LINUX_ALIASES = {"linux.masqueradeAll": "iptables.masqueradeAll"}


def _canonical(path: str) -> str:
    if path in _LINUX_ALIASES:
        return _LINUX_ALIASES[path]
    return path[len(_LINUX) :] if path.startswith(_LINUX) else path


def render_config(settings: Settings) -> str:
    """``settings`` as a KubeProxyConfiguration with every field uproxy reads (what
    ``--write-config-to`` writes, and the docs' example at the defaults): loading it gives
    the same settings back."""
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "mode": "userspace"}
    zeros: list[str] = []
    unset = Settings()
    for f in setting_fields():
        path, value = f.metadata["config"], getattr(settings, f.name)
        if not path or value is None:
            continue
        node = doc
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = _config_value(f.metadata["kind"], value, path)
        if path in ZERO_IS_DEFAULT and _zero(node[leaf]) and value != getattr(unset, f.name):
            zeros.append(path)
    if zeros:
        doc.setdefault("uproxy", {})["zeroValues"] = zeros
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _config_value(kind: str, value: Any, path: str) -> Any:
    if kind == "duration":
        return _duration_text(value)
    if kind == "cidrs" and path != "nodePortAddresses":
        return ",".join(value)  # a string in KubeProxyConfiguration (clusterCIDR)
    if kind == "cidrs":
        return list(value)
    if kind == "mark":
        return f"{value:#x}"
    return value


def _duration_text(seconds: float) -> str:
    """A duration as a Go duration string that reads back as exactly ``seconds``: the short
    form when it does, else the number of one unit (``50us`` is not ``4.99...e-05s``, which
    no duration parser reads)."""
    units = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
    candidates = [format_duration(seconds)]
    candidates += [f"{round(seconds / size)}{unit}" for unit, size in units]
    candidates += [f"{seconds / size:.9f}".rstrip("0").rstrip(".") + unit for unit, size in units]
    for text in candidates:
        if parse_duration(text) == seconds:
            return text
    return candidates[-1]  # to the nanosecond's thousandth: as near as the file can say


def write_config(path: str, settings: Settings) -> None:
    """``--write-config-to``: raises SettingsError with one line when it cannot."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(render_config(settings))
    except OSError as e:
        raise SettingsError(f"--write-config-to {path}: {e.strerror or e}") from None


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load``, refusing a key given twice in one mapping, as kube-proxy's strict
    decoding of its configuration does: PyYAML kept the last one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str, settings: Settings, given: dict[str, str] | None = None) -> Settings:
    """Apply the file's values to ``settings``; raises SettingsError with one clear line.
    ``given`` collects the names of the settings the file sets, each with its field there."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        doc = yaml.load(data.decode("utf-8"), Loader=_StrictLoader)
    except OSError as e:
        raise SettingsError(f"--config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"--config {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None)
        if problem and "another document" in problem:
            problem = "a second document (the file holds one KubeProxyConfiguration)"
        said = f"not valid YAML: {problem}" if problem else "not valid YAML"
        raise SettingsError(f"--config {path}:{where}: {said}") from None
    settings = apply_config(doc, settings, source=path, given=given)
    settings.config_file = path
    settings.config_digest = hashlib.sha256(data).digest()
    return settings


async def watch_config(path: str, digest: bytes, *, interval_s: float = 1.0) -> None:
    """Return once the content of ``path`` no longer hashes to ``digest``.

    Polled: one ``stat`` per interval (following links, so a ConfigMap volume's swap of its
    ``..data`` link is a new file), and the file is read only when that changed. A file
    rewritten with the same content is no change; one that cannot be read is reported once
    and watched on (a missing file is not a new configuration).
    """
    last = _identity(path)
    unreadable = False
    while True:
        await asyncio.sleep(interval_s)
        now = _identity(path)
        if now == last:
            continue
        last = now
        try:
            now_digest = _digest(path)  # a few KiB, and only when the file changed
        except OSError as e:
            if not unreadable:
                log.warning("Cannot read the configuration file", extra=kv(file=path, err=e))
            unreadable = True
            continue
        unreadable = False
        if now_digest != digest:
            return


def _digest(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def apply_config(
    doc: Any,
    settings: Settings,
    *,
    source: str = "--config",
    given: dict[str, str] | None = None,
) -> Settings:
    if not isinstance(doc, Mapping):
        raise SettingsError(f"{source}: expected a {KIND} mapping")
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise SettingsError(
            f"{source}: expected apiVersion {API_VERSION} and kind {KIND}, "
            f"got {doc.get('apiVersion')!r} {doc.get('kind')!r}"
        )
    mode = doc.get("mode")
    if mode not in (None, "", "userspace"):
        raise SettingsError(
            f"{source}: mode: uproxy is the userspace mode, got {mode!r} (leave mode out or "
            "set it to userspace; uproxy.rules chooses how its rules are programmed)"
        )
    zeros = _zero_values(doc, source)
    by_path = {f.metadata["config"]: f for f in setting_fields() if f.metadata["config"]}
    groups = {"linux"} | {p.rsplit(".", 1)[0] for p in by_path if "." in p}
    groups |= {g.rsplit(".", 1)[0] for g in groups if "." in g}
    for path, value in _flatten(doc, frozenset(by_path)):
        if path in ("apiVersion", "kind", "mode", ZERO_VALUES):
            continue
        canonical = _canonical(path)
        f = by_path.get(canonical)
        if f is not None:
            if value is None or (
                canonical in ZERO_IS_DEFAULT and canonical not in zeros and _zero(value)
            ):
                continue
            try:
                setattr(settings, f.name, convert(f, value))
                if given is not None:
                    given[f.name] = path
            except SettingsError as e:
                raise SettingsError(
                    f"{source}: {path}: {e}".replace(f"invalid {f.metadata['flag']}: ", "")
                ) from None
        elif canonical in NOT_APPLICABLE or canonical.split(".")[0] in NOT_APPLICABLE:
            log.log(V2, "Ignoring configuration field that does not apply", extra=kv(field=path))
        elif canonical in groups:
            # A block of fields: empty (every field in it commented out) is no value; any
            # other value is the wrong type, not an unknown field to warn about and skip.
            if value is not None and not isinstance(value, Mapping):
                raise SettingsError(f"{source}: {path}: expected a mapping, got {value!r}")
        else:
            log.warning("Unknown configuration field", extra=kv(file=source, field=path))
    return settings


def _zero_values(doc: Mapping[str, Any], source: str) -> set[str]:
    block = doc.get("uproxy")
    value = block.get("zeroValues") if isinstance(block, Mapping) else None
    if value is None:
        return set()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SettingsError(
            f"{source}: {ZERO_VALUES}: expected a list of field names, got {value!r}"
        )
    for name in value:
        if _canonical(name) not in ZERO_IS_DEFAULT:
            raise SettingsError(
                f"{source}: {ZERO_VALUES}: {name!r} is not one of "
                + ", ".join(sorted(ZERO_IS_DEFAULT))
            )
    return {_canonical(v) for v in value}


def _flatten(
    doc: Mapping[str, Any], fields: Collection[str], prefix: str = ""
) -> list[tuple[str, Any]]:
    """(path, value) of every field; a mapping where a field is (``configSyncPeriod: {a:
    1}``) is that field's value, refused as the wrong type, not a block of unknown fields."""
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        leaf = _canonical(path) in fields
        if isinstance(value, Mapping) and not leaf and path not in NOT_APPLICABLE and value:
            out.extend(_flatten(value, fields, path + "."))
        else:
            out.append((path, value))
    return out
