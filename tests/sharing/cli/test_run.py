"""`vgpu run`: the shim preloaded, limits set, CMD's exit code, shared regions, bad input refused
before CMD starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.shim_ops import Held, parse_ops
from tests.support.vgpu_cli import VGPU, vgpu_run

MiB = 1 << 20
# Two processes' contexts (charged to the slice) and 64 MiB for their allocations.
TWO_CONTEXTS_AND_64MI = str(2 * CONTEXT_MEMORY + 64 * MiB)


@pytest.mark.slow
def test_exit_code_and_environment(tmp_path: Path) -> None:
    r = vgpu_run(
        [
            "--memory",
            "4Gi",
            "--memory-1",
            "512m",
            "--",
            "sh",
            "-c",
            'echo "$CUDA_DEVICE_MEMORY_LIMIT $CUDA_DEVICE_MEMORY_LIMIT_1 $LD_PRELOAD"; exit 7',
        ]
    )
    assert r.returncode == 7
    limit, limit1, preload = r.stdout.split()
    assert (limit, limit1) == (str(4 << 30), str(512 << 20))
    assert preload.endswith("libvgpu.so")


@pytest.mark.slow
def test_every_accounted_device_has_its_flag() -> None:
    last = region.MAX_DEVICES - 1  # 63: devices past the first 16 too
    r = vgpu_run(
        [f"--memory-{last}", "1Gi", "--", "sh", "-c", f'echo "$CUDA_DEVICE_MEMORY_LIMIT_{last}"']
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(1 << 30)
    r = vgpu_run([f"--memory-{last + 1}", "1Gi", "--", "true"])
    assert r.returncode == 2 and f"--memory-{last + 1}" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--memory", "4GB"],
        ["--memory", "-1"],
        ["--memory-3", "lots"],
        ["--memory", "99999999999999999999Gi"],
    ],
)
def test_bad_quantities_refused_before_cmd(args: list[str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = vgpu_run([*args, "--", "touch", str(marker)])
    assert r.returncode == 2
    assert not marker.exists()
    assert r.stderr.count("\n") == 1 and "vgpu run:" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        # A value argparse would take for an option (its usage, not a quantity error).
        (["--memory", "-1Gi"], "vgpu run: --memory: "),
        (["--memory-2", "-0.5Gi"], "vgpu run: --memory-2: "),
        # A quota smaller than any allocation is a missing unit, never a 4-byte slice.
        (
            ["--memory", "4"],
            "vgpu run: --memory: '4' is 4 bytes, less than any allocation; give a quota of at "
            "least 1Mi with its unit (e.g. 4Gi or 4Mi), or 0 for no limit",
        ),
        (["--memory", "512k"], "vgpu run: --memory: '512k' is 524288 bytes, less than any"),
    ],
)
def test_mistaken_quantities_get_one_line_naming_the_flag(
    args: list[str], message: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    r = vgpu_run([*args, "--", "touch", str(marker)])
    assert (r.returncode, marker.exists()) == (2, False)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(message), r.stderr
    assert "usage:" not in r.stderr


@pytest.mark.slow
def test_a_negative_looking_argument_of_the_command_is_left_alone() -> None:
    r = vgpu_run(["--memory", "1Gi", "--", "echo", "--memory", "-1Gi"])
    assert (r.returncode, r.stdout) == (0, "--memory -1Gi\n"), r.stderr


@pytest.mark.slow
def test_corrupt_region_refused_before_cmd(tmp_path: Path) -> None:
    bad = tmp_path / "bad.region"
    bad.write_bytes(b"junk")
    marker = tmp_path / "ran"
    r = vgpu_run(["--memory", "1Gi", "--region", str(bad), "--", "touch", str(marker)])
    assert r.returncode == 2 and not marker.exists()
    assert "size 4 bytes" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_region_refused_before_cmd(value: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = vgpu_run(["--memory", "1Gi", "--region", value, "--", "touch", str(marker)])
    assert r.returncode == 2 and not marker.exists()
    assert r.stderr == "vgpu run: --region: empty; give the accounting file's path\n"


@pytest.mark.slow
def test_missing_command() -> None:
    r = vgpu_run(["--memory", "1Gi"])
    assert (r.returncode, r.stderr) == (
        2,
        "vgpu run: no command given (vgpu run [options] -- CMD [ARGS...])\n",
    )


@pytest.mark.slow
def test_sim_runs_share_one_region(shim_ops: Path, sim_env: dict[str, str], tmp_path: Path) -> None:
    reg = tmp_path / "shared.region"
    env = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    q = TWO_CONTEXTS_AND_64MI
    first = Held(Path(VGPU[0]), env, *VGPU[1:], "run", "--sim", "--memory", q, "--region", str(reg), "--",
                 str(shim_ops), "init", "ctx", f"alloc:{40 * MiB}")  # fmt: skip
    try:
        assert first.results[-1]["rc"] == "0"
        r = vgpu_run(["--sim", "--memory", q, "--region", str(reg), "--", str(shim_ops), "init", "ctx", "info",
                      f"alloc:{32 * MiB}", f"alloc:{16 * MiB}"], env)  # fmt: skip
        res = parse_ops(r.stdout)
        assert r.returncode == 0, r.stderr
        assert res[2]["total"] == q and res[2]["free"] == str(24 * MiB)  # two contexts, 40 MiB used
        assert [x["rc"] for x in res[3:]] == ["2", "0"]
        # the first's context and allocation; the second has exited
        assert region.read(reg).devices[0].used == CONTEXT_MEMORY + 40 * MiB
    finally:
        first.release()


@pytest.mark.slow
def test_children_of_cmd_share_its_quota(
    shim_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """Without --region, the processes CMD starts share one quota (an anonymous region)."""
    env = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    first = tmp_path / "first.out"
    script = (
        f"{shim_ops} init ctx alloc:{40 * MiB} sleep:20000 > {first} & p=$!; "
        f"until grep -q op=alloc {first} 2>/dev/null; do sleep 0.05; done; "
        f"{shim_ops} init ctx alloc:{32 * MiB} alloc:{16 * MiB}; kill $p; wait"
    )
    r = vgpu_run(["--sim", "--memory", TWO_CONTEXTS_AND_64MI, "--", "sh", "-c", script], env)
    assert r.returncode == 0, r.stderr
    assert "op=alloc rc=0" in first.read_text()
    res = parse_ops(r.stdout)
    assert [x["rc"] for x in res if x["op"] == "alloc"] == ["2", "0"], res


def test_contributors_extend_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other features (the compute cap) add flags through run.CONTRIBUTORS; bad values stop the run."""
    import argparse

    from sharing.cli import main as cli
    from sharing.cli import run

    class Extra:
        def add_arguments(self, parser: argparse.ArgumentParser) -> None:
            parser.add_argument("--example-knob", metavar="N")

        def env(self, args: argparse.Namespace) -> dict[str, str]:
            if args.example_knob is not None and not args.example_knob.isdigit():
                raise run.RunConfigError(f"--example-knob: {args.example_knob!r} is not a number")
            return {"VGPU_EXAMPLE_KNOB": args.example_knob} if args.example_knob else {}

    monkeypatch.setattr(run, "CONTRIBUTORS", [*run.CONTRIBUTORS, Extra()])
    args = cli.build_parser().parse_args(
        ["run", "--memory", "1Gi", "--example-knob", "30", "--", "true"]
    )
    env = run.build_env(args, {})
    assert env["VGPU_EXAMPLE_KNOB"] == "30" and env["CUDA_DEVICE_MEMORY_LIMIT"] == str(1 << 30)
    bad = cli.build_parser().parse_args(["run", "--example-knob", "lots", "--", "true"])
    with pytest.raises(run.RunConfigError, match="--example-knob"):
        run.build_env(bad, {})


