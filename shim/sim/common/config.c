/*
 * SIMGPU_CONFIG: the simulated node's devices.
 *
 *   {"devices": [{"name", "uuid", "memory", "sm_count", "pci_bus_id", "numa_node",
 *                 "compute_capability", "healthy", "xid", "minor"}, ...],
 *    "driver_version": "570.172.08", "cuda_version": "12.8"}
 *
 * Every field is optional; a missing one gets a default derived from the device index (see
 * default_device). Unset variable: one H100 80GB. Anything malformed (syntax, unknown field, wrong
 * type, out-of-range value) is reported as ONE stderr line naming the file, the field and what is
 * allowed, and the load fails (cuInit / nvmlInit then fail): a typo must not silently simulate a
 * different node.
 */
#include "config.h"

#include "json.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define DEFAULT_DRIVER "580.95.05"
#define DEFAULT_CUDA   13000

static void default_device(sim_device_cfg *d, int i) {
    memset(d, 0, sizeof *d);
    sim_copy_str(d->name, sizeof d->name, "NVIDIA H100 80GB HBM3");
    snprintf(d->uuid, sizeof d->uuid, "GPU-5a1d0c0e-%04x-4e00-8000-%012x", (unsigned)(0x1000 + i),
             (unsigned)(0xc0de00 + i));
    d->memory = 80ull << 30;
    d->sm_count = 132;
    d->pci_domain = 0;
    d->pci_bus = 0x18u + (unsigned)i;
    d->pci_device = 0;
    d->numa_node = 0;
    d->cc_major = 9;
    d->cc_minor = 0;
    d->healthy = 1;
    d->xid = 79; /* "GPU has fallen off the bus" */
    d->minor = (unsigned)i;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "GPU-" then 8-4-4-4-12 hex digits. */
static int parse_uuid(const char *s, unsigned char out[16]) {
    if (strncmp(s, "GPU-", 4) != 0 || strlen(s) != 40) return -1;
    const char *p = s + 4;
    int n = 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (p[i] != '-') return -1;
            continue;
        }
        int hi = hexval(p[i]), lo = hexval(p[i + 1]);
        if (hi < 0 || lo < 0) return -1;
        out[n++] = (unsigned char)(hi << 4 | lo);
        i++;
    }
    return n == 16 ? 0 : -1;
}

/* "domain:bus:device.function" with a 4- or 8-digit domain, or "bus:device.function". */
static int parse_pci(const char *s, unsigned *dom, unsigned *bus, unsigned *dev) {
    unsigned a, b, c, f;
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", &a, &b, &c, &f, &tail) == 4) {
        if (b > 0xff || c > 0x1f || f > 7) return -1;
        *dom = a;
        *bus = b;
        *dev = c;
        return 0;
    }
    if (sscanf(s, "%x:%x.%x%c", &b, &c, &f, &tail) == 3) {
        if (b > 0xff || c > 0x1f || f > 7) return -1;
        *dom = 0;
        *bus = b;
        *dev = c;
        return 0;
    }
    return -1;
}

typedef struct {
    const char *path;
    int failed;
} ctx_t;

static int bad(ctx_t *c, const char *field, const char *problem, const char *allowed) {
    if (!c->failed) sim_log("config %s: %s: %s; allowed: %s", c->path, field, problem, allowed);
    c->failed = 1;
    return -1;
}

static int get_int(ctx_t *c, const sim_json *v, const char *field, long long lo, long long hi, long long *out,
                   const char *allowed) {
    if (v->type != SIM_JSON_NUMBER || !v->is_integer)
        return bad(c, field, v->type == SIM_JSON_NUMBER ? "not an integer" : sim_json_type_name(v->type), allowed);
    if (v->integer > (uint64_t)INT64_MAX) return bad(c, field, "out of range", allowed);
    long long x = v->negative ? -(long long)v->integer : (long long)v->integer;
    if (x < lo || x > hi) {
        char msg[64];
        snprintf(msg, sizeof msg, "%lld is out of range", x);
        return bad(c, field, msg, allowed);
    }
    *out = x;
    return 0;
}

