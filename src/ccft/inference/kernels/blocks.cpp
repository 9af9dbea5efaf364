// ccft block-weight kernels: y = x · Wᵀ straight from GGUF Q4_1 / Q8_0 blocks (ccft.inference.blocks).
//
// A weight matrix W (n, k) is n rows of k / 32 blocks, in ggml's layout:
//   Q8_0: fp16 d, int8 q[32]                       (34 bytes)   w[j] = d · q[j]
//   Q4_1: fp16 d, fp16 m, uint8 q[16] (two nibbles) (20 bytes)  w[j] = d · q[j] + m,
//         q[j] = q[j] & 15 for j < 16 and q[j - 16] >> 4 for j ≥ 16.
// Activations x and outputs y are fp32, row-major with leading dimensions ldx / ldy. Each weight is
// dequantised exactly as gguf-py (and so transformers) dequantises it: d · q is exact in fp32, so
// d · q + m rounds once, fused or not, and the dequantised weight equals the fp32 engine's weight.
// Products and sums are fp32 (another order than oneDNN's: equal within fp32 rounding).
//
// Threads: OpenMP over output rows, `threads` of them per call. AVX-512 (16 weights per vector) when
// compiled with AVX-512F, AVX2 + FMA (8) when compiled with those (-march=native on such a CPU), plain C++
// otherwise. Built and loaded by ccft.inference.blocks.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CCFT_AVX2 1
#else
#define CCFT_AVX2 0
#endif
#if CCFT_AVX2 && defined(__AVX512F__)
#define CCFT_AVX512 1
#else
#define CCFT_AVX512 0
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int KIND_Q8_0 = 0;
constexpr int KIND_Q4_1 = 1;

inline int64_t block_bytes(int kind) { return kind == KIND_Q8_0 ? 34 : 20; }

inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                exp--;
            }
            mant &= 0x3ffu;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// The 32 weights of one block, as fp32.
inline void dequant_block(int kind, const uint8_t* b, float* out) {
    const float d = fp16_to_fp32(load_u16(b));
    if (kind == KIND_Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
        for (int j = 0; j < QK; ++j) out[j] = d * (float)q[j];
    } else {
        const float m = fp16_to_fp32(load_u16(b + 2));
        const uint8_t* q = b + 4;
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)(q[j] & 15) + m;
            out[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}

#if CCFT_AVX2
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One block's 32 weights in four vectors (w0: weights 0-7, ..., w3: 24-31).
inline void dequant_avx2(int kind, const uint8_t* b, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
    if (kind == KIND_Q8_0) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
        w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        w2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        w3 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
    } else {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask);                     // weights 0-15
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);  // weights 16-31
        // d · q is exact in fp32: the fused multiply-add rounds as d · q + m does
        w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
        w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
        w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
        w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
    }
}

#if CCFT_AVX512
// One block's 32 weights in two vectors (w0: weights 0-15, w1: 16-31): the same roundings as dequant_avx2.
inline void dequant_avx512(int kind, const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
    if (kind == KIND_Q8_0) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
        w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
        w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    } else {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask);                     // weights 0-15
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);  // weights 16-31
        w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);
        w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
    }
}

// out[r] = x[r] · w for MT rows of x (stride ldx) and one weight row of nb blocks: two accumulators per row
// (weights 0-15 and 16-31 of each block; up to 8 rows keep 16 accumulators and the two weight vectors in
// the 32 vector registers).
template <int MT>
inline void dot_rows(int kind, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out) {
    const int64_t bb = block_bytes(kind);
    __m512 a0[MT], a1[MT];
    for (int r = 0; r < MT; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 w0, w1;
        dequant_avx512(kind, w + b * bb, w0, w1);
        const float* xb = x + b * QK;
        for (int r = 0; r < MT; ++r) {
            const float* xr = xb + r * ldx;
            a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0[r]);
            a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a1[r]);
        }
    }
    for (int r = 0; r < MT; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}
