"""Fixtures for tests that program real iptables inside throwaway network namespaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import root_available
from tests.netns.topology import Topology, topology


@pytest.fixture
def topo() -> Iterator[Topology]:
    if root_available() is not None:
        pytest.fail(f"topology fixture used without root: {root_available()}")
    with topology() as created:
        yield created
