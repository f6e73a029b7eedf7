/*
 * The hooks' prototypes, generated from hooks.def: every file that defines a hook_<symbol>
 * includes this so the compiler checks its signature against the list; dispatch.c's wrappers
 * call them.
 */
#ifndef VGPU_HOOKS_H
#define VGPU_HOOKS_H

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"

#define VGPU_HOOK(lib, ret, name, params, args) ret hook_##name params;
#include "hooks.def"
#undef VGPU_HOOK

#endif
