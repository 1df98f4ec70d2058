# uproxy's node image: the package in a virtual environment on Debian's own Python, plus the
# Debian tools it runs (iptables-{nft,legacy}-{save,restore}, nft), and conntrack.
#
# The interpreter is Debian 12's python3 (3.11, with Debian's security fixes): the one `make`
# takes on a Debian 12 host, so the tests and bench/ run the interpreter the node runs. It is
# built with profile-guided and link-time optimization into a static executable; a Python
# built from source without them (pyenv's default) spent 5 % more user time per relayed
# connection (bench/results/NOTE.md). Pin the base by digest where you build
# (debian:bookworm-slim@sha256:...): a digest can only be read from a registry.
# Both stages use the same base, so the venv's interpreter path is valid in the final one.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
# python-iptables compiles a small C wrapper; the compiler and the headers stay in this stage.
# Debian stable only ships security fixes for a release, so its package versions are not
# pinned: a rebuild should pick those fixes up.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/uproxy
WORKDIR /src
COPY pyproject.toml README.md ./
COPY uproxy ./uproxy
RUN python3 -m venv "$VIRTUAL_ENV" \
    && "$VIRTUAL_ENV/bin/pip" install . \
    && "$VIRTUAL_ENV/bin/python" -OO -m compileall -q "$VIRTUAL_ENV/lib" \
    && PYTHONOPTIMIZE=2 "$VIRTUAL_ENV/bin/uproxy" --version

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="uproxy" \
      org.opencontainers.image.description="A userspace L4 service proxy for Kubernetes (kube-proxy's userspace mode on asyncio/uvloop)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"
# python3 (the interpreter the venv was made with), iptables (nft and legacy variants, and the
# libraries python-iptables loads), nftables (nft, for --rules nftables), conntrack (for whoever
# debugs the node: uproxy forgets stale UDP entries over netlink): what uproxy is and runs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 iptables nftables conntrack \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/uproxy /opt/uproxy
# uproxy runs with docstrings and asserts stripped (PYTHONOPTIMIZE=2, as python -OO): the API
# client's package imports 1,500 generated model classes whose docstrings nothing reads, 16 MiB
# of the control process at 10,000 services. The root filesystem is read-only in the DaemonSet,
# so the bytecode for that level is compiled here (the venv's in the build stage), and nothing
# tries to write more at run time.
RUN python3 -OO -m compileall -q -x '/(test|tests|idle_test)/' \
        "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
ENV PATH=/opt/uproxy/bin:$PATH \
    VIRTUAL_ENV=/opt/uproxy \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONOPTIMIZE=2 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["uproxy"]
