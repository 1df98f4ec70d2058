"""The services file: parsing, all-or-nothing validation and reload on change."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.factories import endpoint, endpoint_slice, service
from uproxy import heap
from uproxy.model import Protocol, ServicePortName
from uproxy.objects import object_key
from uproxy.sources import file as file_source
from uproxy.sources.file import FileSource, ServicesFileError, parse_manifests, split_documents
from uproxy.tracker import Converted, Incoming, Kind, Obj, Tracker

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
LOADERS: list[file_source._Loader] = [file_source._PythonLoader]
if yaml.__with_libyaml__:
    LOADERS.append(file_source._LibyamlLoader)


def dump(*docs: object) -> str:
    return yaml.safe_dump_all(docs)


def rewrite(path: Path, text: str) -> None:
    """Write in place with a later mtime (two writes within a clock tick share one), and one
    not within the last poll: the source reads it at once (a file changed less than a poll
    ago waits for the next one, in case it is still being written). A second ahead, then:
    the future, as after a clock step, is not "being written"."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    later = max(before, time.time_ns()) + 10**9
    os.utime(path, ns=(later, later))


class SpyTracker(Tracker):
    """A real tracker that also records what the source asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Kind, str]] = []

    def upsert(self, kind: Kind, obj: Incoming) -> bool:
        raw = obj.obj if isinstance(obj, Converted) else obj
        self.calls.append(("upsert", kind, object_key(raw)))
        return super().upsert(kind, obj)

    def delete(self, kind: Kind, obj: Obj) -> None:
        self.calls.append(("delete", kind, object_key(obj)))
        super().delete(kind, obj)

    async def replace_async(self, kind: Kind, objs: Iterable[Incoming]) -> None:
        objs = list(objs)
        self.calls.append(("replace", kind, str(len(objs))))
        await super().replace_async(kind, objs)


def cluster(n: int, *, ip: str = "10.0.0.1") -> list[dict[str, Any]]:
    docs = []
    for i in range(n):
        docs.append(service(f"svc-{i}", ports=[{"name": "http", "port": 80 + i}]))
        docs.append(endpoint_slice(f"svc-{i}-1", f"svc-{i}", endpoints=[endpoint(ip)]))
    return docs


async def loaded(path: Path, docs: list[dict[str, Any]]) -> tuple[FileSource, SpyTracker]:
    path.write_text(dump(*docs))
    tracker = SpyTracker()
    src = FileSource(path=str(path), tracker=tracker)
    await src.load_initial()
    assert tracker.synced
    assert tracker.calls == [
        ("replace", Kind.SERVICE, str(len(docs) // 2)),
        ("replace", Kind.ENDPOINT_SLICE, str(len(docs) // 2)),
    ]
    tracker.calls.clear()
    return src, tracker


def python_yaml_error(text: str, path: str) -> str:
    """The message the pure-Python loader's whole-file parse gives (what uproxy always said)."""
    with pytest.raises(yaml.MarkedYAMLError) as err:
        list(yaml.load_all(text, Loader=yaml.SafeLoader))
    mark = err.value.problem_mark
    assert mark is not None
    return (
        f"{path}: line {mark.line + 1} column {mark.column + 1}: "
        f"not valid YAML: {err.value.problem}"
    )


# ----- parsing and validation -----


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


def kubectl_json(docs: list[dict[str, Any]]) -> str:
    """What ``kubectl get services,endpointslices -A -o json`` writes: one List, indented."""
    listing = {"apiVersion": "v1", "kind": "List", "items": docs, "metadata": {}}
    return "\ufeff" + json.dumps(listing, indent=4) + "\n"


def test_kubectl_json_is_read_as_json_and_gives_what_its_yaml_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = cluster(20)
    expected = parse_manifests(dump(*docs))

    def no_yaml(*args: object, **kwargs: object) -> object:
        raise AssertionError("a JSON file went to the YAML loader")

    monkeypatch.setattr(yaml, "load_all", no_yaml)
    got = parse_manifests(kubectl_json(docs))
    assert got == expected and len(got.services) == 20


