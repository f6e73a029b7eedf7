"""The README's bursting claim on Kubernetes ("Memory that bursts (Kubernetes)"), run on the
real cluster exactly as the README shows it: its command lines, read from the README, with the
manifests of deploy/examples/burst; the pod must print the README's output. Then the same
commands with the user's pod applied before the admin's policy: the claim's prepare fails with
the one-line refusal (the limit is never silently dropped), the pod waits, and it runs with its
limit once the plugin has the policy (the kubelet retries the prepare).

The shipped policy allows no bursting, so deploy/examples/burst is not one of test_examples'
folders (which run under it); the policy the cluster had is put back after each test, and the
test waits for the plugin to apply it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.cluster.kube import PLUGIN_NS, REPO, Cluster, policy_text, require_sharing, set_policy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEADING = "### Memory that bursts (Kubernetes)"
PLUGIN = "app.kubernetes.io/name=vgpu-kubelet-plugin"
REFUSAL = (
    "VgpuConfig memoryLimit 8Gi: the node's sharing policy lets only DeviceClass configs give a "
    "burst limit (burst.fromClaim: false)"
)


def readme_section() -> tuple[list[list[str]], list[str]]:
    """The section's command lines (each a kubectl argv) and the output it shows."""
    text = (REPO / "README.md").read_text()
    start = text.index(HEADING)
    end = min(i for i in (text.find("\n## ", start), text.find("\n### ", start + 1)) if i > 0)
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```", text[start:end], re.M | re.S)
    [commands] = [b for lang, b in blocks if lang == "sh"]
    [output] = [b for lang, b in blocks if lang == ""]
    argvs = [shlex.split(ln, comments=True) for ln in commands.splitlines()]
    assert argvs and all(a[0] == "kubectl" for a in argvs), argvs
    return argvs, output.splitlines()


def run(cluster: Cluster, argv: list[str]) -> str:
    """One README line, from the repository's root as the README's paths are written."""
    r = subprocess.run(argv, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (argv, r.stdout, r.stderr)
    return r.stdout


def plugin_log(cluster: Cluster) -> str:
    return cluster.kubectl("logs", "-n", PLUGIN_NS, "-l", PLUGIN, "--tail=-1").stdout


def applied(cluster: Cluster) -> int:
    return plugin_log(cluster).count(" applied: ")


def check_output(log: str, shown: list[str]) -> None:
    """The README's output: the program's lines in order, and the shim's refusal line (stderr,
    which the container log may interleave a moment early or late)."""
    lines = log.splitlines()
    assert [x for x in lines if not x.startswith("vgpu: ")] == [
        x for x in shown if not x.startswith("vgpu: ")
    ], log
    assert sorted(x for x in lines if x.startswith("vgpu: ")) == sorted(
        x for x in shown if x.startswith("vgpu: ")
    ), log


@pytest.fixture
def shipped_policy(clean_default: Cluster) -> Iterator[Cluster]:
    """The cluster under a policy that allows no bursting; that policy again after, applied by
    the plugin before the next test (the pods are deleted first, by clean_default)."""
    cluster = clean_default
    require_sharing(cluster)
    original = policy_text(cluster)
    assert "burst" not in (yaml.safe_load(original).get("default") or {}), original
    before = applied(cluster)
    try:
        yield cluster
    finally:
        cluster.kubectl("delete", "pod", "burst", "--ignore-not-found", "--timeout=120s")
        after = applied(cluster)
        set_policy(cluster, original)
        if after > before:  # the example's policy reached the plugin: wait for the original's
            cluster.wait_until(
                "the plugin applying the original policy again",
                lambda: applied(cluster) > after,
                timeout=180,
                every=2,
            )


def test_the_readme_commands_print_the_readme_output(shipped_policy: Cluster) -> None:
    cluster = shipped_policy
    argvs, shown = readme_section()
    t0 = time.monotonic()
    outputs = [run(cluster, argv) for argv in argvs]
    took = time.monotonic() - t0
    check_output(outputs[-1], shown)
    print(f"\n=== README's commands, {took:.0f} s:\n{outputs[-1]}")


def test_a_pod_before_the_policy_fails_clearly_then_runs_with_its_limit(
    shipped_policy: Cluster,
) -> None:
    cluster = shipped_policy
    argvs, shown = readme_section()
    [admin] = [a for a in argvs if a[1:3] == ["apply", "-k"]]
    [user] = [a for a in argvs if a[1:3] == ["apply", "-f"]]
    rest = [a for a in argvs if a not in (admin, user)]
    run(cluster, user)
    uid = cluster.pod("burst")["metadata"]["uid"]

    def refused() -> list[str]:
        # this pod's: the Events of the other test's pod of the same name are still there
        items = cluster.get("events", "--field-selector", f"involvedObject.uid={uid}")["items"]
        return [f"{e['reason']}: {e['message']}" for e in items if e["reason"].startswith("Failed")]

    events = cluster.wait_until("the prepare's refusal on the pod", refused, timeout=120)
    assert REFUSAL in events[0], events
    pod = cluster.pod("burst")
    assert pod["status"]["phase"] == "Pending", pod["status"]
    assert "running" not in str(pod["status"].get("containerStatuses", [])), pod["status"]

    t0 = time.monotonic()
    run(cluster, admin)
    outputs = [run(cluster, argv) for argv in rest]
    took = time.monotonic() - t0
    check_output(outputs[-1], shown)
    print(f"\n=== the pod before the policy: {events[0]}\n{took:.0f} s after the policy:")
    print(outputs[-1])