static int load_device(ctx_t *c, const sim_json *o, int i, sim_device_cfg *d) {
    char field[96];
    default_device(d, i);
    if (o->type != SIM_JSON_OBJECT) {
        snprintf(field, sizeof field, "devices[%d]", i);
        return bad(c, field, sim_json_type_name(o->type),
                   "an object with name, uuid, memory, sm_count, pci_bus_id, numa_node, compute_capability, healthy, "
                   "xid, minor");
    }
    for (const sim_json *m = o->child; m; m = m->next) {
        snprintf(field, sizeof field, "devices[%d].%s", i, m->key);
        long long x;
        if (strcmp(m->key, "name") == 0) {
            if (m->type != SIM_JSON_STRING || !m->string[0] || strlen(m->string) >= SIM_NAME_LEN)
                return bad(c, field, m->type != SIM_JSON_STRING ? sim_json_type_name(m->type) : "empty or too long",
                           "a non-empty string of at most 95 bytes");
            sim_copy_str(d->name, sizeof d->name, m->string);
        } else if (strcmp(m->key, "uuid") == 0) {
            if (m->type != SIM_JSON_STRING || parse_uuid(m->string, d->uuid_bytes) != 0)
                return bad(c, field, m->type != SIM_JSON_STRING ? sim_json_type_name(m->type) : "not a GPU UUID",
                           "a string \"GPU-\" followed by 8-4-4-4-12 hexadecimal digits");
            sim_copy_str(d->uuid, sizeof d->uuid, m->string);
        } else if (strcmp(m->key, "memory") == 0) {
            static const char *allowed = "bytes as an integer or a string quantity: digits with an optional suffix Ki, "
                                         "Mi, Gi, Ti (binary) or K, M, G, T (decimal), e.g. \"80Gi\"; at least 1Mi";
            uint64_t v = 0;
            if (m->type == SIM_JSON_NUMBER && m->is_integer && !m->negative)
                v = m->integer;
            else if (m->type == SIM_JSON_STRING) {
                if (sim_parse_quantity(m->string, &v) != 0) {
                    char msg[160];
                    snprintf(msg, sizeof msg, "\"%.100s\" is not a quantity", m->string);
                    return bad(c, field, msg, allowed);
                }
            } else
                return bad(c, field,
                           m->type == SIM_JSON_NUMBER ? "not a non-negative integer" : sim_json_type_name(m->type),
                           allowed);
            if (v < (1ull << 20) || v > (1ull << 50)) return bad(c, field, "out of range", allowed);
            d->memory = v;
        } else if (strcmp(m->key, "sm_count") == 0) {
            if (get_int(c, m, field, 1, 1024, &x, "an integer from 1 to 1024") != 0) return -1;
            d->sm_count = (int)x;
        } else if (strcmp(m->key, "pci_bus_id") == 0) {
            if (m->type != SIM_JSON_STRING || parse_pci(m->string, &d->pci_domain, &d->pci_bus, &d->pci_device) != 0)
                return bad(c, field, m->type != SIM_JSON_STRING ? sim_json_type_name(m->type) : "not a PCI bus id",
                           "a string \"domain:bus:device.function\" in hexadecimal, e.g. \"00000000:18:00.0\" or "
                           "\"0000:18:00.0\"");
        } else if (strcmp(m->key, "numa_node") == 0) {
            if (get_int(c, m, field, -1, 1023, &x, "an integer from -1 (none) to 1023") != 0) return -1;
            d->numa_node = (int)x;
        } else if (strcmp(m->key, "compute_capability") == 0) {
            int maj, min;
            char tail;
            if (m->type != SIM_JSON_STRING || sscanf(m->string, "%d.%d%c", &maj, &min, &tail) != 2 || maj < 1 ||
                maj > 99 || min < 0 || min > 9)
                return bad(c, field, m->type != SIM_JSON_STRING ? sim_json_type_name(m->type) : "not major.minor",
                           "a string \"major.minor\", e.g. \"9.0\"");
            d->cc_major = maj;
            d->cc_minor = min;
        } else if (strcmp(m->key, "healthy") == 0) {
            if (m->type != SIM_JSON_BOOL) return bad(c, field, sim_json_type_name(m->type), "true or false");
            d->healthy = m->boolean;
        } else if (strcmp(m->key, "xid") == 0) {
            if (get_int(c, m, field, 1, 999, &x, "an integer XID from 1 to 999") != 0) return -1;
            d->xid = (unsigned long long)x;
        } else if (strcmp(m->key, "minor") == 0) {
            if (get_int(c, m, field, 0, 255, &x, "an integer from 0 to 255") != 0) return -1;
            d->minor = (unsigned)x;
        } else {
            return bad(c, field, "unknown field",
                       "name, uuid, memory, sm_count, pci_bus_id, numa_node, compute_capability, healthy, xid, minor");
        }
    }
    return 0;
}

