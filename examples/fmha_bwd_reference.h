// A float64 CPU reference of fmha::bwd for the problems of examples/fmha_bwd.cpp (the Problem
// of fmha_fwd_reference.h), written from the gradient formulas rather than by differentiating
// the forward. With s the logits of fmha_fwd_reference.h (after soft-capping, bias and ALiBi)
// over the keys the mask leaves visible, and lse their log-sum-exp:
//   P_ij   = exp(s_ij - lse_i)
//   Pd_ij  = P_ij * keep_ij / (1 - p_drop)         (dropout; keep = 1 without)
//   dV_j   = sum_i Pd_ij dO_i
//   dP_ij  = (dO_i . V_j) * keep_ij / (1 - p_drop)
//   D_i    = dO_i . O_i                             (= sum_j P_ij dP_ij)
//   dS_ij  = P_ij (dP_ij - D_i)                     (the gradient of s_ij, and of the bias)
//   dR_ij  = dS_ij (1 - tanh^2(R_ij / softcap))     (R = scale * q_i . k_j; soft-capping only)
//   dQ_i   = scale * sum_j dR_ij K_j,   dK_j = scale * sum_i dR_ij Q_i
// dK and dV are summed over the query heads that share a K/V head (MQA/GQA). A row that sees no
// key has dQ = 0, a key that no row sees dK = dV = 0. O in D_i is the forward kernel's output,
// which the backward reads: its rounding is the backward's input, not its error (where a row
// sees one key, dS is that rounding alone).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "fmha_fwd_reference.h"

namespace fmha_example {

// The gradients fmha::bwd wrote, as floats: dq (token, nhead_q, hdim_q), dk (token, nhead_k,
// hdim_q), dv (token, nhead_k, hdim_v) in the layouts of Q, K and V; dbias (batch, nhead_q,
// bias_rows, bias_ld), the full gradient of the bias (empty without -dbias).
struct Gradients {
  std::vector<float> dq, dk, dv, dbias;
};

// The largest error of one gradient over the elements compared, where it is, and the largest
// reference value (the scale of the tolerance).
struct GradError {
  double err = 0.0;
  double ref_max = 0.0;
  int worst_b = -1, worst_h = -1, worst_row = -1;

  void add(double got, double ref, int b, int h, int row) {
    ref_max = std::max(ref_max, std::abs(ref));
    const double e = abs_error(got, ref);
    if (e > err) err = e, worst_b = b, worst_h = h, worst_row = row;
  }
  void merge(const GradError& o) {
    ref_max = std::max(ref_max, o.ref_max);
    if (o.err > err) err = o.err, worst_b = o.worst_b, worst_h = o.worst_h, worst_row = o.worst_row;
  }
  // err relative to the largest reference value (relative to 1 when that is below 1).
  double relative() const { return err / std::max(ref_max, 1.0); }
};

struct BwdErrors {
  GradError dq, dk, dv, dbias;

