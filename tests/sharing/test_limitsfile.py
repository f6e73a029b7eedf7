"""The limits file (sharing/limitsfile.py): what the plugin renders parses back, and every bad
file is refused with one line naming the key and what is allowed (the rules themselves are
vgpu/limits.def's, shared with the shim: tests/shim/test_limits_keys.py)."""

from __future__ import annotations

import pytest

from sharing import region
from sharing.limitsfile import LimitsFileError, parse_limits_file, render_limits_file

GiB = 1024**3


def render(**kw: object) -> str:
    args: dict[str, object] = dict(
        memory_limits=[4 * GiB, GiB],
        sm_limits=[30, 100],
        policy="elastic",
        priority=-5,
        shared_cache="/run/vgpu-sharing/accounting",
        node_state_dir="/run/vgpu-node",
        demand_file="/run/vgpu-demand",
    )
    args.update(kw)
    return render_limits_file(**args)  # type: ignore[arg-type]


def test_render_parses_back() -> None:
    text = render(context_reserve=300 * 1024**2)
    assert text.startswith("#") and text.endswith("\n")
    assert parse_limits_file(text) == {
        "CUDA_DEVICE_MEMORY_LIMIT_0": str(4 * GiB),
        "CUDA_DEVICE_MEMORY_LIMIT_1": str(GiB),
        "CUDA_DEVICE_SM_LIMIT_0": "30",
        "CUDA_DEVICE_SM_LIMIT_1": "100",
        "VGPU_COMPUTE_POLICY": "elastic",
        "VGPU_PRIORITY": "-5",
        "VGPU_CONTEXT_RESERVE": str(300 * 1024**2),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/vgpu-sharing/accounting",
        "VGPU_NODE_STATE_DIR": "/run/vgpu-node",
        "VGPU_DEMAND_FILE": "/run/vgpu-demand",
    }


def test_every_accounted_device_index_is_accepted() -> None:
    """Indices up to the accounting file's bound (64 devices)."""
    n = region.MAX_DEVICES
    limits = parse_limits_file(
        render(memory_limits=[GiB + i for i in range(n)], sm_limits=[50] * n)
    )
    assert limits[f"CUDA_DEVICE_MEMORY_LIMIT_{n - 1}"] == str(GiB + n - 1)
    assert limits[f"CUDA_DEVICE_SM_LIMIT_{n - 1}"] == "50"


def test_comments_and_blank_lines_are_ignored() -> None:
    text = "\n# a comment\n" + render() + "\n\n# end\n"
    assert parse_limits_file(text)["VGPU_COMPUTE_POLICY"] == "elastic"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(sm_limits=[-1, 100]), r"CUDA_DEVICE_SM_LIMIT_0=-1 invalid; allowed: a percentage 0-100"),
        (dict(sm_limits=[101, 100]), r"CUDA_DEVICE_SM_LIMIT_0=101 invalid"),
        (dict(policy="Off"), r"VGPU_COMPUTE_POLICY=Off invalid; allowed: hard, elastic or off"),
        (dict(priority=101), r"VGPU_PRIORITY=101 invalid; allowed: an integer -100\.\.100"),
        (dict(memory_limits=[-1, 1]), r"CUDA_DEVICE_MEMORY_LIMIT_0=-1 invalid; allowed: a byte count"),
        (dict(memory_limits=[2**64, 1]), r"allowed: a byte count 0\.\.18446744073709551615"),
        (dict(shared_cache="relative"), r"allowed: an absolute path"),
        (dict(sm_limits=[30]), r"2 memory limits but 1 SM limits"),
        (dict(memory_limits=[1] * 65, sm_limits=[1] * 65), r"key CUDA_DEVICE_MEMORY_LIMIT_64 unknown; allowed: .* \(i in 0\.\.63\)"),
    ],
)  # fmt: skip
def test_render_refuses_what_the_shim_would(kw: dict[str, object], message: str) -> None:
    with pytest.raises(LimitsFileError, match=message) as e:
        render(**kw)
    assert "\n" not in str(e.value)


