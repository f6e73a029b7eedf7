"""The kustomize tree in deploy/: every overlay renders with `kubectl kustomize`; every rendered
object and every example is valid for Kubernetes 1.34, 1.35, 1.36 and 1.37 (kubernetes-validate's
strict schemas); the objects fit the plugin (RBAC, mounts, env twins, probes, the policy); the
admission policy's CEL admits and refuses the right requests (cel-python)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from driver.flags import parse
from driver.injection import SIM_CONFIG_PATH, SIM_STATE_PATH
from sharing.claimlayout import (
    CONTAINER_ACCOUNTING,
    CONTAINER_CLAIM_DIR,
    CONTAINER_DEMAND_FILE,
    CONTAINER_LIB,
    CONTAINER_LIB_DIR,
    CONTAINER_LIMITS,
    CONTAINER_METADATA_ROOT,
    CONTAINER_NODE_STATE_DIR,
    CONTAINER_PRELOAD,
)
from sharing.observe.podresources import DEFAULT_SOCKET as POD_RESOURCES_SOCKET
from sharing.plan.cel_eval import evaluate
from sharing.policy import from_document
from tests.support.deploy_tree import (
    DEPLOY,
    VERSIONS,
    examples,
    of_kind,
    rendered,
    with_component,
)

OVERLAYS = (
    "base", "overlays/sharing", "overlays/partition", "overlays/sim", "overlays/sim-watchdog"
)  # fmt: skip
SA_USER = "system:serviceaccount:vgpu-sharing:vgpu-kubelet-plugin"
SLICES_POLICY = "vgpu-sharing-resourceslices"
MOUNTS_POLICY = "vgpu-sharing-pod-mounts"
ISOLATION_POLICY = "vgpu-sharing-pod-isolation"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
IMAGE = "localhost/vgpu-sharing:0.1.0"  # scripts/build-image's default name


def plugin_container(overlay: str) -> dict[str, Any]:
    [ds] = of_kind(overlay, "DaemonSet")
    [c] = ds["spec"]["template"]["spec"]["containers"]
    return dict(c)


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_with_every_object(overlay: str) -> None:
    kinds = sorted(d["kind"] for d in rendered(overlay))
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            *["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 3,
            "ConfigMap",
            "DaemonSet",
            "Service",
            "DeviceClass",
            "DeviceClass",
        ]
    )
    names = {d["metadata"]["name"] for d in of_kind(overlay, "DeviceClass")}
    assert names == {"vgpu.sharing.dev", "vgpu-whole.sharing.dev"}
    env = {e["name"]: e.get("value") for e in plugin_container(overlay)["env"]}
    mode = {"base": "auto", "overlays/sim": "auto", "overlays/sim-watchdog": "auto"}.get(
        overlay, overlay.split("/")[-1]
    )
    assert env["SHARING_MODE"] == mode
    assert plugin_container(overlay)["image"] == IMAGE


def _validation_cases() -> list[Any]:
    cases = []
    for overlay in OVERLAYS:
        for i, d in enumerate(rendered(overlay)):
            cases.append(pytest.param(d, id=f"{overlay}#{i}-{d['kind']}"))
    for where, d in examples():
        cases.append(pytest.param(d, id=where))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_strict(version: str) -> None:
    failures = []
    for case in _validation_cases():
        [doc] = case.values
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{case.id}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
    assert not failures, f"invalid for {version}:\n" + "\n".join(failures)


def test_validation_covers_overlays_and_examples() -> None:
    ids = [c.id for c in _validation_cases()]
    assert sum(i.startswith("overlays/partition#") for i in ids) == 15
    assert sum(i.startswith("overlays/sim#") for i in ids) == 15
    assert sum(i.startswith("overlays/sim-watchdog#") for i in ids) == 15
    assert sum(i.startswith("examples/sharing/") for i in ids) == 15
    assert sum(i.startswith("examples/partition/") for i in ids) == 15
    assert sorted(i for i in ids if i.startswith("examples/burst/")) == [
        "examples/burst/pod.yaml#0", "examples/burst/pod.yaml#1", "examples/burst/policy.yaml#0",
    ]  # fmt: skip


def test_strict_validation_catches_a_typo() -> None:
    """The check above can fail: a misspelt field is rejected."""
    [ds] = of_kind("base", "DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.36", strict=True)


def test_rbac_grants_exactly_the_plugin_verbs() -> None:
    [role] = of_kind("base", "ClusterRole")
    grants = {
        (group, res): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
    }
    assert grants == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "create", "update", "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("resource.k8s.io", "resourceclaims/status"): {"patch"},
        ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:patch"},
        ("", "nodes"): {"get"},
        ("", "events"): {"create"},
    }
    # the node-scoped status permission names this driver alone
    [driver_rule] = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule["resourceNames"] == ["vgpu.sharing.dev"]
    [binding] = of_kind("base", "ClusterRoleBinding")
    [sa] = of_kind("base", "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"],
        }
    ]
    assert (
        f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}" == SA_USER
    )


def test_daemonset_mounts_env_probes_and_resources() -> None:
    [ds] = of_kind("base", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    [sa] = of_kind("base", "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    c = plugin_container("base")
    assert c["command"] == ["vgpu-kubelet-plugin"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {n: v["hostPath"]["path"] for n, v in volumes.items() if "hostPath" in v}
    assert "/dev" not in host.values(), "no whole-/dev mount: privileged already shows the GPUs"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    s = parse([], env={k: v or "node-x" for k, v in env.items()})
    # Every path the plugin writes is mounted from the same host path (CDI specs name them).
    for path in (
        s.kubelet_registrar_directory_path,
        s.kubelet_plugins_directory_path,
        s.cdi_root,
        s.data_dir,
    ):
        assert host.get(mounts[str(path)]["name"]) == str(path), path
    # The kubelet's PodResources socket (the metrics' pod and container names), read only.
    pr = mounts[str(PurePosixPath(POD_RESOURCES_SOCKET).parent)]
    assert pr["readOnly"] is True and host[pr["name"]] == pr["mountPath"]
    # The driver root: the host path DRIVER_ROOT, seen read-only at DRIVER_ROOT_MOUNT.
    root_mount = mounts[env["DRIVER_ROOT_MOUNT"]]
    assert root_mount["readOnly"] is True
    assert host[root_mount["name"]] == env["DRIVER_ROOT"]
    # The policy file comes from the ConfigMap, and the shipped policy is valid.
    assert s.policy is not None
    policy_mount = mounts[str(s.policy.parent)]
    cm_name = volumes[policy_mount["name"]]["configMap"]["name"]
    [cm] = [d for d in of_kind("base", "ConfigMap") if d["metadata"]["name"] == cm_name]
    from_document(yaml.safe_load(cm["data"][s.policy.name]))
    # Liveness /healthz and readiness /readyz on the health port; no start-up delay needed
    # (/healthz answers while the plugin waits for the API server).
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    assert s.healthcheck_port == ports["healthz"]
    assert "initialDelaySeconds" not in c["livenessProbe"]
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    # The metrics Service targets the pods' metrics port 9402.
    [svc] = of_kind("base", "Service")
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == ports["metrics"] == 9402


def _env(overlay: str) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in plugin_container(overlay)["env"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_root_filesystem_is_read_only_with_a_writable_tmp(overlay: str) -> None:
    c = plugin_container(overlay)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    [ds] = of_kind(overlay, "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    [tmp] = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_host_pid_only_with_the_watchdog(overlay: str) -> None:
    """hostPID exactly when the plugin runs the watchdog (metrics on and WATCHDOG not false)."""
    [ds] = of_kind(overlay, "DaemonSet")
    env = _env(overlay)
    s = parse([], env={k: v or "node-x" for k, v in env.items()})
    watchdog = s.metrics_address is not None and s.watchdog
    assert ds["spec"]["template"]["spec"].get("hostPID", False) is watchdog
    assert watchdog is (overlay != "overlays/sim")


def test_the_no_watchdog_component_drops_host_pid_and_the_watchdog() -> None:
    """The component works on any overlay: rendered on top of the sharing overlay."""
    [ds] = [x for x in with_component("no-watchdog") if x["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert pod["hostPID"] is False
    assert parse([], env={k: v or "n" for k, v in env.items()}).watchdog is False
    assert env["SHARING_MODE"] == "sharing" and env["METRICS_ADDRESS"] == ":9402"


def test_sim_overlay_runs_the_simulator_on_any_node_unprivileged() -> None:
    [ds] = of_kind("overlays/sim", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = plugin_container("overlays/sim")
    s = parse([], env={k: v or "node-x" for k, v in _env("overlays/sim").items()})
    assert s.sim and s.sim_gpus == 2 and s.sim_model == "h100-80gb"
    assert s.watchdog is False and s.watchdog_enforce == "none"
    assert not pod.get("nodeSelector")  # any node
    assert pod["tolerations"] == [{"operator": "Exists"}]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # No NVIDIA driver root or toolkit specs to read; the data dir (where the simulated node
    # lives, named by the claims' CDI specs) is the host's at the same path.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert "/driver-root" not in mounts and "/etc/cdi" not in mounts
    assert set(host.values()) == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/pod-resources",  # the metrics' pod and container names
        "/var/run/cdi",
        "/var/lib/vgpu-sharing",
    }
    assert host[mounts[str(s.data_dir)]] == str(s.data_dir)


def test_sim_watchdog_overlay_enforces_with_host_pids_unprivileged() -> None:
    """The sim overlay plus the watchdog with kill (tests/cluster/test_watchdog.py): hostPID, so
    the simulated NVML names host PIDs; nothing else changes from the sim overlay."""
    [ds] = of_kind("overlays/sim-watchdog", "DaemonSet")
    [sim] = of_kind("overlays/sim", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    s = parse([], env={k: v or "node-x" for k, v in _env("overlays/sim-watchdog").items()})
    assert s.sim and s.watchdog and s.watchdog_enforce == "kill"
    assert pod["hostPID"] is True
    assert (
        plugin_container("overlays/sim-watchdog")["securityContext"]
        == (plugin_container("overlays/sim")["securityContext"])
    )
    del pod["hostPID"], sim["spec"]["template"]["spec"]["hostPID"]
    for c in (pod["containers"][0], sim["spec"]["template"]["spec"]["containers"][0]):
        c["env"] = [e for e in c["env"] if e["name"] not in ("WATCHDOG", "WATCHDOG_ENFORCE")]
    assert ds == sim


def test_gpu_overlays_stay_privileged_for_nvml() -> None:
    """The real-GPU DaemonSet opens /dev/nvidia*: privileged (see its comment)."""
    for overlay in ("base", "overlays/sharing", "overlays/partition"):
        assert plugin_container(overlay)["securityContext"]["privileged"] is True
        [ds] = of_kind(overlay, "DaemonSet")
        assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


# --- the admission policy ----------------------------------------------------------------------


def admission(
    operation: str,
    node: str | None,
    obj_node: str | None = None,
    old_node: str | None = None,
    user: str = SA_USER,
) -> dict[str, Any]:
    def slice_of(n: str | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"driver": "vgpu.sharing.dev", "pool": {"name": "p"}}
        if n is not None:
            spec["nodeName"] = n
        else:
            spec["allNodes"] = True
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": spec}

    extra = {NODE_NAME_KEY: [node]} if node is not None else {}
    return {
        "request": {"operation": operation, "userInfo": {"username": user, "extra": extra}},
        "object": None if operation == "DELETE" else slice_of(obj_node),
        "oldObject": None if operation == "CREATE" else slice_of(old_node),
    }


def policy(kind: str, name: str) -> dict[str, Any]:
    [obj] = [d for d in of_kind("base", kind) if d["metadata"]["name"] == name]
    return obj


def refusal(activation: dict[str, Any], name: str = SLICES_POLICY) -> str | None:
    """The policy's decision as the API server makes it: matchConditions, then variables,
    then every validation. None when admitted, else the refusal's message."""
    spec = policy("ValidatingAdmissionPolicy", name)["spec"]
    for cond in spec["matchConditions"]:
        if not evaluate(cond["expression"], activation):
            return None  # not a request the policy is about
    variables: dict[str, Any] = {}
    for v in spec["variables"]:
        variables[v["name"]] = evaluate(v["expression"], {**activation, "variables": variables})
    for rule in spec["validations"]:
        env = {**activation, "variables": variables}
        value = evaluate(rule["expression"], env)
        if value is not True and str(value) != "True":
            if "messageExpression" in rule:
                return str(evaluate(rule["messageExpression"], env))
            return str(rule["message"])
    return None


