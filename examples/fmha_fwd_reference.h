// The problem examples/fmha_fwd.cpp runs, and a float64 CPU reference of what fmha.h promises
// for it: masks with either alignment and windows, elementwise bias with broadcasting, ALiBi,
// soft-capping, dropout (the host side of the kernels' Philox pattern), MQA/GQA, group mode
// and effective lengths, and the log-sum-exp.
//
// The logit of query row i and key j is, in this order:
//   s = softmax_scale * (q_i . k_j)
//   s = softcap * tanh(s / softcap)                 (softcap > 0)
//   s = s + bias[b][h][i][j]                        (elementwise bias)
//   s = s - slope[b][h] * |i + offset - j|          (ALiBi)
// over the keys the mask leaves visible; lse = log(sum_j exp(s_j)) and
// o_i = sum_j softmax(s)_j * keep_j / (1 - p_drop) * v_j. A row that sees no key has o = 0 and
// lse = -inf.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "fmha/fmha.h"
#include "fmha/kernels/philox.cuh"

namespace fmha_example {

// One forward problem, resolved from the command line. Sequence b keeps rows_q[b] query rows in
// memory and uses the first len_q[b] of them (likewise for keys): in batch mode rows_q[b] is -s
// for every b and len_q[b] its effective length; in group mode rows_q[b] is the sequence's
// stride in tokens (-s_qpad) and len_q[b] its length.
struct Problem {
  fmha::DataType dtype = fmha::DataType::kFP16;
  fmha::Mode mode = fmha::Mode::kBatch;
  int batch = 0, nhead_q = 0, nhead_k = 0, hdim_q = 0, hdim_v = 0;
  std::vector<int> len_q, len_k, rows_q, rows_k;
  std::vector<int64_t> cu_q, cu_k;  // batch + 1 prefix sums of rows_*: sequence b's first row
  bool seqused_q = false, seqused_k = false;  // pass len_* to the library as seqused_*

  float scale = 0.f;
  fmha::MaskType mask = fmha::MaskType::kNone;
  fmha::MaskAlign align = fmha::MaskAlign::kTopLeft;
  int window_left = -1, window_right = -1;

  fmha::BiasType bias = fmha::BiasType::kNone;
  bool bias_per_batch = false;  // elementwise bias and ALiBi slopes: one per sequence, else shared
  bool bias_per_head = false;   // elementwise bias: one per head, else shared (ALiBi: always)
  int bias_rows = 0, bias_ld = 0;  // elementwise bias: rows per (b, h) and the row stride

  fmha::VLayout vlayout = fmha::VLayout::kRowMajor;
  bool lse = false;
  float p_drop = 0.f;
  uint64_t drop_seed = 0;
  uint32_t drop_offset = 0;
  float softcap = 0.f;

  int64_t tokens_q() const { return cu_q.back(); }
  int64_t tokens_k() const { return cu_k.back(); }

  // Elementwise bias: (batch or 1, nhead_q or 1, bias_rows, bias_ld), broadcast by zero strides.
  int64_t bias_seq_stride() const { return bias_ld; }
  int64_t bias_head_stride() const { return bias_per_head ? int64_t(bias_rows) * bias_ld : 0; }
  int64_t bias_batch_stride() const {
    return bias_per_batch ? int64_t(bias_per_head ? nhead_q : 1) * bias_rows * bias_ld : 0;
  }
  int64_t bias_elements() const {
    return int64_t(bias_per_batch ? batch : 1) * (bias_per_head ? nhead_q : 1) * bias_rows * bias_ld;
  }
  int64_t bias_index(int b, int h, int i, int j) const {
    return b * bias_batch_stride() + h * bias_head_stride() + int64_t(i) * bias_ld + j;
  }
  int64_t alibi_batch_stride() const { return bias_per_batch ? nhead_q : 0; }

