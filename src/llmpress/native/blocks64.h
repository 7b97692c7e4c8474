/* The blocks64 weight layout, shared by linear.cpp and amx.cpp: w[row][cols / 2] bytes; each run
 * of 64 columns is 32 bytes read as 16 little-endian 16-bit lanes, lane j holding u = q + 8 of
 * columns j, j + 16, j + 32 and j + 48 in its four nibbles (lowest first). */
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace llmpress {

/* The 16 values of quarter k (columns 16k .. 16k + 15 of a 64-column block) as 16-bit lanes. */
static inline __m256i quarter(__m256i v, int k) {
    const __m256i low4 = _mm256_set1_epi16(0x000f);
    switch (k) {
        case 0: return _mm256_and_si256(v, low4);
        case 1: return _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        case 2: return _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
        default: return _mm256_srli_epi16(v, 12);
    }
}

/* amx.cpp: whether AMX's bf16 tiles take a weight of this shape in this process (the CPU has
 * them, Linux lets the process use them, rows a multiple of 32 and columns of 64), and
 * y [m, rows] = x [m, cols] times the weight on them (bf16 in and out), where they do. */
bool amx_takes(int64_t rows, int64_t cols);
void amx_int4_product(const uint16_t *x, int64_t m, const uint8_t *w, const float *scale, const float *zero, int64_t rows, int64_t cols,
                      int64_t group, uint16_t *y);
/* the same for int8 weights [rows, cols] meaning q * scale - corr (one of each per row) */
void amx_int8_product(const uint16_t *x, int64_t m, const int8_t *w, const float *scale, const float *corr, int64_t rows, int64_t cols, uint16_t *y);
/* gram.cpp's running X^T X of bf16 x [sequences, tokens, cols] on AMX tiles: acc[k] (float64,
 * heights[k] rows from starts[k], columns starts[k] to cols) += each sequence's product, exact
 * products summed in float32 per sequence; false (nothing added) where AMX is not usable here */
bool amx_gram_add(const uint16_t *x, int64_t sequences, int64_t tokens, int64_t cols, double *const *acc, const int64_t *starts,
                  const int64_t *heights, int64_t count);

}  // namespace llmpress
