"""A small Dockerfile reader: just enough of the format to check the image recipe and to
follow its steps outside Docker (line continuations, comments, ARG/ENV substitution,
key=value lists, exec-form JSON)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field


@dataclass
class Instruction:
    keyword: str
    flags: dict[str, str]
    args: str

    def pairs(self) -> dict[str, str]:
        """The key=value pairs of an ENV, LABEL or ARG instruction."""
        return dict(word.partition("=")[::2] for word in shlex.split(self.args))


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    @property
    def entrypoint(self) -> list[str]:
        (ep,) = self.all("ENTRYPOINT")
        value = json.loads(ep.args)
        if not isinstance(value, list):
            raise ValueError("ENTRYPOINT is not in exec form")
        return [str(v) for v in value]

    def pairs(self, keyword: str) -> dict[str, str]:
        """ENV or LABEL key=value pairs of this stage, in order, later ones winning."""
        out: dict[str, str] = {}
        for i in self.all(keyword):
            out.update(i.pairs())
        return out


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def substitute(text: str, values: dict[str, str]) -> str:
    """``${NAME}`` and ``$NAME`` as Docker expands them in FROM, ENV, LABEL and COPY."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
        if keyword == "FROM":
            words = substitute(rest, global_args).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{keyword} before the first FROM")
            key, _, value = rest.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, flags, rest.strip()))
    return Dockerfile(global_args, stages)