  // LSE: (batch, nhead_q, seqlen_q) in batch mode; (nhead_q, total rows) in group mode.
  int64_t lse_batch_stride() const { return mode == fmha::Mode::kBatch ? int64_t(nhead_q) * rows_q[0] : 0; }
  int64_t lse_head_stride() const { return mode == fmha::Mode::kBatch ? rows_q[0] : tokens_q(); }
  int64_t lse_elements() const { return int64_t(nhead_q) * tokens_q(); }
  int64_t lse_index(int b, int h, int i) const {
    const int64_t first = mode == fmha::Mode::kBatch ? b * lse_batch_stride() : cu_q[b];
    return first + h * lse_head_stride() + i;
  }
};

// Host copies of the inputs as the device holds them after rounding to fp16/bf16, in the logical
// layouts (Q, K, V: (token, head, hdim) rows, V row-major whatever -vlayout says).
struct HostInputs {
  std::vector<float> q, k, v, bias, slopes;
};

// The key that query row i sits on: 0 top-left, len_k - len_q bottom-right (mask and ALiBi).
inline int64_t key_offset(const Problem& p, int len_q, int len_k) {
  return p.align == fmha::MaskAlign::kBottomRight ? int64_t(len_k) - len_q : 0;
}

// The keys [first, last] query row i of a (len_q, len_k) sequence sees; first > last: none.
inline std::pair<int64_t, int64_t> visible_keys(const Problem& p, int i, int len_q, int len_k) {
  const int64_t diagonal = i + key_offset(p, len_q, len_k);
  int64_t first = 0, last = int64_t(len_k) - 1;
  if (p.mask == fmha::MaskType::kCausal) {
    last = std::min(last, diagonal);
  } else if (p.mask == fmha::MaskType::kWindow) {
    if (p.window_left >= 0) first = std::max(first, diagonal - p.window_left);
    if (p.window_right >= 0) last = std::min(last, diagonal + p.window_right);
  }
  return {first, last};
}

// The (query, key) pairs one head computes, summed over the sequences: the FLOP count's base.
inline int64_t visible_pairs(const Problem& p) {
  int64_t pairs = 0;
  for (int b = 0; b < p.batch; ++b) {
    for (int i = 0; i < p.len_q[b]; ++i) {
      const auto [first, last] = visible_keys(p, i, p.len_q[b], p.len_k[b]);
      pairs += std::max<int64_t>(0, last - first + 1);
    }
  }
  return pairs;
}

// ALiBi's slopes for n heads (Press et al.): a geometric sequence from 2^(-8/n) when n is a power
// of two; otherwise those of the power of two below, then every other one of twice that.
inline std::vector<float> alibi_slopes(int nhead) {
  int pow2 = 1;
  while (pow2 * 2 <= nhead) pow2 *= 2;
  std::vector<float> slopes;
  for (int h = 0; h < pow2; ++h) slopes.push_back(float(std::pow(2.0, -8.0 * (h + 1) / pow2)));
  for (int h = 0; int(slopes.size()) < nhead; ++h) {
    slopes.push_back(float(std::pow(2.0, -8.0 * (2 * h + 1) / (2 * pow2))));
  }
  return slopes;
}

// The dropout keep decisions of keys 0 .. len_k - 1 of query row i of head h of sequence b: the
// Philox word of philox.cuh that decides each (row, key), kept where it reaches the threshold.
inline void dropout_keep_row(const Problem& p, int b, int h, int i, int len_k, std::vector<double>* keep) {
  const uint32_t threshold = fmha::philox::drop_threshold(p.p_drop);
  const uint32_t batch_head = uint32_t(b) * uint32_t(p.nhead_q) + uint32_t(h);
  for (int j = 0; j < len_k; j += 2) {
    const fmha::philox::Words words =
        fmha::philox::dropout_words(p.drop_seed, p.drop_offset, batch_head, uint32_t(i), uint32_t(j));
    for (int key = j; key < j + 2 && key < len_k; ++key) {
      (*keep)[key] = words.w[fmha::philox::dropout_word(uint32_t(i), uint32_t(key))] >= threshold;
    }
  }
}

struct Errors {
  double out = 0.0;  // max |o - ref| over the used rows (NaN counts as infinite)
  double lse = 0.0;  // max |lse - ref| (equal infinities count as 0)
  int worst_b = -1, worst_h = -1, worst_row = -1;  // where `out` was found
  int64_t written_padding = 0;  // output elements past a sequence's used rows that are not NaN

