"""ffmpeg: checked, never started."""

from __future__ import annotations

import shutil
import subprocess



from tapeline.home import StackError

# --------------------------------------------------------------------------------------------
# ffmpeg


def check_ffmpeg() -> None:
    """Check that `ffmpeg` and `ffprobe` are on PATH and run.

    Raises:
        StackError: either program is missing or fails to report its version; the message says
            `apt-get install -y ffmpeg`.
    """
    missing = [tool for tool in ("ffmpeg", "ffprobe") if shutil.which(tool) is None]
    if missing:
        raise StackError(f"{' and '.join(missing)} not found on PATH. Install them with "
                         f"`apt-get install -y ffmpeg` (Debian), then retry.")
    if ffmpeg_version() is None:
        raise StackError("`ffmpeg -version` failed. Reinstall with `apt-get install -y --reinstall ffmpeg`.")


def ffmpeg_version() -> str | None:
    """ffmpeg's version string (e.g. `5.1.9-0+deb12u1`), or None if it cannot be run."""
    try:
        out = subprocess.run(["ffmpeg", "-hide_banner", "-version"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.split()
    return words[2] if len(words) > 2 and words[:2] == ["ffmpeg", "version"] else (out.strip() or None)


