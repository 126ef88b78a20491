#!/usr/bin/env bash
# Why does the GPU machine's build of libfmha.so carry its own libstdc++?
set -u
cd "$(dirname "$0")/.."
root=$PWD
env | grep -iE "flags|^CC=|^CXX=|cuda|gcc|ld_" | sort
echo "libstdc++.so for g++: $(g++ -print-file-name=libstdc++.so)"; ls -la "$(g++ -print-file-name=libstdc++.so)" "$(g++ -print-file-name=libstdc++.a)"
cat "$(g++ -print-file-name=libstdc++.so)" 2>/dev/null | head -5
echo 'int main(){}' > /tmp/t.cpp; g++ -shared -fPIC -x c++ probe/mini.cpp -o /tmp/m.so -v 2>&1 | grep collect2 | tr ' ' '\n' | grep -E "stdc|^-l|static" | tr '\n' ' '; echo; readelf -d /tmp/m.so | grep NEEDED
export FMHA_FILTER='bf16,hdim128,fa2,mask=none,!group' FMHA_ARCHS=auto
python3 -m pip install --no-build-isolation -v . > $OUT/pip-verbose.log 2>&1; echo "pip rc=$?"
b=$(ls -d build/pip-*)
grep -E "CMAKE_CXX_COMPILER:|CMAKE_CUDA_COMPILER:|CMAKE_CUDA_HOST_COMPILER|LINKER_FLAGS:|CMAKE_CXX_FLAGS:|CMAKE_CUDA_FLAGS:" $b/CMakeCache.txt
grep -A4 "^build python/fmha/libfmha.so" $b/build.ninja | grep -vE "^build" | cut -c1-400
grep -B1 -A8 "rule CXX_SHARED_LIBRARY_LINKER__fmha" $b/CMakeFiles/rules.ninja | cut -c1-600
lib=$(python3 -c "import fmha, os; print(os.path.dirname(fmha.__file__))")/libfmha.so
readelf -d $lib | grep NEEDED
echo "exported std symbols: $(nm -D --defined-only $lib | grep -c ' _ZN\?K\?St\| _ZNSt\| _ZTISt')"
cd /tmp
for p in select_d256 fwd_softcap; do python3 $root/probe/fmha_probe.py $p > /tmp/p.log 2>&1; rc=$?; tail -2 /tmp/p.log; echo "$p rc=$rc"; done
cd $root
echo "== candidate: libstdc++ symbols hidden (--exclude-libs,ALL)"
CMAKE_ARGS="-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" python3 -m pip install --no-build-isolation -q . > $OUT/pip2.log 2>&1; echo "pip rc=$?"
readelf -d $lib | grep NEEDED
echo "exported std symbols: $(nm -D --defined-only $lib | grep -c ' _ZN\?K\?St\| _ZNSt\| _ZTISt')"
cd /tmp
for p in select_d256 explain_d256 fwd_d256 fwd_softcap fwd_window; do python3 $root/probe/fmha_probe.py $p > /tmp/p.log 2>&1; rc=$?; tail -2 /tmp/p.log; echo "$p rc=$rc"; done
