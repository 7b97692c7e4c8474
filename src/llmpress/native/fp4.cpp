/* fp4_quantize_pack: NVFP4 / MXFP4 weights divided by their group scales, rounded onto the e2m1
 * grid and packed two to a byte, in one pass over the weight.
 *
 * The PyTorch route (quant/qdq.py quantize, formats/fp4_packed.py pack_fp4) makes a float32
 * copy of the weight, divides, clamps, rounds through a few whole-tensor temporaries, checks
 * for NaN, looks the codes up and packs: ~200 MB/s of bf16 weight per thread, the whole cost of
 * a model-free NVFP4 run. This does the same IEEE operations element by element (a correctly
 * rounded division, a clamp that keeps NaN, |v| divided by its grid step, rounded half to even
 * and multiplied back, both exact), so its bytes are PyTorch's, at memory speed.
 *
 * out[r][j] = code(2j) | code(2j + 1) << 4, code = sign << 3 | index of the magnitude in
 * 0, 0.5, 1, 1.5, 2, 3, 4, 6. Returns the number of NaN values met (the caller refuses them).
 *
 * group_min_max: the min and max of each group of 16 or 32 values along a row, in the weight's
 * dtype (exact: they are among its values; NaN where the group holds one, as amin / amax give
 * it), the ranges fp4 group scales come from, without PyTorch's transposed copy.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <stdint.h>

#include <atomic>
#include <cmath>
#include <tuple>

namespace {

bool avx512_units() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return yes;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

/* 16 values (float32) of one group: bytes into out[0..7]; returns the NaN lanes */
static inline __mmask16 quantize16(__m512 x, __m512 scale, uint8_t *out) {
    const __m512 lo = _mm512_set1_ps(-6.0f), hi = _mm512_set1_ps(6.0f), two = _mm512_set1_ps(2.0f), four = _mm512_set1_ps(4.0f);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    /* twice a grid magnitude (0, 1, 2, 3, 4, 6, 8, 12) -> its index */
    const __m512i index_of_twice = _mm512_setr_epi32(0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7, 0, 0, 0);
    __m512 v = _mm512_div_ps(x, scale);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    v = _mm512_max_ps(lo, _mm512_min_ps(hi, v)); /* min/max return their second operand for NaN: NaN stays */
    const __m512 magnitude = _mm512_abs_ps(v);
    /* the grid's step: 0.5 below 2, 1 below 4, 2 above, as 0.5 + 0.5 [m >= 2] + 1 [m >= 4] */
    __m512 step = _mm512_mask_add_ps(half, _mm512_cmp_ps_mask(magnitude, two, _CMP_GE_OQ), half, half);
    step = _mm512_mask_add_ps(step, _mm512_cmp_ps_mask(magnitude, four, _CMP_GE_OQ), step, one);
    const __m512 rounded = _mm512_mul_ps(_mm512_roundscale_ps(_mm512_div_ps(magnitude, step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), step);
    const __m512i twice = _mm512_cvttps_epi32(_mm512_mul_ps(rounded, two));
    const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)), 28);
    const __m512i code = _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_and_si512(twice, _mm512_set1_epi32(15)), index_of_twice), sign);
    /* lanes 2j and 2j + 1 are one 64-bit lane: low code | high code << 4, one byte each */
    const __m512i pairs = _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi64(0xf)), _mm512_srli_epi64(code, 28));
    _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(_mm512_and_si512(pairs, _mm512_set1_epi64(0xff))));
    return nan;
}

static inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

template <typename T>
int64_t quantize_rows(const T *x, const float *scale, int64_t rows, int64_t cols, int64_t groups, int64_t group, uint8_t *out) {
    int64_t nans = 0;
    for (int64_t r = 0; r < rows; r++) {
        const T *row = x + r * cols;
        const float *s = scale + r * groups;
        uint8_t *o = out + r * (cols / 2);
        for (int64_t c = 0; c < cols; c += 16)
            nans += __builtin_popcount(quantize16(load16(row + c), _mm512_set1_ps(s[c / group]), o + c / 2));
    }
    return nans;
}

