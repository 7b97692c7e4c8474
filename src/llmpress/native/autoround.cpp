/* AutoRound's weight on its grid (integers, or fp4's e2m1 values), forward and backward, as
 * PyTorch operators (AVX2).
 *
 *   autoround_qdq: out = (round(clamp(w / s + v (+ z), lo, hi)) (- z)) * s, one value per weight,
 *     s and z one per group of ``group`` columns (the last group may be shorter), the rounding
 *     half to even onto the integers or onto fp4's values (steps of 0.5, 1, 2). The operations
 *     of modifiers/autoround/rounding.py's _on_grid element by element, each rounded as PyTorch
 *     rounds it (built with -ffp-contract=off; -0.0 comes out of the rounding as 0.0), so the
 *     values are the same bit for bit. PyTorch takes about ten passes over the weight for it.
 *   autoround_qdq_backward: the gradients of the offsets v, the steps s and the zero points z,
 *     the rounding passed straight through and the clamp's where m lies in [lo, hi]: on integer
 *     grids m is the rounded value r (the clamp taken after the rounding, as auto-round's int
 *     quantizers take it; the same values), on fp4 the unrounded x (clamped first, as its fp4
 *     quantizers do):
 *       dv = g s [m in range],  ds = sum over the group of g (q - z) - g [m in range] w / s,
 *       dz = sum over the group of g s ([m in range] - 1).
 *     In one pass instead of about twenty; the sums run in another order than autograd's, so
 *     ds and dz may differ from it in the last bits (AutoRound steps on their sign).
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>
#include <stdint.h>

#include "rounding.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

namespace {

using llmpress::round_even;

/* fp4 (e2m1): the magnitude rounded half to even in steps of 0.5 below 2, 1 below 4, 2 above,
 * the sign kept, as quant/qdq.py's round_to_grid computes it */
static inline float round_fp4(float x) {
    const float m = std::fabs(x), step = (m >= 2.0f ? 0.5f : 0.0f) + (m >= 4.0f ? 1.0f : 0.0f) + 0.5f;
    return std::copysign(round_even(m / step) * step, x);
}

static inline __m256 round_fp4(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), m = _mm256_andnot_ps(sign, x);
    const __m256 step = _mm256_add_ps(
        _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(m, _mm256_set1_ps(2.0f), _CMP_GE_OQ), _mm256_set1_ps(0.5f)),
                      _mm256_and_ps(_mm256_cmp_ps(m, _mm256_set1_ps(4.0f), _CMP_GE_OQ), _mm256_set1_ps(1.0f))),
        _mm256_set1_ps(0.5f));
    return _mm256_or_ps(_mm256_mul_ps(round_even(_mm256_div_ps(m, step)), step), _mm256_and_ps(sign, x));
}

static inline float on_grid(float x, bool fp4) { return fp4 ? round_fp4(x) : round_even(x); }
static inline __m256 on_grid(__m256 x, bool fp4) { return fp4 ? round_fp4(x) : round_even(x); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

struct Grid {
    const float *w, *v, *s, *z;
    int64_t rows, cols, groups, group;
    float lo, hi;
    bool fp4;
};

static Grid grid_of(const at::Tensor &weight, const at::Tensor &offset, const at::Tensor &step,
                    const std::optional<at::Tensor> &zero, int64_t group, double q_min, double q_max, bool fp4, const char *op) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
                "llmpress ", op, ": weight must be contiguous float32 [rows, cols]");
    TORCH_CHECK(offset.scalar_type() == at::kFloat && offset.sizes() == weight.sizes() && offset.is_contiguous(),
                "llmpress ", op, ": offset must be float32 shaped as the weight");
    const int64_t rows = weight.size(0), cols = weight.size(1);
    TORCH_CHECK(group > 0, "llmpress ", op, ": group must be positive");
    const int64_t groups = (cols + group - 1) / group;
    TORCH_CHECK(step.scalar_type() == at::kFloat && step.dim() == 2 && step.size(0) == rows && step.size(1) == groups &&
                    step.is_contiguous(),
                "llmpress ", op, ": step must be contiguous float32 [rows, groups]");
    TORCH_CHECK(!zero || (zero->scalar_type() == at::kFloat && zero->sizes() == step.sizes() && zero->is_contiguous()),
                "llmpress ", op, ": zero must be float32 shaped as step");
    return {weight.data_ptr<float>(), offset.data_ptr<float>(), step.data_ptr<float>(),
            zero ? zero->data_ptr<float>() : nullptr, rows, cols, groups, group, (float)q_min, (float)q_max, fp4};
}

/* grain: rows a thread takes at a time, about 32k values */
static int64_t grain(const Grid &g) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(g.cols, 1)); }

