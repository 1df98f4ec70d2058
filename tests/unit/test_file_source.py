"""The services file: parsing, all-or-nothing validation and reload on change."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from tests.factories import endpoint, endpoint_slice, service
from uproxy.model import Protocol, ServicePortName
from uproxy.sources.file import FileSource, ServicesFileError, parse_manifests
from uproxy.tracker import Tracker

WEB = ServicePortName("default", "web", "http", Protocol.TCP)


def dump(*docs: object) -> str:
    return yaml.safe_dump_all(docs)


def test_parse_documents_and_lists() -> None:
    text = dump(
        service(),
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])],
        },
        None,
    )
    m = parse_manifests(text)
    assert len(m.services) == 1 and len(m.slices) == 1


@pytest.mark.parametrize(
    ("docs", "needle"),
    [
        (
            [service(), {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}],
            "document 2: kind",
        ),
        ([{**service(), "apiVersion": "v2"}], "document 1: apiVersion"),
        (
            [service(ports=[{"name": "a", "port": 0}])],
            "document 1: Service default/web: spec.ports[0].port",
        ),
        ([service(), service()], "document 2: Service default/web appears twice"),
        ([endpoint_slice("a", endpoints=[endpoint("nope")])], "endpoints[0].addresses[0]"),
    ],
)
def test_bad_documents_name_document_and_field(docs: list[object], needle: str) -> None:
    with pytest.raises(ServicesFileError) as err:
        parse_manifests(dump(*docs), "svc.yaml")
    assert needle in str(err.value)


def test_yaml_error_names_the_line() -> None:
    with pytest.raises(ServicesFileError, match="line 2"):
        parse_manifests("kind: Service\n  bad: [unclosed\n", "svc.yaml")


def test_reload_applies_changes_and_keeps_last_good_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.yaml"
    path.write_text(dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])))
    tracker = Tracker()
    src = FileSource(path=str(path), tracker=tracker)
    src.load_initial()
    assert tracker.synced
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.1"]

    path.write_text(dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.2")])))
    src.poll()
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.2"]

    with caplog.at_level(logging.ERROR, logger="uproxy"):
        path.write_text(dump(service(ports=[{"name": "http", "port": 99999}])) + "\n# broken\n")
        src.poll()
        src.poll()
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.2"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "spec.ports[0].port" in errors[0].kv["error"]  # type: ignore[attr-defined]
