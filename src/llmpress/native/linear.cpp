/* llmpress's CPU kernels for quantized linear layers (AVX2 + FMA), as the PyTorch operators
 * torch.ops.llmpress.int4_linear / int4_dequantize / int8_linear_bf16 (eager calls and
 * torch.compile'd graphs reach them alike). Threads by OpenMP, the runtime PyTorch itself uses
 * (at::parallel_for measured 1.5x slower here).
 *
 * 4-bit weights are in the blocks64 layout (blocks64.h): a shift and a mask give 16 values as
 * 16-bit integers in place, with no widening shuffle.
 * table: float32 [1 or 2][rows][groups]: the scale s of each group, and its zero z (absent:
 * symmetric), meaning w = (u - 8) * s + z. Groups are 32 columns or a multiple of 64. Each plane's
 * rows are contiguous, the planes may be apart: a slice of rows of a larger table (a fused
 * product's, runtime/fusion.py) is a view, not a copy.
 *
 * For few rows of x (decode) the product works in integers: each row of x is quantized per
 * weight group to int16 (step amax / 32767: error 1.5e-5 of the group's largest value, far
 * below bf16's rounding), u * x16 pairs are summed by _mm256_madd_epi16 into int32, and each
 * group's sum is scaled once. Every byte of the weight is read once per call, one row at a time
 * (a single stream per thread measured 1.5x faster than interleaving four rows), so the product
 * runs near memory speed. Longer inputs (prefill) dequantize rows of the weight for a matrix
 * product in x's dtype: float32 rows a few MB at a time, or for bf16 x the weight as bf16 (the
 * float32 value rounded to nearest even: exactly a dense bf16 model of the same weights), on
 * AMX tiles where they apply (amx.cpp), else in pieces of up to 8M values, one oneDNN product
 * each (bf16 products measured 6x float32 on AMX; pieces under 2048 rows slowed them by
 * 10-50%). The caller sends bf16 x here only on CPUs with native bf16 arithmetic; elsewhere
 * float32 is faster.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "blocks64.h"

namespace {

using llmpress::quarter;

constexpr int64_t GEMV_MAX_ROWS = 16; /* rows of x (tokens) that take the integer product: measured faster than
                                        * dequantizing up to 16-32 rows (576 to 2048 columns) */
constexpr int64_t DEQUANT_ROWS = 512; /* weight rows dequantized at a time for longer inputs */
constexpr int64_t BF16_VALUES = 8 << 20; /* bf16 weight values dequantized at a time (16 MB), at least 2048 rows */
constexpr int64_t PREFETCH_BYTES = 2048; /* how far ahead of its row the integer product asks for the weight: the
                                          * hardware's prefetcher stops at each 4 KB page; with this, 10.4 -> 12.5 GB/s
                                          * on SmolLM2-sized products, 10.4 -> 14-16 GB/s on 2048-wide ones (1-3 KB
                                          * ahead measured alike) */
constexpr int64_t SERIAL_BELOW = 1 << 16; /* weights x rows of x under which one thread does the product */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* 8 values of x from index i, as float32 (x float32, or bf16 when bf16 is set) */
static inline __m256 load_x8(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Row i of x as int16 per group: xq = round(x / step) (halves away from zero), step = amax /
 * 32767; xstep[g] = step, xsum[g] = step * sum(xq) (the group's sum of x as the kernel sees it).
 * 8 values at a time (groups are multiples of 32): a call's fixed cost, 1-3 us in scalar code
 * for 576-1536 columns, which a decode step of 200 small products paid 200 times. */
static void quantize_row(const void *x, int bf16, int64_t cols, int64_t group, int16_t *xq, float *xstep, float *xsum) {
    const int64_t groups = cols / group;
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (int64_t g = 0; g < groups; g++) {
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t j = g * group; j < (g + 1) * group; j += 8)
            vmax = _mm256_max_ps(_mm256_andnot_ps(sign, load_x8(x, bf16, j)), vmax); /* a NaN is passed over */
        const float amax = hmax(vmax);
        const float step = amax > 0.0f ? amax / 32767.0f : 1.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / step);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t j = g * group; j < (g + 1) * group; j += 16) {
            __m256i q[2];
            for (int h = 0; h < 2; h++) {
                __m256 v = _mm256_mul_ps(load_x8(x, bf16, j + 8 * h), inv);
                v = _mm256_add_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), half)); /* v -+ 0.5, then toward zero */
                q[h] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvttps_epi32(v), hi), lo);
                sum = _mm256_add_epi32(sum, q[h]);
            }
            _mm256_storeu_si256((__m256i *)(xq + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8));
        }
        xstep[g] = step;
        xsum[g] = step * (float)hsum_epi32(sum);
    }
}

