/* Prefill products of 4-bit and 8-bit weights on AMX (Intel's tile units: bf16 16 x 32 by
 * 32 x 16 products into float32 tiles), where the CPU has them and Linux lets this process use
 * them (LLMPRESS_AMX=0 turns them off).
 *
 * y [m, rows] (bf16) = x [m, cols] (bf16) times the weight dequantized to bf16 (the float32
 * value rounded to nearest even, as a dense bf16 model holds it). x is the tiles' A operand as
 * it lies in memory (16 rows of 32 columns, strided); the weight is dequantized, 32 rows at a
 * time, straight into the B operand's layout (pairs of columns interleaved: tile[k / 2][row]
 * holds columns k and k + 1 of that row), up to 1 MB of such strips per thread, kept in L2
 * while all of x passes by in blocks of 32 rows.
 *
 * Against dequantizing the whole weight to bf16 for oneDNN's product (which then repacks it
 * into this very layout), no bf16 copy of the weight is written or read: at 512 rows of x this
 * runs at dense bf16's speed (oneDNN, AMX) where that route ran at 0.7-0.95x of it.
 */
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "blocks64.h"

namespace llmpress {

static bool amx_ready() {
    static const bool ready = [] {
        const char *off = getenv("LLMPRESS_AMX");
        if ((off && strcmp(off, "0") == 0) || !__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return false;
        /* ARCH_REQ_XCOMP_PERM for XTILEDATA: without it the first tile instruction faults */
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ready;
}

namespace {

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

constexpr int64_t STRIP = 32;       /* weight rows per pair of B tiles */
constexpr int64_t B_BYTES = 1 << 20;  /* strips kept dequantized while x passes by: up to 1 MB of them (L2) */
constexpr int64_t KBLOCKS = 8;        /* 32-column blocks of x per pass over the strips */
constexpr int64_t GRAM_SPAN = 256;    /* output columns per pass of a gram strip over the sequences */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

/* rows r[0..15] of 16 dwords transposed in place: r[j] holds element j of every input row */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++)
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88), t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    for (int i = 0; i < 8; i++) r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
}

/* 16 values of one quarter, scaled, as 16 bf16 */
static inline __m256i bf16_values(__m256i q, __m512 vs, __m512 vb) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(q)), vs, vb));
}

/* Columns c .. c + 63 of weight row r as bf16 pairs: low (columns c .. c + 31) and high. */
struct Int4Rows {
    const uint8_t *w;
    const float *scale, *zero;
    int64_t cols, group;
    inline const void *at(int64_t r, int64_t c) const { return w + r * (cols / 2) + c / 2; }
    /* the groups of columns c .. c + 31 and c + 32 .. c + 63: the same unless groups are 32 wide */
    inline void groups_of(int64_t c, int64_t &g0, int64_t &g1) const { g0 = c / group, g1 = (c + 32) / group; }
    inline void operator()(int64_t r, int64_t c, int64_t g0, int64_t g1, __m512i &low, __m512i &high) const {
        const int64_t groups = cols / group;
        const __m256i v = _mm256_loadu_si256((const __m256i *)at(r, c));
        const float *s = scale + r * groups, *z = zero ? zero + r * groups : nullptr;
        const __m512 s0 = _mm512_set1_ps(s[g0]), b0 = _mm512_set1_ps((z ? z[g0] : 0.0f) - 8.0f * s[g0]);
        const __m512 s1 = _mm512_set1_ps(s[g1]), b1 = _mm512_set1_ps((z ? z[g1] : 0.0f) - 8.0f * s[g1]);
        low = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_values(quarter(v, 0), s0, b0)), bf16_values(quarter(v, 1), s0, b0), 1);
        high = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_values(quarter(v, 2), s1, b1)), bf16_values(quarter(v, 3), s1, b1), 1);
    }
};

