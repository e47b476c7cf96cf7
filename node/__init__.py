"""The affinity serving node."""

from affinity import __version__ as VERSION

__all__ = ["VERSION"]
