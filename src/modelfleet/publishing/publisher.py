"""Publishing one package: checks in order, the write, the refresh, the announcement.

1. the signature, where ``publish.secret`` is set (before anything else is said);
2. who may publish the model (``Principal.may_publish``): another tenant's model, or a
   new model outside the operator's name prefix, is the same 404 as a missing model;
3. the manifest and the version (``validate.resolve``), the tenant the manifest names
   (an operator's own; a new version keeps the model's);
4. the entrypoint, imported in a throwaway interpreter (``validate.check_entrypoint``);
5. the write to the repository (``PackageWriter``; one publish per model at a time in
   this process, and the store refuses a version that exists);
6. this process's catalog refreshed at once, and the change announced on the broker so
   every other gateway and worker refreshes too (``announce``).

With auth off (no principal) step 2 and the tenant check let everything through, as
every control route does then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from modelfleet.errors import ModelfleetError, ModelNotFound, PackageRejected, SignatureRejected
from modelfleet.metrics import PUBLISHES
from modelfleet.publishing.announce import catalog_changed
from modelfleet.publishing.package import Limits, Package, signature_matches
from modelfleet.publishing.settings import PublishSettings
from modelfleet.publishing.validate import Candidate, check_entrypoint, resolve
from modelfleet.repository import Catalog
from modelfleet.repository.manifest import MODEL_ID, Manifest
from modelfleet.repository.store import PackageWriter
from modelfleet.tenancy import Forbidden
from modelfleet.tenancy.access import Principal

log = logging.getLogger("modelfleet.publish")


@dataclass(frozen=True)
class Published:
    model_id: str
    version: str
    digest: str
    size_bytes: int
    files: int
    servable: bool  # in this gateway's catalog now (False: the refresh after it failed)

    def wire(self) -> dict[str, Any]:
        return {"name": self.model_id, "version": self.version, "sha256": self.digest,
                "size_bytes": self.size_bytes, "files": self.files,
                "servable": self.servable}


@contextlib.contextmanager
def counted() -> Iterator[None]:
    """Count one publish attempt (reading its package too) by its outcome."""
    try:
        yield
    except ModelfleetError as exc:
        PUBLISHES.labels(exc.code).inc()
        raise
    PUBLISHES.labels("published").inc()


def not_found(model_id: str) -> ModelNotFound:
    """The catalog's own words (``Catalog.get``): a foreign model looks like none."""
    return ModelNotFound(f"no model named '{model_id}' (GET /v1/models lists them)")


class Publisher:
    def __init__(self, settings: PublishSettings, store: PackageWriter, catalog: Catalog,
                 refresh: Callable[[], Awaitable[object]],
                 announce: Callable[[dict[str, Any]], Awaitable[None]], origin: str) -> None:
        self._settings = settings
        self._store = store
        self._catalog = catalog
        self._refresh = refresh
        self._announce = announce
        self._origin = origin
        self._locks: dict[str, asyncio.Lock] = {}
        self.limits = Limits(settings.max_package_bytes, settings.max_package_files)

    async def publish(self, model_id: str, package: Package, principal: Principal | None,
                      version: str | None = None, signature: str | None = None,
                      accept: Callable[[Manifest], None] | None = None) -> Published:
        """Check and write ``package`` as a version of ``model_id`` (module docstring);
        ``accept`` may refuse its manifest too (raising), before the import."""
        if not MODEL_ID.match(model_id):
            raise PackageRejected(f"{model_id!r} is not a model name: [a-z0-9][a-z0-9_.-]*, "
                                  "at most 128 characters")
        self._check_signature(package, signature)
        owner = self._owner(model_id)
        if principal is not None and not principal.may_publish(model_id, owner):
            raise not_found(model_id)
        # One lock per model published through this process (kept: a few bytes each).
        async with self._locks.setdefault(model_id, asyncio.Lock()):
            existing = await asyncio.to_thread(self._store.versions, model_id)
            candidate = resolve(package, model_id, version, existing)
            self._check_tenant(candidate, principal, owner)
            if accept is not None:
                accept(candidate.manifest)
            await check_entrypoint(candidate, self._settings.import_timeout_s)
            await asyncio.to_thread(self._store.write_package, model_id, candidate.version,
                                    candidate.package.files)
        log.info("published model '%s' version %s (%d files, %d bytes, sha256 %s)%s",
                 model_id, candidate.version, len(candidate.package.files),
                 package.size_bytes, package.digest()[:12],
                 "" if principal is None else f" by tenant '{principal.tenant.name}'")
        servable = await self._refreshed(model_id, candidate.version)
        try:
            await self._announce(catalog_changed(self._origin, model_id, candidate.version))
        except Exception:  # the others pick it up at their next repo_refresh_s
            log.warning("publish: telling the fleet about '%s' version %s failed; other "
                        "processes see it at their next refresh", model_id,
                        candidate.version, exc_info=True)
        return Published(model_id, candidate.version, package.digest(), package.size_bytes,
                         len(package.files), servable)

    def _check_signature(self, package: Package, signature: str | None) -> None:
        secret = self._settings.secret
        if secret is None:
            if signature:
                raise SignatureRejected(
                    "the package is signed but this gateway has no publishing secret "
                    "(publish.secret) to check the signature against: set it, or send "
                    "the package unsigned")
            return
        if not signature:
            raise SignatureRejected(
                "this gateway takes signed packages only: send the HMAC-SHA256 of the "
                "package's digest, keyed with publish.secret ('modelfleet push' signs "
                "with MODELFLEET_PUBLISH__SECRET)")
        if not signature_matches(secret, package.files, signature):
            raise SignatureRejected("the package's signature does not match: it was "
                                    "changed after signing, or signed with another secret")

    def _owner(self, model_id: str) -> str | None:
        try:
            return self._catalog.get(model_id).manifest.tenant
        except ModelNotFound:
            return None

    @staticmethod
    def _check_tenant(candidate: Candidate, principal: Principal | None,
                      owner: str | None) -> None:
        tenant = candidate.manifest.tenant
        if principal is not None and principal.role != "admin" \
                and tenant != principal.tenant.name:
            raise Forbidden(f"the package's model.toml says tenant = \"{tenant}\": a key of "
                            f"tenant '{principal.tenant.name}' publishes that tenant's "
                            f"models only (tenant = \"{principal.tenant.name}\")")
        if owner is not None and tenant != owner:
            raise PackageRejected(f"model '{candidate.manifest.name}' belongs to tenant "
                                  f"'{owner}'; a new version keeps its tenant, not "
                                  f"tenant = \"{tenant}\"")

    async def _refreshed(self, model_id: str, version: str) -> bool:
        try:
            await self._refresh()
        except Exception:  # logged by the refresher; the next refresh tries again
            return False
        try:
            self._catalog.get(model_id).version(version)
        except ModelNotFound:
            log.warning("publish: '%s' version %s was written but this gateway's catalog "
                        "does not show it yet", model_id, version)
            return False
        return True