def test_a_dump_with_an_sctp_only_service_loads_whole() -> None:
    # A valid object uproxy has nothing to proxy for: skipped as a headless service is,
    # never a reason to keep the last good state instead of the cluster's dump.
    sctp = service("diameter", ports=[{"name": "s", "port": 3868, "protocol": "SCTP"}])
    docs = [*cluster(2), sctp]
    got = parse_manifests(kubectl_json(docs), "svc.json")
    assert len(got.services) == 3 and len(got.slices) == 2


def test_flow_style_yaml_and_broken_json_are_read_as_yaml() -> None:
    # Both start like JSON and are not: the YAML loader reads the one, and names the line
    # of the other's error.
    flow = yaml.safe_dump(service(), default_flow_style=True)
    assert flow.startswith("{") and len(parse_manifests(flow).services) == 1
    broken = kubectl_json(cluster(2)).rstrip()[:-1]  # the List's closing brace is lost
    with pytest.raises(ServicesFileError, match=r"svc.json: line \d+ column \d+: not valid YAML"):
        parse_manifests(broken, "svc.json")


def test_libyaml_is_used_when_pyyaml_has_it() -> None:
    if not yaml.__with_libyaml__:
        pytest.skip("this PyYAML was built without libyaml")
    assert issubclass(file_source._LOADER, yaml.CSafeLoader)


@pytest.mark.parametrize("loader", LOADERS)
def test_loaders_build_no_arbitrary_objects(
    loader: file_source._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_source, "_LOADER", loader)
    text = "a: !!python/object/apply:os.system ['false']\n"
    with pytest.raises(ServicesFileError, match="could not determine a constructor"):
        parse_manifests(text, "svc.yaml")


