"""kmock's KubernetesEmulator, extended to the documented behaviour of the real API server where
the operator depends on it, and run in a background thread so tests stay synchronous.

Extensions (each is what the Kubernetes API documentation specifies; the base emulator merges
every write into the stored dict and keeps no server-side metadata):
  1. metadata set by the server: uid and creationTimestamp on create, generation 1 on create and
     +1 whenever spec changes, resourceVersion changed on every write that changes the object.
  2. A write that changes nothing (same content) is a no-op: no new resourceVersion, no watch
     event. The tests count the writes that did change something.
  3. Optimistic concurrency: a patch carrying metadata.resourceVersion that is not the current
     one fails with 409 Conflict.
  4. Server-side apply (application/apply-patch+yaml), with field ownership, map lists merged by
     key where the CRD's schema says so (the InferenceService's conditions, by type), conflicts
     and force: see server_side_apply.py, the shim that implements it.
  5. The status subresource: for kinds that declare it, writes to the main resource leave
     status alone and writes to /status change only status.
  6. JSON merge patch (RFC 7386) for application/merge-patch+json: null removes a key, lists
     are replaced; JSON patch (RFC 6902: add, remove, replace, test) for
     application/json-patch+json, a failed test answering 422 (kopf adds finalizers so).
  7. metadata.generateName: the server picks a unique name on create (kopf's Events use it).
  8. The scale subresource: a Scale written to .../scale sets spec.replicas and nothing else.
  9. metadata.managedFields: each apply, and each other write that changes the object, records
     its manager, operation and subresource as owner of its fields (server_side_apply.py).
 10. A write to a kind the server does not serve (a CRD not installed) is a 404, as reads are.
Not emulated: garbage collection through owner references, admission, defaulting, strategic
merge patch (the operator does not use it).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock

from pagoda_operator import crd
from tests.operator import server_side_apply as ssa

RESOURCES = {
    # (group, version, plural): (kind, subresources); kopf needs the first two discoverable
    ("", "v1", "namespaces"): ("Namespace", {"status"}),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): ("CustomResourceDefinition", {"status"}),
    ("pagoda.dev", "v1alpha1", "inferenceservices"): ("InferenceService", {"status", "scale"}),
    ("", "v1", "configmaps"): ("ConfigMap", set()),
    ("", "v1", "services"): ("Service", {"status"}),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", set()),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", set()),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", set()),
    ("", "v1", "events"): ("Event", set()),
    ("apps", "v1", "deployments"): ("Deployment", {"status", "scale"}),
    ("policy", "v1", "poddisruptionbudgets"): ("PodDisruptionBudget", {"status"}),
    ("networking.k8s.io", "v1", "ingresses"): ("Ingress", {"status"}),
    ("networking.k8s.io", "v1", "networkpolicies"): ("NetworkPolicy", set()),
    ("", "v1", "secrets"): ("Secret", set()),
    ("", "v1", "pods"): ("Pod", {"status"}),
    ("autoscaling", "v2", "horizontalpodautoscalers"): ("HorizontalPodAutoscaler", {"status"}),
}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition"}
SERVER_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp")


@dataclass
class Write:
    method: str
    path: str
    content_type: str
    params: dict[str, str]
    changed: bool


def _merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


class JsonPatchTestFailed(Exception):
    pass


def _json_patch(doc: Any, operations: list[dict]) -> Any:
    """RFC 6902 (add, remove, replace, test), as kopf uses it for finalizers."""
    doc = copy.deepcopy(doc)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise JsonPatchTestFailed(op["path"])
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if op["op"] == "add":
                    parent.insert(index, copy.deepcopy(op["value"]))
                else:
                    parent[index] = copy.deepcopy(op["value"])
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ValueError(f"unsupported JSON patch op {op['op']!r}")
    return doc


def _written_by(doc: Any, operations: list[dict]) -> dict:
    """What a JSON patch's add and replace operations wrote, as a partial object of `doc` (the
    patched object), for field ownership: a path into a list stops at the list (lists are atomic
    here, see server_side_apply.py)."""
    out: dict = {}
    for op in operations:
        if op["op"] not in ("add", "replace"):
            continue
        node, prefix = doc, []
        for part in (p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]):
            if isinstance(node, list):
                break
            prefix.append(part)
            node = node[part]
        target = out
        for part in prefix[:-1]:
            target = target.setdefault(part, {})
        target[prefix[-1]] = copy.deepcopy(node)
    return out


class ApiServer(kmock.KubernetesEmulator):
    """The emulator with the extensions listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.writes: list[Write] = []
        self.stored: list[tuple[tuple, dict, str]] = []  # every version stored, in order: (key, object, its writer)
        self._versions = itertools.count(1)
        self._owners: dict[tuple, dict[ssa.Owner, set]] = {}  # object key → manager → the paths it owns
        definition = crd.crd()["spec"]
        self._schemas = {(definition["group"], v["name"], definition["names"]["plural"]): v["schema"]["openAPIV3Schema"]
                         for v in definition["versions"]}
        for (group, version, plural), (kind, subresources) in RESOURCES.items():
            self.resources[f"{group}/{version}/{plural}" if group else f"{version}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=kind not in CLUSTER_SCOPED, verbs={"get", "list", "watch", "create", "patch", "delete"},
                subresources=subresources)

    def declare(self, group: str, version: str, plural: str, kind: str) -> None:
        """Install a CRD (e.g. LeaderWorkerSet) after the fact."""
        self.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"})

    def _has_status_subresource(self, resource: Any) -> bool:
        for known, info in self.resources.items():
            if known == resource:
                return "status" in info.subresources
        return False

    def _key(self, request: Any, name: str | None = None) -> tuple:
        data = request.data if isinstance(request.data, dict) else {}
        meta = data.get("metadata") or {}
        return (request.resource, request.namespace or meta.get("namespace"), name or request.name or meta.get("name"))

    def _server_fields(self, new: dict, old: dict | None) -> dict:
        meta = new.setdefault("metadata", {})
        old_meta = (old or {}).get("metadata") or {}
        meta["uid"] = old_meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = old_meta.get("creationTimestamp") or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["generation"] = old_meta.get("generation", 0) + (1 if old is None or new.get("spec") != old.get("spec") else 0)
        meta["resourceVersion"] = old_meta.get("resourceVersion", "0")
        return new

    async def _store(self, key: tuple, new: dict, old: dict | None, writer: str) -> bool:
        """Store new unless equal to old; True when something changed."""
        if old is not None and new == old:
            return False
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        self.stored.append((key, copy.deepcopy(new), writer))
        if key not in self._objects:
            self._objects[key] = new
        else:
            self._objects[key].create(new)
        await self._buses[key[0]].put({"type": "ADDED" if old is None else "MODIFIED", "object": copy.deepcopy(new)})
        return True

    def _current(self, key: tuple) -> dict | None:
        if key in self._objects and not self._objects[key].deleted:
            return copy.deepcopy(self._objects[key].raw)
        return None

    async def _write(self, request: Any) -> tuple[bool, tuple]:
        data = request.data if isinstance(request.data, dict) else {}
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        key = self._key(request)
        old = self._current(key)
        if request.action == kmock.action.CREATE:
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                key = self._key(request)
                old = self._current(key)
            if old is not None:
                raise kmock.KubernetesError(status=409, reason="AlreadyExists", message=f"{key[2]} already exists")
            self._record_owner(key, request, content_type, data)
            new = copy.deepcopy(data)
            new["metadata"]["managedFields"] = ssa.managed_fields(self._owners.get(key, {}))
            return await self._store(key, self._server_fields(new, None), None, request.params.get("fieldManager")), key

        status_only = request.subresource == "status"
        if request.subresource == "scale":
            # A Scale object: only its spec.replicas reaches the object (the scale subresource).
            data = {"spec": {"replicas": (data.get("spec") or {}).get("replicas")}}
        if content_type == "application/apply-patch+yaml":
            manager = request.params.get("fieldManager")
            if not manager:
                raise kmock.KubernetesError(status=400, reason="BadRequest", message="fieldManager is required for apply")
            try:
                new = ssa.apply(old or {}, data, self._owners.setdefault(key, {}), (manager, "Apply", self._subresource(request)),
                                self._schema(key[0]), force=request.params.get("force") == "true", keep=self._scope(request))
            except ssa.ApplyConflict as e:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=f"Apply failed with conflicts: {e}") from None
        else:
            if old is None:
                raise kmock.KubernetesObjectNotFoundError()
            if content_type == "application/json-patch+json":
                try:
                    new = _json_patch(old, request.data)
                except JsonPatchTestFailed as e:
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the test of {e} failed") from None
                data = _written_by(new, request.data)
            else:
                wanted_rv = (data.get("metadata") or {}).get("resourceVersion")
                if wanted_rv is not None and wanted_rv != old["metadata"].get("resourceVersion"):
                    raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified; please apply your changes to the latest version and try again")
                new = _merge_patch(old, data)
        if old is not None:
            for field in SERVER_METADATA:  # clients cannot set these
                if field in old["metadata"]:
                    new.setdefault("metadata", {})[field] = old["metadata"][field]
            if status_only:
                new = {**old, "status": new.get("status")}
                if new["status"] is None:
                    del new["status"]
            elif self._has_status_subresource(key[0]):
                new.pop("status", None)
                if "status" in old:
                    new["status"] = old["status"]
        changed = old is None or {**new, "metadata": {**new.get("metadata", {}), "managedFields": None}} != \
            {**old, "metadata": {**old["metadata"], "managedFields": None}}
        if changed and content_type != "application/apply-patch+yaml":
            self._record_owner(key, request, content_type, data)
        new.setdefault("metadata", {})["managedFields"] = ssa.managed_fields(self._owners.get(key, {}))
        return await self._store(key, self._server_fields(new, old), old, request.params.get("fieldManager")), key

    def _schema(self, resource: Any) -> dict:
        return self._schemas.get((resource.group, resource.version, resource.plural), {})

    @staticmethod
    def _subresource(request: Any) -> str | None:
        return request.subresource if request.subresource in ("status", "scale") else None

    def _scope(self, request: Any) -> Any:
        """Which paths a write to this endpoint can own: status only through /status (where the
        kind has it), never the server's metadata, nor apiVersion, kind, name, namespace."""
        status_only = request.subresource == "status"
        separate_status = status_only or self._has_status_subresource(request.resource)

        def keep(path: tuple) -> bool:
            if path[0] in ("apiVersion", "kind") or path[:2] in {("metadata", f) for f in SERVER_METADATA + ("name", "namespace", "managedFields")}:
                return False
            return path[0] == "status" if status_only else not (separate_status and path[0] == "status")

        return keep

    def _record_owner(self, key: tuple, request: Any, content_type: str, data: dict) -> None:
        """Field ownership of a write that is not an apply: the writer takes the fields it wrote."""
        manager = request.params.get("fieldManager") or "unknown"
        ssa.update(self._owners.setdefault(key, {}), (manager, "Update", self._subresource(request)), data,
                   self._schema(key[0]), keep=self._scope(request))

    def _declared(self, resource: Any) -> bool:
        return any(known == resource for known in self.resources)

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            if not self._declared(request.resource):
                # A kind the server does not serve (its CRD not installed): 404, as for reads.
                self.writes.append(Write(str(request.method.value), request.url.path, request.headers.get("Content-Type", ""),
                                         dict(request.params), False))
                raise kmock.KubernetesError(status=404, reason="NotFound",
                                            message=f"the server could not find the requested resource ({request.resource})")
            async with self._lock:
                changed, key = await self._write(request)
                self.writes.append(Write(str(request.method.value), request.url.path, request.headers.get("Content-Type", ""),
                                         dict(request.params), changed))
                stored = self._current(key)
            if request.subresource == "scale":
                stored = {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": stored["metadata"],
                          "spec": {"replicas": stored.get("spec", {}).get("replicas")},
                          "status": {"replicas": stored.get("status", {}).get("replicas", 0),
                                     "selector": stored.get("status", {}).get("selector", "")}}
            # Answer with the stored object (the base class would merge the write a second time).
            return aiohttp.web.json_response(stored, status=201 if request.action == kmock.action.CREATE else 200)
        if request.resource is not None and request.action == kmock.action.DELETE:
            self.writes.append(Write("DELETE", request.url.path, "", dict(request.params), True))
        return await super()._handle(request)

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict | None:
        for (resource, ns, obj_name), obj in list(self._objects.items()):
            if (resource.group, resource.version, resource.plural, ns, obj_name) == (group, version, plural, namespace, name):
                return None if obj.deleted else copy.deepcopy(obj.raw)
        return None

    def versions(self, group: str, version: str, plural: str, namespace: str, name: str) -> list[tuple[dict, str | None]]:
        """Every version of one object the server stored, oldest first, with the field manager
        of the write that made it."""
        return [(copy.deepcopy(obj), writer) for (resource, ns, obj_name), obj, writer in list(self.stored)
                if (resource.group, resource.version, resource.plural, ns, obj_name) == (group, version, plural, namespace, name)]

    def names(self, group: str, version: str, plural: str, namespace: str) -> list[str]:
        return sorted(
            name for (resource, ns, name), obj in list(self._objects.items())
            if (resource.group, resource.version, resource.plural, ns) == (group, version, plural, namespace) and not obj.deleted
        )


class BackgroundApiServer:
    """ApiServer on 127.0.0.1 (a free port) in its own thread and event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="apiserver", daemon=True)
        self._thread.start()
        self.api = ApiServer()
        self._server = kmock.Server(self.api)

        async def start() -> str:
            await self.api.__aenter__()
            await self._server.__aenter__()
            return str(self._server.url).rstrip("/")

        self.url = self.call(start())

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def stop() -> None:
            await self._server.__aexit__(None, None, None)
            await self.api.__aexit__(None, None, None)

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
