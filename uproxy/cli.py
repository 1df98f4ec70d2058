"""The command line: parse, check, hand over. Nothing here proxies.

Flags are generated from the ``Settings`` table. Precedence: defaults, then ``--config``,
then flags given explicitly on the command line. Any error a user can cause ends in one line
on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from uproxy import __version__, heap
from uproxy.eventloop import run_loop
from uproxy.log import Held, kv, setup as setup_logging
from uproxy.settings import (
    Settings,
    SettingsError,
    convert,
    default_text,
    parse_bool,
    setting_fields,
    validate,
)

EXIT_USAGE = 2
EXIT_FAILURE = 1
LAPTOP_HEALTHZ = "127.0.0.1:10256"  # --healthz-bind-address's default with --rules none

log = logging.getLogger("uproxy.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        return super().parse_args(None if args is None else self._joined(args), namespace)

    def _joined(self, args: Sequence[str]) -> list[str]:
        """``--flag -5s`` as ``--flag=-5s``: argparse takes a value that starts with '-' and
        is not a number for a flag of its own ("expected one argument"), so a negative
        duration would never reach the check that names what is wrong with it."""
        out: list[str] = []
        takes_value = {s for a in self._actions if a.nargs is None for s in a.option_strings}
        # A switch takes its value only as --flag=false, as kube-proxy's flag parser has it:
        # alone it is --flag=true, and the word after it is not its value.
        switches = {s for a in self._actions if a.nargs == "?" for s in a.option_strings}
        it = iter(args)
        for arg in it:
            if arg in switches:
                out.append(f"{arg}=true")
                continue
            if arg in takes_value:
                value = next(it, None)
                if (
                    value is not None
                    and value.startswith("-")
                    and value not in self._option_string_actions
                ):
                    out.append(f"{arg}={value}")
                    continue
                out.append(arg)
                if value is not None:
                    out.append(value)
                continue
            out.append(arg)
        return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="uproxy",
        description="A userspace L4 service proxy for Kubernetes: kube-proxy's userspace mode "
        "on asyncio/uvloop. Follows a cluster (or a --services file), opens one proxy port per "
        "service port and relays TCP and UDP to the endpoints.",
        epilog="Precedence: flags given on the command line win over --config, which wins over "
        "the defaults. Subcommand: 'uproxy demo' runs a self-contained demo (no cluster, no "
        "root).",
        argument_default=argparse.SUPPRESS,
        # No prefixes: kube-proxy's flag parser takes none, so '--v=2' (klog's spelling) and
        # the old '--conntrack-max' must not be read as --version and --conntrack-max-per-core.
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"uproxy {__version__}")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file with an "
        "optional 'uproxy:' block; explicit flags win over it",
    )
    parser.add_argument(
        "--cleanup",
        **_switch(),
        help="Remove every rule and chain uproxy installs (any backend) and exit",
    )
    parser.add_argument(
        "--write-config-to",
        metavar="FILE",
        help="Write the configuration these flags (and --config) give to FILE, as a "
        "KubeProxyConfiguration with every field uproxy reads, and exit",
    )
    parser.add_argument(
        "--init-only",
        **_switch(),
        help="Raise the node's conntrack settings (the conntrack flags) and exit: for a "
        "privileged init container, so that uproxy itself needs no write access to /proc/sys",
    )
    for f in setting_fields():
        flag = f.metadata["flag"]
        if not flag:
            continue
        help_text = f"{f.metadata['help']} (default: {default_text(f) or 'unset'})"
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
        if f.metadata["kind"] == "bool":
            kwargs.update(_switch(convert=False))  # ``convert`` names the flag in its error
        else:
            kwargs["metavar"] = (
                f.metadata["choices"] and "{" + ",".join(f.metadata["choices"]) + "}"
            ) or _metavar(f.metadata["kind"])
        # klog spells the verbosity flag both ways: -v 2 and --v=2.
        parser.add_argument(flag, *(["--v"] if flag == "-v" else []), **kwargs)
    return parser


def _switch(*, convert: bool = True) -> dict[str, Any]:
    """A true/false flag: ``--flag``, ``--flag=true`` or ``--flag=false`` (and the other
    spellings Go's strconv.ParseBool takes), as kube-proxy's flags are; a flag can so turn
    off what --config turned on."""
    return {"nargs": "?", "metavar": "true|false", **({"type": _bool_arg} if convert else {})}


def _bool_arg(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _metavar(kind: str) -> str:
    return {
        "duration": "DURATION",
        "int": "N",
        "ip": "IP",
        "hostport": "HOST:PORT",
        "cidrs": "CIDR,...",
        "mark": "MARK",
    }.get(kind, "VALUE")


def parse_settings(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """Settings from the command line (and --config); raises SettingsError."""
    ns = build_parser().parse_args(list(argv))
    settings = Settings()
    from_file: dict[str, str] = {}  # setting -> its field in --config, unless a flag set it
    config = getattr(ns, "config", None)
    if config:
        from uproxy.configfile import load_config

        load_config(config, settings, from_file)
    given = set(from_file)
    for f in setting_fields():
        if f.metadata["flag"] and hasattr(ns, f.name):
            setattr(settings, f.name, convert(f, getattr(ns, f.name)))
            given.add(f.name)
            from_file.pop(f.name, None)
    laptop = settings.rules == "none" or (settings.laptop and not ns_writes_config(ns))
    if laptop and "healthz_bind_address" not in given:
        # kube-proxy's 0.0.0.0 is for the kubelet and load balancers to reach; a laptop
        # proxy listens on loopback only, /healthz included. Not in a configuration written
        # by a user who is not root with no --rules (a laptop because of who runs it): the
        # node that loads the file would listen on loopback, and its probes would fail.
        settings.healthz_bind_address = LAPTOP_HEALTHZ
    try:
        validate(settings)
    except SettingsError as e:
        raise _where_from(e, config, from_file) from None
    if settings.services:
        ignored = [
            f
            for f, v in (("--kubeconfig", settings.kubeconfig), ("--master", settings.master))
            if v
        ]
        if ignored:  # a laptop user's --config may well name the cluster's kubeconfig
            log.warning(
                "Services come from the --services file: the API server is not used",
                extra=kv(ignored=",".join(ignored)),
            )
    return settings, ns


def ns_writes_config(ns: argparse.Namespace) -> bool:
    return bool(getattr(ns, "write_config_to", None))


_FLAG_ERROR = re.compile(r"(?:invalid )?(--[a-z0-9-]+): (.*)")


def _where_from(err: SettingsError, config: str | None, from_file: dict[str, str]) -> SettingsError:
    """A checked value's error names where the value came from: the flag, or the field of
    the configuration file (``FILE: iptables.syncPeriod: must be positive``)."""
    said = _FLAG_ERROR.fullmatch(str(err))
    if config is None or said is None:
        return err
    flag, rest = said.groups()
    for f in setting_fields():
        if f.metadata["flag"] == flag and f.name in from_file:
            return SettingsError(f"{config}: {from_file[f.name]}: {rest}")
    return err


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        from uproxy.demo import demo_main

        return demo_main(args[1:])
    with Held() as held:  # --config's warnings, logged once logging is set up as it says
        try:
            settings, ns = parse_settings(args)
        except SettingsError as e:
            print(f"uproxy: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        setup_logging(verbosity=settings.verbosity, fmt=settings.logging_format)
    held.replay()
    write_to = getattr(ns, "write_config_to", None)
    if write_to:
        from uproxy.configfile import write_config

        try:
            write_config(write_to, settings)
        except SettingsError as e:
            print(f"uproxy: error: {e}", file=sys.stderr)
            return EXIT_FAILURE
        return 0
    if getattr(ns, "cleanup", False):
        return run_loop(_cleanup, settings.event_loop)
    if getattr(ns, "init_only", False):
        return _init_only(settings)
    # Importing the clients makes ~10^5 long-lived objects: the collector's passes over them
    # were 20-60 ms each at start. The start is bulk work (uproxy.heap): run_proxy() ends it
    # once the proxy has started, which freezes them.
    heap.pause()
    from uproxy.run import run_proxy

    try:
        return run_loop(lambda: run_proxy(settings), settings.event_loop)
    except SettingsError as e:
        print(f"uproxy: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 0


def _init_only(settings: Settings) -> int:
    from uproxy.nodesetup import Wanted, tune

    problems = tune(Wanted.from_settings(settings))
    if problems:
        print(f"uproxy: error: cannot tune conntrack: {'; '.join(problems)}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


async def _cleanup() -> int:
    from uproxy.rules import cleanup_all
    from uproxy.rules.base import RulesError

    try:
        await cleanup_all()
    except RulesError as e:
        print(f"uproxy: error: cleanup failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
