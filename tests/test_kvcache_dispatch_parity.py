"""The C++ dispatcher's choice of KV-cache instance (runtime/src/dispatcher.cpp) must be the
generator's mirror's (generator/dispatch.py: first_serving), as tests/test_dispatch_parity.py
checks for the forward and the backward through fmha.select.

A build of few instances (CI's, the development one) may hold no KV-cache instance, so this
links the dispatcher with a rendered table of the coverage preset's (every kvcache trait,
caches of the queries' dtype and e4m3, decode and chunked prefill, exact and head-dim-padded)
and stub launchers, as test_generator_render.py's drivers do: no GPU, no nvcc. For problems
drawn around every instance (head dims at, below and off its own; both cache dtypes; decode
steps and chunks, GQA packing, page sizes of multiples of 8 or not, left-padded sequences),
on an A100, an sm86 GPU and an H100, both must run the same instance or both miss.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess

import pytest
from conftest import REPO_ROOT, repository
from test_generator_render import CUDA_INCLUDE, CUDA_LIB, RUNTIME_SOURCES, needs_cpp

from generator.dispatch import Problem, first_serving
from generator.render import render
from generator.schema import KV_DTYPE

CASES = 1500
CAPABILITIES = (80, 86, 90)

# Reads one problem a line (its traits as enum values, its shapes, the device) and prints the
# instance the dispatcher runs, or "-" on a miss.
DRIVER = """\
#include <iostream>

#include "dispatcher.h"

namespace fmha::detail::instances {
%s
}  // namespace fmha::detail::instances

int main() {
  static const int32_t ints[1] = {};
  int dtype, kv_dtype, hdim_q, hdim_v, mask, bias, paged, softcap, seqlen_q, group, page_size,
      leftpad, cc;
  while (std::cin >> dtype >> kv_dtype >> hdim_q >> hdim_v >> mask >> bias >> paged >> softcap
         >> seqlen_q >> group >> page_size >> leftpad >> cc) {
    fmha::KvcacheArgs a;
    a.dtype = static_cast<fmha::DataType>(dtype);
    a.kv_dtype = static_cast<fmha::KvCacheDtype>(kv_dtype);
    a.hdim_q = hdim_q;
    a.hdim_v = hdim_v;
    a.mask = static_cast<fmha::MaskType>(mask);
    a.bias = static_cast<fmha::BiasType>(bias);
    a.softcap = softcap ? 5.f : 0.f;
    a.batch = 1;
    a.seqlen_q = seqlen_q;
    a.nhead_k = 2;
    a.nhead_q = 2 * group;
    a.seqlen_cache = a.batch_cache = 4096;
    if (paged) {
      a.block_table = ints;
      a.page_size = page_size;
    }
    if (leftpad) a.cache_leftpad = ints;
    const fmha::detail::KvcacheInstanceEntry* chosen = nullptr;
    const fmha::Status st = fmha::detail::select_instance(a, cc, &chosen);
    std::cout << (st.ok() ? chosen->name : "-") << "\\n";
  }
}
"""


def problems(instances, rng):
    # A quarter around the chunked-prefill instances, which are few, mostly on their GPU.
    prefill = [i for i in instances if i.point.pipeline.token == "fa3"]
    for _ in range(CASES):
        around_prefill = rng.random() < 0.25
        own = rng.choice(prefill if around_prefill else instances).point.traits
        hdim_q, hdim_v = rng.choice([(own.hdim_q, own.hdim_v),
                                     (max(8, own.hdim_q - 8 * rng.randint(1, 4)),) * 2,
                                     (max(16, own.hdim_q - 16 * rng.randint(1, 4)),) * 2,
                                     (own.hdim_q + 16, own.hdim_v + 16)])
        kv_dtype = own.kv_dtype if rng.random() < 0.8 else rng.choice(list(KV_DTYPE))
        traits = dataclasses.replace(own, hdim_q=hdim_q, hdim_v=hdim_v, kv_dtype=kv_dtype)
        page_size = rng.choice([8, 16, 12, 64]) if traits.paged else 0
        yield Problem(traits, seqlen_q=rng.choice([1, 4, 31, 32, 127, 128, 192, 512]),
                      seqlen_k=4096, seqused=False,
                      cc=90 if around_prefill and rng.random() < 0.8 else rng.choice(CAPABILITIES),
                      page_size=page_size, group=rng.choice([1, 4, 8]),
                      leftpad=not traits.paged and rng.random() < 0.2)


def line(problem: Problem) -> str:
    t = problem.traits
    fields = (t.dtype.value, t.kv_dtype.value, t.hdim_q, t.hdim_v, t.mask.value, t.bias.value,
              int(t.paged), int(t.softcap), problem.seqlen_q, problem.group, problem.page_size,
              int(problem.leftpad), problem.cc)
    return " ".join(map(str, fields))


@needs_cpp
@pytest.mark.skipif(not (CUDA_LIB / "libcudart.so").exists(), reason="needs libcudart")
def test_runtime_chooses_the_kvcache_instance_the_generator_rule_chooses(tmp_path):
    selection = repository().select("coverage", "kvcache")
    instances = selection.instances
    assert {i.point.traits.kv_dtype.token for i in instances} == {"same", "e4m3"}
    files = render(selection, source="instances.yaml")
    stubs = "\n".join(f"cudaError_t launch_{i.name}(const KvcacheArgs&, cudaStream_t) "
                      f"{{ return cudaSuccess; }}\n"
                      f"size_t workspace_{i.name}(const KvcacheArgs&) {{ return 0; }}"
                      for i in instances)
    (tmp_path / "driver.cpp").write_text(DRIVER % stubs)
    (tmp_path / "dispatch_table.cpp").write_text(files["dispatch_table.cpp"])
    program = tmp_path / "parity"
    compiled = subprocess.run(
        ["g++", "-std=c++17", "-O0", "-o", str(program),
         "-I", str(REPO_ROOT / "runtime/include"), "-I", str(REPO_ROOT / "runtime/src"),
         "-I", str(CUDA_INCLUDE), str(tmp_path / "driver.cpp"), *RUNTIME_SOURCES,
         str(tmp_path / "dispatch_table.cpp"), f"-L{CUDA_LIB}", f"-Wl,-rpath,{CUDA_LIB}",
         "-lcudart"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    cases = list(problems(instances, random.Random(20261128)))
    ran = subprocess.run([str(program)], input="".join(f"{line(p)}\n" for p in cases),
                         capture_output=True, text=True, check=True)
    chosen = ran.stdout.splitlines()
    assert len(chosen) == len(cases)
    runs = {"same": 0, "e4m3": 0, "prefill": 0, "e4m3 prefill": 0, "miss": 0}
    for problem, name in zip(cases, chosen):
        expected = first_serving(instances, problem)
        assert name == (expected.name if expected else "-"), problem
        if expected is None:
            runs["miss"] += 1
            continue
        runs[expected.point.traits.kv_dtype.token] += 1
        runs["prefill"] += expected.point.pipeline.token == "fa3"
        # An e4m3 cache runs exactly its instance's head dims; chunks of it the chunked-prefill
        # kernel at d64 and d128 only (d256's staging stages do not fit), else the decode one.
        if expected.point.traits.kv_dtype.token == "e4m3":
            assert not expected.point.pad_hdim
            if expected.point.pipeline.token == "fa3":
                assert expected.point.traits.hdim_q in (64, 128)
                runs["e4m3 prefill"] += 1
    # The draw reaches every kind of outcome.
    assert min(runs.values()) > 20, runs
