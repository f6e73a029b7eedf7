/*
 * A CUDA program driven by its arguments for the graph-memory and module-globals tests, in the
 * output format of shim_ops.c: one line per operation, "op=<op> rc=<CUresult> [key=value...]".
 *
 *   init                     cuInit, the primary context of device 0, a stream
 *   info | ready | freeall   as in shim_ops.c (ready waits for stdin EOF; freeall does nothing)
 *   route:R                  how the entry points below are reached from now on: direct (linked),
 *                            dlsym (dlopen libcuda.so.1 + dlsym), procaddr (cuGetProcAddress_v2),
 *                            procaddr_ptds (the same with the per-thread default stream flag)
 *   gnew | gnode:N | gfreenode   cuGraphCreate; an alloc node of N bytes on device 0 (its
 *                            address is pushed); a free node of the last address
 *   capbegin | capalloc:N | capfree | capend   stream capture: cuMemAllocAsync of N bytes
 *                            (pushed), cuMemFreeAsync of the last address, end into the graph
 *   inst[:FLAGS] | launch | execdestroy | gdestroy | trim | gattr
 *                            instantiate (cuGraphInstantiateWithFlags), launch + synchronise,
 *                            destroy, cuDeviceGraphMemTrim(0), the graph memory attributes
 *   alloc:N                  cuMemAlloc_v2 (kept)
 *   touch | memfree | freeasync  cuMemsetD8 over the last address; cuMemFree_v2 / cuMemFreeAsync of it (popped)
 *   ctxnew | ctxdestroy      a created context made current / destroyed (the primary one current again)
 *   preset                   cuDevicePrimaryCtxReset_v2(0), then the primary context retained again
 *   modload:PATH | modfile:PATH | fatload:PATH | libload:PATH | libfile:PATH | modunload | libunload
 *                            cuModuleLoadData of a file's bytes, cuModuleLoad, cuModuleLoadFatBinary,
 *                            cuLibraryLoadData, cuLibraryLoadFromFile; unload the last one
 *   global:NAME              cuModuleGetGlobal in the last module
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"

static CUcontext primary, created;
static CUstream stream;
static CUgraph graph;
static CUgraphExec exec_;
static CUdeviceptr ptrs[256];
static size_t sizes[256];
static int nptr;
static CUmodule mods[64];
static int nmod;
static CUlibrary libs[64];
static int nlib;
static char route[32] = "direct";
static void *libcuda;

/* The entry point `name` by the current route. */
static void *fn(const char *name, void *direct) {
    if (!strcmp(route, "direct")) return direct;
    if (!strcmp(route, "dlsym")) {
        if (!libcuda) libcuda = dlopen("libcuda.so.1", RTLD_NOW);
        return libcuda ? dlsym(libcuda, name) : NULL;
    }
    void *p = NULL;
    CUdriverProcAddressQueryResult q;
    cuuint64_t flags = !strcmp(route, "procaddr_ptds") ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    if (cuGetProcAddress_v2(name, &p, 12080, flags, &q) != CUDA_SUCCESS) return NULL;
    return p;
}
#define CALL(name, type) ((type)fn(#name, (void *)&name))

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = calloc(1, (size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    return b;
}

typedef CUresult (*add_alloc_fn)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
typedef CUresult (*add_free_fn)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
typedef CUresult (*inst_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*launch_fn)(CUgraphExec, CUstream);
typedef CUresult (*exec_fn)(CUgraphExec);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*trim_fn)(CUdevice);
typedef CUresult (*load_data_fn)(CUmodule *, const void *);
typedef CUresult (*load_file_fn)(CUmodule *, const char *);
typedef CUresult (*unload_fn)(CUmodule);
typedef CUresult (*lib_load_fn)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int, CUlibraryOption *,
                                void **, unsigned int);
typedef CUresult (*lib_unload_fn)(CUlibrary);
typedef CUresult (*lib_file_fn)(CUlibrary *, const char *, CUjit_option *, void **, unsigned int, CUlibraryOption *,
                                void **, unsigned int);
