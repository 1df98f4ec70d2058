"""uproxy: kube-proxy's userspace proxy mode, rebuilt on asyncio/uvloop."""

__version__ = "0.1.0"
