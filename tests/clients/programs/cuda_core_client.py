"""An ordinary cuda.core program (run by tests/clients/test_cuda_core.py on the simulated GPU).

cuda_core_client.py basic      NVRTC-compiled program (PTX and cubin), streams, events, launch,
                               device / pinned / legacy pinned memory resources
cuda_core_client.py pool N     the default memory pool (release threshold UINT64_MAX, as
                               cuda.core sets it): N buffers of 128 MiB, free one, allocate one
cuda_core_client.py quota N    128 MiB buffers until out of memory; N = the quota
cuda_core_client.py graphmem   a graph built by stream capture allocating from GraphMemoryResource:
                               memory taken at launch, kept by the graph pool until trimmed
cuda_core_client.py graphquota N   such graphs of 128 MiB each until a launch is out of memory
"""

from __future__ import annotations

import json
import sys

from cuda.core import (
    Device,
    DeviceMemoryResource,
    GraphMemoryResource,
    LaunchConfig,
    LegacyPinnedMemoryResource,
    Program,
    ProgramOptions,
    launch,
)

SOURCE = r"""
__device__ unsigned int hits;
extern "C" __global__ void sim_1000us(float *a, size_t n) {
    size_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { a[i] *= 2.0f; atomicAdd(&hits, 1u); }
}
template <typename T> __global__ void sim_300us(T *a) { a[threadIdx.x] = T(); }
template __global__ void sim_300us<float>(float *);
"""

MiB = 1 << 20


def basic() -> None:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    arch = "".join(str(v) for v in dev.compute_capability)
    opts = ProgramOptions(std="c++17", arch=f"sm_{arch}")
    seen: dict[str, object] = {}
    for target in ("ptx", "cubin"):
        prog = Program(SOURCE, code_type="c++", options=opts)  # one compilation per program
        mod = prog.compile(target, name_expressions=("sim_300us<float>",))
        k = mod.get_kernel("sim_1000us")
        t = mod.get_kernel("sim_300us<float>")  # a mangled template instance
        buf = dev.memory_resource.allocate(4 * 132 * 128, stream=stream)
        cfg = LaunchConfig(grid=132, block=128)
        # The device is kept busy (100 ms of kernels) while the host enqueues what is measured:
        # each event is then taken when the kernel before it ends, not when a slow host gets
        # to it, so the durations are the kernels' own however loaded the machine is.
        for _ in range(100):
            launch(stream, cfg, k, buf, 132 * 128)
        e0 = stream.record(options={"timing_enabled": True})
        launch(stream, cfg, k, buf, 132 * 128)
        e1 = stream.record(options={"timing_enabled": True})
        launch(stream, cfg, t, buf)
        e2 = stream.record(options={"timing_enabled": True})
        e2.sync()
        seen[target] = {
            "kernel_ms": e1 - e0,
            "template_ms": e2 - e1,
            "max_threads_per_block": k.attributes.max_threads_per_block,
        }
        buf.close(stream)
    pinned = LegacyPinnedMemoryResource().allocate(4 * MiB)
    seen["pinned_bytes"] = pinned.size
    pinned.close()
    prio = dev.create_stream(options={"priority": -1})
    prio.sync()
    stream.sync()
    print(json.dumps(seen))


def pool(n: int) -> None:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev.device_id)  # the default pool, release threshold UINT64_MAX
    bufs = [mr.allocate(128 * MiB, stream=stream) for _ in range(n)]
    freed = int(bufs[-1].handle)
    bufs.pop().close(stream)
    bufs.append(mr.allocate(128 * MiB, stream=stream))  # the pool's freed block, or refused
    stream.sync()
    print(json.dumps({"buffers": len(bufs), "freed": freed, "next": int(bufs[-1].handle)}))


def quota(limit: int) -> None:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    mr = dev.memory_resource
    held: list[object] = []
    try:
        while len(held) * 128 * MiB <= 2 * limit + (1 << 30):
            held.append(mr.allocate(128 * MiB, stream=stream))
        print("quota not enforced")
        sys.exit(3)
    except Exception as e:  # cuda.core raises CUDAError with the driver's error name
        assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e), e
        print(f"oom after {len(held)} buffers")


def graph_with_allocation(dev: Device, gmr: GraphMemoryResource) -> tuple[object, object]:
    gb = dev.create_graph_builder().begin_building()
    buf = gmr.allocate(128 * MiB, stream=gb)  # captured: an allocation node, no memory yet
    gb.end_building()
    return gb.complete(), buf


def graphmem() -> None:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    gmr = GraphMemoryResource(dev.device_id)
    graph, buf = graph_with_allocation(dev, gmr)
    steps = []

    def step(name: str) -> None:
        a = gmr.attributes
        steps.append([name, a.reserved_mem_current, a.used_mem_current])

    step("built")
    graph.launch(stream)  # type: ignore[attr-defined]
    stream.sync()
    step("launched")
    buf.close(stream)  # type: ignore[attr-defined]
    stream.sync()
    step("freed")
    gmr.trim()
    step("trimmed")
    print(json.dumps(steps))


def graphquota(limit: int) -> None:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    gmr = GraphMemoryResource(dev.device_id)
    held: list[object] = []
    try:
        while len(held) * 128 * MiB <= 2 * limit + (1 << 30):
            graph, buf = graph_with_allocation(dev, gmr)
            held += [graph, buf]
            graph.launch(stream)  # type: ignore[attr-defined]
            stream.sync()
        print("quota not enforced")
        sys.exit(3)
    except Exception as e:
        assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e), e
        print(
            f"graph oom after {len(held) // 2 - 1} graphs reserved={gmr.attributes.reserved_mem_current}"
        )


if __name__ == "__main__":
    {
        "basic": lambda: basic(),
        "pool": lambda: pool(int(sys.argv[2])),
        "quota": lambda: quota(int(sys.argv[2])),
        "graphmem": lambda: graphmem(),
        "graphquota": lambda: graphquota(int(sys.argv[2])),
    }[sys.argv[1]]()
