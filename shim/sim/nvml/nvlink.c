/*
 * NVLink queries: the simulated GPUs have no NVLink (docs/simulator.md, fidelity limits), so every
 * link of a valid device answers NVML_ERROR_NOT_SUPPORTED, as NVIDIA's NVML does on a PCIe GPU
 * without NVLink. PyTorch asks for the remote device type of each link when it formats an
 * out-of-memory message; a missing symbol there turns torch.cuda.OutOfMemoryError into an
 * internal assert. Argument order and types as nvml.h declares them (pointers are not read).
 */
#include "nvml.h"

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                            int *pNvLinkDeviceType);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, void *pci);

static nvmlReturn_t no_nvlink(nvmlDevice_t device, const void *out) {
    int idx;
    sim_device_cfg cfg;
    nvmlReturn_t rc = sim_nvml_device(device, &idx, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    return out ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                            int *pNvLinkDeviceType) {
    return no_nvlink(device, pNvLinkDeviceType);
}
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive) {
    return no_nvlink(device, isActive);
}
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version) {
    return no_nvlink(device, version);
}
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, void *pci) {
    return no_nvlink(device, pci);
}