template <typename T>
void min_max_rows(const T *x, int64_t rows, int64_t cols, int64_t group, float *lo, float *hi) {
    const int64_t groups = cols / group;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const T *p = x + r * cols + g * group;
            __m512 v = load16(p), vmin = v, vmax = v;
            __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            for (int64_t k = 16; k < group; k += 16) {
                v = load16(p + k);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                vmin = _mm512_min_ps(vmin, v), vmax = _mm512_max_ps(vmax, v);
            }
            const int64_t at = r * groups + g;
            lo[at] = nan ? NAN : _mm512_reduce_min_ps(vmin);
            hi[at] = nan ? NAN : _mm512_reduce_max_ps(vmax);
        }
}

#pragma GCC pop_options

std::tuple<at::Tensor, at::Tensor> group_min_max(const at::Tensor &x, int64_t group) {
    TORCH_CHECK(avx512_units(), "llmpress group_min_max: this CPU has no AVX-512");
    TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous() &&
                    group > 0 && group % 16 == 0 && x.size(1) % group == 0,
                "llmpress group_min_max: a contiguous float32 or bf16 [rows, cols], cols a multiple of the group, the group of 16");
    const int64_t rows = x.size(0), cols = x.size(1), groups = cols / group;
    at::Tensor lo = at::empty({rows, groups}, x.options().dtype(at::kFloat)), hi = at::empty({rows, groups}, x.options().dtype(at::kFloat));
    float *l = lo.data_ptr<float>(), *h = hi.data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
        if (x.scalar_type() == at::kFloat)
            min_max_rows(x.data_ptr<float>() + r0 * cols, r1 - r0, cols, group, l + r0 * groups, h + r0 * groups);
        else
            min_max_rows(reinterpret_cast<const uint16_t *>(x.data_ptr<at::BFloat16>()) + r0 * cols, r1 - r0, cols, group, l + r0 * groups,
                         h + r0 * groups);
    });
    if (x.scalar_type() == at::kFloat) return {lo, hi};
    return {lo.to(at::kBFloat16), hi.to(at::kBFloat16)}; /* exact: bf16 values */
}

std::tuple<at::Tensor, int64_t> fp4_quantize_pack(const at::Tensor &x, const at::Tensor &scale, int64_t group) {
    TORCH_CHECK(avx512_units(), "llmpress fp4_quantize_pack: this CPU has no AVX-512");
    TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
                "llmpress fp4_quantize_pack: a contiguous float32 or bf16 weight [rows, cols]");
    const int64_t rows = x.size(0), cols = x.size(1);
    TORCH_CHECK(group > 0 && group % 16 == 0 && cols % 16 == 0, "llmpress fp4_quantize_pack: groups and columns in multiples of 16");
    const int64_t groups = (cols + group - 1) / group;
    TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                    scale.size(0) == rows && scale.size(1) == groups,
                "llmpress fp4_quantize_pack: contiguous float32 scales [rows, groups]");
    at::Tensor out = at::empty({rows, cols / 2}, x.options().dtype(at::kByte));
    std::atomic<int64_t> nans{0};
    const float *s = scale.data_ptr<float>();
    uint8_t *o = out.data_ptr<uint8_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
        int64_t found;
        if (x.scalar_type() == at::kFloat)
            found = quantize_rows(x.data_ptr<float>() + r0 * cols, s + r0 * groups, r1 - r0, cols, groups, group, o + r0 * (cols / 2));
        else
            found = quantize_rows(reinterpret_cast<const uint16_t *>(x.data_ptr<at::BFloat16>()) + r0 * cols, s + r0 * groups, r1 - r0, cols,
                                  groups, group, o + r0 * (cols / 2));
        nans += found;
    });
    return {out, nans.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmpress, m) {
    m.def("fp4_quantize_pack(Tensor x, Tensor scale, int group) -> (Tensor, int)");
    m.def("group_min_max(Tensor x, int group) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) {
    m.impl("fp4_quantize_pack", &fp4_quantize_pack);
    m.impl("group_min_max", &group_min_max);
}