  void merge(const Errors& e) {
    if (e.out > out) out = e.out, worst_b = e.worst_b, worst_h = e.worst_h, worst_row = e.worst_row;
    lse = std::max(lse, e.lse);
    written_padding += e.written_padding;
  }
};

inline double abs_error(double got, double ref) {
  if (got == ref) return 0.0;  // also -inf == -inf
  return std::isnan(got) ? std::numeric_limits<double>::infinity() : std::abs(got - ref);
}

// Checks head h of sequence b: `out` is O as (token, nhead_q, hdim_v) floats, poisoned with NaN
// before the run; `lse` the log-sum-exp in Problem's layout (empty without -lse).
inline Errors check_head(const Problem& p, const HostInputs& in, const std::vector<float>& out,
                         const std::vector<float>& lse, int b, int h) {
  const int len_q = p.len_q[b], len_k = p.len_k[b], hk = h / (p.nhead_q / p.nhead_k);
  const int64_t offset = key_offset(p, len_q, len_k);
  const double slope = p.bias == fmha::BiasType::kAlibi ? in.slopes[b * p.alibi_batch_stride() + h] : 0.0;
  std::vector<double> logit(len_k), keep(len_k, 1.0), acc(p.hdim_v);
  Errors e;
  for (int i = 0; i < len_q; ++i) {
    const float* qi = &in.q[((p.cu_q[b] + i) * p.nhead_q + h) * p.hdim_q];
    const auto [first, last] = visible_keys(p, i, len_q, len_k);
    double row_max = -std::numeric_limits<double>::infinity();
    for (int64_t j = first; j <= last; ++j) {
      const float* kj = &in.k[((p.cu_k[b] + j) * p.nhead_k + hk) * p.hdim_q];
      double s = 0.0;
      for (int c = 0; c < p.hdim_q; ++c) s += double(qi[c]) * kj[c];
      s *= p.scale;
      if (p.softcap > 0.f) s = p.softcap * std::tanh(s / p.softcap);
      if (p.bias == fmha::BiasType::kElementwise) s += in.bias[p.bias_index(b, h, i, int(j))];
      if (p.bias == fmha::BiasType::kAlibi) s -= slope * std::abs(double(i + offset - j));
      logit[j] = s;
      row_max = std::max(row_max, s);
    }
    double sum = 0.0;
    for (int64_t j = first; j <= last; ++j) sum += logit[j] = std::exp(logit[j] - row_max);
    if (p.p_drop > 0.f) dropout_keep_row(p, b, h, i, len_k, &keep);
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = first; j <= last; ++j) {
      const double weight = logit[j] * keep[j];
      const float* vj = &in.v[((p.cu_k[b] + j) * p.nhead_k + hk) * p.hdim_v];
      for (int c = 0; c < p.hdim_v; ++c) acc[c] += weight * vj[c];
    }
    const double norm = first <= last ? 1.0 / (sum * (1.0 - p.p_drop)) : 0.0;
    const float* oi = &out[((p.cu_q[b] + i) * p.nhead_q + h) * p.hdim_v];
    for (int c = 0; c < p.hdim_v; ++c) {
      const double err = abs_error(oi[c], acc[c] * norm);
      if (err > e.out) e.out = err, e.worst_b = b, e.worst_h = h, e.worst_row = i;
    }
    if (p.lse) {
      const double ref = first <= last ? row_max + std::log(sum) : -std::numeric_limits<double>::infinity();
      e.lse = std::max(e.lse, abs_error(lse[p.lse_index(b, h, i)], ref));
    }
  }
  // fmha.h: output rows past seqused_q are left untouched, so they still hold the poison.
  for (int i = len_q; i < p.rows_q[b]; ++i) {
    const float* oi = &out[((p.cu_q[b] + i) * p.nhead_q + h) * p.hdim_v];
    e.written_padding += std::count_if(oi, oi + p.hdim_v, [](float x) { return !std::isnan(x); });
  }
  return e;
}

// check_head() over every (sequence, head), on all CPU cores.
inline Errors check(const Problem& p, const HostInputs& in, const std::vector<float>& out,
                    const std::vector<float>& lse) {
  const int jobs = p.batch * p.nhead_q;
  const int workers = std::max(1, std::min<int>(int(std::thread::hardware_concurrency()), jobs));
  std::vector<Errors> found(workers);
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int job; (job = next++) < jobs;) {
        found[w].merge(check_head(p, in, out, lse, job / p.nhead_q, job % p.nhead_q));
      }
    });
  }
  Errors all;
  for (int w = 0; w < workers; ++w) pool[w].join(), all.merge(found[w]);
  return all;
}

}  // namespace fmha_example
