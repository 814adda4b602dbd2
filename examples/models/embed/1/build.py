"""Build ``artifacts/projection.safetensors`` ahead of time:
``python examples/models/embed/1/build.py``.

``load`` builds the same artifact when it is missing, so running this is optional.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0], so the handler imports by name.
    from handler import ARTIFACT, build_artifact

    build_artifact(HERE / ARTIFACT)
    print(f"wrote {HERE / ARTIFACT}", file=sys.stderr)
