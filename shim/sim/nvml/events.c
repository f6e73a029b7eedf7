/*
 * Event sets. The simulated device raises one kind of event: while a device is unhealthy
 * (config "healthy": false) every event set registered for nvmlEventTypeXidCriticalError on it
 * receives one XID critical-error event (eventData = the configured "xid", default 79), also a
 * set registered after the device became unhealthy. Once delivered to a set, it is not repeated
 * until the device has been seen healthy again. While waiting, the config file's health fields
 * are re-read when the file changes (checked every 50 ms), so a test can flip health while a
 * monitor waits; other fields change only at the next nvmlInit.
 */
#include "nvml.h"

#include "../common/config.h"
#include "../common/util.h"

#include <stdlib.h>
#include <string.h>

#define EVENT_SET_MAGIC 0x45565331u
#define SUPPORTED_EVENTS                                                                                               \
    (nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError |                 \
     nvmlEventTypePState | nvmlEventTypeClock)

struct nvmlEventSet_st {
    uint32_t magic;
    unsigned long long mask[SIM_MAX_DEVICES];
    int delivered[SIM_MAX_DEVICES];
};

SIM_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_check_init();
    if (rc != NVML_SUCCESS) return rc;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = sim_nvml_check_init();
    if (rc != NVML_SUCCESS) return rc;
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0; /* the struct is kept (small): a stale set fails validation instead of a use-after-free */
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    int i;
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, NULL);
    if (rc == NVML_SUCCESS) *eventTypes = SUPPORTED_EVENTS;
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                 nvmlEventSet_t set) {
    int i;
    nvmlReturn_t rc = sim_nvml_device(device, &i, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~(unsigned long long)SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&N.lock);
    set->mask[i] |= eventTypes;
    pthread_mutex_unlock(&N.lock);
    return NVML_SUCCESS;
}

/* One pass over the set: 1 if an event was produced. N.lock held. */
static int poll_set(nvmlEventSet_t set, nvmlEventData_t *data) {
    if (N.cfg.path[0]) sim_config_refresh_health(&N.cfg, &N.cfg_mtime);
    for (int i = 0; i < N.cfg.ndev; i++) {
        if (N.cfg.dev[i].healthy) {
            set->delivered[i] = 0; /* healthy again: a later failure is a new event */
            continue;
        }
        if (!(set->mask[i] & nvmlEventTypeXidCriticalError) || set->delivered[i]) continue;
        set->delivered[i] = 1;
        *data = (nvmlEventData_t){.device = &N.devs[i],
                                  .eventType = nvmlEventTypeXidCriticalError,
                                  .eventData = N.cfg.dev[i].xid,
                                  .gpuInstanceId = 0xFFFFFFFFu,
                                  .computeInstanceId = 0xFFFFFFFFu};
        return 1;
    }
    return 0;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!data || !set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = sim_now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        pthread_mutex_lock(&N.lock);
        if (N.refcount <= 0) {
            pthread_mutex_unlock(&N.lock);
            return NVML_ERROR_UNINITIALIZED;
        }
        int got = poll_set(set, data);
        pthread_mutex_unlock(&N.lock);
        if (got) return NVML_SUCCESS;
        uint64_t now = sim_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        uint64_t next = now + 50000000ull;
        sim_sleep_until_ns(next < deadline ? next : deadline);
    }
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