def admits(activation: dict[str, Any]) -> bool:
    return refusal(activation) is None


@pytest.mark.parametrize(
    ("request_", "allowed"),
    [
        (admission("CREATE", "node-a", "node-a"), True),
        (admission("CREATE", "node-a", "node-b"), False),
        (admission("CREATE", None, "node-a"), False),  # no node name: refused
        (admission("CREATE", "", "node-a"), False),
        (admission("CREATE", "node-a", None), False),  # allNodes slice
        (admission("UPDATE", "node-a", "node-a", "node-a"), True),
        (admission("UPDATE", "node-a", "node-a", "node-b"), False),  # taking over b's slice
        (admission("UPDATE", "node-a", "node-b", "node-a"), False),
        (admission("DELETE", "node-a", old_node="node-a"), True),
        (admission("DELETE", "node-a", old_node="node-b"), False),
        (admission("DELETE", None, old_node="node-a"), False),
        # Anyone else (the scheduler, an admin) is not this policy's business.
        (admission("CREATE", None, "node-b", user="kubernetes-admin"), True),
    ],
)
def test_admission_policy_admits_only_own_node_slices(
    request_: dict[str, Any], allowed: bool
) -> None:
    assert admits(request_) is allowed


def test_admission_policy_matches_every_served_version() -> None:
    vap = policy("ValidatingAdmissionPolicy", SLICES_POLICY)
    [rule] = vap["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["apiVersions"]) >= {"v1", "v1beta1", "v1beta2"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert vap["spec"]["failurePolicy"] == "Fail"
    binding = policy("ValidatingAdmissionPolicyBinding", SLICES_POLICY)
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert vap["spec"]["matchConditions"][0]["expression"].count(SA_USER) == 1


# The paths the plugin injects into a claim's containers (every CDI mount of driver/claimspec.py
# and driver/injection.py's simulator files; the KEP-5304 device metadata root), as directories
# or files the policy guards.
GUARDED = (
    CONTAINER_LIB_DIR, CONTAINER_PRELOAD, CONTAINER_CLAIM_DIR, CONTAINER_NODE_STATE_DIR,
    CONTAINER_DEMAND_FILE, str(PurePosixPath(SIM_CONFIG_PATH).parent), SIM_STATE_PATH,
    CONTAINER_METADATA_ROOT,
)  # fmt: skip
INJECTED = (
    CONTAINER_LIB, CONTAINER_LIMITS, CONTAINER_ACCOUNTING, SIM_CONFIG_PATH,
    f"{CONTAINER_METADATA_ROOT}/resourceclaims/c1/gpu/vgpu.sharing.dev-metadata.json",
)  # fmt: skip


def _refused_paths() -> list[str]:
    out: set[str] = set()
    for g in GUARDED + INJECTED:
        out |= {g, g + "/", f"{g}/x", f"{g}/./x/y", "/" + g, g.replace("/", "/./", 1)}
        out |= {g.replace("/", "//"), g + "/."}
        for a in map(str, PurePosixPath(g).parents):  # "/", "/etc", "/run", "/usr", ...
            out |= {a, a + "/", a + "/.", "/" + a}
    return sorted(out)


ALLOWED_PATHS = (
    "/data", "/etc/ld.so.preload.d", "/etc/ld.so.preloadx", "/etc/config", "/run/secrets",
    "/run/vgpu-sharing2", "/run/vgpu", "/usr/local/lib64", "/usr/local/lib/python3",
    "/usr/local/libvgpu-sharing", "/usr/share", "/.etc", "/etc.d", "/var/lib", "/var/log",
    "/var/run/secrets", "/var/run/secrets/kubernetes.io/serviceaccount",
    "/var/run/kubernetes.io/dra-device-attributes2", "/var/runx", "/varx/run",
    "/home/etc/ld.so.preload", "/workspace/run/vgpu-sharing",
    "/workspace/var/run/kubernetes.io/dra-device-attributes",
)  # fmt: skip


def pod(
    mounts: list[str],
    devices: list[str] | None = None,
    uses_claim: bool = True,
    init: bool = False,
    pod_claims: bool = True,
) -> dict[str, Any]:
    """A CREATE request for a pod whose container `worker` (an init container if `init`) mounts
    volumes at `mounts`; a plain sidecar mounts /etc (it uses no claim)."""
    c: dict[str, Any] = {
        "name": "worker",
        "image": "i",
        "volumeMounts": [{"name": f"v{i}", "mountPath": m} for i, m in enumerate(mounts)],
    }
    if devices:
        c["volumeDevices"] = [{"name": f"d{i}", "devicePath": d} for i, d in enumerate(devices)]
    if uses_claim:
        c["resources"] = {"claims": [{"name": "gpu"}]}
    sidecar = {
        "name": "sidecar",
        "image": "i",
        "volumeMounts": [{"name": "s", "mountPath": "/etc"}],
    }
    spec: dict[str, Any] = {"containers": [sidecar] + ([] if init else [c])}
    if init:
        spec["initContainers"] = [c]
    if pod_claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    return {
        "request": {"operation": "CREATE", "userInfo": {"username": "tenant"}},
        "object": {"apiVersion": "v1", "kind": "Pod", "spec": spec},
        "oldObject": None,
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", _refused_paths())
def test_pod_mount_policy_refuses_a_volume_at_inside_or_above_an_injected_path(path: str) -> None:
    for request in (pod(["/data", path]), pod([path], init=True), pod([], devices=[path])):
        msg = refusal(request, MOUNTS_POLICY)
        assert msg is not None and msg.startswith(f"container worker mounts a volume at {path}, ")
        assert "over files the vgpu-sharing plugin injects" in msg and "mount it elsewhere" in msg


@pytest.mark.slow
@pytest.mark.parametrize("path", ALLOWED_PATHS)
def test_pod_mount_policy_admits_other_paths(path: str) -> None:
    assert refusal(pod([path]), MOUNTS_POLICY) is None
    assert refusal(pod([], devices=[path]), MOUNTS_POLICY) is None


def test_pod_mount_policy_leaves_containers_without_claims_alone() -> None:
    """The injected files reach only containers that use a claim: a sidecar of the same pod,
    or a pod with no claim at all, may mount anywhere."""
    assert refusal(pod([CONTAINER_PRELOAD], uses_claim=False), MOUNTS_POLICY) is None
    assert refusal(pod(["/etc"], pod_claims=False, uses_claim=False), MOUNTS_POLICY) is None
    assert refusal(pod(["/data"]), MOUNTS_POLICY) is None  # the sidecar's /etc mount is fine


def test_pod_mount_policy_admits_every_example_pod() -> None:
    pods = [(w, d) for w, d in examples() if d.get("kind") == "Pod"]
    assert pods
    for where, d in pods:
        request = {"request": {"operation": "CREATE"}, "object": d, "oldObject": None}
        assert refusal(request, MOUNTS_POLICY) is None, where


def test_pod_mount_policy_is_bound_and_fails_closed() -> None:
    vap = policy("ValidatingAdmissionPolicy", MOUNTS_POLICY)
    [rule] = vap["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == (
        [""],
        ["pods"],
        ["CREATE"],
    )
    assert vap["spec"]["failurePolicy"] == "Fail"
    binding = policy("ValidatingAdmissionPolicyBinding", MOUNTS_POLICY)
    assert binding["spec"]["policyName"] == MOUNTS_POLICY
    assert binding["spec"]["validationActions"] == ["Deny"]


# --- the bursting example (examples/burst) -------------------------------------------------------


def _burst_policy() -> dict[str, Any]:
    """The policy `kubectl apply -k deploy/examples/burst` gives the plugin."""
    [cm] = rendered("examples/burst")  # the ConfigMap alone: no pod, no other object
    [shipped] = of_kind("base", "ConfigMap")
    assert cm["metadata"] == shipped["metadata"] and cm["data"].keys() == shipped["data"].keys()
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["policy.yaml"])
    return doc


@pytest.mark.slow
def test_burst_example_policy_is_the_shipped_one_with_bursting() -> None:
    """The admin's half is deploy/base's policy plus a `burst` block and nothing else, so that
    applying it changes only what the example is about."""
    doc = _burst_policy()
    [shipped] = of_kind("base", "ConfigMap")
    base = yaml.safe_load(shipped["data"]["policy.yaml"])
    burst = doc["default"].pop("burst")
    assert doc == base
    assert "burst" not in base["default"]  # the shipped policy allows no bursting
    assert burst["fromClaim"] is True and burst["reclaim"] == "wait"


@pytest.mark.slow
def test_burst_example_claim_is_allowed_by_its_policy_and_refused_by_the_shipped_one() -> None:
    """The plugin's own check (driver/claims.py) of the pod's VgpuConfig: the example's policy
    allows its memoryLimit, the shipped one refuses it with one line naming the rule, so a claim
    prepared before the new policy reached the plugin fails instead of running without its
    limit."""
    from driver.claims import ClaimError, _check_claim_choices
    from driver.vgpuconfig import decode

    template = next(d for w, d in examples() if w == "examples/burst/pod.yaml#0")
    assert template["kind"] == "ResourceClaimTemplate"
    [entry] = template["spec"]["spec"]["devices"]["config"]
    config = decode(entry["opaque"]["parameters"])
    assert config.memory_limit is not None and config.memory_limit.text == "8Gi"
    request = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]
    assert request["requests"]["memory"] == "4Gi"
    rules = from_document(_burst_policy()).default
    assert rules.burst.max_ratio * 4 >= 8 and rules.burst.from_claim
    _check_claim_choices([("FromClaim", config)], rules, "request gpu")
    [shipped] = of_kind("base", "ConfigMap")
    builtin = from_document(yaml.safe_load(shipped["data"]["policy.yaml"])).default
    with pytest.raises(ClaimError, match=r"burst\.fromClaim: false"):
        _check_claim_choices([("FromClaim", config)], builtin, "request gpu")


