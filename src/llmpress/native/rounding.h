/* Rounding half to even as PyTorch's torch.round rounds, shared by gptq.cpp and autoround.cpp
 * (their values must match PyTorch's bit for bit). */
#pragma once

#include <immintrin.h>

namespace llmpress {

constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

static inline float round_even(float x) { return _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(x), ROUND)); }

static inline __m256 round_even(__m256 x) { return _mm256_round_ps(x, ROUND); }

}  // namespace llmpress
