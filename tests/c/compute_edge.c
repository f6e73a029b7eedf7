/*
 * Edge cases of the launch hooks under a compute cap (tests/shim_compute/test_edges.py):
 * NULL arguments reach the driver (no crash, the driver's error comes back), failed launches
 * give their budget back, stream capture is not charged, and fork in the middle of capped
 * launching neither deadlocks the child nor disturbs the parent; contexts destroyed and created
 * between launches are charged right.
 * Prints "ok" and exits 0 on success.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"

#define EXPECT(cond)                                                                                                   \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "edge: failed: %s (line %d)\n", #cond, __LINE__);                                          \
            return 1;                                                                                                  \
        }                                                                                                              \
    } while (0)

/* The driver's own definition of `name`, found in its file's dynamic symbol table: what a call
 * through an entry point the shim does not hook reaches (no route the shim serves: not direct
 * binding, dlsym or cuGetProcAddress). NULL when it cannot be found. */
static void *driver_definition(const char *name) {
    Dl_info info;
    if (!dladdr((void *)cuDriverGetVersion, &info) || !info.dli_fname) return NULL; /* not hooked: the driver's */
    FILE *f = fopen(info.dli_fname, "rb");
    if (!f) return NULL;
    void *found = NULL;
    Elf64_Ehdr eh;
    Elf64_Shdr *sh = NULL;
    if (fread(&eh, sizeof eh, 1, f) != 1 || memcmp(eh.e_ident, ELFMAG, SELFMAG) || eh.e_ident[EI_CLASS] != ELFCLASS64)
        goto out;
    sh = calloc(eh.e_shnum, sizeof *sh);
    if (!sh || fseek(f, (long)eh.e_shoff, SEEK_SET) || fread(sh, sizeof *sh, eh.e_shnum, f) != eh.e_shnum) goto out;
    for (unsigned i = 0; i < eh.e_shnum && !found; i++) {
        if (sh[i].sh_type != SHT_DYNSYM || sh[i].sh_link >= eh.e_shnum) continue;
        const Elf64_Shdr *str = &sh[sh[i].sh_link];
        char *names = malloc(str->sh_size);
        Elf64_Sym *syms = malloc(sh[i].sh_size);
        if (names && syms && !fseek(f, (long)str->sh_offset, SEEK_SET) &&
            fread(names, 1, str->sh_size, f) == str->sh_size && !fseek(f, (long)sh[i].sh_offset, SEEK_SET) &&
            fread(syms, 1, sh[i].sh_size, f) == sh[i].sh_size)
            for (size_t k = 0; k < sh[i].sh_size / sizeof *syms; k++)
                if (syms[k].st_name < str->sh_size && syms[k].st_value && !strcmp(names + syms[k].st_name, name)) {
                    found = (char *)info.dli_fbase + syms[k].st_value;
                    break;
                }
        free(names);
        free(syms);
    }
out:
    free(sh);
    fclose(f);
    return found;
}

/* `compute_edge unseen`: a capture begun where the shim cannot see it (the driver's own
 * cuStreamBeginCapture_v2, as an entry point the shim does not hook would be). The shim finds it
 * at a measured launch and from then on asks about every launch: most of the captured launches
 * are not charged (tests/shim_compute/test_edges.py bounds them). */