  void merge(const BwdErrors& o) { dq.merge(o.dq), dk.merge(o.dk), dv.merge(o.dv), dbias.merge(o.dbias); }
};

// Checks K/V head hk of sequence b: dK and dV of its used keys, and dQ (and dbias) of the used
// rows of the query heads that share it. `out` is the forward's O and `dout` dO, in O's layout.
inline BwdErrors check_kv_head(const Problem& p, const HostInputs& in, const std::vector<float>& out,
                               const std::vector<float>& dout, const Gradients& got, bool dbias, int b,
                               int hk) {
  const int len_q = p.len_q[b], len_k = p.len_k[b], group = p.nhead_q / p.nhead_k;
  const int dq_dim = p.hdim_q, dv_dim = p.hdim_v;
  const int64_t offset = key_offset(p, len_q, len_k);
  const double keep_scale = 1.0 / (1.0 - p.p_drop);
  std::vector<double> dk(int64_t(len_k) * dq_dim, 0.0), dv(int64_t(len_k) * dv_dim, 0.0);
  std::vector<double> capped(len_k), logit(len_k), prob(len_k), dprob(len_k), keep(len_k, 1.0), dq(dq_dim);
  BwdErrors e;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const double slope = p.bias == fmha::BiasType::kAlibi ? in.slopes[b * p.alibi_batch_stride() + h] : 0.0;
    for (int i = 0; i < len_q; ++i) {
      const int64_t row = (p.cu_q[b] + i) * p.nhead_q + h;
      const float* qi = &in.q[row * dq_dim];
      const float* oi = &out[row * dv_dim];
      const float* doi = &dout[row * dv_dim];
      const auto [first, last] = visible_keys(p, i, len_q, len_k);
      double row_max = -std::numeric_limits<double>::infinity();
      for (int64_t j = first; j <= last; ++j) {
        const float* kj = &in.k[((p.cu_k[b] + j) * p.nhead_k + hk) * dq_dim];
        double s = 0.0;
        for (int c = 0; c < dq_dim; ++c) s += double(qi[c]) * kj[c];
        s *= p.scale;
        if (p.softcap > 0.f) s = p.softcap * std::tanh(s / p.softcap);
        capped[j] = s;
        if (p.bias == fmha::BiasType::kElementwise) s += in.bias[p.bias_index(b, h, i, int(j))];
        if (p.bias == fmha::BiasType::kAlibi) s -= slope * std::abs(double(i + offset - j));
        logit[j] = s;
        row_max = std::max(row_max, s);
      }
      double sum = 0.0;
      for (int64_t j = first; j <= last; ++j) sum += prob[j] = std::exp(logit[j] - row_max);
      if (p.p_drop > 0.f) dropout_keep_row(p, b, h, i, len_k, &keep);
      double d_row = 0.0;
      for (int c = 0; c < dv_dim; ++c) d_row += double(doi[c]) * oi[c];
      for (int64_t j = first; j <= last; ++j) {
        prob[j] /= sum;
        const int64_t kv = (p.cu_k[b] + j) * p.nhead_k + hk;
        const float* vj = &in.v[kv * dv_dim];
        double dpd = 0.0;
        for (int c = 0; c < dv_dim; ++c) dpd += double(doi[c]) * vj[c];
        dprob[j] = dpd * keep[j] * keep_scale;
        const double pd = prob[j] * keep[j] * keep_scale;
        for (int c = 0; c < dv_dim; ++c) dv[j * dv_dim + c] += pd * doi[c];
      }
      std::fill(dq.begin(), dq.end(), 0.0);
      for (int64_t j = 0; j < len_k; ++j) {
        const bool seen = first <= j && j <= last;
        double ds = seen ? prob[j] * (dprob[j] - d_row) : 0.0;
        if (dbias) {
          const int64_t at = ((int64_t(b) * p.nhead_q + h) * p.bias_rows + i) * p.bias_ld + j;
          e.dbias.add(got.dbias[at], ds, b, h, i);
        }
        if (!seen) continue;
        if (p.softcap > 0.f) ds *= 1.0 - (capped[j] / p.softcap) * (capped[j] / p.softcap);
        const float* kj = &in.k[((p.cu_k[b] + j) * p.nhead_k + hk) * dq_dim];
        for (int c = 0; c < dq_dim; ++c) {
          dq[c] += p.scale * ds * kj[c];
          dk[j * dq_dim + c] += p.scale * ds * qi[c];
        }
      }
      for (int c = 0; c < dq_dim; ++c) e.dq.add(got.dq[row * dq_dim + c], dq[c], b, h, i);
    }
  }
  for (int j = 0; j < len_k; ++j) {
    const int64_t kv = (p.cu_k[b] + j) * p.nhead_k + hk;
    for (int c = 0; c < dq_dim; ++c) e.dk.add(got.dk[kv * dq_dim + c], dk[int64_t(j) * dq_dim + c], b, hk, j);
    for (int c = 0; c < dv_dim; ++c) e.dv.add(got.dv[kv * dv_dim + c], dv[int64_t(j) * dv_dim + c], b, hk, j);
  }
  return e;
}

// check_kv_head() over every (sequence, K/V head), on all CPU cores.
inline BwdErrors check_bwd(const Problem& p, const HostInputs& in, const std::vector<float>& out,
                           const std::vector<float>& dout, const Gradients& got, bool dbias) {
  const int jobs = p.batch * p.nhead_k;
  const int workers = std::max(1, std::min<int>(int(std::thread::hardware_concurrency()), jobs));
  std::vector<BwdErrors> found(workers);
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int job; (job = next++) < jobs;) {
        found[w].merge(check_kv_head(p, in, out, dout, got, dbias, job / p.nhead_k, job % p.nhead_k));
      }
    });
  }
  BwdErrors all;
  for (int w = 0; w < workers; ++w) pool[w].join(), all.merge(found[w]);
  return all;
}

}  // namespace fmha_example