@pytest.mark.slow
def test_burst_example_program_prints_the_readme_output(tmp_path: Path) -> None:
    """The pod's program under `vgpu run --memory 4Gi --memory-limit 8Gi` (what its claim's
    request and limit give it, and the whole limit borrowable as on an idle GPU) prints what the
    README shows the pod printing on the cluster."""
    pod = next(d for w, d in examples() if w == "examples/burst/pod.yaml#1")
    script = pod["spec"]["containers"][0]["args"][0]
    vgpu = str(Path(sys.executable).parent / "vgpu")
    r = subprocess.run(
        [vgpu, "run", "--sim", "--memory", "4Gi", "--memory-limit", "8Gi", "--",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    readme = (DEPLOY.parent / "README.md").read_text()
    section = readme[readme.index("### Memory that bursts (Kubernetes)") :]
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```", section, re.M | re.S)
    lines = next(text for lang, text in blocks if lang == "").splitlines()  # the output
    assert r.stdout.splitlines() == [x for x in lines if not x.startswith("vgpu: ")], r.stdout
    assert r.stderr.splitlines() == [x for x in lines if x.startswith("vgpu: ")], r.stderr


# --- docs ----------------------------------------------------------------------------------------


def test_readme_mentions_every_manifest_and_overlay() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*.yaml"):
        rel = path.relative_to(DEPLOY)
        if rel.name in ("kustomization.yaml", "mode.yaml"):
            continue
        assert str(rel) in readme, f"deploy/README.md does not mention {rel}"
    for overlay in OVERLAYS[1:]:
        assert f"kubectl apply -k deploy/{overlay}" in readme
    assert re.search(r"kubectl delete -k", readme)


# --- the examples' workload ------------------------------------------------------------------------


def _example_scripts() -> list[Any]:
    out = []
    for where, doc in examples():
        if doc["kind"] == "Pod":
            for c in doc["spec"]["containers"]:
                out.append(pytest.param(c, id=f"{where}-{c['name']}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("container", _example_scripts())
def test_example_workload_prints_the_memory_it_sees(
    container: dict[str, Any], tmp_path: Path
) -> None:
    """The example pods' CUDA program, run on the simulated GPU under the shim with a 3Gi limit
    as a claim's CDI spec sets it, prints that limit as the memory it sees."""
    from sharing.paths import ArtefactMissingError, shim_library, sim_lib_dir

    try:
        shim, sim = shim_library(), sim_lib_dir()
    except ArtefactMissingError as e:
        pytest.skip(str(e))
    assert container["command"] == ["python3", "-c"]
    script = container["args"][0].replace("time.sleep(3600)", "pass")
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(sim),  # on a node: the driver's libcuda.so.1, injected by CDI
        "LD_PRELOAD": str(shim),  # on a node: /etc/ld.so.preload, mounted by CDI
        "CUDA_DEVICE_MEMORY_LIMIT_0": str(3 * 1024**3),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "accounting"),
        "SIMGPU_STATE": str(tmp_path),
    }
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("GPU 0: 3.00 GiB visible, "), r.stdout
    if "3 GiB more" in script:  # burst: no 3 GiB fits beside the context without a limit
        assert r.stdout.count("3 GiB more: refused (CUDA_ERROR_OUT_OF_MEMORY)") == 3, r.stdout
    elif "cuMemAlloc_v2" in script:  # refused-past-quota: 3Gi less its context, then refused
        assert "GiB in 256 MiB chunks, then refused (CUDA_ERROR_OUT_OF_MEMORY)" in r.stdout
        held = float(r.stdout.split("allocated ")[1].split(" GiB")[0])
        assert 2.0 <= held < 3.0, r.stdout
        assert "denied" in r.stderr, r.stderr


def isolated_pod(pod_seccomp: str | None = "RuntimeDefault", **container: Any) -> dict[str, Any]:
    """A CREATE request for a claim pod; `container` is the claimant's securityContext."""
    request = pod(["/data"])
    spec = request["object"]["spec"]
    if pod_seccomp is not None:
        spec["securityContext"] = {"seccompProfile": {"type": pod_seccomp}}
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    if container:
        worker["securityContext"] = container
    return request


@pytest.mark.parametrize(
    ("request_", "refused_because"),
    [
        (isolated_pod(), None),
        (isolated_pod("Localhost"), None),
        (isolated_pod(None, seccompProfile={"type": "RuntimeDefault"}), None),
        # Kubernetes' default (no profile) is Unconfined: unshare -Urm works there
        (isolated_pod(None), "without a seccomp profile"),
        (isolated_pod("Unconfined"), "without a seccomp profile"),
        (isolated_pod(seccompProfile={"type": "Unconfined"}), "without a seccomp profile"),
        (isolated_pod(privileged=True), "is privileged, adds SYS_ADMIN"),
        (isolated_pod(procMount="Unmasked"), "unmasks /proc"),
        (isolated_pod(capabilities={"add": ["SYS_ADMIN"]}), "adds SYS_ADMIN"),
        (isolated_pod(capabilities={"add": ["NET_ADMIN", "CAP_SYS_ADMIN"]}), "adds SYS_ADMIN"),
        (isolated_pod(capabilities={"add": ["ALL"]}), "adds SYS_ADMIN"),
        (isolated_pod(capabilities={"add": ["NET_BIND_SERVICE"]}, privileged=False), None),
        (isolated_pod(procMount="Default"), None),
    ],
)
def test_pod_isolation_policy_refuses_claim_pods_that_can_mount_over_their_limits(
    request_: dict[str, Any], refused_because: str | None
) -> None:
    """Issue 33, attack 2: container root in a user + mount namespace of its own mounts its own
    file over the plugin's limits. The pods that could are refused (the real API server
    enforces this policy in tests/cluster)."""
    msg = refusal(request_, ISOLATION_POLICY)
    if refused_because is None:
        assert msg is None
    else:
        assert msg is not None and msg.startswith("container worker uses a vgpu-sharing claim")
        assert refused_because in msg, msg


def test_pod_isolation_policy_leaves_pods_without_claims_alone() -> None:
    unconfined = isolated_pod(None, privileged=True)
    unconfined["object"]["spec"].pop("resourceClaims")
    assert refusal(unconfined, ISOLATION_POLICY) is None
    sidecar_only = isolated_pod(None)
    for c in sidecar_only["object"]["spec"]["containers"]:
        c.pop("resources", None)
    assert refusal(sidecar_only, ISOLATION_POLICY) is None


def test_pod_isolation_policy_admits_every_example_pod() -> None:
    pods = [(w, d) for w, d in examples() if d.get("kind") == "Pod"]
    assert pods
    for where, d in pods:
        request = {"request": {"operation": "CREATE"}, "object": d, "oldObject": None}
        assert refusal(request, ISOLATION_POLICY) is None, where


@pytest.mark.parametrize(
    "path", ["/tmp/../etc/ld.so.preload", "/data/..", "..", "../x", "/a/../../run/vgpu-sharing"]
)
def test_pod_mount_policy_refuses_a_path_that_climbs(path: str) -> None:
    """Issue 33: `/tmp/../etc/ld.so.preload` matched none of the patterns, and the runtime
    resolves the '..' inside the container's root."""
    for request in (pod([path]), pod([], devices=[path]), pod(["/data", path], init=True)):
        msg = refusal(request, MOUNTS_POLICY)
        assert msg is not None and "with a '..' segment" in msg, (path, msg)


@pytest.mark.parametrize("path", ["/data/..x", "/data/x..", "/a..b/c", "/.../x"])
def test_pod_mount_policy_admits_dots_that_do_not_climb(path: str) -> None:
    assert refusal(pod([path]), MOUNTS_POLICY) is None
