"""Fixtures for tests that program real iptables inside throwaway network namespaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import root_available
from tests.netns.topology import Topology, topology

DUAL_STACK = "dual-stack"  # ``@pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True)``


@pytest.fixture
def topo(request: pytest.FixtureRequest) -> Iterator[Topology]:
    """The four namespaces; dual-stack (IPv6 in ULA space too) when parametrized so."""
    if root_available() is not None:
        pytest.fail(f"topology fixture used without root: {root_available()}")
    with topology(ipv6=getattr(request, "param", None) == DUAL_STACK) as created:
        yield created
