"""Endpoint's equality and hash, written by hand for speed: they must still mean what the
generated ones meant (every field counts for equality; equal endpoints hash alike)."""

from __future__ import annotations

import dataclasses
from typing import Any

from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, ip_family

BASE = Endpoint(
    "10.0.0.1",
    8080,
    node_name="node-a",
    zone="zone-a",
    zone_hints=("zone-a",),
    node_hints=("node-a",),
)


def _other(value: Any) -> Any:
    """A value of the same kind as ``value`` that differs from it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, tuple):
        return (*value, "x")
    return f"{value}-x"


def test_equal_endpoints_are_equal_and_hash_alike() -> None:
    copy = dataclasses.replace(BASE)
    assert copy is not BASE
    assert copy == BASE
    assert not copy.__ne__(BASE)
    assert hash(copy) == hash(BASE)
    assert len({BASE, copy}) == 1


def test_every_field_counts_for_equality() -> None:
    """A field added to Endpoint and left out of its ``__eq__`` fails here."""
    for field in dataclasses.fields(Endpoint):
        changed = dataclasses.replace(BASE, **{field.name: _other(getattr(BASE, field.name))})
        assert changed != BASE, field.name
        assert changed.__eq__(BASE) is False, field.name
        assert len({BASE, changed}) == 2, field.name  # both in a set, whatever their hashes


def test_an_endpoint_equals_no_other_kind_of_object() -> None:
    assert BASE != ("10.0.0.1", 8080)
    assert BASE != "10.0.0.1:8080"
    assert BASE.__eq__(1) is NotImplemented


def test_a_service_ports_families_are_those_of_its_cluster_ips() -> None:
    name = ServicePortName("ns", "svc", "", Protocol.TCP)

    def families(*ips: str) -> frozenset[IPFamily]:
        return ServicePort(name, 80, cluster_ips=ips).families()

    assert families("10.96.0.1") == {IPFamily.V4}
    assert families("fd00::1") == {IPFamily.V6}
    assert families("10.96.0.1", "fd00::1") == {IPFamily.V4, IPFamily.V6}
    assert families("fd00::1", "10.96.0.1") == {IPFamily.V4, IPFamily.V6}
    assert families() == frozenset()
    assert ip_family("::ffff:10.0.0.1") is IPFamily.V6
    assert ip_family("10.0.0.1") is IPFamily.V4
