"""Regenerate the Python gRPC code of driver/proto/*.proto with grpcio-tools.

    .venv/bin/python driver/proto/generate.py            # rewrite the generated files
    .venv/bin/python driver/proto/generate.py --out DIR  # write into DIR/driver/proto instead

The protos are compiled with the repository root as include path, so the generated modules
import each other as `driver.proto.X` and the package imports cleanly. The generated files are
committed; tests/driver/test_kubelet_proto.py checks that regenerating gives identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sharing.proto.generate import compile_protos

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
PROTOS = (
    "pluginregistration.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "health_v1alpha1.proto",
    "health_v1.proto",
)


def generate(out_root: Path) -> list[Path]:
    """Compile every proto into out_root/driver/proto; return the generated files."""
    return compile_protos("driver/proto", PROTOS, out_root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write driver/proto into")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
