"""Regenerate the Python gRPC code of sharing/observe/proto/*.proto with grpcio-tools.

    .venv/bin/python sharing/observe/proto/generate.py            # rewrite the generated files
    .venv/bin/python sharing/observe/proto/generate.py --out DIR  # write into DIR/sharing/observe/proto instead

compile_protos() is also what driver/proto/generate.py uses. The protos are compiled with the
repository root as include path, so the generated modules import each other by their package
path. The generated files are committed; tests check that regenerating gives identical files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent.parent
PACKAGE_DIR = "sharing/observe/proto"
PROTOS = ("podresources_v1.proto",)


def compile_protos(package_dir: str, protos: Sequence[str], out_root: Path) -> list[Path]:
    """Compile package_dir/<each proto> (relative to the repository root) into
    out_root/package_dir; return the generated files."""
    from grpc_tools import protoc  # only needed here: grpcio-tools is a test dependency

    out_dir = out_root / package_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name in protos:
        rel = f"{package_dir}/{name}"
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            rel,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {rel}")
        stem = name.removesuffix(".proto")
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2_grpc.py"]
    return written


def generate(out_root: Path) -> list[Path]:
    return compile_protos(PACKAGE_DIR, PROTOS, out_root)


def command(
    package_dir: str, protos: Sequence[str], description: str, argv: list[str] | None
) -> int:
    """A generator's command line: --out ROOT, then the files written, one a line."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=REPO_ROOT, help=f"root to write {package_dir} into")
    args = p.parse_args(argv)
    for path in compile_protos(package_dir, protos, args.out):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return command(PACKAGE_DIR, PROTOS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
