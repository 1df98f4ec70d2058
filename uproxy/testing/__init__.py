"""Test doubles shipped with the package, because both the tests and ``bench/`` use them.

Nothing here is imported by the proxy itself.
"""

from uproxy.testing.apiserver import ApiServerDouble

__all__ = ["ApiServerDouble"]
