"""shim/include/vgpu/nvml_api.h agrees with NVIDIA's nvml.h.

Two proofs, both against the nvml.h of the pinned nvidia-nvml-dev wheel (a test dependency in
pyproject's test extras, so this check never skips):
  1. every prototype of ours compiles after NVIDIA's declarations of the same names (a conflicting
     signature is a compile error), the legacy names with NVML_NO_UNVERSIONED_FUNC_DEFS;
  2. the struct layouts and constants we define (sizes, field offsets, enum values, version macros)
     print identically when compiled against ours and against theirs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.nvidia_headers import nvml_include

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "shim" / "include"


@pytest.fixture(scope="session")
def real_nvml_include() -> Path:
    return nvml_include()


def _compile(src: str, tmp: Path, *flags: str, run: bool = False) -> str:
    c = tmp / "t.c"
    c.write_text(src)
    exe = tmp / "t"
    subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Werror", *flags, f"-I{INCLUDE}", "-o", str(exe), str(c)]
        + ([] if run else ["-c"]),
        check=True,
        capture_output=False,
    )
    return (
        subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout if run else ""
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy-names"])
def test_prototypes_match_real_nvml_h(
    real_nvml_include: Path, tmp_path: Path, legacy: bool
) -> None:
    flags = [f"-I{real_nvml_include}"]
    if legacy:
        flags.append("-DNVML_NO_UNVERSIONED_FUNC_DEFS")
    src = '#include <nvml.h>\n#define VGPU_CHECK_AGAINST_NVML_H 1\n#include "vgpu/nvml_api.h"\nint x;\n'
    _compile(src, tmp_path, *flags)


LAYOUT = r"""
#include <stdio.h>
#include <stddef.h>
#define P(e) printf("%s=%lld\n", #e, (long long)(e))
int main(void) {
    P(sizeof(nvmlPciInfo_t)); P(offsetof(nvmlPciInfo_t, domain)); P(offsetof(nvmlPciInfo_t, pciDeviceId));
    P(offsetof(nvmlPciInfo_t, busId));
    P(sizeof(nvmlUtilization_t));
    P(sizeof(nvmlMemory_t)); P(offsetof(nvmlMemory_t, free)); P(offsetof(nvmlMemory_t, used));
    P(sizeof(nvmlMemory_v2_t)); P(offsetof(nvmlMemory_v2_t, reserved)); P(offsetof(nvmlMemory_v2_t, free));
    P(offsetof(nvmlMemory_v2_t, used)); P(nvmlMemory_v2);
    P(sizeof(nvmlProcessInfo_v1_t)); P(sizeof(nvmlProcessInfo_v2_t)); P(sizeof(nvmlProcessInfo_t));
    P(offsetof(nvmlProcessInfo_t, usedGpuMemory)); P(offsetof(nvmlProcessInfo_t, computeInstanceId));
    P(sizeof(nvmlProcessUtilizationSample_t)); P(offsetof(nvmlProcessUtilizationSample_t, smUtil));
    P(offsetof(nvmlProcessUtilizationSample_t, decUtil));
    P(sizeof(nvmlEventData_t)); P(offsetof(nvmlEventData_t, eventData)); P(offsetof(nvmlEventData_t, computeInstanceId));
    P(nvmlEventTypeXidCriticalError); P(nvmlEventTypePState); P(nvmlEventTypeNone);
    P(NVML_DEVICE_UUID_V2_BUFFER_SIZE); P(NVML_DEVICE_NAME_V2_BUFFER_SIZE); P(NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE);
    P(NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE); P(NVML_INIT_FLAG_NO_GPUS);
    P(NVML_SUCCESS); P(NVML_ERROR_UNINITIALIZED); P(NVML_ERROR_INVALID_ARGUMENT); P(NVML_ERROR_NOT_SUPPORTED);
    P(NVML_ERROR_NOT_FOUND); P(NVML_ERROR_INSUFFICIENT_SIZE); P(NVML_ERROR_TIMEOUT); P(NVML_ERROR_GPU_IS_LOST);
    P(NVML_ERROR_ARGUMENT_VERSION_MISMATCH); P(NVML_ERROR_UNKNOWN); P(NVML_ERROR_DRIVER_NOT_LOADED);
    P(NVML_BRAND_TESLA); P(NVML_BRAND_GEFORCE); P(NVML_BRAND_NVIDIA_VGAMING); P(NVML_BRAND_NVIDIA_RTX);
    P(NVML_BRAND_NVIDIA); P(NVML_BRAND_TITAN_RTX); P(NVML_BRAND_NVIDIA_NPU); P(NVML_BRAND_COUNT); P(sizeof(nvmlBrandType_t));
    return 0;
}
"""


def test_layouts_and_constants_match_real_nvml_h(real_nvml_include: Path, tmp_path: Path) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours = _compile('#include "vgpu/nvml_api.h"\n' + LAYOUT, tmp_path / "ours", run=True)
    theirs = _compile(
        "#include <nvml.h>\n" + LAYOUT, tmp_path / "theirs", f"-I{real_nvml_include}", run=True
    )
    assert ours == theirs


def test_header_compiles_standalone(tmp_path: Path) -> None:
    """Without any NVIDIA header (the normal build), the header is self-contained."""
    _compile('#include "vgpu/nvml_api.h"\nint x;\n', tmp_path)
