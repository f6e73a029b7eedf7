"""The container of a process from its cgroup file, as each runtime and the kubelet name them
(the real thing with podman + runc: test_containers_podman.py), and a process of no container;
its name from the kubelet's per-container mount (with real mounts: test_exporter_pod_resources.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharing.observe.procinfo import (
    NO_CONTAINER,
    Container,
    container_of,
    container_of_cgroup,
    kubelet_container_of_mountinfo,
)

CID = "3f1e" + "a" * 56 + "0b9c"
POD = "6f1c0e5e-1234-4000-8000-0000000000aa"


@pytest.mark.parametrize(
    "text",
    [
        # containerd, systemd cgroup driver, cgroup v2
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}"
        f".slice/cri-containerd-{CID}.scope\n",
        # containerd, cgroupfs driver, cgroup v1 (several hierarchies)
        f"12:memory:/kubepods/burstable/pod{POD}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/"
        f"pod{POD}/{CID}\n0::/\n",
        # CRI-O, systemd driver
        f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n",
        # the reader in its own cgroup namespace: the path is relative, the names are the same
        f"0::/../../kubepods-besteffort-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
    ],
)
def test_kubelet_and_runtime_cgroup_names(text: str) -> None:
    assert container_of_cgroup(text) == Container(CID, POD)


@pytest.mark.parametrize(
    "text",
    [
        f"0::/system.slice/docker-{CID}.scope\n",  # Docker, systemd driver
        f"4:memory:/libpod_parent/libpod-{CID}\n0::/\n",  # podman, cgroupfs manager
        f"0::/machine.slice/libpod-{CID}.scope/container\n",  # podman's nested leaf
    ],
)
def test_containers_outside_kubernetes_have_no_pod(text: str) -> None:
    got = container_of_cgroup(text)
    assert got == Container(CID, "")
    assert got.short_id == CID[:12]


@pytest.mark.parametrize(
    "text",
    [
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "0::/\n",
        "4:memory:/process_api/6f0f2e1cd14b7b54cb2f382e1a8efe0b\n0::/\n",  # 32 hex: not an ID
        "",
    ],
)
def test_a_process_in_no_container(text: str) -> None:
    assert container_of_cgroup(text) == NO_CONTAINER


def test_this_process_and_a_gone_one() -> None:
    with open("/proc/self/cgroup") as f:
        assert container_of(os.getpid()) == container_of_cgroup(f.read())
    assert container_of(2**22 + 1) == NO_CONTAINER  # above pid_max: never a process


MOUNTINFO = (
    "612 598 0:52 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u\n"
    "640 612 254:1 /var/lib/kubelet/pods/0f2d5c1e-5a8b-4c1e-9d3a-7b6e2f1a0c9d/etc-hosts "
    "/etc/hosts rw,relatime - ext4 /dev/vda1 rw\n"
    "641 612 254:1 /var/lib/kubelet/pods/0f2d5c1e-5a8b-4c1e-9d3a-7b6e2f1a0c9d/containers/"
    "train-main/8f3c1e2a /dev/termination-log rw,relatime - ext4 /dev/vda1 rw\n"
)


def test_the_kubelets_per_container_mount_names_the_container() -> None:
    assert kubelet_container_of_mountinfo(MOUNTINFO) == (
        "0f2d5c1e-5a8b-4c1e-9d3a-7b6e2f1a0c9d",
        "train-main",
    )
    # the kubelet's root on a file system of its own: the mount root starts at pods/
    separate = MOUNTINFO.replace("/var/lib/kubelet/pods/", "/pods/")
    assert kubelet_container_of_mountinfo(separate)[1] == "train-main"
    # no kubelet file (podman, a host process), or a name that is no container name
    assert kubelet_container_of_mountinfo(MOUNTINFO.splitlines()[0]) == ("", "")
    bad = MOUNTINFO.replace("train-main", "Train_Main")
    assert kubelet_container_of_mountinfo(bad) == ("", "")


def test_a_mount_of_another_pod_than_the_cgroup_says_names_nothing(tmp_path: Path) -> None:
    cid = "a" * 64
    pod = "11111111-2222-3333-4444-555555555555"
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{pod.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"
    )
    (tmp_path / "7" / "mountinfo").write_text(MOUNTINFO)
    assert container_of(7, str(tmp_path)) == Container(cid, pod, "")
    (tmp_path / "7" / "mountinfo").write_text(
        MOUNTINFO.replace("0f2d5c1e-5a8b-4c1e-9d3a-7b6e2f1a0c9d", pod)
    )
    assert container_of(7, str(tmp_path)) == Container(cid, pod, "train-main")