#else
// out[r] = x[r] · w for MT rows of x (stride ldx) and one weight row of nb blocks. Up to 4 rows: two
// accumulators per row (independent FMA chains); more rows: one each (the rows are the independent chains,
// and the accumulators and the four weight vectors stay in registers).
template <int MT>
inline void dot_rows(int kind, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out) {
    const int64_t bb = block_bytes(kind);
    constexpr bool two = MT <= 4;
    __m256 a0[MT], a1[MT];
    for (int r = 0; r < MT; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 w0, w1, w2, w3;
        dequant_avx2(kind, w + b * bb, w0, w1, w2, w3);
        const float* xb = x + b * QK;
        for (int r = 0; r < MT; ++r) {
            const float* xr = xb + r * ldx;
            if (two) {
                a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
                a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
                a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a0[r]);
                a1[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a1[r]);
            } else {
                a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
                a0[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a0[r]);
                a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a0[r]);
                a0[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a0[r]);
            }
        }
    }
    for (int r = 0; r < MT; ++r) out[r] = hsum(two ? _mm256_add_ps(a0[r], a1[r]) : a0[r]);
}
#endif  // CCFT_AVX512
#else
template <int MT>
inline void dot_rows(int kind, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out) {
    const int64_t bb = block_bytes(kind);
    float acc[MT] = {};
    float wd[QK];
    for (int64_t b = 0; b < nb; ++b) {
        dequant_block(kind, w + b * bb, wd);
        for (int r = 0; r < MT; ++r) {
            const float* xr = x + r * ldx + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; ++j) s += wd[j] * xr[j];
            acc[r] += s;
        }
    }
    for (int r = 0; r < MT; ++r) out[r] = acc[r];
}
#endif

// out[r] for up to MT_MAX rows at once (rows = 1..8).
inline void dot_tile(int kind, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, int rows,
                     float* out) {
    switch (rows) {
        case 8: dot_rows<8>(kind, w, nb, x, ldx, out); break;
        case 7: dot_rows<7>(kind, w, nb, x, ldx, out); break;
        case 6: dot_rows<6>(kind, w, nb, x, ldx, out); break;
        case 5: dot_rows<5>(kind, w, nb, x, ldx, out); break;
        case 4: dot_rows<4>(kind, w, nb, x, ldx, out); break;
        case 3: dot_rows<3>(kind, w, nb, x, ldx, out); break;
        case 2: dot_rows<2>(kind, w, nb, x, ldx, out); break;
        default: dot_rows<1>(kind, w, nb, x, ldx, out); break;
    }
}

constexpr int64_t ROWS_PER_TASK = 16;  // output rows one thread takes at a time (their blocks stay in L1)
constexpr int MT_MAX = 8;              // activation rows per pass over a weight row

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

extern "C" {

// 2: the ABI version ccft.inference.blocks checks. Features: bit 0 built with AVX2 + FMA, bit 1 with
// AVX-512F (the products then run 16 weights per vector).
int ccft_blocks_abi() { return 2; }
int ccft_blocks_features() { return CCFT_AVX2 | (CCFT_AVX512 << 1); }

// out (n, k) fp32 = the dequantised weights.
void ccft_blocks_dequant(int kind, const uint8_t* w, int64_t n, int64_t k, float* out, int threads) {
    const int64_t nb = k / QK, rb = nb * block_bytes(kind);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < nb; ++b)
            dequant_block(kind, w + i * rb + b * block_bytes(kind), out + i * k + b * QK);
}

// y (m, n) = x (m, k) · Wᵀ, W (n, k) in blocks; x rows ldx floats apart, y rows ldy floats apart.
void ccft_blocks_matmul(int kind, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m,
                        int64_t ldx, float* y, int64_t ldy, int threads) {
    const int64_t nb = k / QK, rb = nb * block_bytes(kind);
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < n ? n0 + ROWS_PER_TASK : n;
        float out[MT_MAX];
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            const int rows = (int)(m - m0 < MT_MAX ? m - m0 : MT_MAX);
            for (int64_t i = n0; i < n1; ++i) {
                dot_tile(kind, w + i * rb, nb, x + m0 * ldx, ldx, rows, out);
                for (int r = 0; r < rows; ++r) y[(m0 + r) * ldy + i] = out[r];
            }
        }
    }
}

// y (m, n) = silu(x · Wgᵀ) * (x · Wuᵀ): Llama's gated MLP activation, gate and up (n, k) in blocks.
void ccft_blocks_mlp(int kind_gate, const uint8_t* wg, int kind_up, const uint8_t* wu, int64_t n, int64_t k,
                     const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int threads) {
    const int64_t nb = k / QK, rbg = nb * block_bytes(kind_gate), rbu = nb * block_bytes(kind_up);
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < n ? n0 + ROWS_PER_TASK : n;
        float g[MT_MAX], u[MT_MAX];
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            const int rows = (int)(m - m0 < MT_MAX ? m - m0 : MT_MAX);
            for (int64_t i = n0; i < n1; ++i) {
                dot_tile(kind_gate, wg + i * rbg, nb, x + m0 * ldx, ldx, rows, g);
                dot_tile(kind_up, wu + i * rbu, nb, x + m0 * ldx, ldx, rows, u);
                for (int r = 0; r < rows; ++r) y[(m0 + r) * ldy + i] = silu(g[r]) * u[r];
            }
        }
    }
}

}  // extern "C"
