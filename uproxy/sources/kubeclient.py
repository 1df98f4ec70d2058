"""kubernetes_asyncio's API client, without the 800 modules of it that uproxy never runs.

Importing anything from kubernetes_asyncio first runs its packages' ``__init__`` files, and
those import every API group (about 70 modules) and every generated model class (about 770).
uproxy makes no model: it lists and watches with ``_preload_content=False`` and reads the JSON
itself (see ``uproxy.sources.kube``), so it needs the API client, its configuration, two API
groups and the config loaders. Measured in a fresh interpreter on this project's reference
machine: the library as packaged 0.36-0.39 s and 75 MB of peak RSS; with the packages'
``__init__`` deferred 0.19-0.20 s and 44 MB. Both are paid at every start of every node's
proxy, the time on the way to the first sync.

So ``kubernetes_asyncio``, ``kubernetes_asyncio.client`` and its ``api`` and ``models``
packages are made here with their ``__init__`` deferred: a module under them imports as
usual, and the first look-up of a name such a package does not hold yet runs its real
``__init__``, into the same module object, before answering. Any code that wants more of the
library (``client.V1Pod``, ``kubernetes_asyncio.watch``) gets it as if nothing had been
deferred, only later. Nothing is deferred when kubernetes_asyncio was imported before this
module, or when its layout is not the one expected: it is then imported as usual.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

DEFERRED = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.api",
    "kubernetes_asyncio.client.models",
)
_ROOT = DEFERRED[0]


class _DeferredPackage(types.ModuleType):
    """A package whose ``__init__`` runs at the first look-up of a name it lacks."""

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        if state.get("_uproxy_init_ran"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        path = state.get("__path__")
        if path is not None and importlib.machinery.PathFinder.find_spec(
            f"{self.__name__}.{name}", path
        ):
            # A submodule not imported yet: as for any package, ``from package import sub``
            # imports it on this answer; its own package's __init__ is not needed for that.
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        state["_uproxy_init_ran"] = True
        spec = self.__spec__
        assert spec is not None and spec.loader is not None  # set by _defer
        spec.loader.exec_module(self)
        return getattr(self, name)


def _defer() -> bool:
    """Make the packages in ``DEFERRED``; False (and nothing changed) when they cannot be."""
    if any(name in sys.modules for name in DEFERRED):
        return False
    before = set(sys.modules)
    try:
        for name in DEFERRED:
            parent, _, leaf = name.rpartition(".")
            where = sys.modules[parent].__path__ if parent else None
            spec = importlib.machinery.PathFinder.find_spec(name, where)
            if spec is None or spec.loader is None or spec.submodule_search_locations is None:
                raise ImportError(f"{name} is not a package here")
            module = importlib.util.module_from_spec(spec)
            module.__class__ = _DeferredPackage
            sys.modules[name] = module
            if parent:
                setattr(sys.modules[parent], leaf, module)
        # The two names the library's own modules import from the client package.
        from kubernetes_asyncio.client.api_client import ApiClient as _ApiClient
        from kubernetes_asyncio.client.configuration import Configuration as _Configuration

        client = sys.modules["kubernetes_asyncio.client"]
        client.ApiClient = _ApiClient  # type: ignore[attr-defined]
        client.Configuration = _Configuration  # type: ignore[attr-defined]
    except Exception:  # a layout this module does not know: import it as packaged
        for name in set(sys.modules) - before:
            if name == _ROOT or name.startswith(_ROOT + "."):
                del sys.modules[name]
        return False
    return True


deferred = _defer()

# Imported after the deferral on purpose (hence E402): each from its own module.
from kubernetes_asyncio.client.api.core_v1_api import CoreV1Api  # noqa: E402
from kubernetes_asyncio.client.api.discovery_v1_api import DiscoveryV1Api  # noqa: E402
from kubernetes_asyncio.client.api_client import ApiClient  # noqa: E402
from kubernetes_asyncio.client.configuration import Configuration  # noqa: E402
from kubernetes_asyncio.config.config_exception import ConfigException  # noqa: E402
from kubernetes_asyncio.config.incluster_config import load_incluster_config  # noqa: E402
from kubernetes_asyncio.config.kube_config import load_kube_config  # noqa: E402

__all__ = [
    "ApiClient",
    "ConfigException",
    "Configuration",
    "CoreV1Api",
    "DiscoveryV1Api",
    "deferred",
    "load_incluster_config",
    "load_kube_config",
]