#define SIM_STR_(x)     #x
#define SIM_STR(x)      SIM_STR_(x)
#define DEVICES_ALLOWED "an array of 0 to " SIM_STR(SIM_MAX_DEVICES) " device objects"

static int load_doc(ctx_t *c, const sim_json *root, sim_config *cfg) {
    if (root->type != SIM_JSON_OBJECT)
        return bad(c, "(document)", sim_json_type_name(root->type),
                   "an object {\"devices\": [...], \"driver_version\": \"...\", \"cuda_version\": \"12.8\"}");
    int have_devices = 0;
    for (const sim_json *m = root->child; m; m = m->next) {
        if (strcmp(m->key, "devices") == 0) {
            have_devices = 1;
            if (m->type != SIM_JSON_ARRAY) return bad(c, "devices", sim_json_type_name(m->type), DEVICES_ALLOWED);
            if (m->count > SIM_MAX_DEVICES)
                return bad(c, "devices", "more than " SIM_STR(SIM_MAX_DEVICES) " devices", DEVICES_ALLOWED);
            int i = 0;
            for (const sim_json *d = m->child; d; d = d->next, i++)
                if (load_device(c, d, i, &cfg->dev[i]) != 0) return -1;
            cfg->ndev = i;
        } else if (strcmp(m->key, "driver_version") == 0) {
            if (m->type != SIM_JSON_STRING || !m->string[0] || strlen(m->string) >= sizeof cfg->driver_version)
                return bad(c, "driver_version",
                           m->type != SIM_JSON_STRING ? sim_json_type_name(m->type) : "empty or too long",
                           "a non-empty string such as \"570.172.08\"");
            sim_copy_str(cfg->driver_version, sizeof cfg->driver_version, m->string);
        } else if (strcmp(m->key, "cuda_version") == 0) {
            static const char *allowed = "a string \"major.minor\" such as \"12.8\", or an integer such as 12080";
            int maj, min;
            char tail;
            if (m->type == SIM_JSON_STRING && sscanf(m->string, "%d.%d%c", &maj, &min, &tail) == 2 && maj >= 2 &&
                maj <= 99 && min >= 0 && min <= 99)
                cfg->cuda_version = maj * 1000 + min * 10;
            else if (m->type == SIM_JSON_NUMBER && m->is_integer && !m->negative && m->integer >= 2000 &&
                     m->integer <= 99990)
                cfg->cuda_version = (int)m->integer;
            else
                return bad(c, "cuda_version",
                           m->type == SIM_JSON_STRING ? "not major.minor" : sim_json_type_name(m->type), allowed);
        } else {
            return bad(c, m->key, "unknown field", "devices, driver_version, cuda_version");
        }
    }
    if (!have_devices) {
        cfg->ndev = 1;
        default_device(&cfg->dev[0], 0);
    }
    /* Fill the UUID bytes of defaulted UUIDs; reject duplicates (handles by UUID must be unique). */
    for (int i = 0; i < cfg->ndev; i++) {
        parse_uuid(cfg->dev[i].uuid, cfg->dev[i].uuid_bytes);
        for (int j = 0; j < i; j++) {
            char field[48];
            if (strcmp(cfg->dev[i].uuid, cfg->dev[j].uuid) == 0) {
                snprintf(field, sizeof field, "devices[%d].uuid", i);
                return bad(c, field, "same UUID as an earlier device", "a UUID unique on the node");
            }
            if (cfg->dev[i].pci_domain == cfg->dev[j].pci_domain && cfg->dev[i].pci_bus == cfg->dev[j].pci_bus &&
                cfg->dev[i].pci_device == cfg->dev[j].pci_device) {
                snprintf(field, sizeof field, "devices[%d].pci_bus_id", i);
                return bad(c, field, "same PCI bus id as an earlier device", "a PCI bus id unique on the node");
            }
        }
    }
    /* Node (= NVML) order is PCI bus order, as with NVIDIA's NVML, whatever order the file lists
     * the devices in (defaults derived from the index were assigned above, in file order).
     * Insertion sort: at most SIM_MAX_DEVICES devices, and bus ids are unique. */
    for (int i = 1; i < cfg->ndev; i++) {
        sim_device_cfg d = cfg->dev[i];
        int j = i;
        for (; j > 0 && sim_pci_cmp(&cfg->dev[j - 1], &d) > 0; j--) cfg->dev[j] = cfg->dev[j - 1];
        cfg->dev[j] = d;
    }
    return 0;
}

