"""The container of a process from its cgroup file, as each runtime and the kubelet name them
(the real thing with podman + runc: test_containers_podman.py), and a process of no container."""

from __future__ import annotations

import os

import pytest

from sharing.containers import NO_CONTAINER, Container, container_of, container_of_cgroup

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