/* int8 rows with one scale and zero correction each: q * s - c */
struct Int8Rows {
    const int8_t *w;
    const float *scale, *corr;
    int64_t cols;
    inline void groups_of(int64_t, int64_t &g0, int64_t &g1) const { g0 = g1 = 0; } /* one scale per row */
    static inline __m256i values(__m128i q, __m512 vs, __m512 vc) {
        return (__m256i)_mm512_cvtneps_pbh(_mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vs, vc));
    }
    inline const void *at(int64_t r, int64_t c) const { return w + r * cols + c; }
    inline void operator()(int64_t r, int64_t c, int64_t, int64_t, __m512i &low, __m512i &high) const {
        const int8_t *p = (const int8_t *)at(r, c);
        const __m512 vs = _mm512_set1_ps(scale[r]), vc = _mm512_set1_ps(corr ? corr[r] : 0.0f);
        low = _mm512_inserti64x4(_mm512_castsi256_si512(values(_mm_loadu_si128((const __m128i *)p), vs, vc)),
                                 values(_mm_loadu_si128((const __m128i *)(p + 16)), vs, vc), 1);
        high = _mm512_inserti64x4(_mm512_castsi256_si512(values(_mm_loadu_si128((const __m128i *)(p + 32)), vs, vc)),
                                  values(_mm_loadu_si128((const __m128i *)(p + 48)), vs, vc), 1);
    }
};

/* Weight rows n0 .. n0 + 15 as B tiles, one per 32 columns: out[c / 32][k / 2][row] (1 KB each). */
template <typename Rows>
static void b_tiles(const Rows &rows, int64_t n0, uint16_t *out) {
    for (int64_t c = 0; c < rows.cols; c += 64) {
        __m512i low[16], high[16]; /* per row: columns c .. c + 31, c + 32 .. c + 63 as 16 pairs each */
        int64_t g0, g1; /* found once for the 16 rows */
        rows.groups_of(c, g0, g1);
        for (int i = 0; i < 16; i++) {
            /* the same columns of the next call's rows: 16 rows read a line at a time each are 16
             * streams the hardware's prefetcher keeps up with poorly (int8 prefill 3% faster) */
            _mm_prefetch((const char *)rows.at(n0 + 16 + i, c), _MM_HINT_T0);
            rows(n0 + i, c, g0, g1, low[i], high[i]);
        }
        transpose16(low), transpose16(high);
        uint16_t *t0 = out + (c / 32) * 512, *t1 = t0 + 512;
        for (int j = 0; j < 16; j++) _mm512_store_si512((__m512i *)(t0 + 32 * j), low[j]), _mm512_store_si512((__m512i *)(t1 + 32 * j), high[j]);
    }
}

/* 32 rows of y, into the float32 sums c (first: from zero), from 32 rows of x (a, stride lda
 * elements) and one strip's two B tiles per 32 columns, for column blocks [kb0, kb1). x is
 * loaded as it lies (packing it into contiguous tiles first measured slower). */
/* One step of a 32 x 32 product in tiles 0-3: rows a0 / a1 (16 each, A's layout) times columns
 * b0 / b1 (16 each, B's pairs layout), strides in bytes. */
static inline void step(const void *a0, const void *a1, int64_t a_stride, const void *b0, const void *b1, int64_t b_stride) {
    _tile_loadd(4, a0, a_stride);
    _tile_loadd(5, a1, a_stride);
    _tile_loadd(6, b0, b_stride);
    _tile_loadd(7, b1, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* tiles 0-3 into c */
static inline void store(float c[32][32]) {
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
}

static inline void block(const uint16_t *a, int64_t lda, const uint16_t *b0, const uint16_t *b1, int64_t kb0, int64_t kb1, bool first,
                         float c[32][32]) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, &c[0][0], 128);
        _tile_loadd(1, &c[0][16], 128);
        _tile_loadd(2, &c[16][0], 128);
        _tile_loadd(3, &c[16][16], 128);
    }
    for (int64_t kb = kb0; kb < kb1; kb++) step(a + kb * 32, a + 16 * lda + kb * 32, lda * 2, b0 + kb * 512, b1 + kb * 512, 64);
    store(c);
}

