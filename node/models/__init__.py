"""The packaged demo policies (ONNX files with their sidecars, in this directory) and
``--model``'s choice between a packaged name and a path.

Each ``.onnx`` here is rebuilt byte for byte by its ``build_*.py`` script; change the
script, not the file. ``docs/policies.md`` lists what each model takes and returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from affinity.errors import InvalidArgument

__all__ = [
    "ALOHA_DEMO_MODEL",
    "DEMO_MODEL",
    "DROID_DEMO_MODEL",
    "MODELS_DIR",
    "PACKAGED_MODELS",
    "RTC_DEMO_MODEL",
    "VLA_DEMO_MODEL",
    "resolve_model",
]

MODELS_DIR = Path(__file__).parent
DEMO_MODEL: Path = MODELS_DIR / "demo_policy.onnx"
"""The packaged demo policy (see ``build_demo.py``)."""
VLA_DEMO_MODEL: Path = MODELS_DIR / "vla_demo.onnx"
"""The packaged camera-sized demo policy (see ``build_vla.py``)."""
DROID_DEMO_MODEL: Path = MODELS_DIR / "droid_demo.onnx"
"""The camera-sized demo policy for openpi's DROID observations (``build_vla.py``)."""
ALOHA_DEMO_MODEL: Path = MODELS_DIR / "aloha_demo.onnx"
"""The camera-sized demo policy for openpi's ALOHA observations (``build_vla.py``)."""
RTC_DEMO_MODEL: Path = MODELS_DIR / "rtc_demo.onnx"
"""The camera-sized demo policy with real-time chunking's inputs (``build_rtc.py``)."""
PACKAGED_MODELS: Mapping[str, Path] = MappingProxyType(
    {
        "demo": DEMO_MODEL,
        "vla-demo": VLA_DEMO_MODEL,
        "droid-demo": DROID_DEMO_MODEL,
        "aloha-demo": ALOHA_DEMO_MODEL,
        "rtc-demo": RTC_DEMO_MODEL,
    }
)
"""The names :func:`resolve_model` accepts besides a path."""


def resolve_model(name_or_path: str | Path) -> Path:
    """The model file that ``--model`` names: a packaged name (``demo``, ``vla-demo``; see
    :data:`PACKAGED_MODELS`) or a path to an existing file (``./demo`` for a file of that
    name). Raises :class:`InvalidArgument` (a ``ValueError``) naming both choices when it is
    neither."""
    packaged = PACKAGED_MODELS.get(str(name_or_path))
    if packaged is not None:
        return packaged
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise InvalidArgument(
            "model",
            str(name_or_path),
            f"not a packaged model ({', '.join(PACKAGED_MODELS)}) nor an existing file",
        )
    return path
