// The host-cost probes' timer (scripts/host_costs_api.cpp, scripts/host_costs_fa3.cu).
#pragma once

#include <cuda_runtime.h>

#include <chrono>

// Mean host microseconds per call of fn over `calls` calls, after as many untimed ones; the
// GPU is drained before and after, and `calls` must be few enough that the launch queue never
// fills (the GPU keeps up with the calls).
template <class Fn>
double us_per_call(Fn fn, int calls) {
  for (int i = 0; i < calls; ++i) fn();
  cudaDeviceSynchronize();
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  const auto end = std::chrono::steady_clock::now();
  cudaDeviceSynchronize();
  return std::chrono::duration<double, std::micro>(end - begin).count() / calls;
}
