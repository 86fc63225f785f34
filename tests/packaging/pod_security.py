"""A checker of the Kubernetes Pod Security Standards' "restricted" profile, written from its list
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, the baseline controls and
the restricted ones on top, as of Kubernetes 1.33), for pods of any workload kind: what the
Pod Security admission controller in `enforce: restricted` mode would refuse.

`restricted_violations(pod)` takes a pod (or a pod template: {metadata, spec}) and returns one
line per violated control, empty when the pod passes. `pod_templates(obj)` finds the pods of a
workload object (Deployment, LeaderWorkerSet leader and worker, StatefulSet, Job, ...).
"""

from __future__ import annotations

from typing import Any, Iterator

# Baseline: sysctls any pod may set (the "safe" set).
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
APPARMOR_TYPES = {"RuntimeDefault", "Localhost"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
# Restricted: the only volume types a pod may use.
VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            yield f"{field}[{container.get('name')}]", container


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What keeps this pod (or pod template) from the restricted profile; [] when nothing."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    pod_sc = spec.get("securityContext") or {}
    out: list[str] = []

    # --- baseline ---
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"host namespaces: spec.{field} is true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess is true")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"hostPath volumes: volume {volume.get('name')} is a hostPath")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctls: {sysctl.get('name')} is not in the safe set")
    out += _selinux("spec.securityContext", pod_sc)
    if (pod_sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in APPARMOR_TYPES:
        out.append("AppArmor: spec.securityContext.appArmorProfile.type is not RuntimeDefault or Localhost")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: annotation {key} is {value!r}")

    # --- restricted ---
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUME_TYPES:
            out.append(f"volume types: volume {volume.get('name')} is {', '.join(sorted(kinds - VOLUME_TYPES))}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_sc.get("runAsUser") == 0:
        out.append("running as non-root user: spec.securityContext.runAsUser is 0")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_TYPES:
        out.append(f"seccomp: spec.securityContext.seccompProfile.type is {pod_seccomp}")

    for where, container in _containers(spec):
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"privileged: {where} is privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where} is a host process")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"host ports: {where} uses hostPort {port['hostPort']}")
        out += _selinux(f"{where}.securityContext", sc)
        if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in APPARMOR_TYPES:
            out.append(f"AppArmor: {where} appArmorProfile.type is not RuntimeDefault or Localhost")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"/proc mount type: {where} procMount is {sc['procMount']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"privilege escalation: {where} does not set allowPrivilegeEscalation: false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"running as non-root: {where} may run as root (runAsNonRoot is not true for it or its pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"running as non-root user: {where} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in SECCOMP_TYPES:
            out.append(f"seccomp: {where} seccompProfile.type is {seccomp}")
        elif seccomp is None and pod_seccomp is None:
            out.append(f"seccomp: neither {where} nor its pod sets seccompProfile.type RuntimeDefault or Localhost")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            out.append(f"capabilities: {where} does not drop ALL")
        added = set(capabilities.get("add") or []) - ADDABLE_CAPABILITIES
        if added:
            out.append(f"capabilities: {where} adds {', '.join(sorted(added))} (only NET_BIND_SERVICE may be added)")
    return out


def _selinux(where: str, sc: dict[str, Any]) -> list[str]:
    options = sc.get("seLinuxOptions") or {}
    out = []
    if options.get("type", "") not in SELINUX_TYPES:
        out.append(f"SELinux: {where}.seLinuxOptions.type is {options['type']}")
    for field in ("user", "role"):
        if options.get(field):
            out.append(f"SELinux: {where}.seLinuxOptions.{field} is set")
    return out


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod a workload object runs; [] for objects that run none."""
    kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name")
    spec = obj.get("spec") or {}
    if kind == "Pod":
        return [(f"Pod/{name}", obj)]
    if kind == "PodTemplate":
        return [(f"PodTemplate/{name}", obj["template"])]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [(f"{kind}/{name}", spec["template"])]
    if kind == "CronJob":
        return [(f"CronJob/{name}", spec["jobTemplate"]["spec"]["template"])]
    if kind == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [(f"LeaderWorkerSet/{name} {role}", lwt[role]) for role in ("leaderTemplate", "workerTemplate") if role in lwt]
    return []
