/* gram_bf16_add_: the Hessians' running X^T X for bf16 inputs, on AMX or AVX-512 BF16.
 *
 * A bf16 model's calibration inputs are bf16. PyTorch multiplies them either in bf16 (products
 * rounded to bf16: three digits) or, converted, in float32 at half the rate of the bf16 units.
 * Here each sequence's product is taken with the bf16 values multiplied exactly and summed in
 * float32, then added to the float64 accumulator. So, as with the float32 route, the sum depends
 * neither on how the sequences were batched nor on the thread count, and no float32 copy of the
 * inputs is made. Where the CPU has AMX (amx.cpp, ``amx_gram_add``) its tiles take the products:
 * 16.8 ms for a 2816-wide input of two 256-token sequences on one core of the 2-core test
 * machine, against 40 ms converted to float32 and 62 ms on the AVX-512 BF16 tiles below, which
 * run where AMX does not (slower than float32 there; on a CPU whose VDPBF16PS runs at twice
 * the float32 FMA rate, faster).
 *
 * Layout. Both operands come from one array: pairs[t2][c] holds tokens 2 t2 and 2 t2 + 1 of
 * column c as the two bf16 halves of a 32-bit word, which is what VDPBF16PS multiplies
 * pairwise. A tile of 6 output rows by 64 columns keeps 24 accumulators in registers and, per
 * pair of tokens, loads 4 vectors of columns and broadcasts 6 words of rows.
 *
 * The accumulators are the row blocks HessianAccumulator keeps (hessians.py): block k covers
 * rows [start_k, start_k + rows_k) and columns [start_k, cols), float64, contiguous.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "blocks64.h"

namespace {

constexpr int64_t MR = 6;  /* output rows per tile */
constexpr int64_t NR = 64; /* output columns per tile: 4 vectors of 16 floats */

bool bf16_units() {
    static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    return yes;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

/* pairs[t2 * cols + c] = x[2 t2][c] | x[2 t2 + 1][c] << 16; a zero half past an odd last token */
void pack_pairs(const uint16_t *x, int64_t tokens, int64_t cols, uint32_t *pairs) {
    alignas(64) uint16_t low[32], high[32];
    for (int k = 0; k < 16; k++) low[2 * k] = k, low[2 * k + 1] = 32 + k, high[2 * k] = 16 + k, high[2 * k + 1] = 48 + k;
    const __m512i take_low = _mm512_load_si512(low), take_high = _mm512_load_si512(high);
    for (int64_t t2 = 0; 2 * t2 < tokens; t2++) {
        const uint16_t *a = x + 2 * t2 * cols;
        const uint16_t *b = 2 * t2 + 1 < tokens ? a + cols : nullptr;
        uint32_t *out = pairs + t2 * cols;
        int64_t c = 0;
        for (; c + 32 <= cols; c += 32) {
            const __m512i va = _mm512_loadu_si512(a + c), vb = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(va, take_low, vb));
            _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(va, take_high, vb));
        }
        for (; c < cols; c++) out[c] = (uint32_t)a[c] | (b ? (uint32_t)b[c] << 16 : 0u);
    }
}

/* acc[r][j] += sum over the steps of row i0 + r against column j0 + j, for r < rows <= 6 and
 * j < width <= 64 (acc rows `stride` doubles apart). The 24 accumulators are named variables:
 * as an array GCC keeps them on the stack, storing each one every step. */
void tile(const uint32_t *pairs, int64_t steps, int64_t cols, int64_t i0, int64_t rows, int64_t j0, int64_t width, double *acc,
          int64_t stride) {
#define LLMPRESS_ROW(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0;
    LLMPRESS_ROW(0) LLMPRESS_ROW(1) LLMPRESS_ROW(2) LLMPRESS_ROW(3) LLMPRESS_ROW(4) LLMPRESS_ROW(5)
#undef LLMPRESS_ROW
    __mmask16 mask[4];
    for (int q = 0; q < 4; q++) {
        const int64_t left = std::clamp<int64_t>(width - 16 * q, 0, 16);
        mask[q] = (__mmask16)((1u << left) - 1u);
    }
    int64_t at[6]; /* rows past the last repeat it: computed, not stored */
    for (int r = 0; r < 6; r++) at[r] = i0 + std::min<int64_t>(r, rows - 1);
    const uint32_t *b_row = pairs + j0;
    for (int64_t t = 0; t < steps; t++, b_row += cols) {
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(mask[0], b_row), b1 = (__m512bh)_mm512_maskz_loadu_epi32(mask[1], b_row + 16),
                       b2 = (__m512bh)_mm512_maskz_loadu_epi32(mask[2], b_row + 32), b3 = (__m512bh)_mm512_maskz_loadu_epi32(mask[3], b_row + 48);
        const uint32_t *a_row = pairs + t * cols;
#define LLMPRESS_ROW(r)                                                              \
    {                                                                                \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)a_row[at[r]]);           \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0), c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1); \
        c##r##2 = _mm512_dpbf16_ps(c##r##2, a, b2), c##r##3 = _mm512_dpbf16_ps(c##r##3, a, b3); \
    }
        LLMPRESS_ROW(0) LLMPRESS_ROW(1) LLMPRESS_ROW(2) LLMPRESS_ROW(3) LLMPRESS_ROW(4) LLMPRESS_ROW(5)
