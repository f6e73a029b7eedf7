/*
 * A CUDA program driven by its arguments, one operation each, for the shim's tests. Prints one
 * line per operation: "op=<op> rc=<CUresult> [key=value...]". Objects allocated are kept on a
 * stack; "free" releases the top one with the matching call, "freeall" all of them.
 *
 *   init | ctx[:ORD] | info | total[:ORD] | sync | sleep:MS | ready (print, wait for stdin EOF)
 *   step (print "step", wait for one line on stdin: the test changes something in between)
 *   alloc:N | alloc1:N | pitch:W:H | managed:N | create:N[:ORD] | async:N | pool:N | newpool:N
 *   release[:ORD] | reset[:ORD] (cuDevicePrimaryCtxRelease_v2 / cuDevicePrimaryCtxReset_v2)
 *   array:W:H | array3d:W:H:D | mipmap:W:H:LEVELS | ctxcreate[:ORD] | fill:N (allocate N-byte
 *   chunks until refused: count=...) | free | freeall | freeasync (top async object, no sync) | swap
 *   freesync (cuMemFree_v2 of the top object, e.g. a stream-ordered one) | mapunmap:N (top handle)
 *   retainrelease:N         map the top handle (N bytes), cuMemRetainAllocationHandle of the mapped
 *                           address (same=1 if it is that handle), unmap, cuMemRelease of that extra
 *                           reference: the handle stays on the stack
 *   map:N                   map the topmost handle on the stack (N bytes at offset 0) into an address range
 *                           of its own, read-write: pushed as a mapping, which "free" unmaps (and frees
 *                           its range)
 *   twomaps:N               two handles of N bytes mapped side by side into one range of 2N, then
 *                           released: the range is pushed as one mapping, which "free" unmaps in one call
 *   relh                    cuMemRelease of the topmost handle on the stack, taken off it (mappings stay)
 *   retain                  cuMemRetainAllocationHandle of the top mapping's address: the handle is pushed
 *                           (same=1 if it is the handle that mapping maps)
 *   leak:N:COUNT            up to COUNT times: cuMemCreate(N), map it, cuMemRelease, never unmap (ok=..
 *                           how many were created; rc is the first failure's)
 *   screate:N               cuMemCreate(N) on device 0, shareable as a POSIX file descriptor
 *   sendh:PATH              export the topmost handle (a descriptor), listen on the unix socket PATH,
 *                           send it to the first process that connects (SCM_RIGHTS)
 *   recvh:PATH              connect to PATH (waits for it), receive a descriptor, import it: pushed as
 *                           a handle
 *   share:N:COUNT:PATH      up to COUNT times: screate(N), map it, export it and send the descriptor
 *                           over one connection accepted on PATH, wait for the peer's answer (its
 *                           import and map, "take"), then release and unmap here (ok=.. how many the
 *                           peer took; rc: the first failure, here or the peer's)
 *   take:N:PATH             connect to PATH; for each descriptor received: import it, map N bytes of
 *                           it (kept, with the handle), answer the CUresult; until the peer closes
 *                           (ok=.. how many were mapped; rc: the first failure)
 *   vmmodd                  odd VMM calls, each rc printed (unmap=.. of a range never mapped, release2=..
 *                           a second release, map0=.. a handle that is no handle, retain0=.. an address
 *                           no mapping holds, afree=.. a range never reserved, unmapnull=.. size 0)
 *   rtctx[:ORD]             the primary context as NVIDIA's runtime retains it: slot 2 of the private
 *                           table cuGetExportTable answers for 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9,
 *                           made current (slots=.. the table's size slot / pointer size)
 *   threshold:V             the default pool's release threshold (V bytes, or "max" = UINT64_MAX)
 *   deferred:W:H:LEVELS     a CUDA_ARRAY3D_DEFERRED_MAPPING float4 array (LEVELS 0) or mipmapped
 *                           array: its requirements (size=.. alignment=..), then destroyed;
 *                           plainrc=.. is cuArrayGetMemoryRequirements of an ordinary array
 *   dlsym:NAME:N            dlopen("libcuda.so.1") + dlsym(NAME), call it as an allocation of N
 *   procaddr:BASE:VER:FL:N:SYM  cuGetProcAddress_v2(BASE, VER, FL), call it as SYM allocating N
 *   dlsym_is:NAME           same=1 if dlsym(libcuda, NAME) == dlsym(RTLD_DEFAULT, NAME), real=1 if
 *                           it is libcuda's own definition
 *   procaddr_is:BASE:VER:FL:SYM   the same for cuGetProcAddress_v2's answer against symbol SYM,
 *                           judged on the function an internal entry point jumps to; internal=1
 *                           if the answer was such an entry point (the driver's, passed through)
 *   stress:THREADS:ITERS:MAX      random cuMemAlloc_v2/cuMemFree_v2 of 1..MAX bytes per thread
 *                                 (ok=.. oom=.. other=..)
 *   storm:THREADS:MAX       the same until stdin closes (prints "storming" once the threads run)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "entry_target.h"
#include "vgpu/cuda_api.h"

/* not in the shim's API header (the shim does not hook it) */
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType, unsigned long long flags);

