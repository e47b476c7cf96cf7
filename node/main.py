"""The old import path of ``affinity-node`` (``python -m node.main``); kept for one release."""

from node.cli import _FLAGS, _SWITCHES, parse_args
from node.server import _OneWriteTransport, main
from node.startup import StartupError, build_service

__all__ = [
    "_FLAGS",
    "_SWITCHES",
    "StartupError",
    "_OneWriteTransport",
    "build_service",
    "main",
    "parse_args",
]

if __name__ == "__main__":
    main()
