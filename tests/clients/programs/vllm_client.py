"""vLLM's offline engine (`vllm.LLM`) on a made-up model: vllm_client.py MODEL_DIR MODE [ARGS].

MODEL_DIR holds a config.json only (tests/clients/test_vllm.py writes it): the weights are vLLM's
dummy ones (load_format="dummy"), there is no tokenizer (skip_tokenizer_init) and prompts are
token ids, so nothing is fetched. The engine runs in this process (the test sets
VLLM_ENABLE_V1_MULTIPROCESSING=0), so the driver's per-process figures are the engine's.

  generate [UTIL]    eager; generate 8 tokens of a 4-token prompt, print "generated n=N"
                     (UTIL: gpu_memory_utilization, default 0.9)
  sleep LEVELS [UTIL] eager with sleep mode: generate, print "generated n=N" and wait for a line
                     on stdin; then for each level of LEVELS (comma-separated, e.g. 1,2):
                     llm.sleep(level), print "asleep level=L" and wait, llm.wake_up(), print
                     "awake" and wait, generate again (each wait: the test reads the slice while
                     the engine holds still)
  burst [UTIL]       eager with sleep mode, in a bursting slice (docs/policy.md, "Taking it back"):
                     generate, print "generated n=N free=F total=T" (torch.cuda.mem_get_info()),
                     then serve two things at once until stdin closes or says "exit": the plugin's
                     notice (SIGWINCH: give borrowed memory back) makes it llm.sleep(level=1) (the
                     KV cache discarded, the weights offloaded to the host) and print "asleep on
                     notice free=F total=T"; a line "generate" generates again, "wake" wakes it
                     (llm.wake_up()), answered "generated n=N free=F total=T" and "wake ok
                     free=F total=T"; a wake the slice refuses memory for prints "wake refused
                     free=F total=T: WHY" and may be asked again (vLLM wakes what still sleeps)
  ttft N             eager; after two warm-up requests, N requests of one token from a 4-token
                     prompt, one at a time: print "ttft_ms=MEDIAN min=MIN" of their wall times
  decode N [LIB]     eager; after two warm-up batches, one batch of 8 sequences of N tokens each
                     from a 4-token prompt (a prefill and N-1 decode steps); with LIB (the
                     benchmarks' callgrind toggle, benchmarks/c/callgrind_toggle.c) loaded,
                     callgrind counts that batch only: print "tokens=T steps=N"
  graphs WARMUP S    torch.compile and CUDA graphs (vLLM's defaults): generate batches for WARMUP
                     seconds, then for S more, and print the share of the device the simulated
                     driver served this process over the second stretch (simgpuProcessBusyNs),
                     bracketed by torch.cuda.synchronize(): share=P batches=N window_s=W cpu_wait=F
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

# the repository's own measure of a process's wait for a CPU (this interpreter is .venv/frameworks')
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sharing.observe.cpuwait import cpu_wait_ns

PROMPT = TokensPrompt(prompt_token_ids=[3, 4, 5, 6])


def engine(model: str, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=16,
        gpu_memory_utilization=0.9,
    )
    args.update(kw)
    return LLM(**args)


def generate(llm: LLM, n: int = 1, tokens: int = 8) -> int:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False)
    out = llm.generate([PROMPT] * n, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in out)


def served_share(t0: int, t1: int) -> float:
    """The percentage of [t0, t1] (CLOCK_MONOTONIC ns) the simulated driver served this process."""
    fn = ctypes.CDLL("libcuda.so.1").simgpuProcessBusyNs
    fn.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    fn.argtypes += [ctypes.POINTER(ctypes.c_ulonglong)] * 2
    busy, window = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    rc = fn(torch.cuda.current_device(), t0, t1, ctypes.byref(busy), ctypes.byref(window))
    if rc != 0 or window.value == 0:
        raise SystemExit(f"simgpuProcessBusyNs answered {rc}, window {window.value}")
    return 100.0 * busy.value / window.value


def memory() -> str:
    free, total = torch.cuda.mem_get_info()
    return f"free={free} total={total}"


def burst(model: str, util: float) -> None:
    """The burst mode: the notice or the test's next command, whichever comes first. The handler
    is installed before the engine starts, so no notice is lost (SIGWINCH's default: ignored)."""
    noticed = threading.Event()
    signal.signal(signal.SIGWINCH, lambda _sig, _frame: noticed.set())
    llm = engine(model, enforce_eager=True, enable_sleep_mode=True, gpu_memory_utilization=util)
    print(f"generated n={generate(llm)} {memory()}", flush=True)
    pending = b""
    while True:
        if noticed.is_set():
            noticed.clear()
            llm.sleep(level=1)
            print(f"asleep on notice {memory()}", flush=True)
            continue
        if b"\n" not in pending:
            # a SIGWINCH interrupts the wait; its handler runs, then select waits again (PEP 475):
            # a short timeout so the notice is seen within a tenth of a second
            if select.select([0], [], [], 0.1)[0]:
                chunk = os.read(0, 4096)
                pending += chunk or b"exit\n"
            continue
        line, pending = pending.split(b"\n", 1)
        command = line.decode().strip()
        if command == "generate":
            print(f"generated n={generate(llm)} {memory()}", flush=True)
        elif command == "wake":
            try:
                llm.wake_up()
            except (RuntimeError, torch.OutOfMemoryError) as e:  # the slice may not allow it yet
                print(f"wake refused {memory()}: {str(e).splitlines()[0]}", flush=True)
                continue
            print(f"wake ok {memory()}", flush=True)
        elif command == "exit":
            return
        else:
            raise SystemExit(f"unknown command {command!r}")


def main() -> None:
    model, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "generate":
        util = float(args[0]) if args else 0.9
        llm = engine(model, enforce_eager=True, gpu_memory_utilization=util)
        print(f"generated n={generate(llm)}", flush=True)
    elif mode == "sleep":
        util = float(args[1]) if len(args) > 1 else 0.9
        llm = engine(model, enforce_eager=True, enable_sleep_mode=True, gpu_memory_utilization=util)
        print(f"generated n={generate(llm)}", flush=True)
        sys.stdin.readline()
        for level in args[0].split(","):
            llm.sleep(level=int(level))
            print(f"asleep level={level}", flush=True)
            sys.stdin.readline()
            llm.wake_up()
            print("awake", flush=True)
            sys.stdin.readline()
            print(f"generated n={generate(llm)}", flush=True)
    elif mode == "burst":
        burst(model, float(args[0]) if args else 0.9)
    elif mode == "ttft":
        llm = engine(model, enforce_eager=True)
        generate(llm, tokens=1)
        generate(llm, tokens=1)
        times = []
        for _ in range(int(args[0])):
            t0 = time.perf_counter()
            generate(llm, tokens=1)
            times.append(1000 * (time.perf_counter() - t0))
        times.sort()
        print(f"ttft_ms={times[len(times) // 2]:.3f} min={times[0]:.3f}", flush=True)
    elif mode == "decode":
        steps = int(args[0])
        toggle = ctypes.CDLL(args[1]) if len(args) > 1 else None
        # a KV cache of fixed size: the same work with and without a quota, and within what
        # valgrind can map (0.9 of the simulated GPU's 80 GiB is not)
        llm = engine(model, enforce_eager=True, kv_cache_memory_bytes=256 << 20)
        generate(llm, n=8, tokens=steps)
        generate(llm, n=8, tokens=steps)
        if toggle is not None:
            toggle.cg_start()
        tokens = generate(llm, n=8, tokens=steps)
        if toggle is not None:
            toggle.cg_stop()
        print(f"tokens={tokens} steps={steps}", flush=True)
    elif mode == "graphs":
        warmup, seconds = float(args[0]), float(args[1])
        llm = engine(
            model,
            compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
            kernel_config={"enable_jit_warmup": False},
        )

        def run(s: float) -> int:
            n, end = 0, time.monotonic() + s
            while time.monotonic() < end:
                generate(llm, n=16, tokens=32)
                n += 1
            return n

        run(warmup)
        torch.cuda.synchronize()
        w0, t0 = cpu_wait_ns(), time.monotonic_ns()
        n = run(seconds)
        torch.cuda.synchronize()
        w1, t1 = cpu_wait_ns(), time.monotonic_ns()
        print(
            f"share={served_share(t0, t1):.3f} batches={n} window_s={(t1 - t0) / 1e9:.3f} "
            f"cpu_wait={(w1 - w0) / (t1 - t0):.3f}",
            flush=True,
        )
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