PLAIN_AND_NOT = [
    dump(*cluster(3)),
    "a: &x {k: [1, 2]}\nb: *x\n",  # an alias: one shared object
    "base: &b {x: 1}\nderived:\n  <<: *b\n  y: 2\n",  # a merge key
    "t: 2024-01-01T00:00:00Z\nd: 2024-01-02\nb: !!binary aGVsbG8=\nf: 1.5e3\nn: ~\no: 0o17\n",
    "--- !!set\n? a\n? b\n--- !!omap\n- a: 1\n- b: 2\n",
    "a: !!str 1\nb: '2'\nc: yes\nd: 0x1F\n= : v\n",
    "a: 1\na: 2\n1: int key\nnull: x\n",
    # Quoted and flow scalars, flow collections, tags on collections (resolved without
    # the resolver's own calls when no path resolver is registered).
    'g: [1, "80", yes, ~]\nh: {k: \'v\', n: 2}\n--- !!map {a: !!seq [1]}\n--- "top"\n',
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("text", PLAIN_AND_NOT)
def test_direct_building_gives_what_safe_loader_gives(
    loader: file_source._Loader, text: str
) -> None:
    assert file_source._load_all(text, loader) == list(yaml.safe_load_all(text))


@pytest.mark.parametrize("loader", LOADERS)
def test_aliases_share_one_object_as_in_safe_loader(loader: file_source._Loader) -> None:
    [doc] = file_source._load_all("a: &x {k: [1]}\nb: *x\n", loader)
    assert doc["a"] is doc["b"]
    [looped] = file_source._load_all("&a [*a, 1]\n", loader)
    assert looped[0] is looped


@pytest.mark.parametrize(
    "text",
    [
        "a: 1\nb:\n\tc: 2\n",  # a tab
        "a: 1\n---\nb: [1, 2\n---\nc: 3\n",  # seen only at the next document
        'a: 1\n---\nb: "\\q"\n',  # an escape libyaml places a column earlier
        "a: 1\n---\nb: *nope\n",
        "a: 1\n---\n- a\nb: 1\n",
        "%YAML 1.1\n%YAML 1.1\n---\na: 1\n",  # parsed whole: libyaml's words
    ],
)
def test_syntax_errors_read_as_before_with_libyaml(text: str) -> None:
    """libyaml finds the error; the message is the pure-Python loader's (line, column, words)
    for that document, as the whole-file parse always gave it."""
    with pytest.raises(ServicesFileError) as err:
        parse_manifests(text, "svc.yaml")
    if text.startswith("%") and file_source._LOADER is not file_source._PythonLoader:
        assert "svc.yaml: line 2 column 1: not valid YAML:" in str(err.value)
    else:
        assert str(err.value) == python_yaml_error(text, "svc.yaml")


# ----- splitting into documents -----

TRICKY = {
    "keep chomping before ---": "a: |+\n  x\n\n---\nb: 1\n",
    "block scalar at the top": "--- |\n  foo\n---\nb: 1\n",
    "--- inside a block scalar": "a: |\n  ---\n  x\n---\nb: 1\n",
    "multi-line quoted": 'a: "x\n  y"\n---\nb: 1\n',
    "--- inside quotes": "a: 'x\n---\nb: 1'\n",
    "unclosed flow": "a: [1,\n---\nb: 2\n",
    "document end": "a: 1\n...\n---\nb: 2\n...\n",
    "content after document end": "a: 1\n...\nb: 2\n",
    "alias into another document": "a: &x {k: 1}\n---\nc: *x\n",
    "comments only before ---": "# hi\n---\na: 1\n",
    "empty documents": "---\n---\na: 1\n---\n",
    "no final newline": "---\na: 1\n---\nb: 2",
    "CRLF": "a: 1\r\n---\r\nb: 2\r\n",
    "BOM": "\ufeff---\na: 1\n---\nb: 2\n",
    "tab after ---": "---\ta: 1\n---\t\nb: 2\n",
    "inline documents": "--- {a: 1}\n--- [1, 2]\n--- x\n",
    "not a document start": "a: ---\n---x: 1\n",
}
WHOLE = {
    "a directive": "%YAML 1.1\n---\na: 1\n",
    "a lone CR": "a: 1\r---\rb: 2\r",
    "a line separator": "a: 1\u2028---\u2028b: 2\n",
    "a NEL": "a: 1\x85---\x85b: 2\n",
}


def piecewise(text: str) -> list[Any] | None:
    pieces = split_documents(text)
    assert pieces is not None
    assert "".join(pieces) == text
    parsed = file_source._parse_pieces(pieces)
    return None if parsed is None else [doc for docs in parsed for doc in docs]


@pytest.mark.parametrize("text", TRICKY.values(), ids=TRICKY.keys())
def test_documents_parse_alone_as_in_the_whole_file(text: str) -> None:
    try:
        whole = file_source._load_all(text)
    except yaml.YAMLError:
        with pytest.raises(yaml.YAMLError):
            piecewise(text)
        return
    assert piecewise(text) == whole


@pytest.mark.parametrize("text", WHOLE.values(), ids=WHOLE.keys())
def test_doubtful_files_are_parsed_whole(text: str) -> None:
    assert split_documents(text) is None


def test_random_fragments_parse_alone_as_in_the_whole_file() -> None:
    frags = [
        "---", "--- ", "--- |", "--- |+", "--- [1,", "...", "a: 1", "b: 'x", "y'",
        'c: "p', 'q"', "d: |+", "  ---", "  x", "- 1", "f: [1,", "2]", "# c", "",
        "&a k: 1", "k2: *a", "<<: *a", "x: !!str 1", "---x", "----", "z:", "  w: 1",
        "\ta: 1", "plain", "  cont",
    ]  # fmt: skip
    rng = random.Random(7)
    agreed = 0
    for _ in range(2000):
        text = "\n".join(rng.choice(frags) for _ in range(rng.randint(0, 10)))
        text += rng.choice(["", "\n", "\n\n"])
        try:
            whole = file_source._load_all(text)
        except yaml.YAMLError:
            with pytest.raises(yaml.YAMLError):
                piecewise(text)
            continue
        assert piecewise(text) == whole, repr(text)
        agreed += 1
    assert agreed > 100


# ----- reloads -----


async def test_reload_applies_changes_and_keeps_last_good_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.yaml"
    path.write_text(dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])))
    tracker = Tracker()
    src = FileSource(path=str(path), tracker=tracker)
    await src.load_initial()
    assert tracker.synced
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.1"]

    rewrite(path, dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.2")])))
    await src.poll()
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.2"]

    with caplog.at_level(logging.ERROR, logger="uproxy"):
        rewrite(path, dump(service(ports=[{"name": "http", "port": 99999}])) + "\n# broken\n")
        await src.poll()
        await src.poll()
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.2"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "spec.ports[0].port" in errors[0].kv["error"]  # type: ignore[attr-defined]


async def test_an_edit_whose_read_failed_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that fails (out of fds, under a flood of connections) is not bad content:
    the edit used to be remembered as read, and lost until the next one."""
    path = tmp_path / "services.yaml"
    path.write_text(dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])))
    tracker = Tracker()
    src = FileSource(path=str(path), tracker=tracker)
    await src.load_initial()
    real_load = file_source._load
    failures = [OSError(24, "Too many open files")]

    def load(*args: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_load(*args)

    monkeypatch.setattr(file_source, "_load", load)
    caplog.set_level(logging.ERROR, logger="uproxy")
    caplog.clear()
    rewrite(path, dump(service(), endpoint_slice("a", endpoints=[endpoint("10.0.0.2")])))
    await src.poll()
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.1"]  # not read yet
    assert [r.kv["error"] for r in caplog.records] == [  # type: ignore[attr-defined]
        f"{path}: Too many open files"
    ]
    await src.poll()  # the same file, read this time
    assert [e.ip for e in tracker.snapshot()[WEB].endpoints] == ["10.0.0.2"]


async def test_an_emptied_file_is_applied_only_once_it_stays_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An editor that truncates, then writes: the moment in between must not take every
    # service down. A file that stays empty is taken for what it says.
    monkeypatch.setattr(file_source, "EMPTY_SETTLE_S", 0.2)
    path = tmp_path / "services.yaml"
    src, tracker = await loaded(path, cluster(3))
    text = path.read_text()
    path.write_text("")  # truncated...
    await src.poll()
    assert len(tracker.snapshot()) == 3 and tracker.calls == []
    path.write_text(text)  # ... and written again
    await src.poll()
    assert len(tracker.snapshot()) == 3 and tracker.calls == []
    path.write_text("")  # now emptied for good
    with caplog.at_level(logging.WARNING, logger="uproxy"):
        await src.poll()
        assert len(tracker.snapshot()) == 3
        for _ in range(50):  # polled as the source does, up to 5 s
            await asyncio.sleep(0.1)
            await src.poll()
            if not tracker.snapshot():
                break
    assert tracker.snapshot() == {}
    said = [r for r in caplog.records if r.getMessage().startswith("Services file empty")]
    assert [r.getMessage() for r in said] == [
        "Services file empty for a while: removing every service"
    ]
    assert said[0].__dict__["kv"]["services"] == 3  # services, not their slices too


@pytest.mark.parametrize("how", ["deleted", "broken"])
async def test_a_file_gone_or_broken_then_restored_is_said_both_ways(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    path = tmp_path / "services.yaml"
    src, tracker = await loaded(path, cluster(3))
    text = path.read_text()
    caplog.set_level(logging.INFO, logger="uproxy")
    caplog.clear()  # the first load's line
    if how == "deleted":
        path.unlink()
    else:
        path.write_text(text + "---\nkind: Service\n  spec: [\n")
        os.utime(path, ns=(0, 0))  # old enough to be read at once
    for _ in range(3):
        await src.poll()
    said = [(r.getMessage(), r.__dict__["kv"]) for r in caplog.records]
    assert [m for m, _ in said] == ["Ignoring services file change, keeping the last good state"]
    assert ("no such file" in said[0][1]["error"]) == (how == "deleted")
    caplog.clear()
    path.write_text(text)  # restored as it was: nothing to change, but the error is over
    os.utime(path, ns=(0, 0))
    for _ in range(3):
        await src.poll()
    assert [r.getMessage() for r in caplog.records] == ["Services file is good again: as served"]
    assert len(tracker.snapshot()) == 3 and tracker.calls == []


async def test_a_file_written_in_place_is_read_once_the_writes_stop(tmp_path: Path) -> None:
    # ``cmd > services.yaml``: the file grows in chunks; a part that ends between two
    # documents parses, and read then it would remove every service after the cut.
    path = tmp_path / "services.yaml"
    src, tracker = await loaded(path, cluster(20))
    text = path.read_text()
    cut = text.index("---", len(text) // 3)  # a document boundary, a third of the way in
    with open(path, "w") as fh:
        fh.write(text[:cut])
        fh.flush()
        await src.poll()  # changed this instant: still being written, not read
        assert len(tracker.snapshot()) == 20 and tracker.calls == []
        fh.write(text[cut:])
    for _ in range(50):  # then read once it stops changing (up to 5 s, as the source polls)
        await src.poll()
        await asyncio.sleep(0.1)
    assert len(tracker.snapshot()) == 20
    assert not any(call[0] == "delete" for call in tracker.calls), tracker.calls


async def test_a_json_file_loads_and_reloads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.json"
    docs = cluster(3)
    path.write_text(kubectl_json(docs))
    tracker = Tracker()
    src = FileSource(path=str(path), tracker=tracker)
    await src.load_initial()
    svc1 = ServicePortName("default", "svc-1", "http", Protocol.TCP)
    assert [e.ip for e in tracker.snapshot()[svc1].endpoints] == ["10.0.0.1"]
    docs[3] = endpoint_slice("svc-1-1", "svc-1", endpoints=[endpoint("10.0.0.7")])
    rewrite(path, kubectl_json(docs))
    caplog.set_level(logging.INFO, logger="uproxy")
    caplog.clear()
    await src.poll()
    assert [e.ip for e in tracker.snapshot()[svc1].endpoints] == ["10.0.0.7"]
    assert len(tracker.snapshot()) == 3
    # One List, one document: every item was looked at, one changed (it said 6).
    (loaded,) = [r for r in caplog.records if r.getMessage() == "Loaded services file"]
    assert loaded.kv["changed"] == 1  # type: ignore[attr-defined]


async def test_a_bad_first_file_fails_the_start(tmp_path: Path) -> None:
    path = tmp_path / "services.yaml"
    path.write_text(dump(*cluster(2), service("svc-0")))
    tracker = Tracker()
    with pytest.raises(ServicesFileError, match="document 5: Service default/svc-0 appears"):
        await FileSource(path=str(path), tracker=tracker).load_initial()
    with pytest.raises(OSError):
        await FileSource(path=str(tmp_path / "missing"), tracker=tracker).load_initial()
    assert not tracker.synced


async def test_one_changed_document_is_parsed_and_upserted_alone(tmp_path: Path) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(50)
    src, tracker = await loaded(path, docs)
    assert src.documents_parsed == 100

    docs[41] = endpoint_slice("svc-20-1", "svc-20", endpoints=[endpoint("10.0.0.9")])
    rewrite(path, dump(*docs))
    await src.poll()
    assert src.documents_parsed == 101
    assert tracker.calls == [("upsert", Kind.ENDPOINT_SLICE, "default/svc-20-1")]
    svc20 = ServicePortName("default", "svc-20", "http", Protocol.TCP)
    assert [e.ip for e in tracker.snapshot()[svc20].endpoints] == ["10.0.0.9"]

    # The same content again (an editor's save without changes): nothing parsed, no calls.
    tracker.calls.clear()
    rewrite(path, dump(*docs))
    await src.poll()
    assert src.documents_parsed == 101 and tracker.calls == []


async def test_each_object_is_converted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source converts every object to validate the file; the tracker takes those
    conversions (and builds the same state as from the objects themselves)."""
    converted: list[str] = []
    for name in ("service_ports", "endpoint_slice"):
        real = getattr(file_source, name)

        def counting(obj: Obj, real: Any = real) -> Any:
            converted.append(object_key(obj))
            return real(obj)

        monkeypatch.setattr(file_source, name, counting)
        monkeypatch.setattr("uproxy.tracker." + name, counting)
    path = tmp_path / "services.yaml"
    docs = cluster(20)
    src, tracker = await loaded(path, docs)
    assert sorted(converted) == sorted(object_key(d) for d in docs)
    fresh = Tracker()
    fresh.replace(Kind.SERVICE, docs[0::2])
    fresh.replace(Kind.ENDPOINT_SLICE, docs[1::2])
    assert tracker.snapshot() == fresh.snapshot()

    converted.clear()
    docs[3] = endpoint_slice("svc-1-1", "svc-1", endpoints=[endpoint("10.0.0.9")])
    rewrite(path, dump(*docs))
    await src.poll()  # by document: the changed one alone
    assert converted == ["default/svc-1-1"]
    svc1 = ServicePortName("default", "svc-1", "http", Protocol.TCP)
    assert [e.ip for e in tracker.snapshot()[svc1].endpoints] == ["10.0.0.9"]

    converted.clear()
    rewrite(path, "%YAML 1.1\n---\n" + dump(*docs[:-2]))  # a directive: parsed whole
    await src.poll()
    assert sorted(converted) == sorted(object_key(d) for d in docs[:-2])
    assert ServicePortName("default", "svc-19", "http", Protocol.TCP) not in tracker.snapshot()


@pytest.fixture
def collector_restored() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.enable()


class LoadSpy:
    """``_load`` as it is, noting whether the collector was on while it ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.collector_on: list[bool] = []
        self.made: list[Any] = []  # the documents each load parsed
        self._real = file_source._load
        monkeypatch.setattr(file_source, "_load", self)

    def __call__(self, *args: Any) -> Any:
        self.collector_on.append(gc.isenabled())
        change = self._real(*args)
        if change is not None:
            self.made += [c.obj for _, c in change.upserts]
        return change


def frozen(obj: object) -> bool:
    """Moved out of the collector's generations by ``gc.freeze`` (it is still tracked)."""
    assert gc.is_tracked(obj)
    return all(o is not obj for o in gc.get_objects())


@pytest.mark.usefixtures("collector_restored")
async def test_a_big_reload_parses_without_the_collector_and_freezes_what_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The collector's full passes over a big parse's objects held the GIL, and with it the
    # loop, for up to 125 ms each at 10,000 services.
    path = tmp_path / "services.yaml"
    n = heap.BULK_MIN + 100
    src, tracker = await loaded(path, cluster(n))
    spy = LoadSpy(monkeypatch)
    rewrite(path, dump(*cluster(n, ip="10.0.0.2")))
    await src.poll()
    assert len(tracker.calls) == n  # every slice changed
    assert spy.collector_on == [False]
    assert gc.isenabled() and heap._depth == 0
    assert frozen(spy.made[-1])  # what the tracker keeps is out of the passes' way


@pytest.mark.usefixtures("collector_restored")
async def test_a_small_or_bad_reload_leaves_the_collector_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(20)
    src, tracker = await loaded(path, docs)
    spy = LoadSpy(monkeypatch)
    docs[3] = endpoint_slice("svc-1-1", "svc-1", endpoints=[endpoint("10.0.0.7")])
    rewrite(path, dump(*docs))
    await src.poll()
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        rewrite(path, "kind: [")
        await src.poll()
    assert tracker.calls == [("upsert", Kind.ENDPOINT_SLICE, "default/svc-1-1")]
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.ERROR]
    assert spy.collector_on == [False, False]
    assert gc.isenabled() and heap._depth == 0
    assert not frozen(spy.made[0])  # a small change's objects stay in the collector's sight