#undef LLMPRESS_ROW
    }
    const __m512 c[6][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                            {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
    for (int r = 0; r < rows; r++) {
        double *out = acc + r * stride;
        for (int q = 0; q < 4 && mask[q]; q++) {
            const __mmask8 m0 = (__mmask8)(mask[q] & 0xff), m1 = (__mmask8)(mask[q] >> 8);
            double *o = out + 16 * q;
            const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(c[r][q]));
            const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[r][q]), 1)));
            _mm512_mask_storeu_pd(o, m0, _mm512_add_pd(_mm512_maskz_loadu_pd(m0, o), lo));
            if (m1) _mm512_mask_storeu_pd(o + 8, m1, _mm512_add_pd(_mm512_maskz_loadu_pd(m1, o + 8), hi));
        }
    }
}

#pragma GCC pop_options

struct Tile {
    int64_t block, i0, rows;
};

void gram_bf16_add_(at::TensorList blocks, at::IntArrayRef starts, const at::Tensor &x) {
    TORCH_CHECK(bf16_units(), "llmpress gram_bf16_add_: this CPU has no AVX-512 BF16");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(),
                "llmpress gram_bf16_add_: a contiguous bf16 x [sequences, tokens, columns]");
    TORCH_CHECK((int64_t)blocks.size() == (int64_t)starts.size(), "llmpress gram_bf16_add_: one start per block");
    const int64_t sequences = x.size(0), tokens = x.size(1), cols = x.size(2), steps = (tokens + 1) / 2;
    std::vector<double *> acc;
    std::vector<int64_t> heights;
    int64_t rows = 0;
    for (size_t k = 0; k < blocks.size(); k++) {
        const at::Tensor &block = blocks[k];
        const int64_t start = starts[k];
        TORCH_CHECK(block.device().is_cpu() && block.scalar_type() == at::kDouble && block.dim() == 2 && block.is_contiguous() &&
                        start >= 0 && block.size(1) == cols - start && start + block.size(0) <= cols,
                    "llmpress gram_bf16_add_: contiguous float64 blocks [rows, columns - start]");
        acc.push_back(block.data_ptr<double>());
        heights.push_back(block.size(0));
        rows += block.size(0);
    }
    if (sequences == 0 || tokens == 0 || rows == 0) return;
    const uint16_t *data = reinterpret_cast<const uint16_t *>(x.data_ptr<at::BFloat16>());
    if (llmpress::amx_gram_add(data, sequences, tokens, cols, acc.data(), starts.data(), heights.data(), (int64_t)blocks.size())) return;
    std::vector<Tile> tiles;
    for (size_t k = 0; k < blocks.size(); k++)
        for (int64_t i = 0; i < heights[k]; i += MR) tiles.push_back({(int64_t)k, starts[k] + i, std::min(MR, heights[k] - i)});
    std::vector<uint32_t> pairs((size_t)(sequences * steps * cols));
    at::parallel_for(0, sequences, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; s++) pack_pairs(data + s * tokens * cols, tokens, cols, pairs.data() + s * steps * cols);
    });
    const int threads = std::max(1, at::get_num_threads());
    /* tiles of upper rows span more columns: hand them out one at a time */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t n = 0; n < (int64_t)tiles.size(); n++) {
        const Tile t = tiles[n];
        const int64_t start = starts[t.block];
        const int64_t stride = cols - start;
        double *out = acc[t.block] + (t.i0 - start) * stride;
        for (int64_t s = 0; s < sequences; s++) { /* in order: the sum is the same however the work is split */
            const uint32_t *p = pairs.data() + s * steps * cols;
            for (int64_t j0 = start; j0 < cols; j0 += NR) {
                const int64_t width = std::min(NR, cols - j0);
                tile(p, steps, cols, t.i0, t.rows, j0, width, out + (j0 - start), stride);
            }
        }
    }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmpress, m) {
    m.def("gram_bf16_add_(Tensor(a!)[] blocks, int[] starts, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(llmpress, CPU, m) { m.impl("gram_bf16_add_", &gram_bf16_add_); }