typedef CUresult (*ctx_destroy_fn)(CUcontext);

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", argv[i]);
        char *arg = strchr(buf, ':');
        if (arg) *arg++ = 0;
        const char *op = buf;
        CUresult rc = CUDA_SUCCESS;
        char extra[256] = "";
        if (!strcmp(op, "init")) {
            CUdevice d;
            rc = cuInit(0);
            if (rc == CUDA_SUCCESS) rc = cuDeviceGet(&d, 0);
            if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxRetain(&primary, d);
            if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(primary);
            if (rc == CUDA_SUCCESS) rc = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
        } else if (!strcmp(op, "info")) {
            size_t fr = 0, t = 0;
            rc = cuMemGetInfo_v2(&fr, &t);
            snprintf(extra, sizeof extra, "free=%zu total=%zu used=%zu", fr, t, t - fr);
        } else if (!strcmp(op, "ready")) {
            printf("ready\n");
            char c;
            while (read(0, &c, 1) > 0) {}
        } else if (!strcmp(op, "freeall")) {
        } else if (!strcmp(op, "route")) {
            snprintf(route, sizeof route, "%s", arg);
        } else if (!strcmp(op, "gnew")) {
            rc = cuGraphCreate(&graph, 0);
        } else if (!strcmp(op, "gnode")) {
            CUDA_MEM_ALLOC_NODE_PARAMS p = {0};
            p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            p.poolProps.location.id = 0;
            p.bytesize = strtoull(arg, NULL, 0);
            CUgraphNode n;
            rc = CALL(cuGraphAddMemAllocNode, add_alloc_fn)(&n, graph, NULL, 0, &p);
            if (rc == CUDA_SUCCESS) {
                sizes[nptr] = p.bytesize;
                ptrs[nptr++] = p.dptr;
            }
        } else if (!strcmp(op, "gfreenode")) {
            CUgraphNode n;
            rc = CALL(cuGraphAddMemFreeNode, add_free_fn)(&n, graph, NULL, 0, ptrs[nptr - 1]);
        } else if (!strcmp(op, "capbegin")) {
            rc = cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
        } else if (!strcmp(op, "capalloc")) {
            CUdeviceptr p;
            size_t n = strtoull(arg, NULL, 0);
            rc = CALL(cuMemAllocAsync, alloc_async_fn)(&p, n, stream);
            if (rc == CUDA_SUCCESS) {
                sizes[nptr] = n;
                ptrs[nptr++] = p;
            }
        } else if (!strcmp(op, "capfree")) {
            rc = CALL(cuMemFreeAsync, free_async_fn)(ptrs[nptr - 1], stream);
        } else if (!strcmp(op, "capend")) {
            rc = cuStreamEndCapture(stream, &graph);
        } else if (!strcmp(op, "inst")) {
            rc = CALL(cuGraphInstantiateWithFlags, inst_fn)(&exec_, graph, arg ? strtoull(arg, NULL, 0) : 0);
        } else if (!strcmp(op, "launch")) {
            rc = CALL(cuGraphLaunch, launch_fn)(exec_, stream);
            if (rc == CUDA_SUCCESS) rc = cuStreamSynchronize(stream);
        } else if (!strcmp(op, "execdestroy")) {
            rc = CALL(cuGraphExecDestroy, exec_fn)(exec_);
        } else if (!strcmp(op, "gdestroy")) {
            rc = cuGraphDestroy(graph);
        } else if (!strcmp(op, "trim")) {
            rc = CALL(cuDeviceGraphMemTrim, trim_fn)(0);
        } else if (!strcmp(op, "gattr")) {
            cuuint64_t u = 0, r = 0;
            rc = cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &u);
            if (rc == CUDA_SUCCESS) rc = cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r);
            snprintf(extra, sizeof extra, "gused=%llu greserved=%llu", (unsigned long long)u, (unsigned long long)r);
        } else if (!strcmp(op, "alloc")) {
            CUdeviceptr p;
            rc = cuMemAlloc_v2(&p, strtoull(arg, NULL, 0));
        } else if (!strcmp(op, "touch")) {
            rc = cuMemsetD8_v2(ptrs[nptr - 1], 0x5a, sizes[nptr - 1]);
        } else if (!strcmp(op, "memfree")) {
            rc = cuMemFree_v2(ptrs[--nptr]);
        } else if (!strcmp(op, "freeasync")) {
            rc = CALL(cuMemFreeAsync, free_async_fn)(ptrs[--nptr], stream);
            if (rc == CUDA_SUCCESS) rc = cuStreamSynchronize(stream);
        } else if (!strcmp(op, "ctxnew")) {
            CUdevice d;
            rc = cuDeviceGet(&d, 0);
            if (rc == CUDA_SUCCESS) rc = cuCtxCreate_v2(&created, 0, d);
        } else if (!strcmp(op, "ctxdestroy")) {
            rc = CALL(cuCtxDestroy_v2, ctx_destroy_fn)(created);
            cuCtxSetCurrent(primary);
        } else if (!strcmp(op, "preset")) {
            CUdevice d;
            rc = cuStreamDestroy_v2(stream);
            if (rc == CUDA_SUCCESS) rc = cuDeviceGet(&d, 0);
            if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxReset_v2(d);
            if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxRetain(&primary, d);
            if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(primary);
            if (rc == CUDA_SUCCESS) rc = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
        } else if (!strcmp(op, "modload")) {
            char *img = read_file(arg);
            rc = img ? CALL(cuModuleLoadData, load_data_fn)(&mods[nmod], img) : CUDA_ERROR_FILE_NOT_FOUND;
            if (rc == CUDA_SUCCESS) nmod++;
            free(img);
        } else if (!strcmp(op, "fatload")) {
            char *img = read_file(arg);
            rc = img ? CALL(cuModuleLoadFatBinary, load_data_fn)(&mods[nmod], img) : CUDA_ERROR_FILE_NOT_FOUND;
            if (rc == CUDA_SUCCESS) nmod++;
            free(img);
        } else if (!strcmp(op, "libfile")) {
            rc = CALL(cuLibraryLoadFromFile, lib_file_fn)(&libs[nlib], arg, NULL, NULL, 0, NULL, NULL, 0);
            if (rc == CUDA_SUCCESS) nlib++;
        } else if (!strcmp(op, "modfile")) {
            rc = CALL(cuModuleLoad, load_file_fn)(&mods[nmod], arg);
            if (rc == CUDA_SUCCESS) nmod++;
        } else if (!strcmp(op, "modunload")) {
            rc = CALL(cuModuleUnload, unload_fn)(mods[--nmod]);
        } else if (!strcmp(op, "libload")) {
            char *img = read_file(arg);
            rc = img ? CALL(cuLibraryLoadData, lib_load_fn)(&libs[nlib], img, NULL, NULL, 0, NULL, NULL, 0)
                     : CUDA_ERROR_FILE_NOT_FOUND;
            if (rc == CUDA_SUCCESS) nlib++;
            free(img);
        } else if (!strcmp(op, "libunload")) {
            rc = CALL(cuLibraryUnload, lib_unload_fn)(libs[--nlib]);
        } else if (!strcmp(op, "global")) {
            CUdeviceptr p = 0;
            size_t n = 0;
            rc = cuModuleGetGlobal_v2(&p, &n, mods[nmod - 1], arg);
            snprintf(extra, sizeof extra, "bytes=%zu", n);
        } else {
            fprintf(stderr, "unknown op %s\n", op);
            return 64;
        }
        printf("op=%s rc=%d%s%s\n", op, (int)rc, extra[0] ? " " : "", extra);
    }
    return 0;
}
