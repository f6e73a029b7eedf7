/*
 * Fat binaries: the container nvcc embeds in a program (and the CUDA libraries hand to
 * cuLibraryLoadData): a 16-byte header (magic 0xba55ed50, version, header size, payload size)
 * followed by entries, each a header (kind 1 PTX / 2 ELF cubin, target SM, flags, sizes) and an
 * image, compressed with LZ4 or Zstandard in the CUDA 12/13 libraries. The layout is described
 * by public reverse-engineering notes (see NOTICE).
 *
 * The simulator needs one thing from a fat binary: the ELF cubin the device would run, to find
 * its module globals (modglobals.c). sim_fatbin_cubin picks the entry for the highest SM not
 * above the device's compute capability and decompresses it with the system's liblz4 /
 * libzstd (loaded on first use; without them a compressed entry has no globals).
 */
#include "fatbin.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FATBIN_MAGIC  0xba55ed50u
#define WRAPPER_MAGIC 0x466243b1u
#define ENTRY_ELF     2
#define FLAG_LZ4      0x2000ull
#define FLAG_ZSTD     0x8000ull

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }

const unsigned char *sim_fatbin_header(const void *image) {
    const unsigned char *p = image;
    if (!p) return NULL;
    if (rd32(p) == WRAPPER_MAGIC) { /* __fatBinC_Wrapper_t: magic, version, data, filename */
        const unsigned char *data;
        memcpy(&data, p + 8, sizeof data);
        p = data;
        if (!p) return NULL;
    }
    return rd32(p) == FATBIN_MAGIC ? p : NULL;
}

size_t sim_fatbin_size(const unsigned char *fb) { return (size_t)(fb[6] | fb[7] << 8) + (size_t)rd64(fb + 8); }

typedef int (*lz4_fn)(const char *src, char *dst, int srcSize, int dstCapacity);
typedef size_t (*zstd_fn)(void *dst, size_t dstCapacity, const void *src, size_t srcSize);
typedef unsigned (*zstd_err_fn)(size_t code);

static lz4_fn lz4;
static zstd_fn zstd;
static zstd_err_fn zstd_err;
static pthread_once_t codecs_once = PTHREAD_ONCE_INIT;

static void load_codecs(void) {
    void *h = dlopen("liblz4.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h) lz4 = (lz4_fn)dlsym(h, "LZ4_decompress_safe");
    h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h) {
        zstd = (zstd_fn)dlsym(h, "ZSTD_decompress");
        zstd_err = (zstd_err_fn)dlsym(h, "ZSTD_isError");
    }
}

static unsigned char *decompress(const unsigned char *src, size_t n, size_t out_n, uint64_t flags) {
    pthread_once(&codecs_once, load_codecs);
    if (out_n == 0 || out_n > (1ull << 31)) return NULL;
    unsigned char *out = malloc(out_n + 1);
    if (!out) return NULL;
    int ok = 0;
    if ((flags & FLAG_LZ4) && lz4 && n < (1ull << 31)) {
        ok = lz4((const char *)src, (char *)out, (int)n, (int)out_n) == (int)out_n;
    } else if ((flags & FLAG_ZSTD) && zstd && zstd_err) {
        size_t r = zstd(out, out_n, src, n);
        ok = !zstd_err(r) && r == out_n;
    }
    if (!ok) {
        free(out);
        return NULL;
    }
    out[out_n] = 0;
    return out;
}

/* Entry header fields (byte offsets). */
#define E_KIND              0
#define E_HEADER_SIZE       4
#define E_PAYLOAD_SIZE      8
#define E_COMPRESSED_SIZE   16
#define E_SM                28
#define E_FLAGS             40
#define E_UNCOMPRESSED_SIZE 56
#define E_MIN_HEADER        64

unsigned char *sim_fatbin_cubin(const void *image, int sm) {
    const unsigned char *fb = sim_fatbin_header(image);
    if (!fb) return NULL;
    size_t hs = (size_t)(fb[6] | fb[7] << 8), total = sim_fatbin_size(fb);
    const unsigned char *best = NULL;
    uint32_t best_sm = 0;
    for (size_t off = hs; off + E_MIN_HEADER <= total;) {
        const unsigned char *e = fb + off;
        uint32_t ehs = rd32(e + E_HEADER_SIZE), psz = rd32(e + E_PAYLOAD_SIZE), esm = rd32(e + E_SM);
        if (ehs < E_MIN_HEADER || (size_t)ehs + psz > total - off) break;
        if ((e[E_KIND] | e[E_KIND + 1] << 8) == ENTRY_ELF && esm <= (uint32_t)sm && (!best || esm > best_sm)) {
            best = e;
            best_sm = esm;
        }
        off += (size_t)ehs + psz;
    }
    if (!best) return NULL;
    const unsigned char *payload = best + rd32(best + E_HEADER_SIZE);
    uint64_t flags = rd64(best + E_FLAGS);
    size_t psz = rd32(best + E_PAYLOAD_SIZE);
    if (flags & (FLAG_LZ4 | FLAG_ZSTD)) {
        size_t csz = rd32(best + E_COMPRESSED_SIZE);
        return decompress(payload, csz && csz <= psz ? csz : psz, (size_t)rd64(best + E_UNCOMPRESSED_SIZE), flags);
    }
    unsigned char *copy = malloc(psz + 1);
    if (copy) {
        memcpy(copy, payload, psz);
        copy[psz] = 0;
    }
    return copy;
}
