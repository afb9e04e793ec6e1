"""What LXD serves and vmready does not: refused in LXD's error shape, saying so.

LXD's clients reach these through everyday commands (``lxc exec``, ``lxc
file``, ``lxc image``, ``lxc storage``, ``lxc network``…): each answers 501
Not Implemented with "… not supported by vmready" instead of a 404 that
reads as if the instance were missing.  Profiles and projects exist as LXD
has them by default and no further: one empty ``default`` profile, the
``default`` project.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from vmready.api.operatorbase import (
    DEFAULT_PROJECT,
    OperatorBase,
    operator_app,
    project_not_found,
)
from vmready.api.requestbody import recursion_level
from vmready.api.views import instance_url
from vmready.api.web import sync_response
from vmready.domain import NotFound, VMReadyError

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
# An instance's sub-resources LXD has and vmready does not, with what they are for.
_INSTANCE_FEATURES = {
    "exec": "running commands in a guest (lxc exec)",
    "files": "guest files (lxc file)",
    "sftp": "guest files (lxc file mount)",
    "metadata": "image metadata and templates",
    "backups": "instance backups (lxc export)",
    "migration": "migrations",
}
# Top-level collections LXD has and vmready does not.
_COLLECTIONS = {
    "images": "images (lxc image, lxc launch IMAGE; vmready boots what config's boot.image names)",
    "storage-pools": "storage pools (lxc storage)",
    "networks": "networks (lxc network)",
    "network-acls": "network ACLs",
    "network-zones": "network zones",
    "warnings": "warnings",
    "resources": "host resources (lxc info --resources)",
    "containers": "containers (vmready runs virtual machines: /1.0/instances)",
    "virtual-machines": "the /1.0/virtual-machines paths (use /1.0/instances)",
}

# LXD's collections of which vmready has the ``default`` entry only, each named.
_KINDS = {"profiles": "profile", "projects": "project"}

# werkzeug's converters matching exactly those names (other paths stay 404 or 405).
_INSTANCE_ANY = f"any({', '.join(map(repr, _INSTANCE_FEATURES))})"
_COLLECTIONS_ANY = f"any({', '.join(map(repr, _COLLECTIONS))})"
_KINDS_ANY = f"any({', '.join(map(repr, _KINDS))})"


class NotSupported(VMReadyError):
    """501: LXD has this; vmready does not."""

    http_status = 501


def _refuse(what: str) -> NotSupported:
    return NotSupported(f"{what[0].upper()}{what[1:]}: not supported by vmready")


class UnsupportedRoutes(OperatorBase):
    """LXD's other endpoints: refused (501), or the defaults (profile, project)."""

    app = operator_app

    @app.route(f"/1.0/instances/<name>/<{_INSTANCE_ANY}:feature>", methods=ALL_METHODS)
    def instance_feature(self, request: IRequest, name: str, feature: str) -> bytes:
        """``exec``, ``files``… of an instance: 501 naming the feature."""
        self.lifecycle.store.view.get_instance(name)
        raise _refuse(_INSTANCE_FEATURES[feature])

    @app.route(f"/1.0/instances/<name>/<{_INSTANCE_ANY}:feature>/<path:rest>", methods=ALL_METHODS)
    def instance_feature_item(
        self, request: IRequest, name: str, feature: str, rest: str
    ) -> bytes:
        """Below an instance's unsupported feature (``backups/NAME``…): the same 501."""
        return self.instance_feature(request, name, feature)

    @app.route("/1.0/instances/<name>/console", methods=["POST"])
    def attach_console(self, request: IRequest, name: str) -> bytes:
        """Attaching to the console (``lxc console`` without ``--show-log``): 501."""
        self.lifecycle.store.view.get_instance(name)
        raise _refuse("attaching to an instance's console (lxc console --show-log reads its log)")

    @app.route(f"/1.0/<{_COLLECTIONS_ANY}:collection>", methods=ALL_METHODS)
    def collection(self, request: IRequest, collection: str) -> bytes:
        """An LXD collection vmready does not have: 501."""
        raise _refuse(_COLLECTIONS[collection])

    @app.route(f"/1.0/<{_COLLECTIONS_ANY}:collection>/<path:rest>", methods=ALL_METHODS)
    def collection_item(self, request: IRequest, collection: str, rest: str) -> bytes:
        """Anything below such a collection: the same 501."""
        return self.collection(request, collection)

    # -- the defaults that exist ------------------------------------------

    def _used_by(self) -> list[str]:
        return [
            instance_url(record.name)
            for record in sorted(self.lifecycle.store.view.list_instances(), key=_name)
        ]

    def _default(self, kind: str) -> dict[str, Any]:
        """The one profile or project there is, ``default``: empty."""
        entry: dict[str, Any] = {
            "name": DEFAULT_PROJECT,
            "description": f"vmready's only {_KINDS[kind]}: empty",
            "config": {},
            "used_by": self._used_by(),
        }
        if kind == "profiles":
            entry["devices"] = {}
        return entry

    @app.route(f"/1.0/<{_KINDS_ANY}:kind>", methods=["GET"])
    def defaults(self, request: IRequest, kind: str) -> bytes:
        """The one profile or project, ``default``, as a URL or (``recursion=1``) an object."""
        if recursion_level(request) >= 1:
            return sync_response(request, [self._default(kind)])
        return sync_response(request, [f"/1.0/{kind}/{DEFAULT_PROJECT}"])

    @app.route(f"/1.0/<{_KINDS_ANY}:kind>/<name>", methods=["GET"])
    def default(self, request: IRequest, kind: str, name: str) -> bytes:
        """The ``default`` profile or project; any other is not found."""
        if name != DEFAULT_PROJECT:
            if kind == "projects":
                raise NotFound(project_not_found(name))
            raise NotFound(f"Profile {name!r} not found: vmready has only 'default'")
        return sync_response(request, self._default(kind))

    @app.route(f"/1.0/<{_KINDS_ANY}:kind>", methods=["POST"])
    @app.route(f"/1.0/<{_KINDS_ANY}:kind>/<name>", methods=["PUT", "PATCH", "POST", "DELETE"])
    def change_defaults(self, request: IRequest, kind: str, name: str = "") -> bytes:
        """Creating, changing or removing a profile or a project: 501."""
        raise _refuse("profiles and projects other than an empty 'default'")


def _name(record: Any) -> str:
    return str(record.name)