BASE = (
    "CUDA_DEVICE_MEMORY_LIMIT_0=1024\nCUDA_DEVICE_SM_LIMIT_0=50\nVGPU_COMPUTE_POLICY=hard\n"
    "VGPU_PRIORITY=1\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/run/vgpu-sharing/accounting\n"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "CUDA_DISABLE_CONTROL=1\n", r"key CUDA_DISABLE_CONTROL unknown; allowed: CUDA_DEVICE_MEMORY_LIMIT_<i>,"),
        (BASE + "CUDA_DEVICE_SM_LIMIT_0=60\n", r"CUDA_DEVICE_SM_LIMIT_0 appears twice"),
        (BASE + "just words\n", r"just words: not KEY=VALUE"),
        (BASE + "CUDA_DEVICE_MEMORY_LIMIT_64=1\n", r"key CUDA_DEVICE_MEMORY_LIMIT_64 unknown"),
        (BASE + "VGPU_CONTEXT_RESERVE=1Gi\n", r"VGPU_CONTEXT_RESERVE=1Gi invalid; allowed: a byte count"),
        (BASE + "VGPU_PRIORITY =1\n", r"key VGPU_PRIORITY  unknown"),
        (BASE + "CUDA_TASK_PRIORITY=1\n", r"key CUDA_TASK_PRIORITY unknown"),
        (BASE.replace("=1024", "="), r"CUDA_DEVICE_MEMORY_LIMIT_0= invalid"),
        (BASE.replace("=50", "="), r"CUDA_DEVICE_SM_LIMIT_0= invalid"),
        (BASE.replace("VGPU_COMPUTE_POLICY=hard\n", ""), r"VGPU_COMPUTE_POLICY missing"),
        (BASE + "CUDA_DEVICE_MEMORY_LIMIT_2=1\n", r"must name devices 0\.\.n-1 .* without a gap"),
        (BASE + "CUDA_DEVICE_MEMORY_LIMIT_1=1\n", r"CUDA_DEVICE_SM_LIMIT_<i> must name the same devices as CUDA_DEVICE_MEMORY_LIMIT_<i>"),
        (BASE + "VGPU_DEMAND_FILE=/x\x1b[2J\n", r"non-printable"),
        (BASE + "#\0\n", r"a NUL byte"),
        (BASE + "#" * 70000, r"larger than 65536 bytes"),
    ],
)  # fmt: skip
def test_parse_refuses_bad_files(text: str, message: str) -> None:
    with pytest.raises(LimitsFileError, match=message) as e:
        parse_limits_file(text)
    assert "\n" not in str(e.value)


def test_context_sizes_per_device() -> None:
    """VGPU_CONTEXT_SIZE_<i>: optional per device, only for the slice's devices, a byte count."""
    text = render(context_sizes=[500 * 1024**2, None])
    values = parse_limits_file(text)
    assert values["VGPU_CONTEXT_SIZE_0"] == str(500 * 1024**2)
    assert "VGPU_CONTEXT_SIZE_1" not in values
    with pytest.raises(LimitsFileError, match=r"VGPU_CONTEXT_SIZE_<i> names a device that"):
        parse_limits_file(text + "VGPU_CONTEXT_SIZE_2=1\n")
    with pytest.raises(
        LimitsFileError, match=r"VGPU_CONTEXT_SIZE_0=500Mi invalid; allowed: a byte"
    ):
        parse_limits_file(text.replace(f"={500 * 1024**2}", "=500Mi"))
    with pytest.raises(LimitsFileError, match=r"key VGPU_CONTEXT_SIZE_64 unknown"):
        parse_limits_file(text + "VGPU_CONTEXT_SIZE_64=1\n")
    with pytest.raises(LimitsFileError, match=r"key VGPU_CONTEXT_SIZE unknown; allowed: .*"):
        parse_limits_file(text + "VGPU_CONTEXT_SIZE=1\n")
