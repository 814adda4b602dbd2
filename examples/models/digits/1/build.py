"""Build ``artifacts/model.joblib`` ahead of time: ``python examples/models/digits/1/build.py``.

``load`` builds the same artifact when it is missing, so running this is optional;
it saves the first request the two seconds of training.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0], so the handler imports by name.
    from handler import ARTIFACT, build_artifact, split_indices

    artifact = build_artifact(HERE / ARTIFACT)
    _, held_out = split_indices()
    print(f"wrote {HERE / ARTIFACT} (sklearn {artifact['sklearn_version']}, "
          f"{len(held_out)} samples held out)", file=sys.stderr)