static int unseen_capture(CUfunction fn) {
    CUresult (*begin)(CUstream, CUstreamCaptureMode) =
        (CUresult (*)(CUstream, CUstreamCaptureMode))driver_definition("cuStreamBeginCapture_v2");
    EXPECT(begin != NULL && (void *)begin != (void *)cuStreamBeginCapture_v2);
    CUstream cs;
    CUgraph g;
    EXPECT(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    for (int i = 0; i < 40; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(cs) == CUDA_SUCCESS);
    EXPECT(begin(cs, CU_STREAM_CAPTURE_MODE_RELAXED) == CUDA_SUCCESS);
    for (int i = 0; i < 200; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture(cs, &g) == CUDA_SUCCESS);
    printf("ok\n");
    return 0;
}

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    EXPECT(cuInit(0) == CUDA_SUCCESS);
    EXPECT(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    EXPECT(cuModuleLoadData(&mod, "simgpu-module") == CUDA_SUCCESS);
    EXPECT(cuModuleGetFunction(&fn, mod, "sim_1000us") == CUDA_SUCCESS);
    if (argc > 1 && !strcmp(argv[1], "unseen")) return unseen_capture(fn);

    /* NULL arguments: the driver's answer, no crash. */
    EXPECT(cuLaunchKernelEx(NULL, fn, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuLaunchKernelEx_ptsz(NULL, fn, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuGraphLaunch(NULL, NULL) != CUDA_SUCCESS);
    /* A launch the driver refuses (no context current): nothing charged, no crash. */
    EXPECT(cuCtxSetCurrent(NULL) == CUDA_SUCCESS);
    EXPECT(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);

    /* Capture: launches recorded into a graph are not charged (they do not run). */
    CUstream cs;
    CUgraph g;
    CUgraphExec ge;
    EXPECT(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    EXPECT(cuStreamBeginCapture_v2(cs, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
    for (int i = 0; i < 200; i++) /* 200 ms of kernels: at a 10% cap that would be 2 s of waiting */
        EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture(cs, &g) == CUDA_SUCCESS);
    EXPECT(cuGraphInstantiateWithFlags(&ge, g, 0) == CUDA_SUCCESS);

    /* The shim counts the captures in progress and asks whether a launch's stream is capturing
     * only while there is one: the count must survive two captures at once, one of them ended,
     * an end on a stream not capturing, a begin that fails, and an invalidated capture. A launch
     * on a stream still capturing that the shim took for none would be charged (and wait). */
    CUstream cs2;
    CUgraph g2 = NULL;
    EXPECT(cuStreamCreate(&cs2, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    EXPECT(cuStreamBeginCapture_v2(cs, CU_STREAM_CAPTURE_MODE_RELAXED) == CUDA_SUCCESS);
    EXPECT(cuStreamBeginCapture_v2_ptsz(cs2, CU_STREAM_CAPTURE_MODE_RELAXED) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture_ptsz(cs2, &g2) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture(cs2, &g2) == CUDA_ERROR_ILLEGAL_STATE);                      /* not capturing */
    EXPECT(cuStreamBeginCapture(cs) == CUDA_ERROR_ILLEGAL_STATE);                          /* already capturing */
    EXPECT(cuStreamBeginCapture_v2(NULL, CU_STREAM_CAPTURE_MODE_RELAXED) != CUDA_SUCCESS); /* legacy */
    for (int i = 0; i < 200; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(cs) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); /* invalidates the capture */
    EXPECT(cuStreamEndCapture(cs, &g2) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* The per-thread default stream, captured through the _ptsz entry points. */
    EXPECT(cuStreamBeginCapture_ptsz(NULL) == CUDA_SUCCESS);
    for (int i = 0; i < 200; i++)
        EXPECT(cuLaunchKernel_ptsz(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture_ptsz(NULL, &g2) == CUDA_SUCCESS);
    /* No capture now: launches on the same streams run, and are charged. */
    for (int i = 0; i < 5; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(cs) == CUDA_SUCCESS);

    for (int i = 0; i < 20; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
    fflush(NULL);
    pid_t pid = fork();
    EXPECT(pid >= 0);
    if (pid == 0) {
        /* The child: the parent's context is not ours (CUDA does not survive fork); the hooks
         * must answer, not hang on a lock the parent held. */
        CUresult r = cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        (void)r;
        _exit(0);
    }
    for (int i = 0; i < 20; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
    int status = 0;
    EXPECT(waitpid(pid, &status, 0) == pid);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT(cuCtxSynchronize() == CUDA_SUCCESS);

    /* Contexts come and go (the gate keeps the device of a thread's context until a context is
     * destroyed): a launch in a new context, maybe at a destroyed one's address, is charged like
     * any other; one after its context was destroyed is the driver's error, charged nothing. */
    for (int k = 0; k < 3; k++) {
        CUcontext c2;
        CUmodule m2;
        CUfunction f2;
        EXPECT(cuCtxCreate_v2(&c2, 0, dev) == CUDA_SUCCESS); /* current now */
        EXPECT(cuModuleLoadData(&m2, "simgpu-module") == CUDA_SUCCESS);
        EXPECT(cuModuleGetFunction(&f2, m2, "sim_1000us") == CUDA_SUCCESS);
        for (int i = 0; i < 5; i++) EXPECT(cuLaunchKernel(f2, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
        EXPECT(cuCtxSynchronize() == CUDA_SUCCESS);
        EXPECT(cuCtxDestroy_v2(c2) == CUDA_SUCCESS);
        EXPECT(cuLaunchKernel(f2, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
        EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    }
    printf("ok\n");
    return 0;
}
