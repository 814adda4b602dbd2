"""``modelfleet push FOLDER --gateway URL [--key KEY] [--version V]``: publish a package.

The folder (its ``model.toml`` at the top; hidden files and ``__pycache__`` left out) is
sent as a tar.gz to ``PUT /v1/models/{name}/package`` of the gateway, the model's name
read from the manifest. Where ``MODELFLEET_PUBLISH__SECRET`` is set (the gateways'
publishing secret) the package is signed with it. The key comes from ``--key``, else
``MODELFLEET_KEY``, else the gateway URL's user part (``http://KEY:@host:8000``).
Prints what the gateway published; exits 0, 1 if the gateway refused it (its message on
stderr), 2 for a folder that is no package.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path

import httpx

from modelfleet.errors import ManifestError, PackageRejected
from modelfleet.exits import EXIT_CONFIG, EXIT_FAILED
from modelfleet.publishing.package import MANIFEST, Limits, Package, from_folder, sign
from modelfleet.repository.manifest import parse_manifest

SIGNATURE_HEADER = "X-Modelfleet-Signature"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet push",
                                     description="publish a model package to the repository "
                                                 "through a gateway")
    parser.add_argument("folder", type=Path, help="the package: model.toml, handler, files")
    parser.add_argument("--gateway", required=True, help="the gateway's URL, e.g. "
                        "http://127.0.0.1:8000")
    parser.add_argument("--key", default=os.environ.get("MODELFLEET_KEY"),
                        help="an operator's (or admin's) API key (env MODELFLEET_KEY)")
    parser.add_argument("--version", default=None,
                        help="the version to publish as (default: the manifest's, else "
                             "the model's next)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds to wait for the gateway (default 300)")
    return parser


def archive(package: Package) -> bytes:
    """The package as a tar.gz, entries sorted, with no owners or times of this machine."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(package.files):
            data = package.files[path]
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not (args.folder / MANIFEST).is_file():
            raise PackageRejected(f"{args.folder} has no {MANIFEST}: push a model's "
                                  "version folder")
        # The gateway holds the package to its limits (and says which): none here.
        package = from_folder(args.folder, Limits(sys.maxsize, sys.maxsize))
        name = parse_manifest(package.files[MANIFEST].decode("utf-8"),
                              str(args.folder / MANIFEST)).name
    except (PackageRejected, ManifestError, UnicodeDecodeError, OSError) as exc:
        print(f"modelfleet push: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    headers = {"content-type": "application/gzip"}
    secret = os.environ.get("MODELFLEET_PUBLISH__SECRET")
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, package.files)
    if args.key:
        headers["authorization"] = f"Bearer {args.key}"
    url = f"{args.gateway.rstrip('/')}/v1/models/{name}/package"
    try:
        answer = httpx.put(url, content=archive(package), headers=headers,
                           params={"version": args.version} if args.version else None,
                           timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"modelfleet push: error: cannot reach {args.gateway}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if answer.status_code != 201:
        print(f"modelfleet push: error: {answer.status_code}: {_message(answer)}",
              file=sys.stderr)
        return EXIT_FAILED
    body = answer.json()
    print(f"published {body['name']} version {body['version']} ({body['files']} files, "
          f"{body['size_bytes']} bytes, sha256 {body['sha256']})")
    return 0


def _message(answer: httpx.Response) -> str:
    try:
        error = answer.json()["error"]
    except (ValueError, KeyError, TypeError):
        return answer.text[:500]
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)
