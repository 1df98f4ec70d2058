"""quick_init: the same construction as a frozen dataclass's own ``__init__``, made cheaper."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from uproxy import model, objects
from uproxy.dataplane import messages
from uproxy.records import quick_init
from uproxy.rules import base, portals


def _make(name: str) -> type[Any]:
    @dataclass(frozen=True, slots=True)
    class Record:
        a: int
        b: str = "b"
        c: tuple[int, ...] = field(default_factory=tuple)
        d: dict[str, int] = field(default_factory=dict, init=False, compare=False)
        e: int = field(default=5, kw_only=True)

    Record.__name__ = Record.__qualname__ = name  # pickled by that name, as a module's own
    return Record


_Plain = _make("_Plain")  # the generated __init__
_Quick = quick_init(_make("_Quick"))


def _fields(obj: object) -> dict[str, object]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        ((1, "x"), {}),
        ((1, "x", (2, 3)), {"e": 9}),
        ((), {"a": 1, "c": (4,), "e": 0}),
    ],
)
def test_same_fields_as_the_generated_init(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    assert _fields(_Quick(*args, **kwargs)) == _fields(_Plain(*args, **kwargs))


def test_same_signature() -> None:
    plain = inspect.signature(_Plain)
    quick = inspect.signature(_Quick)
    assert [(p.name, p.kind) for p in quick.parameters.values()] == [
        (p.name, p.kind) for p in plain.parameters.values()
    ]
    assert quick.parameters["b"].default == "b"
    assert quick.parameters["e"].default == 5


def test_factories_make_a_new_value_each_time() -> None:
    one, two = _Quick(1), _Quick(1)
    assert one.d == {} and one.d is not two.d  # init=False: made by its factory
    assert _Quick(1).c == ()


def test_stays_frozen_and_checks_its_arguments() -> None:
    q = _Quick(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.a = 2
    with pytest.raises(TypeError):
        _Quick()
    with pytest.raises(TypeError):
        _Quick(1, "x", (), 4)  # e is keyword-only
    with pytest.raises(TypeError):
        _Quick(1, f=2)


def test_equality_hash_replace_and_pickling_unchanged() -> None:
    q = _Quick(1, "x", (2,), e=3)
    assert q == _Quick(1, "x", (2,), e=3) and hash(q) == hash(_Quick(1, "x", (2,), e=3))
    assert dataclasses.replace(q, b="y") == _Quick(1, "y", (2,), e=3)
    assert pickle.loads(pickle.dumps(q)) == q


def test_refuses_what_it_cannot_make() -> None:
    @dataclass(slots=True)
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    for cls in (Mutable, NoSlots, PostInit):
        with pytest.raises(TypeError):
            quick_init(cls)


@pytest.mark.parametrize(
    "cls",
    [
        model.ServicePortName,
        model.ServicePort,
        model.Endpoint,
        model.ServiceState,
        objects.EndpointSliceInfo,
        portals.PortalRule,
        base.Portal,
        messages.OpenListener,
        messages.SetEndpoints,
    ],
)
def test_the_hot_classes_use_it(cls: type) -> None:
    # What a cold start makes by the ten thousand: a class that loses its decorator makes
    # every one of them at the generated speed again.
    init = cls.__dict__["__init__"]
    assert any(n.startswith("_set_") for n in init.__code__.co_names)
