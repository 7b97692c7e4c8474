/* llmpress's CPU kernels for GPTQ's small, many steps (AVX2), as PyTorch operators:
 *
 *   gptq_columns: one inner block of GPTQ's update. Column i (a row of the transposed weight) is
 *     rounded onto its grid, its error w - q kept, and every later column k of the block updated
 *     by -upper[i][k] * (w - q). In PyTorch that is six operator calls per column (47 000 columns
 *     in a 1024-hidden Llama); here one call per block.
 *   candidate_errors: the MSE observer's squared error of each candidate scale, per unit, in one
 *     pass over the weight instead of seven passes through a temporary of the candidates' size.
 *   transpose_into: a weight copied transposed, GPTQ's way in and out of its column layout.
 *   add_float32_: a float32 product added into a float64 sum (the Hessians), without a temporary.
 *   permute_rows_: a matrix's rows (and columns) put in activation order in its own memory,
 *     along the permutation's cycles with one row of scratch (linalg.py's Python loop made a
 *     copy call per row: 5% of a mixed-precision run's time, which permutes a weight per option).
 *
 * Both do the float operations of the PyTorch code they replace (quant/observers.py,
 * modifiers/gptq/algorithm.py) element by element: divide, round half to even, add / subtract
 * the zero point, clamp, multiply, subtract, each rounded as PyTorch rounds it (the library is
 * built with -ffp-contract=off). Two places differ in the last bit: the update of later columns
 * is one fused multiply-add (PyTorch's addr_ goes to BLAS, which fuses most elements but not
 * all), and candidate_errors adds each unit's squares in another order.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <stdint.h>

#include "rounding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using llmpress::round_even;

constexpr int64_t ROW_CHUNK = 256; /* weight rows taken at a time: the block's columns of them stay in L1/L2 */

/* q = (clamp(round(w / s) + z, lo, hi) - z) * s, as _Rounding computes it (z = 0 when symmetric) */
static void gptq_columns_rows(float *inner, float *err, const float *upper, const float *scale, int64_t scale_step,
                              const float *zero, int64_t zero_step, int64_t n, int64_t width, int64_t r0, int64_t r1,
                              float lo, float hi) {
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (int64_t i = 0; i < n; i++) {
        float *w = inner + i * width, *e = err + i * width;
        const float *s = scale + i * scale_step, *z = zero ? zero + i * zero_step : nullptr;
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) {
            __m256 vw = _mm256_loadu_ps(w + r), vs = _mm256_loadu_ps(s + r);
            __m256 q = round_even(_mm256_div_ps(vw, vs));
            if (z) {
                __m256 vz = _mm256_loadu_ps(z + r);
                q = _mm256_sub_ps(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), vlo), vhi), vz);
            } else {
                q = _mm256_min_ps(_mm256_max_ps(q, vlo), vhi);
            }
            q = _mm256_mul_ps(q, vs);
            __m256 d = _mm256_sub_ps(vw, q);
            _mm256_storeu_ps(e + r, d);
            _mm256_storeu_ps(w + r, q);
            for (int64_t k = i + 1; k < n; k++) { /* later columns: w_k - u_ik * d, rounded once */
                __m256 u = _mm256_set1_ps(-upper[i * n + k]);
                float *wk = inner + k * width + r;
                _mm256_storeu_ps(wk, _mm256_fmadd_ps(d, u, _mm256_loadu_ps(wk)));
            }
        }
        for (; r < r1; r++) {
            float q = round_even(w[r] / s[r]);
            q = z ? std::min(std::max(q + z[r], lo), hi) - z[r] : std::min(std::max(q, lo), hi);
            q = q * s[r];
            float d = w[r] - q;
            e[r] = d;
            w[r] = q;
            for (int64_t k = i + 1; k < n; k++) inner[k * width + r] = std::fma(d, -upper[i * n + k], inner[k * width + r]);
        }
    }
}

static void check_rows(const at::Tensor &t, int64_t n, int64_t width, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == n && t.size(1) == width &&
                    t.stride(1) == 1,
                "llmpress gptq_columns: ", name, " must be float32 [", n, ", ", width, "] with contiguous rows");
}

