/* Decode an internal entry point of the simulated driver (tests/c programs). */
#ifndef ENTRY_TARGET_H
#define ENTRY_TARGET_H

/* The function an entry point from cuGetProcAddress jumps to: the simulator, like NVIDIA's driver,
 * hands out internal entry points (trampolines) rather than its exported symbols. */
static inline void *entry_target(void *fn) {
    const unsigned char *b = (const unsigned char *)fn;
#if defined(__x86_64__)
    if (b && b[0] == 0xff && b[1] == 0x25 && b[2] == 0 && b[3] == 0 && b[4] == 0 && b[5] == 0) {
        void *t;
        __builtin_memcpy(&t, b + 6, sizeof t);
        return t;
    }
#elif defined(__aarch64__)
    static const unsigned int code[2] = {0x58000050u, 0xd61f0200u};
    if (b && __builtin_memcmp(b, code, sizeof code) == 0) {
        void *t;
        __builtin_memcpy(&t, b + 8, sizeof t);
        return t;
    }
#endif
    return fn;
}

#endif
