/* llmpress's CPU kernels for 4-bit weights (AVX2 + FMA), as the PyTorch operator
 * torch.ops.llmpress.int4_linear (eager calls and torch.compile'd graphs reach it alike). Threads
 * by OpenMP, the runtime PyTorch itself uses (at::parallel_for measured 1.5x slower here).
 *
 * Weight layout ("blocks32"): w[row][cols / 2] bytes; each run of 32 columns is 16 bytes,
 * byte k holding u = q + 8 of column k in its low nibble and of column k + 16 in its high one.
 * table: float32 [1 or 2][rows][groups]: the scale s of each group, and its zero z (absent:
 * symmetric), meaning w = (u - 8) * s + z.
 *
 * For few rows of x (decode) the product works in integers: each row of x is quantized per
 * weight group to int16 (step amax / 32767: error 1.5e-5 of the group's largest value, far
 * below bf16's rounding), u * x16 pairs are summed by _mm256_madd_epi16 into int32, and each
 * group's sum is scaled once. Every byte of the weight is read once per call, so the product
 * runs at memory speed instead of at the speed of converting nibbles to floats.
 * Longer inputs (prefill) dequantize rows of the weight to float32, a few MB at a time, for
 * float32 matrix products.
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

#include <vector>

namespace {

constexpr int64_t GEMV_MAX_ROWS = 8;  /* rows of x (tokens) that take the integer product */
constexpr int64_t DEQUANT_ROWS = 512; /* weight rows dequantized at a time for longer inputs */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float load_x(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Row i of x as int16 per group: xq = round(x / step), step = amax / 32767; xstep[g] = step,
 * xsum[g] = step * sum(xq) (the group's sum of x as the kernel sees it). */
static void quantize_row(const void *x, int bf16, int64_t cols, int64_t group, int16_t *xq, float *xstep, float *xsum) {
    const int64_t groups = cols / group;
    for (int64_t g = 0; g < groups; g++) {
        float amax = 0.0f;
        for (int64_t j = g * group; j < (g + 1) * group; j++) {
            float v = load_x(x, bf16, j);
            v = v < 0 ? -v : v;
            amax = v > amax ? v : amax;
        }
        float step = amax > 0.0f ? amax / 32767.0f : 1.0f;
        float inv = 1.0f / step;
        int32_t sum = 0;
        for (int64_t j = g * group; j < (g + 1) * group; j++) {
            float v = load_x(x, bf16, j) * inv;
            int32_t q = (int32_t)(v < 0 ? v - 0.5f : v + 0.5f);
            q = q > 32767 ? 32767 : (q < -32767 ? -32767 : q);
            xq[j] = (int16_t)q;
            sum += q;
        }
        xstep[g] = step;
        xsum[g] = step * (float)sum;
    }
}

#define TILE 4 /* weight rows per step: one load of x serves four rows, and four chains run at once */

/* values[k] = row r0 + k of the weight times one quantized row of x, for k < n (n is TILE or 1;
 * the compiler specializes both from the constant bounds). */
static inline __attribute__((always_inline)) void gemv_rows(const uint8_t *w, const float *scale, const float *zero,
                                                             const int16_t *xq, const float *xstep, const float *xsum, int64_t r0,
                                                             const int n, int64_t cols, int64_t group, float *values) {
    const int64_t groups = cols / group, blocks = group / 32, half = cols / 2;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc[TILE];
    float corr[TILE];
    for (int k = 0; k < n; k++) acc[k] = _mm256_setzero_ps(), corr[k] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[TILE];
        for (int k = 0; k < n; k++) dot[k] = _mm256_setzero_si256();
        const int16_t *xg = xq + g * group;
        for (int64_t b = 0; b < blocks; b++) {
            __m256i xlo = _mm256_loadu_si256((const __m256i *)(xg + b * 32));
            __m256i xhi = _mm256_loadu_si256((const __m256i *)(xg + b * 32 + 16));
            const int64_t offset = g * (group / 2) + b * 16;
            for (int k = 0; k < n; k++) {
                const uint8_t *at = w + (r0 + k) * half + offset;
                __m128i bytes = _mm_loadu_si128((const __m128i *)at);
                __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
                __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
                dot[k] = _mm256_add_epi32(dot[k], _mm256_add_epi32(_mm256_madd_epi16(lo, xlo), _mm256_madd_epi16(hi, xhi)));
            }
        }
        for (int k = 0; k < n; k++) {
            float s = scale[(r0 + k) * groups + g];
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[k]), _mm256_set1_ps(s * xstep[g]), acc[k]);
            corr[k] += ((zero ? zero[(r0 + k) * groups + g] : 0.0f) - 8.0f * s) * xsum[g]; /* w = u*s + (z - 8s) */
        }
    }
    for (int k = 0; k < n; k++) values[k] = hsum(acc[k]) + corr[k];
}