void gptq_columns(at::Tensor inner, at::Tensor err, const at::Tensor &upper, const at::Tensor &scale,
                  const std::optional<at::Tensor> &zero, double q_min, double q_max) {
    const int64_t n = inner.size(0), width = inner.size(1);
    check_rows(inner, n, width, "inner");
    check_rows(err, n, width, "err");
    check_rows(scale, n, width, "scale");
    if (zero) check_rows(*zero, n, width, "zero");
    TORCH_CHECK(inner.stride(0) == width && err.stride(0) == width, "llmpress gptq_columns: inner and err must be contiguous");
    TORCH_CHECK(upper.scalar_type() == at::kFloat && upper.is_contiguous() && upper.dim() == 2 && upper.size(0) == n && upper.size(1) == n,
                "llmpress gptq_columns: upper must be contiguous float32 [", n, ", ", n, "]");
    float *w = inner.data_ptr<float>(), *e = err.data_ptr<float>();
    const float *u = upper.data_ptr<float>(), *s = scale.data_ptr<float>();
    const float *z = zero ? zero->data_ptr<float>() : nullptr;
    const int64_t s_step = scale.stride(0), z_step = zero ? zero->stride(0) : 0;
    const float lo = (float)q_min, hi = (float)q_max;
    /* one thread: a second measured no faster here and left ~40 MB more resident in a GPTQ run */
    for (int64_t r0 = 0; r0 < width; r0 += ROW_CHUNK)
        gptq_columns_rows(w, e, u, s, s_step, z, z_step, n, width, r0, std::min(width, r0 + ROW_CHUNK), lo, hi);
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* sum over one unit's values of ((clamp(round(w / s + z), lo, hi) - z) * s - w)^2, as
 * _candidate_errors computes each term */
static float unit_error(const float *w, int64_t size, float s, const float *zp, float lo, float hi) {
    const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    const float z = zp ? *zp : 0.0f;
    const __m256 vz = _mm256_set1_ps(z);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= size; j += 8) {
        __m256 vw = _mm256_loadu_ps(w + j), x = _mm256_div_ps(vw, vs);
        if (zp) x = _mm256_add_ps(x, vz);
        x = _mm256_min_ps(_mm256_max_ps(round_even(x), vlo), vhi);
        if (zp) x = _mm256_sub_ps(x, vz);
        __m256 d = _mm256_sub_ps(_mm256_mul_ps(x, vs), vw);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(d, d));
    }
    float total = hsum(acc);
    for (; j < size; j++) {
        float x = w[j] / s;
        if (zp) x = x + z;
        x = std::min(std::max(round_even(x), lo), hi);
        if (zp) x = x - z;
        float d = x * s - w[j];
        total += d * d;
    }
    return total;
}

at::Tensor candidate_errors(const at::Tensor &blocks, const at::Tensor &scale, const std::optional<at::Tensor> &zero,
                            double q_min, double q_max) {
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kFloat && blocks.dim() == 3 && blocks.is_contiguous(),
                "llmpress candidate_errors: blocks must be contiguous float32 [rows, units, size]");
    const int64_t rows = blocks.size(0), units = blocks.size(1), size = blocks.size(2);
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 3 && scale.size(1) == rows && scale.size(2) == units &&
                    scale.is_contiguous(),
                "llmpress candidate_errors: scale must be contiguous float32 [candidates, rows, units]");
    TORCH_CHECK(!zero || (zero->scalar_type() == at::kFloat && zero->sizes() == scale.sizes() && zero->is_contiguous()),
                "llmpress candidate_errors: zero must be float32 shaped as scale");
    const int64_t total = scale.numel();
    at::Tensor out = at::empty(scale.sizes(), scale.options());
    const float *w = blocks.data_ptr<float>(), *s = scale.data_ptr<float>();
    const float *z = zero ? zero->data_ptr<float>() : nullptr;
    float *o = out.data_ptr<float>();
    const float lo = (float)q_min, hi = (float)q_max;
    const int64_t per_candidate = rows * units;
    at::parallel_for(0, total, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(size, 1)), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t unit = t % per_candidate; /* row * units + unit: where its values start, / size */
            o[t] = unit_error(w + unit * size, size, s[t], z ? z + t : nullptr, lo, hi);
        }
    });
    return out;
}