enum { K_PTR, K_PTR1, K_HANDLE, K_ASYNC, K_ARRAY, K_MIPMAP, K_CTX, K_POOL, K_MAP };
struct obj {
    int kind;
    unsigned long long h;
    size_t size;              /* K_MAP: the mapping's size (h its address) */
    unsigned long long whose; /* K_MAP: the handle it maps */
};
static struct obj stack[1 << 16];
static int top;
static CUcontext ctx;
static CUstream stream;

static void push(int kind, unsigned long long h) {
    if (top < (int)(sizeof stack / sizeof stack[0])) stack[top++] = (struct obj){kind, h, 0, 0};
}

static CUresult release(struct obj o) {
    switch (o.kind) {
    case K_PTR: return cuMemFree_v2((CUdeviceptr)o.h);
    case K_PTR1: return cuMemFree((CUdeviceptr_v1)o.h);
    case K_HANDLE: return cuMemRelease((CUmemGenericAllocationHandle)o.h);
    case K_ASYNC: {
        CUresult rc = cuMemFreeAsync((CUdeviceptr)o.h, stream);
        if (rc == CUDA_SUCCESS) rc = cuStreamSynchronize(stream);
        return rc;
    }
    case K_ARRAY: return cuArrayDestroy((CUarray)(uintptr_t)o.h);
    case K_MIPMAP: return cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)o.h);
    case K_CTX: return cuCtxDestroy_v2((CUcontext)(uintptr_t)o.h);
    case K_POOL: return cuMemPoolDestroy((CUmemoryPool)(uintptr_t)o.h);
    case K_MAP: {
        CUresult rc = cuMemUnmap((CUdeviceptr)o.h, o.size);
        CUresult frc = cuMemAddressFree((CUdeviceptr)o.h, o.size);
        return rc != CUDA_SUCCESS ? rc : frc;
    }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*alloc1_fn)(CUdeviceptr_v1 *, unsigned int);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*pitch1_fn)(CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int);
typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);

/* Call an allocation entry point obtained by name, with the signature of the symbol `name`
 * (the exact versioned symbol the route was expected to answer with). */
static CUresult call_alloc(const char *name, void *fn, size_t n) {
    if (fn == NULL) return CUDA_ERROR_NOT_FOUND;
    CUresult rc;
    if (!strcmp(name, "cuMemAlloc")) {
        CUdeviceptr_v1 p;
        if ((rc = ((alloc1_fn)fn)(&p, (unsigned)n)) == CUDA_SUCCESS) push(K_PTR1, p);
    } else if (!strcmp(name, "cuMemAllocManaged")) {
        CUdeviceptr p;
        if ((rc = ((managed_fn)fn)(&p, n, CU_MEM_ATTACH_GLOBAL)) == CUDA_SUCCESS) push(K_PTR, p);
    } else if (!strcmp(name, "cuMemAllocPitch_v2")) {
        CUdeviceptr p;
        size_t pitch;
        if ((rc = ((pitch_fn)fn)(&p, &pitch, 1024, n / 1024, 4)) == CUDA_SUCCESS) push(K_PTR, p);
    } else if (!strcmp(name, "cuMemAllocPitch")) {
        CUdeviceptr_v1 p;
        unsigned pitch;
        if ((rc = ((pitch1_fn)fn)(&p, &pitch, 1024, (unsigned)(n / 1024), 4)) == CUDA_SUCCESS) push(K_PTR1, p);
    } else if (!strcmp(name, "cuMemAllocAsync") || !strcmp(name, "cuMemAllocAsync_ptsz")) {
        CUdeviceptr p;
        if ((rc = ((async_fn)fn)(&p, n, stream)) == CUDA_SUCCESS) push(K_ASYNC, p);
    } else {
        CUdeviceptr p;
        if ((rc = ((alloc_fn)fn)(&p, n)) == CUDA_SUCCESS) push(K_PTR, p);
    }
    return rc;
}

struct stress {
    long iters;
    size_t max;
    unsigned seed;
    long ok, oom, other;
};

static int storm_stop; /* storm: set when stdin closes */

static void *stress_thread(void *p) {
    struct stress *s = p;
    cuCtxSetCurrent(ctx);
    CUdeviceptr held[64];
    int n = 0;
    for (long i = 0; s->iters < 0 ? !__atomic_load_n(&storm_stop, __ATOMIC_RELAXED) : i < s->iters; i++) {
        if (n < 64 && (n == 0 || rand_r(&s->seed) % 3 != 0)) {
            size_t b = 1 + (size_t)rand_r(&s->seed) % s->max;
            CUresult rc = cuMemAlloc_v2(&held[n], b);
            if (rc == CUDA_SUCCESS) {
                n++;
                s->ok++;
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                s->oom++;
                if (n > 0 && cuMemFree_v2(held[--n]) != CUDA_SUCCESS) s->other++;
            } else {
                s->other++;
            }
        } else if (cuMemFree_v2(held[--n]) != CUDA_SUCCESS) {
            s->other++;
        }
    }
    while (n > 0)
        if (cuMemFree_v2(held[--n]) != CUDA_SUCCESS) s->other++;
    return NULL;
}

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

