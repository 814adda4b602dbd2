"""The throwaway interpreter's side of ``validate.check_entrypoint``.

``python -m modelfleet.publishing.entrypoint FOLDER`` reads FOLDER's manifest and
imports its entrypoint as a runtime would (``modelfleet.model.importer``); exit 0 if it
is a ``modelfleet.Model`` subclass, else 1 with the reason as the last line of stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from modelfleet.errors import ModelfleetError
    from modelfleet.model.importer import import_handler
    from modelfleet.repository.manifest import load_manifest

    folder = Path(argv[0])
    try:
        import_handler(load_manifest(folder / "model.toml"), folder)
    except ModelfleetError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    except BaseException as exc:  # whatever the package's code raised on the way
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
