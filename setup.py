"""Build hook: compiles the plain C shared libraries (shim + simulated driver) and the cffi binding.

All C goes through setuptools' compiler, so `pip install -e .` (or a wheel build) is the only
build step. The library list, sources and flags live in shim/build.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from shim.build import CFLAGS, INCLUDE_DIR, LIBRARIES, PROGRAMS, link_args  # noqa: E402


class BuildWithSharedLibraries(build_ext):
    """build_ext that also produces the plain shared libraries and programs under sharing/_lib."""

    def run(self) -> None:
        super().run()
        self._build_plain_libraries()

    def _lib_root(self) -> Path:
        if self.inplace or getattr(self, "editable_mode", False):
            return ROOT / "sharing" / "_lib"
        return Path(self.build_lib) / "sharing" / "_lib"

    def _build_plain_libraries(self) -> None:
        from setuptools._distutils.ccompiler import new_compiler

        # Not customize_compiler(): Python's own CFLAGS/LDSHARED (-fwrapv, an rpath to the
        # interpreter's lib dir) have no business in libraries loaded into non-Python programs.
        cc = os.environ.get("CC", "gcc")
        compiler = new_compiler(verbose=self.verbose, force=self.force)
        compiler.set_executables(compiler=cc, compiler_so=cc, linker_so=f"{cc} -shared")
        lib_root = self._lib_root()
        for lib in LIBRARIES:
            target = lib.output_path(lib_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = Path(self.build_temp) / "plain" / lib.filename
            objects = compiler.compile(
                [str(s) for s in lib.sources()],
                output_dir=str(temp),
                include_dirs=[str(INCLUDE_DIR)],
                extra_postargs=[*CFLAGS, *lib.cflags],
                depends=[str(h) for h in lib.headers()],
            )
            compiler.link_shared_object(
                objects,
                str(target),
                libraries=list(lib.libs),
                extra_postargs=link_args(lib),
            )
        for prog in PROGRAMS:
            target = prog.output_path(lib_root)
            temp = Path(self.build_temp) / "plain" / prog.filename
            objects = compiler.compile(
                [str(s) for s in prog.sources()],
                output_dir=str(temp),
                include_dirs=[str(INCLUDE_DIR)],
                extra_postargs=[*CFLAGS],
                depends=[str(h) for h in INCLUDE_DIR.rglob("*.h")],
            )
            compiler.link_executable(
                objects, prog.filename, output_dir=str(target.parent), libraries=list(prog.libs)
            )


setup(
    cmdclass={"build_ext": BuildWithSharedLibraries},
    cffi_modules=["sharing/_region_build.py:ffibuilder"],
)