/* Reserve an address range of `size`, map `h` there read-write: its address, or 0 (*rc says why). */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size, CUresult *rc) {
    CUdeviceptr va = 0;
    CUdevice d = 0;
    cuCtxGetDevice(&d);
    CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, d}, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    *rc = cuMemAddressReserve(&va, size, 0, 0, 0);
    if (*rc == CUDA_SUCCESS) *rc = cuMemMap(va, size, 0, h, 0);
    if (*rc == CUDA_SUCCESS) *rc = cuMemSetAccess(va, size, &acc, 1);
    if (*rc != CUDA_SUCCESS && va) {
        cuMemUnmap(va, size);
        cuMemAddressFree(va, size);
        va = 0;
    }
    return va;
}

/* A unix socket at path: listening and accepting one connection (listen=1), or connected to it
 * (waits up to 20 s for it to appear). The connection, or -1. */
static int unix_conn(const char *path, int listen_side) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), c = -1;
    if (s < 0 || strlen(path) >= sizeof a.sun_path) goto out;
    strcpy(a.sun_path, path);
    if (listen_side) {
        if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 && listen(s, 1) == 0)
            c = accept4(s, NULL, NULL, SOCK_CLOEXEC);
    } else {
        for (int k = 0; k < 2000 && c < 0; k++) {
            if (connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
                c = s;
                s = -1;
            } else {
                usleep(10000);
            }
        }
    }
out:
    if (s >= 0) close(s);
    return c;
}