int sim_pci_cmp(const sim_device_cfg *a, const sim_device_cfg *b) {
    if (a->pci_domain != b->pci_domain) return a->pci_domain < b->pci_domain ? -1 : 1;
    if (a->pci_bus != b->pci_bus) return a->pci_bus < b->pci_bus ? -1 : 1;
    if (a->pci_device != b->pci_device) return a->pci_device < b->pci_device ? -1 : 1;
    return 0;
}

static char *read_file(const char *path, size_t *len, int *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        *err = errno;
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap) break;
        if (cap >= (16u << 20)) { /* a config is small; refuse absurd files */
            free(buf);
            buf = NULL;
            *err = EFBIG;
            break;
        }
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            *err = ENOMEM;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        *err = errno ? errno : EIO;
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = n;
    return buf;
}

int64_t sim_config_mtime_ns(const char *path) {
    struct stat st;
    if (!path[0] || stat(path, &st) != 0) return -1;
    return (int64_t)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec + (int64_t)st.st_size * 7;
}

static int parse_path(const char *path, sim_config *cfg) {
    ctx_t c = {.path = path, .failed = 0};
    size_t len = 0;
    int err = 0;
    char *text = read_file(path, &len, &err);
    if (!text) {
        bad(&c, "(file)", strerror(err), "SIMGPU_CONFIG naming a readable JSON file, or unset for one simulated H100");
        return -1;
    }
    char jerr[160];
    sim_json *root = sim_json_parse(text, len, jerr, sizeof jerr);
    free(text);
    if (!root) {
        char msg[200];
        snprintf(msg, sizeof msg, "invalid JSON at %s", jerr);
        bad(&c, "(document)", msg,
            "a JSON object {\"devices\": [...], \"driver_version\": \"...\", \"cuda_version\": \"12.8\"}");
        return -1;
    }
    int rc = load_doc(&c, root, cfg);
    sim_json_free(root);
    return rc;
}

/* SIMGPU_CUDA_VERSION ("13.0" or 13000): the CUDA version the driver reports, over the file's.
 * 0 when unset; a malformed value prints one line and is ignored. */
static int cuda_version_knob(void) {
    const char *v = getenv("SIMGPU_CUDA_VERSION");
    if (!v || !*v) return 0;
    int maj, min, n;
    char tail;
    if (sscanf(v, "%d.%d%c", &maj, &min, &tail) == 2 && maj >= 2 && maj <= 99 && min >= 0 && min <= 99)
        return maj * 1000 + min * 10;
    if (sscanf(v, "%d%c", &n, &tail) == 1 && n >= 2000 && n <= 99990) return n;
    sim_log("SIMGPU_CUDA_VERSION=%s: allowed: \"major.minor\" such as \"13.0\", or an integer such as 13000; ignored",
            v);
    return 0;
}

int sim_config_load(sim_config *out) {
    sim_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) return -1;
    sim_copy_str(cfg->driver_version, sizeof cfg->driver_version, DEFAULT_DRIVER);
    cfg->cuda_version = DEFAULT_CUDA;
    const char *path = getenv("SIMGPU_CONFIG");
    int rc = 0;
    if (!path || !*path) {
        cfg->ndev = 1;
        default_device(&cfg->dev[0], 0);
        parse_uuid(cfg->dev[0].uuid, cfg->dev[0].uuid_bytes);
    } else {
        sim_copy_str(cfg->path, sizeof cfg->path, path);
        rc = parse_path(path, cfg);
    }
    int knob = cuda_version_knob();
    if (knob) cfg->cuda_version = knob;
    if (rc == 0) *out = *cfg;
    free(cfg);
    return rc;
}

void sim_config_refresh_health(sim_config *cfg, int64_t *mtime_ns) {
    int64_t m = sim_config_mtime_ns(cfg->path);
    if (m < 0 || m == *mtime_ns) return;
    *mtime_ns = m;
    sim_config *fresh = calloc(1, sizeof *fresh);
    if (!fresh) return;
    sim_copy_str(fresh->path, sizeof fresh->path, cfg->path);
    if (parse_path(cfg->path, fresh) == 0) {
        /* Devices are matched by UUID: an index may now describe another device. */
        for (int i = 0; i < cfg->ndev; i++)
            for (int j = 0; j < fresh->ndev; j++)
                if (strcmp(cfg->dev[i].uuid, fresh->dev[j].uuid) == 0) {
                    cfg->dev[i].healthy = fresh->dev[j].healthy;
                    cfg->dev[i].xid = fresh->dev[j].xid;
                }
    }
    free(fresh);
}
