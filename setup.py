"""Builds attnkit's compiled CPU attention kernel (``attnkit._native``) at install time.

Everything else about the package is in pyproject.toml. The kernel is C++17 with OpenMP
(``src/attnkit/csrc``); it needs a C++ compiler (GCC >= 9 or Clang >= 10) and Python's headers.
It is an *optional* extension: where it cannot be built, pip prints the compiler's error, the
install goes on, and attnkit runs torch's kernels instead, saying so once
(``attnkit.backends._native.status()``; ``attnkit.dispatch`` names the kernel that runs).
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = "src/attnkit/csrc"
# ATTNKIT_NATIVE_OPT: the optimisation level (default -O3); the wheel test builds with -O1, which compiles in a third
# of the time (its check is that the wheel builds, installs and runs, not the kernel's speed)
OPT = os.environ.get("ATTNKIT_NATIVE_OPT", "-O3")
if OPT not in ("-O0", "-O1", "-O2", "-O3"):
    raise SystemExit(f"ATTNKIT_NATIVE_OPT: expected one of -O0, -O1, -O2, -O3; got {OPT!r}")
args = [OPT, "-std=c++17", "-fopenmp", "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wextra"]
link = ["-fopenmp"]
if sys.platform == "darwin":  # Apple clang: OpenMP from libomp, when installed
    args = [OPT, "-std=c++17", "-Xpreprocessor", "-fopenmp"]
    link = ["-lomp"]
if os.environ.get("ATTNKIT_NO_NATIVE") == "1":  # build without the kernel (tests of the fallback, odd machines)
    ext = []
else:
    ext = [Extension(
        "attnkit._native",
        sources=[f"{SRC}/attn_dispatch.cpp", f"{SRC}/attn_base.cpp", f"{SRC}/attn_avx2.cpp", f"{SRC}/attn_avx512.cpp"],
        depends=[f"{SRC}/attn_impl.h", f"{SRC}/attn_common.h", f"{SRC}/attn_entry.h", f"{SRC}/attn_decode.h",
                 f"{SRC}/attn_prog.h", f"{SRC}/attn_widen.h", f"{SRC}/attn_amx.h"],
        extra_compile_args=args,
        extra_link_args=link,
        language="c++",
        optional=True,
    )]



class ParallelBuildExt(build_ext):
    """build_ext compiling an extension's sources side by side, one compiler per core (at most 4: the kernel's
    four translation units, one per instruction set and the dispatcher): on 2 cores its build takes about half
    the wall time. ``ATTNKIT_BUILD_JOBS=1`` compiles one at a time."""

    def build_extension(self, ext):
        jobs = min(len(ext.sources), int(os.environ.get("ATTNKIT_BUILD_JOBS", "0")) or os.cpu_count() or 1, 4)
        if jobs > 1:
            one = self.compiler.compile

            def compile_all(sources, *a, **kw):  # the objects in the sources' order, as the linker expects them
                with ThreadPoolExecutor(jobs) as pool:
                    parts = list(pool.map(lambda src: one([src], *a, **kw), sources))
                return [o for part in parts for o in part]

            self.compiler.compile = compile_all
            try:
                return super().build_extension(ext)
            finally:
                self.compiler.compile = one
        return super().build_extension(ext)


setup(ext_modules=ext, cmdclass={"build_ext": ParallelBuildExt})
