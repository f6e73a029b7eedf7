/*
 * The limits file's keys and value forms (vgpu/limits.def): one check for the
 * shim and for the plugin's writer (compiled into the Python binding too), so
 * both refuse the same files.
 */
#include "limitkeys.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu/region.h" /* VGPU_MAX_DEVICES */

enum { LF_BYTES, LF_PERCENT, LF_POLICY, LF_PRIORITY, LF_PATH, LF_SWITCH };
enum { LP_REQUIRED, LP_OPTIONAL, LP_INDEXED, LP_PER_DEVICE };

static const struct limit_key {
    const char *name;
    int form, presence;
} keys[] = {
#define VGPU_LIMIT_KEY(key, form, presence) {#key, LF_##form, LP_##presence},
#include "vgpu/limits.def"
#undef VGPU_LIMIT_KEY
};
#define NKEYS (sizeof keys / sizeof keys[0])

static const char *const forms[] = {
    [LF_BYTES] = "a byte count 0..18446744073709551615",
    [LF_PERCENT] = "a percentage 0-100 (e.g. 30 or 12.5; 0 or 100 = no cap)",
    [LF_POLICY] = "hard, elastic or off",
    [LF_PRIORITY] = "an integer -100..100",
    [LF_PATH] = "an absolute path of at most 4095 bytes",
    [LF_SWITCH] = "0 or 1",
};

static int digits(const char *s, const char *e) {
    if (s == e) return 0;
    for (const char *p = s; p < e; p++)
        if (*p < '0' || *p > '9') return 0;
    return 1;
}

static int valid_bytes(const char *v) {
    size_t n = strlen(v);
    if (!digits(v, v + n) || n > 20 || (n > 1 && v[0] == '0')) return 0;
    return n < 20 || strcmp(v, "18446744073709551615") <= 0;
}

/* sharing/percent.py's grammar: [ \t]*[0-9]+(.[0-9]+)?%?[ \t]*, at most 32
 * digits, <= 100. */
static int valid_percent(const char *v) {
    const char *p = v;
    while (*p == ' ' || *p == '\t') p++;
    const char *start = p;
    while (*p >= '0' && *p <= '9') p++;
    if (p == start) return 0;
    if (*p == '.') {
        const char *frac = ++p;
        while (*p >= '0' && *p <= '9') p++;
        if (p == frac) return 0;
    }
    const char *end = p;
    if (*p == '%') p++;
    while (*p == ' ' || *p == '\t') p++;
    if (*p != '\0' || end - start > 32) return 0;
    char num[40];
    memcpy(num, start, (size_t)(end - start));
    num[end - start] = '\0';
    return strtod(num, NULL) <= 100.0;
}

static int valid_priority(const char *v) {
    const char *d = v + (*v == '-');
    size_t n = strlen(d);
    if (!digits(d, d + n) || n > 3 || (n > 1 && d[0] == '0')) return 0;
    return atoi(d) <= 100;
}

static int valid(int form, const char *v) {
    switch (form) {
    case LF_BYTES: return valid_bytes(v);
    case LF_PERCENT: return valid_percent(v);
    case LF_POLICY: return !strcmp(v, "hard") || !strcmp(v, "elastic") || !strcmp(v, "off");
    case LF_PRIORITY: return valid_priority(v);
    case LF_PATH: return v[0] == '/' && strlen(v) <= 4095;
    case LF_SWITCH: return !strcmp(v, "0") || !strcmp(v, "1");
    }
    return 0;
}

/* The key of "KEY=..." (klen bytes): its table entry and device index (-1 if
 * not indexed). */
static const struct limit_key *find(const char *k, size_t klen, int *index) {
    *index = -1;
    for (size_t i = 0; i < NKEYS; i++) {
        size_t n = strlen(keys[i].name);
        if (keys[i].presence != LP_INDEXED && keys[i].presence != LP_PER_DEVICE) {
            if (n == klen && !memcmp(k, keys[i].name, n)) return &keys[i];
            continue;
        }
        if (klen < n + 2 || memcmp(k, keys[i].name, n) != 0 || k[n] != '_') continue;
        const char *d = k + n + 1, *e = k + klen;
        if (!digits(d, e) || e - d > 2 || (e - d > 1 && d[0] == '0')) continue;
        int x = atoi(d);
        if (x >= VGPU_MAX_DEVICES) continue;
        *index = x;
        return &keys[i];
    }
    return NULL;
}

static void allowed_keys(char *buf, size_t len) {
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < NKEYS; i++) {
        int w = snprintf(buf + n, len - n, "%s%s%s", i ? ", " : "", keys[i].name,
                         keys[i].presence >= LP_INDEXED ? "_<i>" : "");
        if (w < 0 || (size_t)w >= len - n) return;
        n += (size_t)w;
    }
}

static size_t key_index(const char *name) {
    size_t i = 0;
    while (i < NKEYS && strcmp(keys[i].name, name) != 0) i++;
    return i;
}

/* KEY_<d> as a number (its form already checked), 0 when absent. */
static uint64_t number_of(char **entries, const char *key, int d) {
    char name[64];
    int n = snprintf(name, sizeof name, "%s_%d=", key, d);
    for (char **e = entries; n > 0 && *e != NULL; e++)
        if (strncmp(*e, name, (size_t)n) == 0) return strtoull(*e + n, NULL, 10);
    return 0;
}

