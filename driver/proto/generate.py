"""Regenerate the Python gRPC code of driver/proto/*.proto with grpcio-tools.

    .venv/bin/python driver/proto/generate.py            # rewrite the generated files
    .venv/bin/python driver/proto/generate.py --out DIR  # write into DIR/driver/proto instead

The protos are compiled with the repository root as include path, so the generated modules
import each other as `driver.proto.X` and the package imports cleanly. The generated files are
committed; tests/driver/test_kubelet.py checks that regenerating gives identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sharing.observe.proto.generate import command, compile_protos

PACKAGE_DIR = "driver/proto"
PROTOS = (
    "pluginregistration.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "health_v1alpha1.proto",
    "health_v1.proto",
)


def generate(out_root: Path) -> list[Path]:
    """Compile every proto into out_root/driver/proto; return the generated files."""
    return compile_protos(PACKAGE_DIR, PROTOS, out_root)


def main(argv: list[str] | None = None) -> int:
    return command(PACKAGE_DIR, PROTOS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
