"""A model package in transit: its files by relative path, read from an archive, a
protocol request's ``file:`` parameters or a folder, within limits, and its digest.

Every way in ends in ``Package``, whose paths were checked: relative POSIX paths with no
``..``, no empty or hidden-control parts, no absolute or drive paths; an archive's links,
devices and other special members are refused (a package is plain files). The limits
(``publish.max_package_bytes``, ``max_package_files``) count the unpacked files, so a
small archive that unpacks to gigabytes stops at the limit, while it is read.

The digest names the content whatever carried it (tar, zip or JSON): SHA-256 over the
files sorted by path, each as ``path NUL size NUL bytes`` (the size in decimal ASCII).
The signature is HMAC-SHA256 of that digest's hex form, keyed with the publishing secret;
``modelfleet push`` computes both (``sign``).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import re
import stat
import tarfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from modelfleet.errors import PackageRejected, PackageTooLarge

MANIFEST = "model.toml"
_SAFE_PART = re.compile(r"^[^\x00-\x1f/\\]+$")
NAME_MAX = 255  # bytes in one file name: the limit of the filesystems a package lands on


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_files: int


@dataclass(frozen=True)
class Package:
    """The files of one model version, by relative POSIX path (checked)."""

    files: Mapping[str, bytes]

    @property
    def size_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    def digest(self) -> str:
        return package_digest(self.files)

    def with_manifest(self, text: str) -> Package:
        return Package({**self.files, MANIFEST: text.encode("utf-8")})


def package_digest(files: Mapping[str, bytes]) -> str:
    """The hex SHA-256 of a package's files (see the module docstring)."""
    digest = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        digest.update(path.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()


def sign(secret: str, files: Mapping[str, bytes]) -> str:
    """The signature a package needs where ``publish.secret`` is ``secret``."""
    return hmac.new(secret.encode(), package_digest(files).encode(), hashlib.sha256).hexdigest()


def signature_matches(secret: str, files: Mapping[str, bytes], signature: str) -> bool:
    return hmac.compare_digest(sign(secret, files), signature.strip().lower())


def checked_path(name: str) -> str:
    """``name`` as a safe relative POSIX path inside a package, else PackageRejected."""
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise PackageRejected(f"the package's path {name!r} is absolute: paths are relative "
                              "to the package's folder")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts:
        raise PackageRejected(f"the package's path {name!r} names no file")
    if ".." in parts:
        raise PackageRejected(f"the package's path {name!r} leaves the package's folder "
                              "('..')")
    for part in parts:
        if not _SAFE_PART.match(part):
            raise PackageRejected(f"the package's path {name!r} has a backslash or a "
                                  "control character")
        if len(part.encode("utf-8")) > NAME_MAX:
            raise PackageRejected(f"the package's path {name[:64]!r}... has a part of "
                                  f"{len(part.encode('utf-8'))} bytes: a file name is at "
                                  f"most {NAME_MAX}")
    return "/".join(parts)


class _Counter:
    """Adds files up against the limits as they are read."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.files: dict[str, bytes] = {}
        self.size = 0

    def room(self) -> int:
        return self.limits.max_bytes - self.size

    def add(self, name: str, data: bytes) -> None:
        path = checked_path(name)
        if path in self.files:
            raise PackageRejected(f"the package holds {path!r} twice")
        if len(self.files) >= self.limits.max_files:
            raise PackageTooLarge(f"the package has more than {self.limits.max_files} files "
                                  "(publish.max_package_files)")
        self.size += len(data)
        if self.size > self.limits.max_bytes:
            self.too_large()
        self.files[path] = data

    def too_large(self) -> None:
        raise PackageTooLarge(f"the package's files come to more than "
                              f"{self.limits.max_bytes} bytes (publish.max_package_bytes)")


def from_archive(data: bytes, limits: Limits) -> Package:
    """The package in a tar, tar.gz or zip archive (told apart by their first bytes).

    A package whose files all sit in one top folder (``tar czf p.tgz mymodel``) is that
    folder's content.
    """
    if data[:4] == b"PK\x03\x04" or data[:4] == b"PK\x05\x06":
        files = _from_zip(data, limits)
    elif data[:2] == b"\x1f\x8b" or data[257:262] == b"ustar":
        files = _from_tar(data, limits)
    else:
        raise PackageRejected("the body is not a tar, tar.gz or zip archive")
    return Package(_unwrapped(files))


def _from_tar(data: bytes, limits: Limits) -> dict[str, bytes]:
    counter = _Counter(limits)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive:
                if member.isdir():
                    checked_path(member.name)
                    continue
                if not member.isreg():
                    kind = "a link" if member.issym() or member.islnk() else "not a file"
                    raise PackageRejected(f"the archive's {member.name!r} is {kind}: a "
                                          "package holds plain files only")
                if member.size > counter.room():
                    counter.too_large()
                source = archive.extractfile(member)
                assert source is not None  # a regular file
                counter.add(member.name, source.read(counter.room() + 1))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise PackageRejected(f"the archive cannot be read: {exc}") from exc
    return counter.files


def _from_zip(data: bytes, limits: Limits) -> dict[str, bytes]:
    counter = _Counter(limits)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                # A Unix file type, where the archiver recorded one (many record none).
                mode = stat.S_IFMT(info.external_attr >> 16)
                if info.is_dir():
                    checked_path(info.filename)
                    continue
                if mode and mode != stat.S_IFREG:
                    raise PackageRejected(f"the archive's {info.filename!r} is "
                                          f"{'a link' if stat.S_ISLNK(mode) else 'not a file'}"
                                          ": a package holds plain files only")
                if info.file_size > counter.room():
                    counter.too_large()
                with archive.open(info) as source:
                    counter.add(info.filename, source.read(counter.room() + 1))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, RuntimeError,
            NotImplementedError) as exc:  # RuntimeError: encrypted; NotImplemented: method
        raise PackageRejected(f"the archive cannot be read: {exc}") from exc
    return counter.files


def _unwrapped(files: dict[str, bytes]) -> dict[str, bytes]:
    if MANIFEST in files or not files:
        return files
    tops = {path.split("/", 1)[0] for path in files}
    if len(tops) == 1 and all("/" in path for path in files):
        top = tops.pop()
        return {path[len(top) + 1:]: data for path, data in files.items()}
    return files


def from_folder(folder: Path, limits: Limits) -> Package:
    """The files under ``folder`` (hidden ones and ``__pycache__`` left out); a symbolic
    link is refused, as in an archive."""
    counter = _Counter(limits)
    for path in _walk(folder):
        counter.add(path.relative_to(folder).as_posix(), path.read_bytes())
    return Package(counter.files)


def _walk(folder: Path) -> Iterator[Path]:
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        path = Path(entry.path)
        if entry.is_symlink():
            raise PackageRejected(f"{path} is a symbolic link: a package holds plain files "
                                  "only")
        if entry.is_dir():
            yield from _walk(path)
        elif entry.is_file():
            yield path


def from_files(files: Mapping[str, bytes], limits: Limits) -> Package:
    """A package from (path, bytes) pairs, e.g. the protocol's ``file:`` parameters."""
    counter = _Counter(limits)
    for name, data in files.items():
        counter.add(name, data)
    return Package(counter.files)


def split_version(package: Package) -> tuple[str | None, Package]:
    """Triton's ``file:<version>/<path>`` form: all files in one folder holding the
    manifest are that version's; a manifest at the top names no version."""
    if MANIFEST in package.files:
        return None, package
    tops = {PurePosixPath(path).parts[0] for path in package.files}
    if len(tops) == 1:
        top = tops.pop()
        if f"{top}/{MANIFEST}" in package.files:
            return top, Package({path[len(top) + 1:]: data
                                 for path, data in package.files.items()})
    raise PackageRejected(f"the package has no {MANIFEST} at its top (or in one version "
                          f"folder, as in file:1/{MANIFEST})")
