"""Where model weights live on disk.

Weights are never written into site-packages: an installed kvserve keeps them in the user's cache folder, and a
source checkout keeps them next to this file (git-ignored), so tests, CI and the CLI share one download.
"""

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WEIGHTS_DIR_ENV = "KVSERVE_WEIGHTS_DIR"


def weights_dir(override: str | None = None) -> Path:
    """The folder that holds converted models (one sub-folder each) and the GGUFs they came from."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get(WEIGHTS_DIR_ENV):
        return Path(env).expanduser()
    package_dir = Path(__file__).resolve().parent
    # A source checkout (plain or editable install) has pyproject.toml one level up; an installed wheel sits in
    # site-packages, which has none, so it falls through to the cache.
    if (package_dir.parent / "pyproject.toml").is_file() and os.access(package_dir, os.W_OK):
        return package_dir
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "kvserve"
