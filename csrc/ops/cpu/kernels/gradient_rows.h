// Where the backward stores dq, dk and dv (attention_backward_kernel.cpp).
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "row_ops.h"
#include "row_sources.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Where dq, dk or dv is stored: in q's dtype, rounded once, or, where the call gave delta (a
// step of a larger call, whose shares its caller sums), in acc_t as summed.
template <typename scalar_t, typename acc_t>
class GradientRows {
 public:
  GradientRows(const at::Tensor& t, const int32_t* offsets)
      : rounded_(t.scalar_type() == c10::CppTypeToScalarType<scalar_t>::value),
        rows_(t, offsets),
        sums_(t, offsets) {}

  // factor * src (n values) as row r of head h of batch item b.
  void store(const acc_t* src, int64_t n, acc_t factor, int64_t b, int64_t h, int64_t r) const {
    if (rounded_) {
      store_scaled_row(src, n, factor, rows_.row(b, h, r));
    } else {
      store_scaled_row(src, n, factor, sums_.row(b, h, r));
    }
  }
  // The rows in q's dtype, for float32/float64 (where acc_t is that dtype).
  const HeadRows<scalar_t>& rows() const { return rows_; }

 private:
  bool rounded_;
  HeadRows<scalar_t> rows_;
  HeadRows<acc_t> sums_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
