# Two entry points for a newcomer:
#   make demo         install uproxy in .venv and run the self-contained demo (no root)
#   make test         as root (else sudo make test): install what the tests need and run
#                     lint, typing and the whole suite
# (without root, the tests that need network namespaces and iptables are skipped, visibly)

# The interpreter: the distribution's own python3 when it is 3.11 or newer and can make a venv
# (Debian's and Ubuntu's are built with profile-guided and link-time optimization; on a Debian
# 12 host it is the very interpreter of the image), else python3 from PATH. PYTHON=... overrides.
PYTHON ?= $(shell /usr/bin/python3 -c 'import ensurepip, sys; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
APT_PACKAGES := python3 python3-venv python3-dev iptables nftables conntrack iproute2 dnsutils curl \
	netcat-openbsd dnsmasq-base socat haproxy nginx-light libnginx-mod-stream wrk iperf3 gcc libc6-dev \
	make openssl

.PHONY: demo test lint typecheck pytest system-deps venv bench bench-quick clean

$(BIN)/uproxy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

venv: $(BIN)/uproxy

demo: venv
	$(BIN)/uproxy demo

system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		missing=""; for p in $(APT_PACKAGES); do \
			dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
		done; \
		if [ -n "$$missing" ]; then \
			echo "installing:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		fi; \
	else echo "not root: skipping system packages (root-only tests will be skipped)"; fi

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

pytest: venv
	$(BIN)/python -m pytest -p no:cacheprovider

test: system-deps venv lint typecheck pytest

bench: venv
	$(BIN)/python -m bench

bench-quick: venv
	$(BIN)/python -m bench --quick

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