async def test_a_reload_is_announced_once_when_all_of_it_is_in(tmp_path: Path) -> None:
    """A reload replacing every service is one change for the syncer: each callback runs
    once, after the last object is in (a sync started on the first one saw half of it)."""
    path = tmp_path / "services.yaml"
    src, tracker = await loaded(path, cluster(30))
    seen: list[tuple[str, int]] = []

    def on(kind: str) -> None:
        seen.append((kind, len(tracker.snapshot())))

    tracker.on_change = lambda: on("services")
    tracker.on_endpoints = lambda: on("endpoints")
    others = []
    for i in range(40):
        others.append(service(f"new-{i}", ports=[{"name": "http", "port": 80 + i}]))
        others.append(endpoint_slice(f"new-{i}-1", f"new-{i}", endpoints=[endpoint("10.0.0.2")]))
    rewrite(path, dump(*others))
    await src.poll()
    assert seen == [("services", 40), ("endpoints", 40)]
    assert {k.name for k in tracker.snapshot()} == {f"new-{i}" for i in range(40)}
    # Outside a reload, each change is announced as it comes.
    seen.clear()
    tracker.upsert(Kind.SERVICE, service("late", ports=[{"name": "http", "port": 9}]))
    assert seen == [("services", 41)]


async def test_a_removed_document_deletes_only_its_object(tmp_path: Path) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(20)
    src, tracker = await loaded(path, docs)
    del docs[6]  # svc-3
    rewrite(path, dump(*docs))
    await src.poll()
    assert src.documents_parsed == 40
    assert tracker.calls == [("delete", Kind.SERVICE, "default/svc-3")]
    assert ServicePortName("default", "svc-3", "http", Protocol.TCP) not in tracker.snapshot()