/* out[i][r] = sum_c x[i][c] * w[r][c] for i < m (x and out float32, or bf16 when bf16 is set). */
void gemv(const uint8_t *w, const float *scale, const float *zero, const void *x, void *out, bool bf16, int64_t m, int64_t rows,
          int64_t cols, int64_t group) {
    const int64_t groups = cols / group;
    std::vector<int16_t> xq(m * cols);
    std::vector<float> xstep(m * groups), xsum(m * groups);
    for (int64_t i = 0; i < m; i++)
        quantize_row(bf16 ? (const void *)((const uint16_t *)x + i * cols) : (const void *)((const float *)x + i * cols), bf16,
                     cols, group, xq.data() + i * cols, xstep.data() + i * groups, xsum.data() + i * groups);
    const int64_t tiles = (rows + TILE - 1) / TILE;
    const int threads = at::get_num_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        {
            for (int64_t i = 0; i < m; i++) {
                float values[TILE];
                const int16_t *xi = xq.data() + i * cols;
                const float *stepi = xstep.data() + i * groups, *sumi = xsum.data() + i * groups;
                if (t * TILE + TILE <= rows)
                    gemv_rows(w, scale, zero, xi, stepi, sumi, t * TILE, TILE, cols, group, values);
                else
                    for (int64_t r = t * TILE; r < rows; r++)
                        gemv_rows(w, scale, zero, xi, stepi, sumi, r, 1, cols, group, values + r - t * TILE);
                for (int64_t k = 0; k < TILE && t * TILE + k < rows; k++) {
                    int64_t at = i * rows + t * TILE + k;
                    if (bf16)
                        ((uint16_t *)out)[at] = f32_to_bf16(values[k]);
                    else
                        ((float *)out)[at] = values[k];
                }
            }
        }
    }
}

/* Rows [r0, r1) of the weight as float32 into out[(r1 - r0)][cols]. */
void dequantize(const uint8_t *w, const float *scale, const float *zero, float *out, int64_t r0, int64_t r1, int64_t cols,
                int64_t group) {
    const int64_t groups = cols / group, blocks = group / 32, half = cols / 2;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const int threads = at::get_num_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        {
            const uint8_t *wr = w + r * half;
            float *o = out + (r - r0) * cols;
            for (int64_t g = 0; g < groups; g++) {
                float s = scale[r * groups + g];
                __m256 vs = _mm256_set1_ps(s);
                __m256 vb = _mm256_set1_ps((zero ? zero[r * groups + g] : 0.0f) - 8.0f * s);
                for (int64_t b = 0; b < blocks; b++) {
                    __m128i bytes = _mm_loadu_si128((const __m128i *)(wr + g * (group / 2) + b * 16));
                    __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                    float *ob = o + g * group + b * 32;
                    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    for (int k = 0; k < 4; k++) {
                        __m256 u = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
                        _mm256_storeu_ps(ob + 8 * k, _mm256_fmadd_ps(u, vs, vb)); /* exactly (u - 8) * s when z = 0 */
                    }
                }
            }
        }
    }
}

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    const int64_t cols = x.size(-1), rows = weight.size(0);
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && table.device().is_cpu(), "llmpress int4_linear runs on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) * 2 == cols && weight.is_contiguous(),
                "llmpress int4_linear: weight must be contiguous uint8 [out, in / 2], in = ", cols);
    TORCH_CHECK(group % 32 == 0 && group > 0 && cols % group == 0, "llmpress int4_linear: group ", group, " must be a multiple of 32 dividing ", cols);
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 3 && (table.size(0) == 1 || table.size(0) == 2) &&
                    table.size(1) == rows && table.size(2) == cols / group && table.is_contiguous(),
                "llmpress int4_linear: table must be contiguous float32 [1 or 2, out, in / group]");
    const float *scale = table.data_ptr<float>();
    const float *zero = table.size(0) == 2 ? scale + rows * (cols / group) : nullptr;
    const uint8_t *w = weight.data_ptr<uint8_t>();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = rows;
    at::Tensor flat = x.reshape({-1, cols});
    const int64_t m = flat.size(0);
    at::Tensor out;
    if (m <= GEMV_MAX_ROWS) {
        bool bf16 = flat.scalar_type() == at::kBFloat16;
        at::Tensor input = (bf16 || flat.scalar_type() == at::kFloat) ? flat.contiguous() : flat.to(at::kFloat).contiguous();
        out = at::empty({m, rows}, input.options());
        gemv(w, scale, zero, input.data_ptr(), out.data_ptr(), bf16, m, rows, cols, group);
    } else {
        at::Tensor wide = flat.to(at::kFloat).contiguous();
        std::vector<at::Tensor> parts;
        for (int64_t r0 = 0; r0 < rows; r0 += DEQUANT_ROWS) {
            int64_t r1 = std::min(rows, r0 + DEQUANT_ROWS);
            at::Tensor dense = at::empty({r1 - r0, cols}, wide.options());
            dequantize(w, scale, zero, dense.data_ptr<float>(), r0, r1, cols, group);
            parts.push_back(at::mm(wide, dense.t()));
        }
        out = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
    }
    return out.view(shape).to(x.scalar_type());
}

at::Tensor int4_dequantize(const at::Tensor &weight, const at::Tensor &table, int64_t group) {
    const int64_t rows = weight.size(0), cols = weight.size(1) * 2;
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && table.scalar_type() == at::kFloat && table.is_contiguous() &&
                    group % 32 == 0 && cols % group == 0 && table.size(1) == rows && table.size(2) == cols / group,
                "llmpress int4_dequantize: weight uint8 [out, in / 2], table float32 [1 or 2, out, in / group]");
    const float *scale = table.data_ptr<float>();
    const float *zero = table.size(0) == 2 ? scale + rows * (cols / group) : nullptr;
    at::Tensor out = at::empty({rows, cols}, table.options());
    dequantize(weight.data_ptr<uint8_t>(), scale, zero, out.data_ptr<float>(), 0, rows, cols, group);
    return out;
}

}  // namespace

TORCH_LIBRARY(llmpress, m) {
    m.def("int4_linear(Tensor x, Tensor weight, Tensor table, int group) -> Tensor");
    m.def("int4_dequantize(Tensor weight, Tensor table, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) {
    m.impl("int4_linear", &int4_linear);
    m.impl("int4_dequantize", &int4_dequantize);
}
