// The decoder's small ops fused, for the CPU: what torch runs as five to seven ops each (an RMSNorm,
// a residual add and the next RMSNorm, rotary embedding, SiLU times the up projection) in one pass
// over the rows. In a decode step every op costs a few microseconds of dispatch whatever its size,
// and a small model's step runs hundreds of them.
//
// Each op computes what core/model.py's torch code computes, rounding where it rounds: float32 math,
// with a bf16 result rounded back to bf16 wherever torch's bf16 ops round (so bf16 models see the
// same numbers up to the order of the sums).
//
// Built on first use by core/native.py; registered as torch.ops.pagechat.* so traced steps record
// them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kGrainElems = 1 << 16;  // below this a thread split costs more than it saves

template <class T>
inline float f32(T v) { return static_cast<float>(v); }

// torch's bf16 ops compute in float and round each result to bf16; float32 ops round to float.
template <class T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 2, op,
              ": a contiguous CPU tensor [..., H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bf16");
}

template <class F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(width, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) body(r);
                   });
}

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, as RMSNorm.forward: float32
// math; in bf16 the normalised row is rounded to bf16 before the weight multiplies it.
template <class T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t h, T* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < h; ++i) ss += f32(x[i]) * f32(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    y[i] = static_cast<T>(f32(w[i]) * round_to<T>(f32(x[i]) * r));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(), "rms_norm: a weight [H] in x's dtype");
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) {
      rms_norm_row(xp + r * h, wp, static_cast<float>(eps), h, yp + r * h);
    });
  });
  return y;
}

// (rms_norm(x + residual), x + residual): the residual add between two sublayers and the norm
// of the next, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.is_contiguous(), "add_rms_norm: a residual shaped as x");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(), "add_rms_norm: a weight [H] in x's dtype");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) {
      for (int64_t i = 0; i < h; ++i) {
        sp[r * h + i] = static_cast<scalar_t>(f32(xp[r * h + i]) + f32(rp[r * h + i]));
      }
      rms_norm_row(sp + r * h, wp, static_cast<float>(eps), h, yp + r * h);
    });
  });
  return {y, sum};
}

// silu(gate) * up for gate_up [..., 2I] = (gate, up): MLP's activation, as torch rounds it.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t i2 = gate_up.size(-1), inter = i2 / 2, rows = gate_up.numel() / i2;
  TORCH_CHECK(i2 % 2 == 0, "silu_mul: gate and up of one size");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor y = at::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, i2, [&](int64_t r) {
      const scalar_t* g = gp + r * i2;
      for (int64_t i = 0; i < inter; ++i) {
        const float v = f32(g[i]);
        const float s = round_to<scalar_t>(v / (1.0f + std::exp(-v)));
        yp[r * inter + i] = static_cast<scalar_t>(s * f32(g[inter + i]));
      }
    });
  });
  return y;
}

// Rotary embedding of x [T, heads, D] with core/model.py's tables cos and signed sin [T, 1, D]:
// x * cos + (x rolled by D/2) * sin, where the roll brings x's other half to each position. x may
// be a slice of the fused qkv projection's rows (any row and head strides); the result is dense.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope: a CPU x [T, heads, D] with D even and D's elements adjacent");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rope: float32 or bf16");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.numel() == t * d && sin.numel() == t * d && cos.is_contiguous() &&
                  sin.is_contiguous(), "rope: cos and sin [T, 1, D] in x's dtype");
  at::Tensor y = at::empty({t, heads, d}, x.options());
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(t * heads, d, [&](int64_t row) {
      const scalar_t* xr = xp + (row / heads) * row_stride + (row % heads) * head_stride;
      const scalar_t *c = cp + (row / heads) * d, *s = sp + (row / heads) * d;
      for (int64_t i = 0; i < d; ++i) {
        const float a = round_to<scalar_t>(f32(xr[i]) * f32(c[i]));
        const float b = round_to<scalar_t>(f32(xr[(i + half) % d]) * f32(s[i]));
        yp[row * d + i] = static_cast<scalar_t>(a + b);
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagechat, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagechat, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
}
