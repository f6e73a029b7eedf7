"""One set of rules for the limits file on both sides: every key of vgpu/limits.def and every bad
form of its value, fed to the Python reader (sharing/limitsfile.py, the plugin's writer checks with
it) and to the shim (a copy with the file beside it, both read-only bind mounts as the plugin
mounts them). Each case is
accepted by both or refused by both, and a refusal is one line."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from sharing import burstpool, region
from sharing.limitsfile import LimitsFileError, parse_limits_file
from sharing.paths import shim_library
from tests.support.shim_ops import parse_ops

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "shim" / "include" / "vgpu" / "limits.def"
ENTRY = re.compile(r"^VGPU_LIMIT_KEY\((\w+), (\w+), (\w+)\)$", re.M)

# Per form: values the file must take, and values it must refuse.
GOOD = {
    "BYTES": ["0", "1024", "18446744073709551615"],
    "PERCENT": ["30", "12.5", "0", "100", "50%"],
    "POLICY": ["hard", "elastic", "off"],
    "PRIORITY": ["-100", "0", "1", "100"],
    "PATH": ["@"],  # an absolute path under the test's directory
    "SWITCH": ["0", "1"],
}
BAD = {
    "BYTES": ["", "-1", "4Gi", "007", "18446744073709551616", "1.5", " 1", "0x10"],
    "PERCENT": ["", "101", "-1", "1e2", "0x10", "30%%", "abc"],
    "POLICY": ["", "Hard", "on", " hard", "force"],
    "PRIORITY": ["", "101", "-101", "+1", "01", "1.0", "high"],
    "PATH": ["", "relative/path", "/" + "a" * 4095],
    "SWITCH": ["", "2", "true", "on", "yes"],
}


def table() -> list[tuple[str, str, str]]:
    return ENTRY.findall(TABLE.read_text())


def test_the_table_has_every_form_and_presence() -> None:
    rows = table()
    assert {f for _, f, _ in rows} == set(GOOD) == set(BAD)
    assert {p for _, _, p in rows} == {"REQUIRED", "OPTIONAL", "INDEXED", "PER_DEVICE"}


def _value(form: str, v: str, tmp: Path) -> str:
    return str(tmp / "p") if (form, v) == ("PATH", "@") else v


def _base(tmp: Path) -> dict[str, str]:
    """A complete file: every required and indexed key (device 0), valid."""
    out = {}
    for key, form, presence in table():
        if presence == "INDEXED":
            out[f"{key}_0"] = _value(form, GOOD[form][1], tmp)
        elif presence == "REQUIRED":
            out[key] = _value(form, GOOD[form][0], tmp)
    out["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp / "acct")
    return out


def _text(entries: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in entries.items())


# Bursting's keys go together (docs/policy.md): each is tried in a file with the whole group.
def _burst(tmp: Path) -> dict[str, str]:
    return {"VGPU_MEMORY_BURST_LIMIT_0": "2048", "VGPU_BURST_GRANT_0": "3",
            "VGPU_BURST_KEY_0": "7", "VGPU_BURST_POOL": str(tmp / "pool")}  # fmt: skip


# Values of a good form that the group's rules refuse: a limit below the request (the base's
# CUDA_DEVICE_MEMORY_LIMIT_0 is 1024), an entry past the pool's table, a free entry's key.
BURST_REFUSED = {
    ("VGPU_MEMORY_BURST_LIMIT_0", "0"),
    ("VGPU_BURST_GRANT_0", "1024"),
    ("VGPU_BURST_GRANT_0", "18446744073709551615"),
    ("VGPU_BURST_KEY_0", "0"),
}


def _burst_cases(tmp: Path, base: dict[str, str]) -> list[tuple[str, str, bool]]:
    group = base | _burst(tmp)
    out = [("a bursting device", _text(group), True)]
    for k in _burst(tmp):
        out.append(
            (f"burst group without {k}", _text({x: v for x, v in group.items() if x != k}), False)
        )
    out += [
        ("burst limit = request", _text(group | {"VGPU_MEMORY_BURST_LIMIT_0": "1024"}), True),
        (
            "burst limit below the request",
            _text(group | {"VGPU_MEMORY_BURST_LIMIT_0": "1023"}),
            False,
        ),
        ("burst without a request", _text(group | {"CUDA_DEVICE_MEMORY_LIMIT_0": "0"}), False),
        ("burst entry 1023", _text(group | {"VGPU_BURST_GRANT_0": "1023"}), True),
        ("burst entry 1024", _text(group | {"VGPU_BURST_GRANT_0": "1024"}), False),
    ]
    two = {k: v for k, v in base.items()}
    two |= {f"{k[:-2]}_1": v for k, v in base.items() if k.endswith("_0")}
    two |= _burst(tmp) | {"VGPU_MEMORY_BURST_LIMIT_1": "2048", "VGPU_BURST_KEY_1": "8"}
    out.append(("two devices, one entry", _text(two | {"VGPU_BURST_GRANT_1": "3"}), False))
    out.append(("two devices, two entries", _text(two | {"VGPU_BURST_GRANT_1": "4"}), True))
    return out


def cases(tmp: Path) -> list[tuple[str, str, bool]]:
    """(name, file text, valid) for every key and form, and the file-level rules."""
    base = _base(tmp)
    out = [("complete", _text(base), True)]
    burst_keys = {k.removesuffix("_0") for k in _burst(tmp)}
    out += _burst_cases(tmp, base)
    for key, form, presence in table():
        name = f"{key}_0" if presence in ("INDEXED", "PER_DEVICE") else key
        with_group = base | _burst(tmp) if key in burst_keys else base
        for v in GOOD[form]:
            ok = (name, v) not in BURST_REFUSED
            # the pool must be the (mounted) pool file: the shim maps it
            value = with_group[name] if name == "VGPU_BURST_POOL" else _value(form, v, tmp)
            out.append((f"{name}={v}", _text(with_group | {name: value}), ok))
        for v in BAD[form]:
            out.append((f"{name}={v!r}", _text(base | {name: v}), False))
        if presence == "REQUIRED":
            out.append((f"no {name}", _text({k: v for k, v in base.items() if k != name}), False))
        if presence == "PER_DEVICE":
            good = _value(form, GOOD[form][1], tmp)
            out.append((f"{key}_1 without device 1", _text(base | {f"{key}_1": good}), False))
            out.append((f"{key}_64", _text(base | {f"{key}_64": good}), False))
            out.append((f"bare {key}", _text(base | {key: good}), False))
        if presence == "INDEXED":
            two = base | {f"{k[:-2]}_1": v for k, v in base.items() if k.endswith("_0")}
            out.append((f"{key}_0 and _1", _text(two), True))
            out.append((f"{key}_1 alone", _text(base | {f"{key}_1": base[name]}), False))
            out.append((f"{key}_2 gap", _text(two | {f"{key}_3": base[name]}), False))
            out.append((f"{key}_64", _text(base | {f"{key}_64": base[name]}), False))
            out.append((f"{key}_01", _text(base | {f"{key}_01": base[name]}), False))
            out.append((f"bare {key}", _text(base | {key: base[name]}), False))
            out.append((f"no {name}", _text({k: v for k, v in base.items() if k != name}), False))
    text = _text(base)
    for other in ("CUDA_TASK_PRIORITY", "CUDA_DISABLE_CONTROL", "GPU_CORE_UTILIZATION_POLICY",
                  "LIBCUDA_LOG_LEVEL", "vgpu_priority"):  # fmt: skip
        out.append((f"unknown {other}", text + f"{other}=1\n", False))
    out += [
        ("a key twice", text + "VGPU_COMPUTE_POLICY=hard\n", False),
        ("not KEY=VALUE", text + "just words\n", False),
        ("blank around the key", text.replace("VGPU_PRIORITY=", "VGPU_PRIORITY ="), False),
        ("an escape sequence", text + f"VGPU_DEMAND_FILE={tmp}/x\x1b[2J\n", False),
        ("a NUL byte", text + "#\0\n", False),
        ("non-ASCII", text + f"VGPU_DEMAND_FILE={tmp}/\u00e9\n", False),
        ("comments, blanks, CRLF", "# c\n\n  # indented\n" + text.replace("\n", " \r\n"), True),
        ("leading blanks", "".join(f"\t {line}\n" for line in text.splitlines()), True),
        ("too large", text + "#" * 70000 + "\n", False),
        ("empty", "", False),
    ]
    return out


def _python(text: str) -> bool:
    try:
        parse_limits_file(text)
    except LimitsFileError as e:
        assert "\n" not in str(e)
        return False
    return True


@pytest.mark.slow
def test_both_readers_agree_on_every_key_and_form(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the plugin's files are read-only bind mounts")
    shim_dir = tmp_path / "lib"
    shim_dir.mkdir()
    shutil.copy(shim_library(), shim_dir / "libvgpu.so")
    env = dict(shim_env, SIMGPU_CONTEXT_MEMORY="0", LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    burstpool.create(tmp_path / "pool")  # what the bursting cases name, mounted as the plugin does
    disagree = []
    for name, text, valid in cases(tmp_path):
        (tmp_path / "acct").unlink(missing_ok=True)
        limits = shim_dir / "limits"
        limits.unlink(missing_ok=True)
        limits.write_bytes(text.encode())
        # the plugin's files are read-only bind mounts of their own (what CDI's mounts make)
        mounts = " && ".join(
            f"mount --bind -o ro {shlex.quote(str(f))} {shlex.quote(str(f))}"
            for f in (shim_dir / "libvgpu.so", limits, tmp_path / "pool")
        )
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'{mounts} && exec "$0" init', str(shim_ops)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        [op] = parse_ops(r.stdout)
        lines = [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]
        c_ok = op["rc"] == "0"
        if not c_ok:
            assert op["rc"] == "1" and len(lines) == 1, (name, r.stderr)  # INVALID_VALUE, one line
        py_ok = _python(text)
        if (c_ok, py_ok) != (valid, valid):
            disagree.append((name, valid, c_ok, py_ok, lines))
    assert disagree == []


def test_every_device_index_of_the_accounting_file() -> None:
    n = region.MAX_DEVICES
    text = (
        "".join(f"CUDA_DEVICE_MEMORY_LIMIT_{i}=1\nCUDA_DEVICE_SM_LIMIT_{i}=50\n" for i in range(n))
        + "VGPU_COMPUTE_POLICY=hard\nVGPU_PRIORITY=1\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/a\n"
    )
    assert parse_limits_file(text)[f"CUDA_DEVICE_SM_LIMIT_{n - 1}"] == "50"