/* Bursting (docs/policy.md): a device's limit, grant entry and key go together with the pool file;
 * the limit is at least the device's request, which is set; the entry is in the pool's table, its
 * key not a free entry's, and no two devices share an entry. */
static int check_bursts(char **entries, const uint64_t *seen, char *why, size_t len) {
    size_t lim = key_index("VGPU_MEMORY_BURST_LIMIT"), ent = key_index("VGPU_BURST_GRANT"),
           key = key_index("VGPU_BURST_KEY"), pool = key_index("VGPU_BURST_POOL");
    uint64_t any = seen[lim] | seen[ent] | seen[key], entry_of[VGPU_MAX_DEVICES];
    int rc = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES && rc == 0; d++) {
        uint64_t bit = 1ULL << d;
        if (!(any & bit)) continue;
        uint64_t limit = number_of(entries, "VGPU_MEMORY_BURST_LIMIT", d),
                 request = number_of(entries, "CUDA_DEVICE_MEMORY_LIMIT", d);
        entry_of[d] = number_of(entries, "VGPU_BURST_GRANT", d);
        rc = -1;
        if (!(seen[lim] & bit) || !(seen[ent] & bit) || !(seen[key] & bit) || !seen[pool])
            snprintf(why, len,
                     "VGPU_MEMORY_BURST_LIMIT_%d, VGPU_BURST_GRANT_%d, VGPU_BURST_KEY_%d and VGPU_BURST_POOL go "
                     "together",
                     d, d, d);
        else if (request == 0 || limit < request)
            snprintf(why, len,
                     "VGPU_MEMORY_BURST_LIMIT_%d must be at least CUDA_DEVICE_MEMORY_LIMIT_%d (the request), "
                     "which must not be 0",
                     d, d);
        else if (entry_of[d] >= VGPU_POOL_MAX_GRANTS)
            snprintf(why, len, "VGPU_BURST_GRANT_%d must be below %d (the pool's table)", d, VGPU_POOL_MAX_GRANTS);
        else if (number_of(entries, "VGPU_BURST_KEY", d) == 0)
            snprintf(why, len, "VGPU_BURST_KEY_%d must not be 0 (a free entry's)", d);
        else
            rc = 0;
        for (int e = 0; e < d && rc == 0; e++)
            if ((any >> e & 1) && entry_of[e] == entry_of[d]) {
                snprintf(why, len, "VGPU_BURST_GRANT_%d names device %d's entry too", d, e);
                rc = -1;
            }
    }
    return rc;
}

int vgpu_limits_check(char **entries, char *why, size_t len) {
    uint64_t seen[NKEYS] = {0}; /* bit i: device i (indexed keys), bit 0: present (the others) */
    for (char **e = entries; *e != NULL; e++) {
        const char *kv = *e, *eq = strchr(kv, '=');
        for (const char *p = kv; *p; p++) {
            if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) {
                snprintf(why, len, "non-printable or non-ASCII characters in an entry");
                return -1;
            }
        }
        if (eq == NULL || eq == kv) {
            snprintf(why, len, "%.60s: not KEY=VALUE", kv);
            return -1;
        }
        int klen = (int)(eq - kv), index;
        const struct limit_key *k = find(kv, (size_t)klen, &index);
        if (k == NULL) {
            char allowed[512];
            allowed_keys(allowed, sizeof allowed);
            snprintf(why, len, "key %.*s unknown; allowed: %s (i in 0..%d)", klen > 80 ? 80 : klen, kv, allowed,
                     VGPU_MAX_DEVICES - 1);
            return -1;
        }
        uint64_t bit = 1ULL << (index < 0 ? 0 : index);
        uint64_t *s = &seen[k - keys];
        if (*s & bit) {
            snprintf(why, len, "%.*s appears twice", klen, kv);
            return -1;
        }
        *s |= bit;
        if (!valid(k->form, eq + 1)) {
            snprintf(why, len, "%.*s=%.80s invalid; allowed: %s", klen, kv, eq + 1, forms[k->form]);
            return -1;
        }
    }
    const struct limit_key *first = NULL;
    uint64_t devices = 0;
    for (size_t i = 0; i < NKEYS; i++) {
        if (keys[i].presence == LP_REQUIRED && !seen[i]) {
            snprintf(why, len, "%s missing", keys[i].name);
            return -1;
        }
        if (keys[i].presence != LP_INDEXED) continue;
        if (first == NULL) {
            first = &keys[i];
            devices = seen[i];
            if (devices == 0 || (devices & (devices + 1)) != 0) {
                snprintf(why, len,
                         "%s_<i> must name devices 0..n-1 (at least device 0), without "
                         "a gap",
                         keys[i].name);
                return -1;
            }
        } else if (seen[i] != devices) {
            snprintf(why, len, "%s_<i> must name the same devices as %s_<i>", keys[i].name, first->name);
            return -1;
        }
    }
    for (size_t i = 0; first != NULL && i < NKEYS; i++) {
        if (keys[i].presence == LP_PER_DEVICE && (seen[i] & ~devices) != 0) {
            snprintf(why, len, "%s_<i> names a device that %s_<i> does not", keys[i].name, first->name);
            return -1;
        }
    }
    return check_bursts(entries, seen, why, len);
}