template <typename Rows>
void product(const uint16_t *x, int64_t m, const Rows &weight, int64_t rows, uint16_t *y) {
    const int64_t cols = weight.cols;
    const int64_t kblocks = cols / 32, strips = rows / STRIP, tile_values = kblocks * 512 * 2; /* per strip */
    const int threads = (int)std::min<int64_t>(at::get_num_threads(), strips);
#pragma omp parallel num_threads(threads)
    {
        TileConfig config = {};
        config.palette = 1;
        for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
        _tile_loadconfig(&config);
        const int nthreads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = strips * me / nthreads, last = strips * (me + 1) / nthreads;
        const int64_t at_once = std::max<int64_t>(1, std::min<int64_t>(last - first, B_BYTES / (tile_values * 2)));
        uint16_t *b = (uint16_t *)aligned_alloc(64, at_once * tile_values * 2);
        float(*c)[32][32] = (float(*)[32][32])aligned_alloc(64, at_once * 32 * 32 * 4);
        uint16_t *tail = nullptr; /* the last rows of x, padded to 32 with zeros */
        if (m % 32) {
            tail = (uint16_t *)aligned_alloc(64, 32 * cols * 2);
            memset(tail, 0, 32 * cols * 2);
            memcpy(tail, x + (m - m % 32) * cols, (m % 32) * cols * 2);
        }
        for (int64_t s0 = first; s0 < last; s0 += at_once) {
            const int64_t count = std::min<int64_t>(at_once, last - s0);
            for (int64_t s = 0; s < count; s++) {
                uint16_t *bs = b + s * tile_values;
                b_tiles(weight, (s0 + s) * STRIP, bs);
                b_tiles(weight, (s0 + s) * STRIP + 16, bs + kblocks * 512);
            }
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                const uint16_t *a = m0 + 32 <= m ? x + m0 * cols : tail;
                const int64_t valid = std::min<int64_t>(32, m - m0);
                /* KBLOCKS column blocks of these 32 rows of x (16 KB) stay in L1 while every strip takes them */
                for (int64_t kb = 0; kb < kblocks; kb += KBLOCKS)
                    for (int64_t s = 0; s < count; s++) {
                        const uint16_t *bs = b + s * tile_values;
                        block(a, cols, bs, bs + kblocks * 512, kb, std::min(kblocks, kb + KBLOCKS), kb == 0, c[s]);
                    }
                for (int64_t s = 0; s < count; s++) {
                    uint16_t *out = y + m0 * rows + (s0 + s) * STRIP;
                    for (int64_t i = 0; i < valid; i++) {
                        _mm256_storeu_si256((__m256i *)(out + i * rows), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&c[s][i][0])));
                        _mm256_storeu_si256((__m256i *)(out + i * rows + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&c[s][i][16])));
                    }
                }
            }
        }
        free(b);
        free(c);
        free(tail);
        _tile_release();
    }
}


/* Gram rows (gram.cpp's blocks): A is x's transpose, xt[c][t] (rows of 32 tokens, cp x tp bf16),
 * B the token pairs, pairs[t / 2][c] (two tokens of a column in one 32-bit word, tp / 2 x cp):
 * c[32][32] = sum over all tokens of x[t][i0 + r] x[t][j0 + q], each product exact, summed in
 * float32 in the tiles. */
static inline void gram_tile(const uint16_t *xt, int64_t tp, int64_t ldx, const uint32_t *pairs, int64_t cp, int64_t i0, int64_t j0,
                             float c[32][32]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < tp; k += 32)
        step(xt + i0 * ldx + k, xt + (i0 + 16) * ldx + k, ldx * 2, pairs + (k / 2) * cp + j0, pairs + (k / 2) * cp + j0 + 16, cp * 4);
    store(c);
}

/* acc[r][q] += c[r][q] in float64, for r < rows and q < width (acc rows `stride` doubles apart) */
static inline void add_tile(const float c[32][32], int64_t rows, int64_t width, double *acc, int64_t stride) {
    for (int64_t r = 0; r < rows; r++) {
        double *out = acc + r * stride;
        for (int64_t q = 0; q < width; q += 8) {
            const __mmask8 m = (__mmask8)((1u << std::min<int64_t>(8, width - q)) - 1u);
            const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(&c[r][q]));
            _mm512_mask_storeu_pd(out + q, m, _mm512_add_pd(_mm512_maskz_loadu_pd(m, out + q), v));
        }
    }
}

