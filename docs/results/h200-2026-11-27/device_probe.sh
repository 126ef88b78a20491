#!/usr/bin/env bash
# Where does a miss's message crash when fmha is built on the GPU machine?
set -u
cd "$(dirname "$0")"
g++ --version | head -1; nvcc --version | tail -1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.__file__)"
ldconfig -p | grep -E "libstdc\+\+" ; ls -la /usr/lib/x86_64-linux-gnu/libstdc++.so.6*
echo "== libraries that define std::locale symbols, loaded after import torch"
python3 - <<'PY'
import torch, subprocess, re
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if ".so" in l})
for lib in libs:
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout
    n = len(re.findall(r"_ZNSt6locale|_ZNSo9_M_insert|basic_ostringstream", out))
    if n: print(n, lib)
PY
for v in dyn static; do
  flags="-O2 -shared -fPIC"
  [[ $v == static ]] && flags="$flags -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL"
  g++ $flags mini.cpp -o mini_$v.so
  for imp in notorch torch; do python3 mini_probe.py ./mini_$v.so $imp; echo "mini $v $imp rc=$?"; done
done
LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ldb python3 mini_probe.py ./mini_dyn.so torch
echo "== mini_dyn.so's bindings outside libstdc++/libc"
grep -h "file=./mini_dyn.so" /tmp/ldb.* | grep -v "to /usr/lib/x86_64-linux-gnu/libstdc++\|libc.so.6" | head -30
echo "== all mini_dyn.so bindings"; grep -h "file=./mini_dyn.so" /tmp/ldb.* | head -30
rm -f /tmp/ldb.*
cd ..
export FMHA_FILTER='bf16,hdim128,fa2,mask=none,!group' FMHA_ARCHS=auto
time python3 -m pip install --no-build-isolation -q . > $OUT/pip.log 2>&1; echo "pip rc=$?"; tail -5 $OUT/pip.log
root=$PWD; cd /tmp
python3 -c "import fmha; print(fmha.__file__, fmha.compiled_targets())"
ldd $(python3 -c "import fmha, os; print(os.path.dirname(fmha.__file__))")/libfmha.so
for p in select_d256 explain_d256 fwd_d256 fwd_softcap fwd_window; do
  python3 $root/probe/fmha_probe.py $p > /tmp/p.log 2>&1; rc=$?; tail -3 /tmp/p.log; echo "$p rc=$rc"
done
LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ldf python3 $root/probe/fmha_probe.py select_d256 > /dev/null 2>&1
echo "== libfmha.so's bindings outside libstdc++/libc/libm/libgcc"
grep -h "libfmha.so " /tmp/ldf.* | grep "binding file" | grep -v "to /usr/lib/x86_64-linux-gnu/lib\(stdc++\|c\|m\|gcc_s\)\.so" | head -40
echo "== libfmha.so bindings into std symbols, by target"
grep -h "binding file .*libfmha.so" /tmp/ldf.* | grep "_ZNS\|_ZSt" | sed -E 's/.* to ([^ ]+) .*/\1/' | sort | uniq -c
tar czf $OUT/ldf.tgz /tmp/ldf.* 2>/dev/null