@pytest.mark.slow
def test_help_lists_the_flags() -> None:
    r = subprocess.run([*VGPU, "run", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--memory", "--memory-0", "--region", "--sim"):
        assert flag in r.stdout
    # the spellings of "no limit" are in the help, not only in the shim's docs
    text = " ".join(r.stdout.split())
    assert "0 = no limit" in text and "0 or 100: no cap" in text


@pytest.mark.slow
def test_region_limits_beside_the_file_for_observers(
    shim_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """`vgpu run --region FILE` writes FILE.limits (the limits-file format) for `vgpu top` and the
    exporter; in a directory the user may not write it warns in one line and CMD still runs
    limited (the shim takes the limits from CMD's environment)."""
    from sharing.limitsfile import parse_limits_file

    env = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    reg = tmp_path / "a.region"
    r = vgpu_run(["--sim", "--memory", "64Mi", "--compute", "30", "--region", str(reg), "--",
                  str(shim_ops), "init"], env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    limits = parse_limits_file((tmp_path / "a.region.limits").read_text())
    assert limits["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(64 * MiB)
    assert limits["CUDA_DEVICE_SM_LIMIT_0"] == "30"
    assert limits["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == str(reg)
    # FILE.limits cannot be written (here: a directory stands in its way): one warning line, no
    # leftover temporary file, and CMD runs limited all the same.
    blocked = tmp_path / "b.region"
    (tmp_path / "b.region.limits").mkdir()
    r = vgpu_run(["--sim", "--memory", "1Gi", "--region", str(blocked), "--", str(shim_ops),
                  "init", "ctx", f"alloc:{1024 * MiB}"], env)  # fmt: skip
    assert r.returncode == 0 and parse_ops(r.stdout)[2]["rc"] == "2", r.stdout + r.stderr
    assert r.stderr.count("cannot write") == 1, r.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file


@pytest.mark.parametrize(
    ("extra", "policy", "priority"),
    [
        ({}, "hard", "1"),
        ({"GPU_CORE_UTILIZATION_POLICY": "disable"}, "off", "1"),
        ({"GPU_CORE_UTILIZATION_POLICY": "DEFAULT", "CUDA_TASK_PRIORITY": "3"}, "elastic", "3"),
        (
            {"VGPU_COMPUTE_POLICY": "Elastic", "GPU_CORE_UTILIZATION_POLICY": "force"},
            "elastic",
            "1",
        ),
        ({"VGPU_PRIORITY": "-2", "CUDA_TASK_PRIORITY": "3"}, "hard", "-2"),
    ],
)
def test_region_limits_show_the_policy_the_shim_enforces(
    tmp_path: Path, extra: dict[str, str], policy: str, priority: str
) -> None:
    """FILE.limits says what the shim reads from CMD's environment, HAMi's spellings included
    (VGPU_COMPUTE_POLICY over GPU_CORE_UTILIZATION_POLICY, VGPU_PRIORITY over CUDA_TASK_PRIORITY)."""
    from sharing.cli.run import write_region_limits
    from sharing.limitsfile import parse_limits_file

    reg = tmp_path / "r.region"
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT_1": "20", **extra}
    write_region_limits(str(reg), env)
    limits = parse_limits_file((tmp_path / "r.region.limits").read_text())
    assert limits["VGPU_COMPUTE_POLICY"] == policy
    assert limits["VGPU_PRIORITY"] == priority
    assert limits["CUDA_DEVICE_MEMORY_LIMIT_1"] == str(1024 * MiB)
    assert (limits["CUDA_DEVICE_SM_LIMIT_0"], limits["CUDA_DEVICE_SM_LIMIT_1"]) == ("100", "20")


@pytest.mark.slow
@pytest.mark.parametrize("show", [False, True])
def test_memory_limit_bursts_above_the_request(
    shim_ops: Path, sim_env: dict[str, str], show: bool
) -> None:
    """--memory is the request CMD is shown (unless --show-memory-limit), --memory-limit what it
    may allocate: a pool of its own grants the difference (docs/policy.md)."""
    env = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    request = 64 * MiB + CONTEXT_MEMORY
    flags = ["--sim", "--memory", str(request), "--memory-limit", str(request + 64 * MiB)]
    r = vgpu_run([*flags, *(["--show-memory-limit"] if show else []), "--", str(shim_ops),
                  "init", "ctx", f"alloc:{64 * MiB}", "info", f"alloc:{64 * MiB}", f"alloc:{2 * MiB}"],
                 env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = parse_ops(r.stdout)
    # the request, then 64 MiB borrowed, then refused at the limit
    assert [x["rc"] for x in res if x["op"] == "alloc"] == ["0", "0", "2"], res
    info = next(x for x in res if x["op"] == "info")
    if show:
        assert info["total"] == str(request + 64 * MiB) and info["free"] == str(64 * MiB), info
    else:
        assert info["total"] == str(request) and info["free"] == "0", info


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--memory-limit", "8Gi"], "no --memory (the request)"),
        (["--memory", "8Gi", "--memory-limit", "4Gi"], "below device 0's --memory"),
        (["--memory", "4Gi", "--memory-limit-0", "8GB"], "--memory-limit-0"),
    ],
)
def test_a_bad_memory_limit_is_refused_before_cmd(
    args: list[str], says: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    r = vgpu_run(["--sim", *args, "--", "touch", str(marker)])
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not marker.exists()


@pytest.mark.slow
def test_a_bursting_region_shows_its_borrowed_bytes_in_top(
    shim_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """`vgpu run --memory-limit --region FILE` writes the burst limit into FILE.limits; `vgpu top`
    shows the request as the quota, the limit, and what the slice holds above the request."""
    import json

    from sharing.limitsfile import parse_limits_file

    env = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    reg = tmp_path / "burst.region"
    request, limit = CONTEXT_MEMORY + 64 * MiB, CONTEXT_MEMORY + 256 * MiB
    run = [*VGPU[1:], "run", "--sim", "--memory", str(request), "--memory-limit", str(limit),
           "--region", str(reg), "--", str(shim_ops), "init", "ctx", f"alloc:{160 * MiB}"]  # fmt: skip
    held = Held(Path(VGPU[0]), env, *run)
    try:
        assert held.results[-1]["rc"] == "0", held.results
        limits = parse_limits_file((tmp_path / "burst.region.limits").read_text())
        assert limits["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(request)
        assert limits["VGPU_MEMORY_BURST_LIMIT_0"] == str(limit)
        r = subprocess.run([*VGPU, "top", "--sim", "--data-dir", str(tmp_path / "none"),
                            "--region", str(reg), "--json"], env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        [dev] = json.loads(r.stdout)["devices"]
        [s] = dev["slices"]
        assert (s["memory_limit_bytes"], s["memory_burst_limit_bytes"]) == (request, limit), s
        assert s["memory_used_bytes"] == CONTEXT_MEMORY + 160 * MiB, s
        assert s["memory_borrowed_bytes"] == 96 * MiB, s
    finally:
        held.release()
