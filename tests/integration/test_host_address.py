"""The address the host portals DNAT the node's own traffic to, followed by the whole proxy on
a node (a services file, a rules backend that records what it is told, the host's addresses
as the test sets them): gone, it is replaced by the family's primary address now; gone with
no other, it is said once and kept; one the operator chose (``--bind-address``) stays. The
rules the real backends write for it, and the node's own traffic, are in
``tests/e2e/test_node_address.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from uproxy import localnet, nodeip, proxy as proxy_module
from uproxy.model import IPFamily
from uproxy.proxy import Proxy
from uproxy.rules.base import LocalTraffic, Portal
from uproxy.settings import Settings

START_IP = "192.0.2.10"
NEW_IP = "192.0.2.20"


class RecordingRules:
    """Programs nothing; remembers each host address it was told and each sync."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.checks = 0

    async def prepare(self) -> None:
        return None

    async def sync(self, portals: Collection[Portal]) -> None:
        self.events.append(("sync", len(portals)))

    def set_local_traffic(self, local: LocalTraffic) -> None:
        return None

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        self.events.append(("host", (family, host_ip)))

    async def check(self) -> bool:
        self.checks += 1  # each pass of the proxy's check loop, right after the addresses
        return True

    async def cleanup(self) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def hosts(self) -> list[tuple[IPFamily, str]]:
        return [value for kind, value in self.events if kind == "host"]


class Host:
    """This host's IPv4 addresses and primary address, as the proxy reads them."""

    def __init__(self) -> None:
        self.addresses: frozenset[str] | None = frozenset({START_IP})
        self.primary: str | None = START_IP
        self.reads = 0

    def addresses_now(self, family: IPFamily, seq: int = 1) -> frozenset[str] | None:
        self.reads += 1
        return self.addresses if family is IPFamily.V4 else frozenset()

    def primary_address(self, family: IPFamily, preferred: tuple[str, ...] = ()) -> str | None:
        return self.primary if family is IPFamily.V4 else None

    async def read_again(self, times: int) -> None:
        """Until the proxy has read the addresses ``times`` more times."""
        reads = self.reads
        await wait_for(lambda: self.reads >= reads + times, message=f"{times} more checks")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Host:
    h = Host()
    monkeypatch.setattr(localnet, "primary_address", h.primary_address)  # at start
    monkeypatch.setattr(nodeip, "primary_address", h.primary_address)  # when it changed
    monkeypatch.setattr(nodeip, "addresses_now", h.addresses_now)
    monkeypatch.setattr(proxy_module, "RULES_CHECK_INTERVAL_S", 0.02)
    return h


@pytest.fixture
async def started(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    running: list[Proxy] = []
    path = tmp_path / "services.yaml"
    path.write_text("")

    async def start(rules: RecordingRules, **settings: Any) -> Proxy:
        proxy = Proxy(
            Settings(
                services=str(path),
                rules="iptables-restore",  # node mode; the backend itself is the recorder
                workers=0,
                dial_mark=0,
                healthz_bind_address="",
                metrics_bind_address="",
                iptables_min_sync_period=0.02,
                **settings,
            ),
            rules=rules,
        )
        running.append(proxy)
        await proxy.start()
        await asyncio.wait_for(proxy.synced.wait(), 10)
        return proxy

    yield start
    for proxy in running:
        await proxy.stop()


async def test_a_host_address_that_went_away_is_replaced_by_the_primary_one(
    host: Host, started: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy.proxy")
    rules = RecordingRules()
    proxy = await started(rules)
    assert [s.host_ip for s in proxy.stacks] == [START_IP]
    await host.read_again(3)
    assert rules.hosts == []  # still there: nothing to do

    host.addresses, host.primary = frozenset({NEW_IP}), NEW_IP
    await wait_for(lambda: rules.hosts == [(IPFamily.V4, NEW_IP)], message="the new address")
    told = next(i for i, (kind, _) in enumerate(rules.events) if kind == "host")
    await wait_for(
        lambda: any(kind == "sync" for kind, _ in rules.events[told:]),
        message="a rules sync after the new address",
    )
    assert [s.host_ip for s in proxy.stacks] == [NEW_IP]
    said = [r for r in caplog.records if "address changed" in r.getMessage()]
    assert len(said) == 1
    assert said[0].kv == {"family": "IPv4", "was": START_IP, "now": NEW_IP}  # type: ignore[attr-defined]
    await host.read_again(3)
    assert rules.hosts == [(IPFamily.V4, NEW_IP)]  # once


async def test_gone_with_no_other_it_is_said_once_and_kept_until_one_comes(
    host: Host, started: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy.proxy")
    rules = RecordingRules()
    proxy = await started(rules)
    host.addresses, host.primary = frozenset(), None
    await host.read_again(5)
    gone = [r for r in caplog.records if "has no other" in r.getMessage()]
    assert len(gone) == 1
    assert rules.hosts == [] and [s.host_ip for s in proxy.stacks] == [START_IP]

    host.addresses = frozenset({START_IP})  # back: nothing to do
    await host.read_again(3)
    assert rules.hosts == []
    host.addresses, host.primary = frozenset({NEW_IP}), NEW_IP
    await wait_for(lambda: rules.hosts == [(IPFamily.V4, NEW_IP)], message="the new address")


async def test_unreadable_addresses_change_nothing(host: Host, started: Any) -> None:
    rules = RecordingRules()
    await started(rules)
    host.addresses, host.primary = None, NEW_IP
    await host.read_again(3)
    assert rules.hosts == []


async def test_an_address_of_bind_address_is_the_operators_and_stays(
    host: Host, started: Any
) -> None:
    rules = RecordingRules()
    await started(rules, bind_address=START_IP)
    host.addresses, host.primary = frozenset({NEW_IP}), NEW_IP
    checks = rules.checks
    await wait_for(lambda: rules.checks >= checks + 3, message="three passes of the check loop")
    assert host.reads == 0 and rules.hosts == []


class FailingCheckRules(RecordingRules):
    """Its check cannot look for a while (the process out of fds), then can again."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def check(self) -> bool:
        await super().check()
        if self.checks <= self.failures:
            raise OSError(24, "Too many open files")
        return True


async def test_a_rules_check_that_cannot_look_is_one_line_and_forces_no_resync(
    host: Host, started: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A check that failed to run said "Rules check failed" every second, then "Rules missing
    or changed by someone else, resyncing" (it knew nothing of the rules), and forced a sync
    every second, past the syncs' own back-off."""
    caplog.set_level(logging.INFO, logger="uproxy.proxy")
    rules = FailingCheckRules(failures=10)
    await started(rules)
    syncs = sum(kind == "sync" for kind, _ in rules.events)
    await wait_for(lambda: rules.checks > 12, message="the check working again")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said.count("Rules check failed") == 1
    assert "Rules missing or changed by someone else, resyncing" not in said
    assert "Rules check works again" in said
    assert sum(kind == "sync" for kind, _ in rules.events) == syncs