at::Tensor candidate_errors_meta(const at::Tensor &blocks, const at::Tensor &scale, const std::optional<at::Tensor> &zero,
                                 double q_min, double q_max) {
    return at::empty(scale.sizes(), scale.options());
}

/* dst = src^T for float32 matrices with contiguous rows (any row stride): 8 x 8 tiles through
 * AVX2 registers. PyTorch's strided copy moves ~2.3 GB/s here; GPTQ transposes every weight
 * in (its update runs on columns) and out. */
static inline void transpose8(const float *s, int64_t ss, float *d, int64_t ds) {
    __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ss), r2 = _mm256_loadu_ps(s + 2 * ss), r3 = _mm256_loadu_ps(s + 3 * ss);
    __m256 r4 = _mm256_loadu_ps(s + 4 * ss), r5 = _mm256_loadu_ps(s + 5 * ss), r6 = _mm256_loadu_ps(s + 6 * ss), r7 = _mm256_loadu_ps(s + 7 * ss);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5), t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    r0 = _mm256_shuffle_ps(t0, t2, 0x44), r1 = _mm256_shuffle_ps(t0, t2, 0xEE), r2 = _mm256_shuffle_ps(t1, t3, 0x44), r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    r4 = _mm256_shuffle_ps(t4, t6, 0x44), r5 = _mm256_shuffle_ps(t4, t6, 0xEE), r6 = _mm256_shuffle_ps(t5, t7, 0x44), r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(r0, r4, 0x20));
    _mm256_storeu_ps(d + ds, _mm256_permute2f128_ps(r1, r5, 0x20));
    _mm256_storeu_ps(d + 2 * ds, _mm256_permute2f128_ps(r2, r6, 0x20));
    _mm256_storeu_ps(d + 3 * ds, _mm256_permute2f128_ps(r3, r7, 0x20));
    _mm256_storeu_ps(d + 4 * ds, _mm256_permute2f128_ps(r0, r4, 0x31));
    _mm256_storeu_ps(d + 5 * ds, _mm256_permute2f128_ps(r1, r5, 0x31));
    _mm256_storeu_ps(d + 6 * ds, _mm256_permute2f128_ps(r2, r6, 0x31));
    _mm256_storeu_ps(d + 7 * ds, _mm256_permute2f128_ps(r3, r7, 0x31));
}

template <typename T> static void permute_rows_typed(T *m, const int64_t *order, int64_t n, int64_t cols, bool columns_too) {
    std::vector<char> done(n, 0);
    std::vector<T> scratch(cols);
    auto put = [&](int64_t row, const T *source) { /* row <- source (its columns in order too) */
        T *dst = m + row * cols;
        if (columns_too) {
            for (int64_t j = 0; j < cols; ++j) dst[j] = source[order[j]];
        } else {
            std::memcpy(dst, source, sizeof(T) * cols);
        }
    };
    for (int64_t start = 0; start < n; ++start) {
        if (done[start]) continue;
        std::memcpy(scratch.data(), m + start * cols, sizeof(T) * cols); /* the cycle's first row, overwritten first */
        int64_t row = start;
        while (true) {
            done[row] = 1;
            const int64_t source = order[row];
            if (source == start) {
                put(row, scratch.data());
                break;
            }
            put(row, m + source * cols);
            row = source;
        }
    }
}

void permute_rows_(at::Tensor matrix, const at::Tensor &perm, bool columns_too) {
    TORCH_CHECK(matrix.device().is_cpu() && matrix.dim() == 2 && matrix.is_contiguous() &&
                    (matrix.scalar_type() == at::kFloat || matrix.scalar_type() == at::kDouble) && perm.device().is_cpu() &&
                    perm.scalar_type() == at::kLong && perm.dim() == 1 && perm.size(0) == matrix.size(0) &&
                    (!columns_too || matrix.size(0) == matrix.size(1)),
                "llmpress permute_rows_: a contiguous float32 / float64 CPU matrix and an int64 permutation of its rows");
    const at::Tensor order = perm.contiguous();
    const int64_t *o = order.data_ptr<int64_t>();
    const int64_t n = matrix.size(0);
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(o[i] >= 0 && o[i] < n, "llmpress permute_rows_: an index out of range");
    if (matrix.scalar_type() == at::kFloat) {
        permute_rows_typed(matrix.data_ptr<float>(), o, n, matrix.size(1), columns_too);
    } else {
        permute_rows_typed(matrix.data_ptr<double>(), o, n, matrix.size(1), columns_too);
    }
}

