"""Which symbols of a runtime a shared library exports (nm -D), for the build and package tests.

A module that exports the C++ or CUDA runtime it carries (a toolchain that links libstdc++
statically, libcudart_static) lends it to the whole process: in a Python process that holds
libstdc++.so.6 already, the dynamic linker binds part of the module's copy to that library, and
formatting an integer into a std::ostringstream crashed. libfmha and fmha._C must
export their own API only: what fmha.h marks FMHA_API, PyInit__C, and the weak instances of
header templates every C++ module defines alike.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

# Demangled names that only a runtime library defines: the locale machinery and the facets' ids,
# the C++ ABI (exceptions, guards, the typeinfo of its own classes), the unwinder, the CUDA
# runtime.
RUNTIME_SYMBOL = re.compile(
    r"^(std::locale\b|std::ios_base\b|std::basic_ios<|std::.*::id$|"
    r"(typeinfo|vtable) for (std::(exception|bad_|type_info)|__cxxabiv1::)|"
    r"__cxa_|__gxx_personality|_Unwind_|__gcc_|cuda[A-Z]|__cudart)")


def nm_available() -> bool:
    return shutil.which("nm") is not None


def runtime_exports(library: Path) -> list[str]:
    """The demangled names of the symbols `library` defines and exports that belong to the C++
    or CUDA runtime (RUNTIME_SYMBOL)."""
    listing = subprocess.run(["nm", "-D", "--defined-only", "-C", str(library)],
                             capture_output=True, text=True, check=True).stdout
    names = (line.split(maxsplit=2)[2] for line in listing.splitlines()
             if len(line.split(maxsplit=2)) == 3)
    return [name for name in names if RUNTIME_SYMBOL.match(name)]