/* Send fd over the connection (SCM_RIGHTS), with one byte: 0, or -1. */
static int send_fd(int conn, int fd) {
    char byte = 'h', cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(conn, &m, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

/* A descriptor received over the connection, or -1 (closed, or none came). */
static int recv_fd(int conn) {
    char byte, cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    int fd = -1;
    if (recvmsg(conn, &m, MSG_CMSG_CLOEXEC) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* Export h as a descriptor: it, or -1 (*rc says why). */
static int export_fd(CUmemGenericAllocationHandle h, CUresult *rc) {
    int fd = -1;
    *rc = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    return *rc == CUDA_SUCCESS ? fd : -1;
}

static CUmemAllocationProp device_prop(int ordinal) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    return prop;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    void *libcuda = NULL;
    for (int i = 1; i < argc; i++) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", argv[i]);
        char *f[8] = {0};
        int nf = 0;
        for (char *tok = strtok(buf, ":"); tok && nf < 8; tok = strtok(NULL, ":")) f[nf++] = tok;
        const char *op = f[0];
        CUresult rc = CUDA_SUCCESS;
        char extra[256] = "";
        if (!strcmp(op, "init")) {
            rc = cuInit(0);
        } else if (!strcmp(op, "ctx")) {
            CUdevice d;
            rc = cuDeviceGet(&d, nf > 1 ? atoi(f[1]) : 0);
            if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxRetain(&ctx, d);
            if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(ctx);
            if (rc == CUDA_SUCCESS) rc = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
        } else if (!strcmp(op, "ctxcreate")) {
            CUdevice d;
            CUcontext c;
            rc = cuDeviceGet(&d, nf > 1 ? atoi(f[1]) : 0);
            if (rc == CUDA_SUCCESS) rc = cuCtxCreate_v2(&c, 0, d);
            if (rc == CUDA_SUCCESS) {
                push(K_CTX, (uintptr_t)c);
                cuCtxSetCurrent(ctx);
            }
        } else if (!strcmp(op, "release") || !strcmp(op, "reset")) { /* the primary context */
            CUdevice d;
            rc = cuDeviceGet(&d, nf > 1 ? atoi(f[1]) : 0);
            if (rc == CUDA_SUCCESS)
                rc = !strcmp(op, "release") ? cuDevicePrimaryCtxRelease_v2(d) : cuDevicePrimaryCtxReset_v2(d);
        } else if (!strcmp(op, "info")) {
            size_t fr = 0, t = 0;
            rc = cuMemGetInfo_v2(&fr, &t);
            snprintf(extra, sizeof extra, "free=%zu total=%zu used=%zu", fr, t, t - fr);
        } else if (!strcmp(op, "total")) {
            CUdevice d;
            size_t t = 0;
            rc = cuDeviceGet(&d, nf > 1 ? atoi(f[1]) : 0);
            if (rc == CUDA_SUCCESS) rc = cuDeviceTotalMem_v2(&t, d);
            snprintf(extra, sizeof extra, "total=%zu", t);
        } else if (!strcmp(op, "sync")) {
            rc = cuCtxSynchronize();
        } else if (!strcmp(op, "sleep")) {
            usleep((useconds_t)num(f[1]) * 1000);
        } else if (!strcmp(op, "ready")) {
            printf("ready\n");
            char c;
            while (read(0, &c, 1) > 0) {}
        } else if (!strcmp(op, "step")) {
            printf("step\n");
            fflush(stdout);
            char line[64];
            if (fgets(line, sizeof line, stdin) == NULL) rc = CUDA_ERROR_UNKNOWN;
        } else if (!strcmp(op, "alloc")) {
            CUdeviceptr p;
            rc = cuMemAlloc_v2(&p, num(f[1]));
            if (rc == CUDA_SUCCESS) push(K_PTR, p);
        } else if (!strcmp(op, "alloc1")) {
            CUdeviceptr_v1 p;
            rc = cuMemAlloc(&p, (unsigned)num(f[1]));
            if (rc == CUDA_SUCCESS) push(K_PTR1, p);
        } else if (!strcmp(op, "pitch")) {
            CUdeviceptr p;
            size_t pitch = 0;
            rc = cuMemAllocPitch_v2(&p, &pitch, num(f[1]), num(f[2]), 4);
            if (rc == CUDA_SUCCESS) push(K_PTR, p);
            snprintf(extra, sizeof extra, "pitch=%zu", pitch);
        } else if (!strcmp(op, "managed")) {
            CUdeviceptr p;
            rc = cuMemAllocManaged(&p, num(f[1]), CU_MEM_ATTACH_GLOBAL);
            if (rc == CUDA_SUCCESS) push(K_PTR, p);
        } else if (!strcmp(op, "create")) {
            CUmemAllocationProp prop = device_prop(nf > 2 ? atoi(f[2]) : 0);
            CUmemGenericAllocationHandle h;
            rc = cuMemCreate(&h, num(f[1]), &prop, 0);
            if (rc == CUDA_SUCCESS) push(K_HANDLE, h);
        } else if (!strcmp(op, "async")) {
            CUdeviceptr p;
            rc = cuMemAllocAsync(&p, num(f[1]), stream);
            if (rc == CUDA_SUCCESS) push(K_ASYNC, p);
        } else if (!strcmp(op, "pool") || !strcmp(op, "newpool")) {
            CUmemoryPool pool = NULL;
            CUdevice d;
            cuCtxGetDevice(&d);
            if (!strcmp(op, "pool")) {
                rc = cuDeviceGetDefaultMemPool(&pool, d);
            } else {
                CUmemPoolProps props;
                memset(&props, 0, sizeof props);
                props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
                props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                props.location.id = d;
                rc = cuMemPoolCreate(&pool, &props);
                if (rc == CUDA_SUCCESS) push(K_POOL, (uintptr_t)pool);
            }
            if (rc == CUDA_SUCCESS) {
                CUdeviceptr p;
                rc = cuMemAllocFromPoolAsync(&p, num(f[1]), pool, stream);
                if (rc == CUDA_SUCCESS) push(K_ASYNC, p);
            }
        } else if (!strcmp(op, "array") || !strcmp(op, "array3d") || !strcmp(op, "mipmap")) {
            if (!strcmp(op, "array")) {
                CUDA_ARRAY_DESCRIPTOR d = {num(f[1]), num(f[2]), CU_AD_FORMAT_FLOAT, 4};
                CUarray a;
                rc = cuArrayCreate_v2(&a, &d);
                if (rc == CUDA_SUCCESS) push(K_ARRAY, (uintptr_t)a);
            } else {
                CUDA_ARRAY3D_DESCRIPTOR d = {num(f[1]),          num(f[2]), !strcmp(op, "array3d") ? num(f[3]) : 0,
                                             CU_AD_FORMAT_FLOAT, 4,         0};
                if (!strcmp(op, "array3d")) {
                    CUarray a;
                    rc = cuArray3DCreate_v2(&a, &d);
                    if (rc == CUDA_SUCCESS) push(K_ARRAY, (uintptr_t)a);
                } else {
                    CUmipmappedArray m;
                    rc = cuMipmappedArrayCreate(&m, &d, (unsigned)num(f[3]));
                    if (rc == CUDA_SUCCESS) push(K_MIPMAP, (uintptr_t)m);
                }
            }
        } else if (!strcmp(op, "fill")) {
            long count = 0;
            CUdeviceptr p;
            while ((rc = cuMemAlloc_v2(&p, num(f[1]))) == CUDA_SUCCESS) {
                push(K_PTR, p);
                count++;
            }
            snprintf(extra, sizeof extra, "count=%ld", count);
        } else if (!strcmp(op, "free")) {
            rc = top > 0 ? release(stack[--top]) : CUDA_ERROR_INVALID_VALUE;
        } else if (!strcmp(op, "nulls")) { /* NULL output pointers: the driver's error, never a crash */
            CUdevice d = 0;
            size_t fr;
            int bad = 0;
            bad += cuMemGetInfo_v2(NULL, NULL) == CUDA_SUCCESS;
            bad += cuMemGetInfo_v2(&fr, NULL) == CUDA_SUCCESS;
            bad += cuMemAlloc_v2(NULL, 1024) == CUDA_SUCCESS;
            bad += cuMemAllocPitch_v2(NULL, NULL, 1024, 4, 4) == CUDA_SUCCESS;
            bad += cuMemAllocManaged(NULL, 1024, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS;
            bad += cuDeviceTotalMem_v2(NULL, d) == CUDA_SUCCESS;
            bad += cuMemCreate(NULL, 2 << 20, NULL, 0) == CUDA_SUCCESS;
            bad += cuArrayCreate_v2(NULL, NULL) == CUDA_SUCCESS;
            bad += cuArray3DCreate_v2(NULL, NULL) == CUDA_SUCCESS;
            bad += cuMipmappedArrayCreate(NULL, NULL, 1) == CUDA_SUCCESS;
            bad += cuMemAllocAsync(NULL, 1024, stream) == CUDA_SUCCESS;
            bad += cuMemAllocFromPoolAsync(NULL, 1024, NULL, stream) == CUDA_SUCCESS;
            bad += cuMemPoolCreate(NULL, NULL) == CUDA_SUCCESS;
            bad += cuDevicePrimaryCtxRetain(NULL, d) == CUDA_SUCCESS;
            bad += cuCtxCreate_v2(NULL, 0, d) == CUDA_SUCCESS;
            bad += cuGetProcAddress_v2("cuMemAlloc", NULL, 12000, 0, NULL) == CUDA_SUCCESS;
            snprintf(extra, sizeof extra, "accepted=%d", bad);
        } else if (!strcmp(op, "fork")) { /* a child that outlives us a little, touching no CUDA */
            pid_t pid = fork();
            if (pid == 0) { /* let go of the test's pipes: only the region descriptor is inherited */
                close(0);
                close(1);
                close(2);
                usleep(3000 * 1000);
                _exit(0);
            }
            snprintf(extra, sizeof extra, "child=%d", (int)pid);
        } else if (!strcmp(op, "freesync")) { /* cuMemFree_v2 of the top object, whatever allocated it */
            rc = top > 0 ? cuMemFree_v2((CUdeviceptr)stack[--top].h) : CUDA_ERROR_INVALID_VALUE;
        } else if (!strcmp(op, "mapunmap")) { /* map the top cuMemCreate handle, then unmap it */
            CUdeviceptr va = 0;
            size_t size = num(f[1]);
            rc = top > 0 && stack[top - 1].kind == K_HANDLE ? cuMemAddressReserve(&va, size, 0, 0, 0)
                                                            : CUDA_ERROR_INVALID_VALUE;
            if (rc == CUDA_SUCCESS) rc = cuMemMap(va, size, 0, (CUmemGenericAllocationHandle)stack[top - 1].h, 0);
            if (rc == CUDA_SUCCESS) rc = cuMemUnmap(va, size);
            if (va) cuMemAddressFree(va, size);
        } else if (!strcmp(op, "retainrelease")) {
            CUdeviceptr va = 0;
            size_t size = num(f[1]);
            CUmemGenericAllocationHandle h = 0, again = 0;
            rc = top > 0 && stack[top - 1].kind == K_HANDLE ? cuMemAddressReserve(&va, size, 0, 0, 0)
                                                            : CUDA_ERROR_INVALID_VALUE;
            if (rc == CUDA_SUCCESS) h = (CUmemGenericAllocationHandle)stack[top - 1].h;
            if (rc == CUDA_SUCCESS) rc = cuMemMap(va, size, 0, h, 0);
            if (rc == CUDA_SUCCESS) {
                rc = cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)va);
                cuMemUnmap(va, size);
            }
            if (va) cuMemAddressFree(va, size);
            if (rc == CUDA_SUCCESS) rc = cuMemRelease(again);
            snprintf(extra, sizeof extra, "same=%d", again == h);
        } else if (!strcmp(op, "map")) {
            int i = top - 1;
            while (i >= 0 && stack[i].kind != K_HANDLE) i--;
            size_t size = num(f[1]);
            rc = CUDA_ERROR_INVALID_VALUE;
            CUdeviceptr va = i >= 0 ? map_rw((CUmemGenericAllocationHandle)stack[i].h, size, &rc) : 0;
            if (va && top < (int)(sizeof stack / sizeof stack[0]))
                stack[top++] = (struct obj){K_MAP, va, size, stack[i].h};
        } else if (!strcmp(op, "twomaps")) {
            CUmemAllocationProp prop = device_prop(0);
            size_t size = num(f[1]);
            CUmemGenericAllocationHandle h[2] = {0, 0};
            CUdeviceptr va = 0;
            rc = cuMemAddressReserve(&va, 2 * size, 0, 0, 0);
            for (int k = 0; k < 2 && rc == CUDA_SUCCESS; k++) {
                rc = cuMemCreate(&h[k], size, &prop, 0);
                if (rc == CUDA_SUCCESS) rc = cuMemMap(va + k * size, size, 0, h[k], 0);
            }
            for (int k = 0; k < 2; k++)
                if (h[k]) cuMemRelease(h[k]); /* the mappings hold the memory */
            if (rc == CUDA_SUCCESS && top < (int)(sizeof stack / sizeof stack[0]))
                stack[top++] = (struct obj){K_MAP, va, 2 * size, h[0]};
        } else if (!strcmp(op, "relh")) {
            int i = top - 1;
            while (i >= 0 && stack[i].kind != K_HANDLE) i--;
            rc = i >= 0 ? cuMemRelease((CUmemGenericAllocationHandle)stack[i].h) : CUDA_ERROR_INVALID_VALUE;
            if (rc == CUDA_SUCCESS) {
                memmove(&stack[i], &stack[i + 1], (size_t)(top - i - 1) * sizeof stack[0]);
                top--;
            }
        } else if (!strcmp(op, "retain")) {
            CUmemGenericAllocationHandle h = 0;
            struct obj m = top > 0 ? stack[top - 1] : (struct obj){K_PTR, 0, 0, 0};
            rc = m.kind == K_MAP ? cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(m.h + m.size / 2))
                                 : CUDA_ERROR_INVALID_VALUE;
            if (rc == CUDA_SUCCESS) push(K_HANDLE, h);
            snprintf(extra, sizeof extra, "same=%d", rc == CUDA_SUCCESS && h == m.whose);
        } else if (!strcmp(op, "leak")) {
            CUmemAllocationProp prop = device_prop(0);
            size_t size = num(f[1]);
            long ok = 0, count = (long)num(f[2]);
            while (ok < count) {
                CUmemGenericAllocationHandle h;
                if ((rc = cuMemCreate(&h, size, &prop, 0)) != CUDA_SUCCESS) break;
                ok++;
                CUdeviceptr va = map_rw(h, size, &rc);
                CUresult rrc = cuMemRelease(h); /* the mapping keeps the memory */
                if (rc == CUDA_SUCCESS) rc = rrc;
                if (rc != CUDA_SUCCESS || va == 0) break;
            }
            snprintf(extra, sizeof extra, "ok=%ld", ok);
        } else if (!strcmp(op, "screate")) {
            CUmemAllocationProp prop = device_prop(0);
            prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            CUmemGenericAllocationHandle h;
            rc = cuMemCreate(&h, num(f[1]), &prop, 0);
            if (rc == CUDA_SUCCESS) push(K_HANDLE, h);
        } else if (!strcmp(op, "sendh")) {
            int i = top - 1;
            while (i >= 0 && stack[i].kind != K_HANDLE) i--;
            rc = CUDA_ERROR_INVALID_VALUE;
            int fd = i >= 0 ? export_fd((CUmemGenericAllocationHandle)stack[i].h, &rc) : -1;
            int conn = fd >= 0 ? unix_conn(f[1], 1) : -1;
            if (fd >= 0 && (conn < 0 || send_fd(conn, fd) != 0)) rc = CUDA_ERROR_OPERATING_SYSTEM;
            if (conn >= 0) close(conn);
            if (fd >= 0) close(fd);
        } else if (!strcmp(op, "recvh")) {
            int conn = unix_conn(f[1], 0), fd = conn >= 0 ? recv_fd(conn) : -1;
            CUmemGenericAllocationHandle h;
            rc = fd < 0 ? CUDA_ERROR_OPERATING_SYSTEM
                        : cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            if (rc == CUDA_SUCCESS) push(K_HANDLE, h);
            if (fd >= 0) close(fd);
            if (conn >= 0) close(conn);
        } else if (!strcmp(op, "share")) {
            CUmemAllocationProp prop = device_prop(0);
            prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            size_t size = num(f[1]);
            long ok = 0, count = (long)num(f[2]);
            int conn = unix_conn(f[3], 1);
            rc = conn < 0 ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS;
            while (rc == CUDA_SUCCESS && ok < count) {
                CUmemGenericAllocationHandle h;
                if ((rc = cuMemCreate(&h, size, &prop, 0)) != CUDA_SUCCESS) break;
                CUdeviceptr va = map_rw(h, size, &rc);
                int fd = va ? export_fd(h, &rc) : -1, answer = CUDA_ERROR_OPERATING_SYSTEM;
                if (fd >= 0 && (send_fd(conn, fd) != 0 || read(conn, &answer, sizeof answer) != sizeof answer))
                    answer = CUDA_ERROR_OPERATING_SYSTEM;
                if (fd >= 0) rc = (CUresult)answer; /* the peer's import and map */
                if (fd >= 0) close(fd);
                CUresult rrc = cuMemRelease(h); /* the creator lets go: the peer holds it now */
                if (va) {
                    CUresult urc = cuMemUnmap(va, size);
                    if (rrc == CUDA_SUCCESS) rrc = urc;
                    cuMemAddressFree(va, size);
                }
                if (rc == CUDA_SUCCESS) rc = rrc;
                if (rc == CUDA_SUCCESS) ok++;
            }
            if (conn >= 0) close(conn);
            snprintf(extra, sizeof extra, "ok=%ld", ok);
        } else if (!strcmp(op, "take")) {
            size_t size = num(f[1]);
            long ok = 0;
            int conn = unix_conn(f[2], 0), fd;
            CUresult first = conn < 0 ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS;
            while (conn >= 0 && (fd = recv_fd(conn)) >= 0) {
                CUmemGenericAllocationHandle h;
                CUresult r =
                    cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
                close(fd);
                CUdeviceptr va = 0;
                if (r == CUDA_SUCCESS) {
                    va = map_rw(h, size, &r);
                    if (va) {
                        push(K_HANDLE, h);
                        if (top < (int)(sizeof stack / sizeof stack[0]))
                            stack[top++] = (struct obj){K_MAP, va, size, h};
                        ok++;
                    } else {
                        cuMemRelease(h);
                    }
                }
                if (first == CUDA_SUCCESS) first = r;
                int answer = (int)r;
                if (write(conn, &answer, sizeof answer) != sizeof answer) break;
            }
            if (conn >= 0) close(conn);
            rc = first;
            snprintf(extra, sizeof extra, "ok=%ld", ok);
        } else if (!strcmp(op, "vmmodd")) {
            CUmemAllocationProp prop = device_prop(0);
            size_t gran = 0;
            CUdeviceptr va = 0;
            CUmemGenericAllocationHandle h = 0, r = 0;
            rc = cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
            if (rc == CUDA_SUCCESS) rc = cuMemAddressReserve(&va, 2 * gran, 0, 0, 0);
            if (rc == CUDA_SUCCESS) rc = cuMemCreate(&h, gran, &prop, 0);
            if (rc == CUDA_SUCCESS) {
                CUresult unmap = cuMemUnmap(va, gran);
                CUresult unmapnull = cuMemUnmap(va, 0);
                CUresult map0 = cuMemMap(va, gran, 0, (CUmemGenericAllocationHandle)0x7777777, 0);
                CUresult retain0 = cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + gran));
                CUresult afree = cuMemAddressFree(va + gran, gran);
                CUresult release1 = cuMemRelease(h);
                CUresult release2 = cuMemRelease(h);
                rc = cuMemAddressFree(va, 2 * gran);
                snprintf(extra, sizeof extra,
                         "unmap=%d unmapnull=%d map0=%d retain0=%d afree=%d release1=%d release2=%d", (int)unmap,
                         (int)unmapnull, (int)map0, (int)retain0, (int)afree, (int)release1, (int)release2);
            }
        } else if (!strcmp(op, "rtctx")) {
            static const unsigned char id[16] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                                 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9};
            CUuuid rt;
            memcpy(rt.bytes, id, sizeof id);
            const void *table = NULL;
            CUdevice d;
            rc = cuDeviceGet(&d, nf > 1 ? atoi(f[1]) : 0);
            if (rc == CUDA_SUCCESS) rc = cuGetExportTable(&table, &rt);
            if (rc == CUDA_SUCCESS) {
                const void *const *t = table;
                CUresult (*retain)(CUcontext *, CUdevice) = (CUresult (*)(CUcontext *, CUdevice))(uintptr_t)t[2];
                snprintf(extra, sizeof extra, "slots=%zu", (size_t)(uintptr_t)t[0] / sizeof(void *));
                rc = retain(&ctx, d);
            }
            if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(ctx);
            if (rc == CUDA_SUCCESS && stream == NULL) rc = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
        } else if (!strcmp(op, "threshold")) {
            CUmemoryPool pool = NULL;
            CUdevice d;
            cuCtxGetDevice(&d);
            cuuint64_t v = !strcmp(f[1], "max") ? UINT64_MAX : (cuuint64_t)num(f[1]);
            rc = cuDeviceGetDefaultMemPool(&pool, d);
            if (rc == CUDA_SUCCESS) rc = cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v);
        } else if (!strcmp(op, "deferred")) {
            CUDA_ARRAY3D_DESCRIPTOR d = {num(f[1]), num(f[2]), 0, CU_AD_FORMAT_FLOAT, 4, CUDA_ARRAY3D_DEFERRED_MAPPING};
            CUDA_ARRAY_MEMORY_REQUIREMENTS req = {0};
            CUdevice dev;
            cuCtxGetDevice(&dev);
            unsigned levels = (unsigned)num(f[3]);
            if (levels == 0) {
                CUarray a = NULL;
                rc = cuArray3DCreate_v2(&a, &d);
                if (rc == CUDA_SUCCESS) rc = cuArrayGetMemoryRequirements(&req, a, dev);
                if (a) cuArrayDestroy(a);
            } else {
                CUmipmappedArray m = NULL;
                rc = cuMipmappedArrayCreate(&m, &d, levels);
                if (rc == CUDA_SUCCESS) rc = cuMipmappedArrayGetMemoryRequirements(&req, m, dev);
                if (m) cuMipmappedArrayDestroy(m);
            }
            CUDA_ARRAY_MEMORY_REQUIREMENTS plain_req;
            CUDA_ARRAY_DESCRIPTOR pd = {num(f[1]), num(f[2]), CU_AD_FORMAT_FLOAT, 4};
            CUarray plain;
            CUresult prc = cuArrayCreate_v2(&plain, &pd);
            if (prc == CUDA_SUCCESS) {
                prc = cuArrayGetMemoryRequirements(&plain_req, plain, dev);
                cuArrayDestroy(plain);
            }
            snprintf(extra, sizeof extra, "size=%zu alignment=%zu plainrc=%d", req.size, req.alignment, (int)prc);
        } else if (!strcmp(op, "swap")) { /* swap the top two objects (free a pool before its block) */
            if (top >= 2) {
                struct obj t = stack[top - 1];
                stack[top - 1] = stack[top - 2];
                stack[top - 2] = t;
            }
        } else if (!strcmp(op, "freeasync")) { /* cuMemFreeAsync of the top object, no synchronisation */
            rc = top > 0 && stack[top - 1].kind == K_ASYNC ? cuMemFreeAsync((CUdeviceptr)stack[--top].h, stream)
                                                           : CUDA_ERROR_INVALID_VALUE;
        } else if (!strcmp(op, "freeall")) {
            while (top > 0 && rc == CUDA_SUCCESS) rc = release(stack[--top]);
        } else if (!strcmp(op, "dlsym") || !strcmp(op, "dlsym_is")) {
            if (libcuda == NULL) libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
            void *fn = libcuda ? dlsym(libcuda, f[1]) : NULL;
            if (!strcmp(op, "dlsym")) {
                rc = call_alloc(f[1], fn, num(f[2]));
            } else {
                Dl_info info;
                int real = fn && dladdr(fn, &info) && info.dli_fname && strstr(info.dli_fname, "libcuda.so");
                snprintf(extra, sizeof extra, "same=%d real=%d", fn != NULL && fn == dlsym(RTLD_DEFAULT, f[1]), real);
            }
        } else if (!strcmp(op, "procaddr") || !strcmp(op, "procaddr_is")) {
            void *fn = NULL;
            CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
            rc = cuGetProcAddress_v2(f[1], &fn, atoi(f[2]), num(f[3]), &st);
            if (!strcmp(op, "procaddr")) {
                /* f[5]: the versioned symbol the answer must be (its signature is used to call it) */
                if (rc == CUDA_SUCCESS) rc = call_alloc(nf > 5 ? f[5] : f[1], fn, num(f[4]));
            } else {
                Dl_info info;
                void *t = entry_target(fn);
                int real = t && dladdr(t, &info) && info.dli_fname && strstr(info.dli_fname, "libcuda.so");
                snprintf(extra, sizeof extra, "same=%d real=%d status=%d internal=%d",
                         t != NULL && t == dlsym(RTLD_DEFAULT, f[4]), real, (int)st, t != fn);
            }
        } else if (!strcmp(op, "stress") || !strcmp(op, "storm")) {
            int nt = atoi(f[1]), storm = !strcmp(op, "storm");
            pthread_t t[64];
            struct stress s[64];
            for (int k = 0; k < nt && k < 64; k++) {
                s[k] = (struct stress){storm ? -1 : (long)num(f[2]),
                                       (size_t)num(f[storm ? 2 : 3]),
                                       (unsigned)(getpid() * 7919 + k),
                                       0,
                                       0,
                                       0};
                pthread_create(&t[k], NULL, stress_thread, &s[k]);
            }
            if (storm) {
                printf("storming\n");
                fflush(stdout);
                char c;
                while (read(0, &c, 1) > 0) {}
                __atomic_store_n(&storm_stop, 1, __ATOMIC_RELAXED);
            }
            long ok = 0, oom = 0, other = 0;
            for (int k = 0; k < nt && k < 64; k++) {
                pthread_join(t[k], NULL);
                ok += s[k].ok;
                oom += s[k].oom;
                other += s[k].other;
            }
            snprintf(extra, sizeof extra, "ok=%ld oom=%ld other=%ld", ok, oom, other);
        } else {
            fprintf(stderr, "unknown op %s\n", op);
            return 2;
        }
        printf("op=%s rc=%d%s%s\n", op, (int)rc, extra[0] ? " " : "", extra);
    }
    return 0;
}