void transpose_into(at::Tensor dst, const at::Tensor &src) {
    TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu() && src.scalar_type() == at::kFloat && dst.scalar_type() == at::kFloat &&
                    src.dim() == 2 && dst.dim() == 2 && dst.size(0) == src.size(1) && dst.size(1) == src.size(0) && src.stride(1) == 1 &&
                    dst.stride(1) == 1,
                "llmpress transpose_into: float32 dst [n, m] and src [m, n] with contiguous rows");
    const int64_t rows = src.size(0), cols = src.size(1), ss = src.stride(0), ds = dst.stride(0);
    const float *s = src.data_ptr<float>();
    float *d = dst.data_ptr<float>();
    constexpr int64_t TILE = 64; /* 64 x 64 floats: a tile of each side stays in L1 */
    for (int64_t r0 = 0; r0 < rows; r0 += TILE)
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            const int64_t r1 = std::min(rows, r0 + TILE), c1 = std::min(cols, c0 + TILE);
            int64_t r = r0;
            for (; r + 8 <= r1; r += 8) {
                int64_t c = c0;
                for (; c + 8 <= c1; c += 8) transpose8(s + r * ss + c, ss, d + c * ds + r, ds);
                for (; c < c1; c++)
                    for (int64_t k = r; k < r + 8; k++) d[c * ds + k] = s[k * ss + c];
            }
            for (; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) d[c * ds + r] = s[r * ss + c];
        }
}

/* acc += x, a float64 sum of float32 terms (each converted exactly), in one pass: PyTorch's
 * mixed-dtype add_ converts x into a float64 temporary first, 5x the time of the add itself for
 * the Hessians' 128-row blocks. */
void add_float32_(at::Tensor acc, const at::Tensor &x) {
    TORCH_CHECK(acc.device().is_cpu() && x.device().is_cpu() && acc.scalar_type() == at::kDouble && x.scalar_type() == at::kFloat &&
                    acc.is_contiguous() && x.is_contiguous() && acc.sizes() == x.sizes(),
                "llmpress add_float32_: contiguous float64 acc and float32 x of one shape");
    double *a = acc.data_ptr<double>();
    const float *v = x.data_ptr<float>();
    const int64_t n = acc.numel();
    at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
        int64_t i = i0;
        for (; i + 4 <= i1; i += 4)
            _mm256_storeu_pd(a + i, _mm256_add_pd(_mm256_loadu_pd(a + i), _mm256_cvtps_pd(_mm_loadu_ps(v + i))));
        for (; i < i1; i++) a[i] += (double)v[i];
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmpress, m) {
    m.def("gptq_columns(Tensor(a!) inner, Tensor(b!) err, Tensor upper, Tensor scale, Tensor? zero, float q_min, float q_max) -> ()");
    m.def("candidate_errors(Tensor blocks, Tensor scale, Tensor? zero, float q_min, float q_max) -> Tensor");
    m.def("transpose_into(Tensor(a!) dst, Tensor src) -> ()");
    m.def("add_float32_(Tensor(a!) acc, Tensor x) -> ()");
    m.def("permute_rows_(Tensor(a!) matrix, Tensor perm, bool columns_too) -> ()");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) {
    m.impl("gptq_columns", &gptq_columns);
    m.impl("candidate_errors", &candidate_errors);
    m.impl("transpose_into", &transpose_into);
    m.impl("add_float32_", &add_float32_);
    m.impl("permute_rows_", &permute_rows_);
}

TORCH_LIBRARY_IMPL(llmpress, Meta, m) {
    m.impl("candidate_errors", &candidate_errors_meta);
}