/* The m rows of x quantized by quantize_row, in buffers of the calling thread kept between calls. */
struct QuantizedRows {
    const int16_t *q;
    const float *step, *sum;
};

static QuantizedRows quantize_rows(const void *x, bool bf16, int64_t m, int64_t cols, int64_t group) {
    const int64_t groups = cols / group;
    static thread_local std::vector<int16_t> xq;
    static thread_local std::vector<float> xstep, xsum;
    xq.resize(m * cols), xstep.resize(m * groups), xsum.resize(m * groups);
    for (int64_t i = 0; i < m; i++)
        quantize_row(bf16 ? (const void *)((const uint16_t *)x + i * cols) : (const void *)((const float *)x + i * cols), bf16,
                     cols, group, xq.data() + i * cols, xstep.data() + i * groups, xsum.data() + i * groups);
    return {xq.data(), xstep.data(), xsum.data()};
}

/* One row of the weight times one quantized row of x. */
static inline float gemv_row(const uint8_t *wr, const float *scale, const float *zero, const int16_t *xq, const float *xstep,
                             const float *xsum, int64_t cols, int64_t group) {
    const int64_t groups = cols / group;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    if (group == 32) { /* two groups per 64-column block: quarters 0-1 and 2-3 */
        for (int64_t g = 0; g < groups; g += 2) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wr + g * 16));
            const int16_t *xb = xq + g * 32;
            __m256i a = _mm256_add_epi32(_mm256_madd_epi16(quarter(v, 0), _mm256_loadu_si256((const __m256i *)xb)),
                                         _mm256_madd_epi16(quarter(v, 1), _mm256_loadu_si256((const __m256i *)(xb + 16))));
            __m256i b = _mm256_add_epi32(_mm256_madd_epi16(quarter(v, 2), _mm256_loadu_si256((const __m256i *)(xb + 32))),
                                         _mm256_madd_epi16(quarter(v, 3), _mm256_loadu_si256((const __m256i *)(xb + 48))));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(scale[g] * xstep[g]), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_set1_ps(scale[g + 1] * xstep[g + 1]), acc);
            corr += ((zero ? zero[g] : 0.0f) - 8.0f * scale[g]) * xsum[g];
            corr += ((zero ? zero[g + 1] : 0.0f) - 8.0f * scale[g + 1]) * xsum[g + 1];
        }
        return hsum(acc) + corr;
    }
    const int64_t blocks = group / 64;
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot = _mm256_setzero_si256();
        for (int64_t b = 0; b < blocks; b++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wr + g * (group / 2) + b * 32));
            const int16_t *xb = xq + g * group + b * 64;
            __m256i p0 = _mm256_madd_epi16(quarter(v, 0), _mm256_loadu_si256((const __m256i *)xb));
            __m256i p1 = _mm256_madd_epi16(quarter(v, 1), _mm256_loadu_si256((const __m256i *)(xb + 16)));
            __m256i p2 = _mm256_madd_epi16(quarter(v, 2), _mm256_loadu_si256((const __m256i *)(xb + 32)));
            __m256i p3 = _mm256_madd_epi16(quarter(v, 3), _mm256_loadu_si256((const __m256i *)(xb + 48)));
            dot = _mm256_add_epi32(dot, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[g] * xstep[g]), acc);
        corr += ((zero ? zero[g] : 0.0f) - 8.0f * scale[g]) * xsum[g]; /* w = u*s + (z - 8s) */
    }
    return hsum(acc) + corr;
}