at::Tensor autoround_qdq(const at::Tensor &weight, const at::Tensor &offset, const at::Tensor &step,
                         const std::optional<at::Tensor> &zero, int64_t group, double q_min, double q_max, bool fp4) {
    const Grid g = grid_of(weight, offset, step, zero, group, q_min, q_max, fp4, "autoround_qdq");
    at::Tensor out = at::empty_like(weight);
    float *o = out.data_ptr<float>();
    at::parallel_for(0, g.rows, grain(g), [&](int64_t r0, int64_t r1) {
        const __m256 lo = _mm256_set1_ps(g.lo), hi = _mm256_set1_ps(g.hi), zero_f = _mm256_setzero_ps();
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < g.groups; k++) {
                const float s = g.s[r * g.groups + k], z = g.z ? g.z[r * g.groups + k] : 0.0f;
                const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
                const int64_t c0 = k * g.group, c1 = std::min(g.cols, c0 + g.group), base = r * g.cols;
                int64_t c = c0;
                for (; c + 8 <= c1; c += 8) {
                    __m256 x = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(g.w + base + c), vs), _mm256_loadu_ps(g.v + base + c));
                    if (g.z) x = _mm256_add_ps(x, vz);
                    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
                    __m256 q = _mm256_add_ps(on_grid(x, g.fp4), zero_f);
                    if (g.z) q = _mm256_sub_ps(q, vz);
                    _mm256_storeu_ps(o + base + c, _mm256_mul_ps(q, vs));
                }
                for (; c < c1; c++) {
                    float x = g.w[base + c] / s + g.v[base + c];
                    if (g.z) x = x + z;
                    float q = on_grid(std::min(std::max(x, g.lo), g.hi), g.fp4) + 0.0f;
                    if (g.z) q = q - z;
                    o[base + c] = q * s;
                }
            }
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> autoround_qdq_backward(
    const at::Tensor &grad, const at::Tensor &weight, const at::Tensor &offset, const at::Tensor &step,
    const std::optional<at::Tensor> &zero, int64_t group, double q_min, double q_max, bool fp4) {
    const Grid g = grid_of(weight, offset, step, zero, group, q_min, q_max, fp4, "autoround_qdq_backward");
    TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.sizes() == weight.sizes() && grad.is_contiguous(),
                "llmpress autoround_qdq_backward: grad must be contiguous float32 shaped as the weight");
    at::Tensor d_offset = at::empty_like(weight), d_step = at::empty_like(step);
    at::Tensor d_zero = zero ? at::empty_like(step) : at::empty({0}, step.options());
    const float *go = grad.data_ptr<float>();
    float *dv = d_offset.data_ptr<float>(), *ds = d_step.data_ptr<float>(), *dz = zero ? d_zero.data_ptr<float>() : nullptr;
    at::parallel_for(0, g.rows, grain(g), [&](int64_t r0, int64_t r1) {
        const __m256 lo = _mm256_set1_ps(g.lo), hi = _mm256_set1_ps(g.hi), zero_f = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < g.groups; k++) {
                const float s = g.s[r * g.groups + k], z = g.z ? g.z[r * g.groups + k] : 0.0f;
                const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
                const int64_t c0 = k * g.group, c1 = std::min(g.cols, c0 + g.group), base = r * g.cols;
                __m256 sum_s = _mm256_setzero_ps(), sum_z = _mm256_setzero_ps();
                int64_t c = c0;
                for (; c + 8 <= c1; c += 8) {
                    const __m256 scaled = _mm256_div_ps(_mm256_loadu_ps(g.w + base + c), vs), gv = _mm256_loadu_ps(go + base + c);
                    __m256 x = _mm256_add_ps(scaled, _mm256_loadu_ps(g.v + base + c));
                    if (g.z) x = _mm256_add_ps(x, vz);
                    const __m256 r = on_grid(x, g.fp4), m = g.fp4 ? x : r;
                    const __m256 inside = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(m, lo, _CMP_GE_OQ), _mm256_cmp_ps(m, hi, _CMP_LE_OQ)), one);
                    __m256 q = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), zero_f);
                    if (g.z) q = _mm256_sub_ps(q, vz);
                    const __m256 gs = _mm256_mul_ps(gv, vs), passed = _mm256_mul_ps(gs, inside);
                    _mm256_storeu_ps(dv + base + c, passed);
                    sum_s = _mm256_add_ps(sum_s, _mm256_sub_ps(_mm256_mul_ps(gv, q), _mm256_mul_ps(_mm256_mul_ps(gv, inside), scaled)));
                    if (g.z) sum_z = _mm256_add_ps(sum_z, _mm256_sub_ps(passed, gs));
                }
                float total_s = hsum(sum_s), total_z = hsum(sum_z);
                for (; c < c1; c++) {
                    const float scaled = g.w[base + c] / s, gv = go[base + c];
                    float x = scaled + g.v[base + c];
                    if (g.z) x = x + z;
                    const float r = on_grid(x, g.fp4), m = g.fp4 ? x : r, inside = (m >= g.lo && m <= g.hi) ? 1.0f : 0.0f;
                    float q = std::min(std::max(r, g.lo), g.hi) + 0.0f;
                    if (g.z) q = q - z;
                    const float gs = gv * s, passed = gs * inside;
                    dv[base + c] = passed;
                    total_s += gv * q - gv * inside * scaled;
                    total_z += passed - gs;
                }
                ds[r * g.groups + k] = total_s;
                if (dz) dz[r * g.groups + k] = total_z;
            }
    });
    return {d_offset, d_step, d_zero};
}

at::Tensor autoround_qdq_meta(const at::Tensor &weight, const at::Tensor &offset, const at::Tensor &step,
                              const std::optional<at::Tensor> &zero, int64_t group, double q_min, double q_max, bool fp4) {
    return at::empty_like(weight);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmpress, m) {
    m.def("autoround_qdq(Tensor weight, Tensor offset, Tensor step, Tensor? zero, int group, float q_min, float q_max, bool fp4) -> Tensor");
    m.def("autoround_qdq_backward(Tensor grad, Tensor weight, Tensor offset, Tensor step, Tensor? zero, int group, "
          "float q_min, float q_max, bool fp4) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) {
    m.impl("autoround_qdq", &autoround_qdq);
    m.impl("autoround_qdq_backward", &autoround_qdq_backward);
}

TORCH_LIBRARY_IMPL(llmpress, Meta, m) { m.impl("autoround_qdq", &autoround_qdq_meta); }
