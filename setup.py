"""Builds attnkit's compiled CPU attention kernel (``attnkit._native``) at install time.

Everything else about the package is in pyproject.toml. The kernel is C++17 with OpenMP
(``src/attnkit/csrc``); it needs a C++ compiler (GCC >= 9 or Clang >= 10) and Python's headers.
It is an *optional* extension: where it cannot be built, pip prints the compiler's error, the
install goes on, and attnkit runs torch's kernels instead, saying so once
(``attnkit.backends._native.status()``; ``attnkit.dispatch`` names the kernel that runs).
"""

import os
import sys

from setuptools import Extension, setup

SRC = "src/attnkit/csrc"
args = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wextra"]
link = ["-fopenmp"]
if sys.platform == "darwin":  # Apple clang: OpenMP from libomp, when installed
    args = ["-O3", "-std=c++17", "-Xpreprocessor", "-fopenmp"]
    link = ["-lomp"]
if os.environ.get("ATTNKIT_NO_NATIVE") == "1":  # build without the kernel (tests of the fallback, odd machines)
    ext = []
else:
    ext = [Extension(
        "attnkit._native",
        sources=[f"{SRC}/attn_dispatch.cpp", f"{SRC}/attn_base.cpp", f"{SRC}/attn_avx2.cpp", f"{SRC}/attn_avx512.cpp"],
        depends=[f"{SRC}/attn_impl.h", f"{SRC}/attn_common.h", f"{SRC}/attn_entry.h", f"{SRC}/attn_decode.h",
                 f"{SRC}/attn_prog.h", f"{SRC}/attn_widen.h"],
        extra_compile_args=args,
        extra_link_args=link,
        language="c++",
        optional=True,
    )]

setup(ext_modules=ext)