/* out[i][r] = sum_c x[i][c] * w[r][c] for i < m (x and out float32, or bf16 when bf16 is set). */
void gemv(const uint8_t *w, const float *scale, const float *zero, const void *x, void *out, bool bf16, int64_t m, int64_t rows,
          int64_t cols, int64_t group) {
    const int64_t groups = cols / group, half = cols / 2;
    const QuantizedRows xs = quantize_rows(x, bf16, m, cols, group);
    const int16_t *xqp = xs.q;
    const float *xstepp = xs.step, *xsump = xs.sum;
    /* small products run on the calling thread: waking the others costs more than they save */
    const int threads = rows * cols * m >= SERIAL_BELOW ? at::get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t off = 0; off < half; off += 64) _mm_prefetch((const char *)(w + r * half + off + PREFETCH_BYTES), _MM_HINT_T0);
        for (int64_t i = 0; i < m; i++) {
            float value = gemv_row(w + r * half, scale + r * groups, zero ? zero + r * groups : nullptr, xqp + i * cols,
                                   xstepp + i * groups, xsump + i * groups, cols, group);
            if (bf16)
                ((uint16_t *)out)[i * rows + r] = f32_to_bf16(value);
            else
                ((float *)out)[i * rows + r] = value;
        }
    }
}

/* The largest of 128 / 64 / 32 columns dividing cols: the groups x is quantized in for an int8
 * weight (which has one scale per row); 0 when none divides. */
static inline int64_t int8_x_group(int64_t cols) {
    for (int64_t g : {128, 64, 32})
        if (cols % g == 0) return g;
    return 0;
}

/* out[i][r] = scale[r] * sum_c x[i][c] * q[r][c] - corr[r] * sum_c x[i][c], for an int8 weight q:
 * x quantized to int16 per group as for 4-bit weights, the weight's bytes widened to int16 16 at a
 * time and summed by _mm256_madd_epi16 (at most 8 pairs of |128 * 32767| per int32 lane and
 * group: no overflow), each group's sum scaled once. One weight row at a time, prefetched ahead. */
void gemv_int8(const int8_t *w, const float *scale, const float *corr, const void *x, void *out, bool bf16, int64_t m, int64_t rows,
               int64_t cols) {
    const int64_t group = int8_x_group(cols), groups = cols / group;
    const QuantizedRows xs = quantize_rows(x, bf16, m, cols, group);
    float xtotal[GEMV_MAX_ROWS]; /* each row's sum as the kernel sees it (the caller allows at most GEMV_MAX_ROWS) */
    for (int64_t i = 0; i < m; i++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) total += xs.sum[i * groups + g];
        xtotal[i] = total;
    }
    const int16_t *xqp = xs.q;
    const float *xstepp = xs.step, *xtotalp = xtotal;
    const int threads = rows * cols * m >= SERIAL_BELOW ? at::get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *wr = w + r * cols;
        for (int64_t off = 0; off < cols; off += 64) _mm_prefetch((const char *)(wr + off + PREFETCH_BYTES), _MM_HINT_T0);
        for (int64_t i = 0; i < m; i++) {
            const int16_t *xr = xqp + i * cols;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                __m256i dot = _mm256_setzero_si256();
                for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
                    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + c)));
                    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + c + 16)));
                    dot = _mm256_add_epi32(dot, _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(xr + c))),
                                                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + c + 16)))));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xstepp[i * groups + g]), acc);
            }
            float value = scale[r] * hsum(acc) - (corr ? corr[r] * xtotalp[i] : 0.0f);
            if (bf16)
                ((uint16_t *)out)[i * rows + r] = f32_to_bf16(value);
            else
                ((float *)out)[i * rows + r] = value;
        }
    }
}

/* 8 float32 values rounded to bf16 (nearest, ties to even; no NaN in a dequantized weight). */
static inline __m128i bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* 16 values of one quarter, scaled (v * s + b: exactly (u - 8) * s when z = 0), stored as
 * float32 (T = float) or bf16 (T = uint16_t). */
template <typename T>
static inline void store_quarter(T *o, __m256i q, __m256 vs, __m256 vb) {
    __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(q))), vs, vb);
    __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(q, 1))), vs, vb);
    if constexpr (sizeof(T) == 4) {
        _mm256_storeu_ps((float *)o, lo);
        _mm256_storeu_ps((float *)o + 8, hi);
    } else {
        _mm_storeu_si128((__m128i *)o, bf16x8(lo));
        _mm_storeu_si128((__m128i *)(o + 8), bf16x8(hi));
    }
}

/* Rows [r0, r1) of the weight into out[(r1 - r0)][cols]: float32 (T = float) or bf16 (T = uint16_t).
 * Group by group, so that no column needs a division to find its group. */