async def test_a_bad_edit_changes_nothing_and_the_fix_parses_one_document(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(20)
    src, tracker = await loaded(path, docs)
    bad = list(docs)
    bad[25] = endpoint_slice("svc-12-1", "svc-12", endpoints=[endpoint("10.0.0.x")])
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        rewrite(path, dump(*bad))
        await src.poll()
        rewrite(path, dump(*docs).replace("  name: svc-3\n", "\tname: svc-3\n", 1))
        await src.poll()
    errors = [str(r.kv["error"]) for r in caplog.records if r.levelno == logging.ERROR]  # type: ignore[attr-defined]
    assert len(errors) == 2
    assert errors[0].startswith(f"{path}: document 26: EndpointSlice default/svc-12-1:")
    assert errors[1] == python_yaml_error(path.read_text(), str(path))
    assert tracker.calls == [] and src.reloads == 1

    docs[4] = service("svc-2", ports=[{"name": "http", "port": 8080}])
    rewrite(path, dump(*docs))
    await src.poll()
    assert tracker.calls == [("upsert", Kind.SERVICE, "default/svc-2")]
    assert src.documents_parsed == 41


async def test_a_duplicate_is_named_by_its_document_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(5)
    src, tracker = await loaded(path, docs)
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        rewrite(path, dump(*docs, service("svc-1")))
        await src.poll()
    errors = [str(r.kv["error"]) for r in caplog.records if r.levelno == logging.ERROR]  # type: ignore[attr-defined]
    assert errors == [f"{path}: document 11: Service default/svc-1 appears twice"]
    assert tracker.calls == []


async def test_a_file_with_directives_reloads_whole_and_right(tmp_path: Path) -> None:
    path = tmp_path / "services.yaml"
    docs = cluster(5)
    path.write_text("%YAML 1.1\n---\n" + dump(*docs))
    tracker = SpyTracker()
    src = FileSource(path=str(path), tracker=tracker)
    await src.load_initial()
    docs[3] = endpoint_slice("svc-1-1", "svc-1", endpoints=[endpoint("10.0.0.7")])
    del docs[0]
    rewrite(path, "%YAML 1.1\n---\n" + dump(*docs))
    await src.poll()
    assert src.documents_parsed == 10 + 9  # the whole file, twice
    state = tracker.snapshot()
    assert ServicePortName("default", "svc-0", "http", Protocol.TCP) not in state
    svc1 = ServicePortName("default", "svc-1", "http", Protocol.TCP)
    assert [e.ip for e in state[svc1].endpoints] == ["10.0.0.7"]
