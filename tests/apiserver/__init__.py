"""Test doubles for the tests and for ``bench/``: an API server that speaks the real wire format.

Nothing here is imported by the proxy itself, and none of it is part of the installed package.
"""

from tests.apiserver.apiserver import ApiServerDouble

__all__ = ["ApiServerDouble"]