template <typename T>
void dequantize(const uint8_t *w, const float *scale, const float *zero, T *out, int64_t r0, int64_t r1, int64_t cols, int64_t group) {
    const int64_t groups = cols / group, half = cols / 2;
    const int threads = at::get_num_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * half;
        const float *sr = scale + r * groups, *zr = zero ? zero + r * groups : nullptr;
        T *o = out + (r - r0) * cols;
        /* w = u * s + (z - 8s) for group g */
        auto factors = [&](int64_t g, __m256 &vs, __m256 &vb) { vs = _mm256_set1_ps(sr[g]), vb = _mm256_set1_ps((zr ? zr[g] : 0.0f) - 8.0f * sr[g]); };
        __m256 vs, vb, vs2, vb2;
        if (group == 32) { /* two groups per 64 columns: quarters 0-1, then 2-3 */
            for (int64_t g = 0; g < groups; g += 2) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wr + g * 16));
                factors(g, vs, vb), factors(g + 1, vs2, vb2);
                store_quarter(o + g * 32, quarter(v, 0), vs, vb), store_quarter(o + g * 32 + 16, quarter(v, 1), vs, vb);
                store_quarter(o + g * 32 + 32, quarter(v, 2), vs2, vb2), store_quarter(o + g * 32 + 48, quarter(v, 3), vs2, vb2);
            }
            continue;
        }
        for (int64_t g = 0; g < groups; g++) {
            factors(g, vs, vb);
            for (int64_t c = g * group; c < (g + 1) * group; c += 64) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wr + c / 2));
                for (int k = 0; k < 4; k++) store_quarter(o + c + 16 * k, quarter(v, k), vs, vb);
            }
        }
    }
}

/* x [m, cols] times the weight's rows, which fill(dense, r0, r1) dequantizes a piece at a time
 * into a buffer kept between calls (a fresh one costs its page faults every time: 4 MB of them
 * took longer than the product itself), one product per piece; one buffer per dtype. */
template <typename Fill>
at::Tensor piecewise_product(const at::Tensor &wide, int64_t rows, int64_t cols, int64_t piece, Fill fill) {
    static thread_local at::Tensor buffers[2]; /* float32, bf16 */
    at::Tensor &buffer = buffers[wide.scalar_type() == at::kBFloat16];
    piece = std::max<int64_t>(1, std::min(rows, piece));
    if (!buffer.defined() || buffer.numel() < piece * cols) buffer = at::empty({piece * cols}, wide.options());
    std::vector<at::Tensor> parts;
    for (int64_t r0 = 0; r0 < rows; r0 += piece) {
        const int64_t r1 = std::min(rows, r0 + piece);
        at::Tensor dense = buffer.narrow(0, 0, (r1 - r0) * cols).view({r1 - r0, cols});
        fill(dense.data_ptr(), r0, r1);
        parts.push_back(at::mm(wide, dense.t()));
    }
    return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
}

/* Rows of bf16 values per piece: BF16_VALUES, at least 2048 rows. */
static inline int64_t bf16_piece(int64_t cols) { return std::max<int64_t>(2048, BF16_VALUES / std::max<int64_t>(cols, 1)); }