void gram_add(const uint16_t *x, int64_t sequences, int64_t tokens, int64_t cols, double *const *acc, const int64_t *starts,
                  const int64_t *heights, int64_t count) {
    /* tokens to whole tiles of 32; columns to whole tiles past the last, from any start */
    const int64_t tp = (tokens + 31) / 32 * 32, cp = (cols + 31) / 32 * 32 + 32;
    const int64_t ldx = tp + 32; /* xt's rows 64 bytes longer: 16 rows of a tile never share a cache set */
    std::vector<uint16_t> xt((size_t)(sequences * cp * ldx), 0);
    std::vector<uint32_t> pairs((size_t)(sequences * (tp / 2) * cp), 0);
    at::parallel_for(0, sequences, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; s++) {
            const uint16_t *xs = x + s * tokens * cols;
            uint16_t *ts = xt.data() + s * cp * ldx;
            uint32_t *ps = pairs.data() + s * (tp / 2) * cp;
            for (int64_t c0 = 0; c0 < cols; c0 += 64) /* 64 rows of xt written at once stay in L1 */
                for (int64_t t = 0; t < tokens; t++)
                    for (int64_t c = c0; c < std::min(cols, c0 + 64); c++) ts[c * ldx + t] = xs[t * cols + c];
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t c = 0; c < cols; c++) ps[(t / 2) * cp + c] |= (uint32_t)xs[t * cols + c] << (16 * (t & 1));
        }
    });
    struct Strip {
        int64_t block, i0;
    };
    std::vector<Strip> strips;
    for (int64_t k = 0; k < count; k++)
        for (int64_t i = 0; i < heights[k]; i += 32) strips.push_back({k, starts[k] + i});
    const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)strips.size()));
#pragma omp parallel num_threads(threads)
    {
        TileConfig config = {};
        config.palette = 1;
        for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
        _tile_loadconfig(&config);
        float(*c)[32] = (float(*)[32])aligned_alloc(64, 32 * 32 * 4);
        /* strips of upper rows span more columns: handed out one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < (int64_t)strips.size(); n++) {
            const Strip strip = strips[n];
            const int64_t start = starts[strip.block], stride = cols - start;
            const int64_t rows = std::min<int64_t>(32, start + heights[strip.block] - strip.i0);
            double *out = acc[strip.block] + (strip.i0 - start) * stride;
            /* GRAM_SPAN columns at a time: a sequence's 32 rows of xt stay in L1 across them, their
             * float64 sums in L2 across the sequences */
            for (int64_t jc = start; jc < cols; jc += GRAM_SPAN)
                for (int64_t s = 0; s < sequences; s++) /* in order: the sum is the same however the work is split */
                    for (int64_t j0 = jc; j0 < std::min(cols, jc + GRAM_SPAN); j0 += 32) {
                        gram_tile(xt.data() + s * cp * ldx, tp, ldx, pairs.data() + s * (tp / 2) * cp, cp, strip.i0, j0, c);
                        add_tile(c, rows, std::min<int64_t>(32, cols - j0), out + (j0 - start), stride);
                    }
        }
        free(c);
        _tile_release();
    }
}

#pragma GCC pop_options

}  // namespace

bool amx_takes(int64_t rows, int64_t cols) { return rows > 0 && rows % STRIP == 0 && cols > 0 && cols % 64 == 0 && amx_ready(); }

void amx_int4_product(const uint16_t *x, int64_t m, const uint8_t *w, const float *scale, const float *zero, int64_t rows, int64_t cols,
                      int64_t group, uint16_t *y) {
    product(x, m, Int4Rows{w, scale, zero, cols, group}, rows, y);
}

void amx_int8_product(const uint16_t *x, int64_t m, const int8_t *w, const float *scale, const float *corr, int64_t rows, int64_t cols, uint16_t *y) {
    product(x, m, Int8Rows{w, scale, corr, cols}, rows, y);
}



bool amx_gram_add(const uint16_t *x, int64_t sequences, int64_t tokens, int64_t cols, double *const *acc, const int64_t *starts,
                  const int64_t *heights, int64_t count) {
    if (!amx_ready()) return false;
    if (sequences > 0 && tokens > 0 && cols > 0) gram_add(x, sequences, tokens, cols, acc, starts, heights, count);
    return true;
}

}  // namespace llmpress
