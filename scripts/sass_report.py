"""Per kernel of a built libfmha: registers, stack and local memory, and the instructions that
show which path it takes, from cuobjdump (no GPU needed, but cuobjdump: the device machines
have it in /usr/local/cuda/bin, this project's build machine does not).

    python3 scripts/sass_report.py build/DIR/python/fmha/libfmha.so [NAME_FILTER] > report.txt

HGMMA is wgmma on the tensor cores (the fa3 pipeline), HMMA is mma.sync (fa2); UTMALDG and
UTMASTG are TMA loads and stores, STSM stmatrix, USETMAXREG the register hand-over between
warpgroups, LDL/STL local-memory traffic (spills). NAME_FILTER (default "fa3") keeps the kernels
whose demangled name holds it: fa3 kernels are fmha::fa3::fwd_kernel.
"""

import collections
import re
import subprocess
import sys

OPCODES = re.compile(r"\b(HGMMA\.\S+|HMMA\.\S+|MUFU\.EX2|STSM\.\S+|UTMALDG\.\S+|UTMASTG\.\S+|"
                     r"USETMAXREG\.\S+|LDL(?:\.\S+)?|STL(?:\.\S+)?)")
FUNCTION = re.compile(r"^\s+Function : (\S+)")
RESOURCES = re.compile(r"^Function (\S+):\s*(.*)$")


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), text=True, capture_output=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def main():
    library = sys.argv[1]
    wanted = sys.argv[2] if len(sys.argv) > 2 else "fa3"
    sass = subprocess.run(["cuobjdump", "-sass", library], text=True, capture_output=True,
                          check=True).stdout
    counts = collections.defaultdict(collections.Counter)
    current = None
    for line in sass.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = match.group(1)
            continue
        if current:
            for opcode in OPCODES.findall(line):
                counts[current][opcode.rstrip(";")] += 1
    usage = subprocess.run(["cuobjdump", "-res-usage", library], text=True, capture_output=True,
                           check=True).stdout
    resources = {}
    pending = None  # a function whose figures are on the next line
    for line in usage.splitlines():
        match = RESOURCES.match(line.strip())
        if match:
            pending = None if match.group(2) else match.group(1)
            if match.group(2):
                resources[match.group(1)] = match.group(2)
        elif pending and line.strip():
            resources[pending] = line.strip()
            pending = None
    names = demangle(sorted(set(counts) | set(resources)))
    print(f"# cuobjdump -sass / -res-usage {library}: per kernel, resources | instruction counts")
    for mangled, name in sorted(names.items(), key=lambda item: item[1]):
        if wanted not in name:
            continue
        ops = ", ".join(f"{op} {n}" for op, n in sorted(counts[mangled].items()))
        print(name)
        print(f"    {resources.get(mangled, '?')} | {ops}")


if __name__ == "__main__":
    main()