/* A table of [1 or 2][rows][groups] float32 whose planes each hold their rows one after another. */
static bool table_fits(const at::Tensor &table, int64_t rows, int64_t groups) {
    return table.scalar_type() == at::kFloat && table.dim() == 3 && (table.size(0) == 1 || table.size(0) == 2) && table.size(1) == rows &&
           table.size(2) == groups && (groups <= 1 || table.stride(2) == 1) && (rows <= 1 || table.stride(1) == groups);
}

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    const int64_t cols = x.size(-1), rows = weight.size(0);
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && table.device().is_cpu(), "llmpress int4_linear runs on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) * 2 == cols && weight.is_contiguous(),
                "llmpress int4_linear: weight must be contiguous uint8 [out, in / 2], in = ", cols);
    TORCH_CHECK((group == 32 || group % 64 == 0) && group > 0 && cols % group == 0 && cols % 64 == 0, "llmpress int4_linear: group ", group,
                " must be 32 or a multiple of 64 dividing ", cols, " (a multiple of 64)");
    TORCH_CHECK(table_fits(table, rows, cols / group), "llmpress int4_linear: table must be float32 [1 or 2, out, in / group] with contiguous planes");
    const float *scale = table.data_ptr<float>();
    const float *zero = table.size(0) == 2 ? scale + table.stride(0) : nullptr;
    const uint8_t *w = weight.data_ptr<uint8_t>();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = rows;
    const int64_t m = cols > 0 ? x.numel() / cols : 0;
    if (m <= GEMV_MAX_ROWS) { /* decode: no reshape, view or copy unless the input needs one (each costs a dispatch) */
        const bool bf16 = x.scalar_type() == at::kBFloat16;
        at::Tensor input = (bf16 || x.scalar_type() == at::kFloat) ? x : x.to(at::kFloat);
        if (!input.is_contiguous()) input = input.contiguous();
        at::Tensor out = at::empty(shape, input.options());
        gemv(w, scale, zero, input.data_ptr(), out.data_ptr(), bf16, m, rows, cols, group);
        return input.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
    }
    if (x.scalar_type() == at::kBFloat16) {
        at::Tensor wide = x.reshape({m, cols}).contiguous();
        if (llmpress::amx_takes(rows, cols)) {
            at::Tensor out = at::empty(shape, x.options());
            llmpress::amx_int4_product((const uint16_t *)wide.data_ptr(), m, w, scale, zero, rows, cols, group, (uint16_t *)out.data_ptr());
            return out;
        }
        return piecewise_product(wide, rows, cols, bf16_piece(cols), [&](void *dense, int64_t r0, int64_t r1) {
                   dequantize<uint16_t>(w, scale, zero, (uint16_t *)dense, r0, r1, cols, group);
               }).view(shape);
    }
    at::Tensor wide = x.reshape({m, cols}).to(at::kFloat).contiguous();
    return piecewise_product(wide, rows, cols, DEQUANT_ROWS, [&](void *dense, int64_t r0, int64_t r1) {
               dequantize<float>(w, scale, zero, (float *)dense, r0, r1, cols, group);
           }).view(shape).to(x.scalar_type());
}

at::Tensor int4_dequantize(const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    const int64_t rows = weight.size(0), cols = weight.size(1) * 2;
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && (group == 32 || group % 64 == 0) && cols % group == 0 &&
                    cols % 64 == 0 && table_fits(table, rows, cols / group),
                "llmpress int4_dequantize: weight uint8 [out, in / 2], table float32 [1 or 2, out, in / group] with contiguous planes");
    const float *scale = table.data_ptr<float>();
    const float *zero = table.size(0) == 2 ? scale + table.stride(0) : nullptr;
    at::Tensor out = at::empty({rows, cols}, table.options());
    dequantize<float>(weight.data_ptr<uint8_t>(), scale, zero, out.data_ptr<float>(), 0, rows, cols, group);
    return out;
}

/* 8-bit weights [rows][cols] with one scale (and zero correction zp * scale) per row, as bf16
 * values q * s - c rounded from float32, 16 at a time. */
void dequantize_int8(const int8_t *w, const float *scale, const float *corr, uint16_t *out, int64_t r0, int64_t r1, int64_t cols) {
    const int threads = at::get_num_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = w + r * cols;
        uint16_t *o = out + (r - r0) * cols;
        const __m256 vs = _mm256_set1_ps(scale[r]), vc = _mm256_set1_ps(corr ? corr[r] : 0.0f);
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            __m128i q = _mm_loadu_si128((const __m128i *)(wr + c));
            __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
            _mm_storeu_si128((__m128i *)(o + c), bf16x8(_mm256_fmsub_ps(lo, vs, vc)));
            _mm_storeu_si128((__m128i *)(o + c + 8), bf16x8(_mm256_fmsub_ps(hi, vs, vc)));
        }
        for (; c < cols; c++) o[c] = f32_to_bf16(std::fma((float)wr[c], scale[r], -(corr ? corr[r] : 0.0f)));
    }
}

/* Prefill of an 8-bit weight on a CPU with native bf16: x (bf16) times the weight dequantized
 * to bf16 a piece at a time, one oneDNN product per piece (PyTorch's _weight_int8pack_mm, the
 * decode kernel, runs 13x slower at 512 rows). */
at::Tensor int8_linear_bf16(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale, const c10::optional<at::Tensor> &correction) {
    const int64_t cols = x.size(-1), rows = weight.size(0);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "llmpress int8_linear_bf16: x must be bf16 on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == cols && weight.is_contiguous(),
                "llmpress int8_linear_bf16: weight must be contiguous int8 [out, in], in = ", cols);
    TORCH_CHECK(scale.numel() == rows && (!correction.has_value() || correction->numel() == rows),
                "llmpress int8_linear_bf16: scale (and correction) must hold one value per output row");
    at::Tensor s = scale.to(at::kFloat).contiguous();
    at::Tensor c = correction.has_value() ? correction->to(at::kFloat).contiguous() : at::Tensor();
    const float *cp = c.defined() ? c.data_ptr<float>() : nullptr;
    const int64_t m = cols > 0 ? x.numel() / cols : 0;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = rows;
    const int8_t *w = weight.data_ptr<int8_t>();
    at::Tensor wide = x.reshape({m, cols}).contiguous();
    if (llmpress::amx_takes(rows, cols)) {
        at::Tensor out = at::empty(shape, x.options());
        llmpress::amx_int8_product((const uint16_t *)wide.data_ptr(), m, w, s.data_ptr<float>(), cp, rows, cols, (uint16_t *)out.data_ptr());
        return out;
    }
    return piecewise_product(wide, rows, cols, bf16_piece(cols), [&](void *dense, int64_t r0, int64_t r1) {
               dequantize_int8(w, s.data_ptr<float>(), cp, (uint16_t *)dense, r0, r1, cols);
           }).view(shape);
}

/* Decode with an 8-bit weight: x (float32 or bf16, up to GEMV_MAX_ROWS rows of a multiple of 32
 * columns) times q [out, in] (int8) with float32 scale and correction (zp * scale) per row. */
at::Tensor int8_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale, const c10::optional<at::Tensor> &correction) {
    const int64_t cols = x.size(-1), rows = weight.size(0);
    TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "llmpress int8_linear: x must be float32 or bf16 on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == cols && weight.is_contiguous() &&
                    int8_x_group(cols) > 0,
                "llmpress int8_linear: weight must be contiguous int8 [out, in] with in a multiple of 32, in = ", cols);
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == rows && scale.is_contiguous() &&
                    (!correction.has_value() || (correction->scalar_type() == at::kFloat && correction->numel() == rows && correction->is_contiguous())),
                "llmpress int8_linear: scale (and correction) must be contiguous float32, one value per output row");
    const int64_t m = cols > 0 ? x.numel() / cols : 0;
    TORCH_CHECK(m <= GEMV_MAX_ROWS, "llmpress int8_linear: at most ", GEMV_MAX_ROWS, " rows of x (decode), got ", m);
    at::Tensor input = x.is_contiguous() ? x : x.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = rows;
    at::Tensor out = at::empty(shape, input.options());
    gemv_int8(weight.data_ptr<int8_t>(), scale.data_ptr<float>(), correction.has_value() ? correction->data_ptr<float>() : nullptr,
              input.data_ptr(), out.data_ptr(), x.scalar_type() == at::kBFloat16, m, rows, cols);
    return out;
}

/* Shapes alone, for torch.compile's tracing (fake tensors run the Meta kernels). */
at::Tensor int4_linear_meta(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    return at::empty(shape, x.options());
}

/* int8_linear and int8_linear_bf16 alike: x's shape with the weight's rows, in x's dtype. */
at::Tensor int8_linear_meta(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale, const c10::optional<at::Tensor> &correction) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    return at::empty(shape, x.options());
}

at::Tensor int4_dequantize_meta(const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    return at::empty({weight.size(0), weight.size(1) * 2}, table.options());
}

}  // namespace

TORCH_LIBRARY(llmpress, m) {
    m.def("int4_linear(Tensor x, Tensor weight, Tensor table, int group) -> Tensor");
    m.def("int4_dequantize(Tensor weight, Tensor table, int group) -> Tensor");
    m.def("int8_linear_bf16(Tensor x, Tensor weight, Tensor scale, Tensor? correction) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? correction) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) {
    m.impl("int4_linear", &int4_linear);
    m.impl("int4_dequantize", &int4_dequantize);
    m.impl("int8_linear_bf16", &int8_linear_bf16);
    m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_IMPL(llmpress, Meta, m) {
    m.impl("int4_linear", &int4_linear_meta);
    m.impl("int4_dequantize", &int4_dequantize_meta);
    m.impl("int8_linear_bf16", &int8_linear_meta);
    m.impl("int8_linear", &int8_linear_meta);
}
