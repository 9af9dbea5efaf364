// ccft block-weight kernels: y = x · Wᵀ straight from GGUF Q4_1 / Q8_0 blocks (ccft.inference.blocks).
//
// A weight matrix W (n, k) is n rows of k / 32 blocks, in ggml's layout:
//   Q8_0: fp16 d, int8 q[32]                       (34 bytes)   w[j] = d · q[j]
//   Q4_1: fp16 d, fp16 m, uint8 q[16] (two nibbles) (20 bytes)  w[j] = d · q[j] + m,
//         q[j] = q[j] & 15 for j < 16 and q[j - 16] >> 4 for j ≥ 16.
//   F32:  32 fp32 weights                          (128 bytes)  (an fp32 matrix read in place)
// Activations x and outputs y are fp32, row-major with leading dimensions ldx / ldy. Each weight is
// dequantised exactly as gguf-py (and so transformers) dequantises it: d · q is exact in fp32, so
// d · q + m rounds once, fused or not, and the dequantised weight equals the fp32 engine's weight.
// Products and sums are fp32 (another order than oneDNN's: equal within fp32 rounding).
//
// Threads: OpenMP over output rows, `threads` of them per call. AVX-512 (16 weights per vector) when
// compiled with AVX-512F, AVX2 + FMA (8) when compiled with those (-march=native on such a CPU), plain C++
// otherwise. Built and loaded by ccft.inference.blocks.

#include <algorithm>
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
constexpr int KIND_F32 = 2;  // plain fp32 rows seen as blocks of 32 floats (the fp32 engine's fused step)

inline int64_t block_bytes(int kind) { return kind == KIND_Q8_0 ? 34 : kind == KIND_Q4_1 ? 20 : 128; }

// Software prefetch PREFETCH_BYTES ahead in the weight stream. A product at a few activation rows reads each
// weight once, in address order, and spends ~10 cycles per 20-byte Q4_1 block: the hardware prefetcher alone
// then keeps too few lines in flight, and the stream runs at ~40% of the rate the same product reaches on
// cache-resident weights (benchmarks/fused_step.py, docs/inference.md "Fused decode step"). A prefetch never
// faults, so reading past the matrix's end is harmless.
constexpr int64_t PREFETCH_BYTES = 2048;
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

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
    if (kind == KIND_F32) {
        std::memcpy(out, b, QK * sizeof(float));
        return;
    }
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
    if (kind == KIND_F32) {
        const float* f = reinterpret_cast<const float*>(b);
        w0 = _mm256_loadu_ps(f), w1 = _mm256_loadu_ps(f + 8), w2 = _mm256_loadu_ps(f + 16);
        w3 = _mm256_loadu_ps(f + 24);
        return;
    }
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
    if (kind == KIND_F32) {
        w0 = _mm512_loadu_ps(reinterpret_cast<const float*>(b));
        w1 = _mm512_loadu_ps(reinterpret_cast<const float*>(b) + 16);
        return;
    }
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
    if (kind == KIND_Q8_0) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
        w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
        w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    } else {
        // The block's 16 possible weights t[j] = d · j + m (j = 0..15; one rounding, d · j being exact), then
        // each weight looked up by its nibble: the values of dequant_avx2's fma(d, q, m), with fewer vector ops per
        // block (d and m converted together; no int -> float conversion). vpermps reads only an index's low
        // 4 bits, so the low nibbles need no mask.
        uint32_t dm_bits;
        std::memcpy(&dm_bits, b, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));  // d, m
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 t = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), iota,
                                         _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm)));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
        w0 = _mm512_permutexvar_ps(q, t);                          // weights 0-15: the low nibbles
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);  // 16-31: the high nibbles
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
        prefetch_ahead(w + b * bb);
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
        prefetch_ahead(w + b * bb);
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
        prefetch_ahead(w + b * bb);
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
constexpr int64_t MAX_HEAD_DIM = 512;  // the fused decode step's largest head dimension
constexpr int64_t MAX_GROUP = 64;  // and its largest number of query heads per KV head (H / h)

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// What a product does with each output: store it, add it to what y holds (a residual), or (the MLP) store
// silu(gate) * up.
enum Out { STORE = 0, ADD = 1 };

// The share of y (m, n) = x (m, k) · Wᵀ of the calling thread: an orphaned `omp for` over tasks of output rows,
// so it runs in a parallel region of the caller (one region per call below, one per decode step in
// ccft_blocks_decode_step) or alone. x rows ldx floats apart, y rows ldy floats apart.
inline void matmul_for(int kind, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m,
                       int64_t ldx, float* y, int64_t ldy, Out mode) {
    const int64_t nb = k / QK, rb = nb * block_bytes(kind);
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < n ? n0 + ROWS_PER_TASK : n;
        float out[MT_MAX];
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            const int rows = (int)(m - m0 < MT_MAX ? m - m0 : MT_MAX);
            for (int64_t i = n0; i < n1; ++i) {
                dot_tile(kind, w + i * rb, nb, x + m0 * ldx, ldx, rows, out);
                for (int r = 0; r < rows; ++r) {
                    float* o = y + (m0 + r) * ldy + i;
                    *o = mode == ADD ? *o + out[r] : out[r];
                }
            }
        }
    }
}

// The calling thread's share of y (m, n) = silu(x · Wgᵀ) * (x · Wuᵀ) (orphaned `omp for`, as matmul_for).
inline void mlp_for(int kind_gate, const uint8_t* wg, int kind_up, const uint8_t* wu, int64_t n, int64_t k,
                    const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy) {
    const int64_t nb = k / QK, rbg = nb * block_bytes(kind_gate), rbu = nb * block_bytes(kind_up);
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp for schedule(static)
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

// a · b over n fp32 values (vectorised where the build has AVX2 / AVX-512).
inline float dot_f32(const float* a, const float* b, int64_t n) {
    int64_t j = 0;
    float s = 0.0f;
#if CCFT_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
    s = _mm512_reduce_add_ps(acc);
#elif CCFT_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    s = hsum(acc);
#endif
    for (; j < n; ++j) s += a[j] * b[j];
    return s;
}

#if CCFT_AVX512 || CCFT_AVX2
// One vector of floats, the widest the build has (16 lanes with AVX-512, else 8), and its operations.
#if CCFT_AVX512
using vecf = __m512;
constexpr int64_t VL = 16;  // floats per vector
inline vecf vzero() { return _mm512_setzero_ps(); }
inline vecf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vecf v) { _mm512_storeu_ps(p, v); }
inline vecf vset1(float x) { return _mm512_set1_ps(x); }
inline vecf vadd(vecf a, vecf b) { return _mm512_add_ps(a, b); }
inline vecf vsub(vecf a, vecf b) { return _mm512_sub_ps(a, b); }
inline vecf vmul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
inline vecf vmax(vecf a, vecf b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
inline vecf vfnma(vecf a, vecf b, vecf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline vecf vround(vecf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vecf vpow2_times(vecf y, vecf n) { return _mm512_scalef_ps(y, n); }  // y 2^n, n integral
inline float vhsum(vecf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vecf v) { return _mm512_reduce_max_ps(v); }
#else
using vecf = __m256;
constexpr int64_t VL = 8;
inline vecf vzero() { return _mm256_setzero_ps(); }
inline vecf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vecf v) { _mm256_storeu_ps(p, v); }
inline vecf vset1(float x) { return _mm256_set1_ps(x); }
inline vecf vadd(vecf a, vecf b) { return _mm256_add_ps(a, b); }
inline vecf vsub(vecf a, vecf b) { return _mm256_sub_ps(a, b); }
inline vecf vmul(vecf a, vecf b) { return _mm256_mul_ps(a, b); }
inline vecf vmax(vecf a, vecf b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
inline vecf vfnma(vecf a, vecf b, vecf c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
inline vecf vround(vecf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vecf vpow2_times(vecf y, vecf n) {  // y 2^n, n integral in [-126, 127]: 2^n built as a normal float
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline float vhsum(vecf v) { return hsum(v); }
inline float vhmax(vecf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

// exp(x) of each lane, x <= 0 (softmax after its maximum is subtracted): 2^n e^r with n = round(x log2 e) and
// r = x - n ln 2 (ln 2 in two parts), e^r by the degree-6 polynomial of Cephes' expf (within ~2 ulp of
// std::exp). Below -87.3 the result is e^-87.3 (~1e-38, n >= -126) instead of less: nothing beside a term >= 1
// in a sum. A NaN stays NaN (vmax returns its second operand).
inline vecf vexp_neg(vecf x) {
    x = vmax(vset1(-87.3f), x);
    const vecf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vecf r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vecf y = vset1(1.9875691500e-4f);
    y = vfma(y, r, vset1(1.3981999507e-3f));
    y = vfma(y, r, vset1(8.3334519073e-3f));
    y = vfma(y, r, vset1(4.1665795894e-2f));
    y = vfma(y, r, vset1(1.6666665459e-1f));
    y = vfma(y, r, vset1(5.0000001201e-1f));
    y = vfma(y, vmul(r, r), vadd(r, vset1(1.0f)));
    return vpow2_times(y, n);
}
#endif

// Softmax numerators in place: s[j] = exp(s[j] - max s) over n scores; returns their sum (in vectors with
// vexp_neg where the build has AVX2 / AVX-512; std::exp otherwise and for the remainder).
inline float softmax_numerators(float* s, int64_t n) {
    int64_t j = 0;
    float mx = -INFINITY, sum = 0.0f;
#if CCFT_AVX512 || CCFT_AVX2
    if (n >= VL) {
        vecf vm = vset1(-INFINITY);
        for (; j + VL <= n; j += VL) vm = vmax(vm, vload(s + j));
        mx = vhmax(vm);
    }
#endif
    for (; j < n; ++j) mx = std::max(mx, s[j]);
    j = 0;
#if CCFT_AVX512 || CCFT_AVX2
    const vecf m = vset1(mx);
    vecf acc = vzero();
    for (; j + VL <= n; j += VL) {
        const vecf e = vexp_neg(vsub(vload(s + j), m));
        vstore(s + j, e);
        acc = vadd(acc, e);
    }
    sum = vhsum(acc);
#endif
    for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
    return sum;
}

#if CCFT_AVX512 || CCFT_AVX2
// Columns c .. c + NV VL - 1 of the outputs of KN query heads of one KV head: o_k = inv_k Σ_j e_kj v_j over
// np prefix values (vp, vstride floats apart) then nt tail values (vt, tstride apart), each value's columns
// loaded once for the KN heads; e_k: head k's softmax numerators (np + nt of them, width floats apart),
// inv_k: 1 / their sum. vp, vt and o point at column c; o_k is o + k d.
template <int KN, int NV>
inline void values_chunk(const float* e, int64_t width, const float* inv, const float* vp, int64_t vstride,
                         int64_t np, const float* vt, int64_t tstride, int64_t nt, float* o, int64_t d) {
    vecf acc[KN][NV];
    for (int k = 0; k < KN; ++k)
        for (int u = 0; u < NV; ++u) acc[k][u] = vzero();
    for (int part = 0; part < 2; ++part) {  // the prefix values, then the tail's
        const float* base = part == 0 ? vp : vt;
        const int64_t n = part == 0 ? np : nt, stride = part == 0 ? vstride : tstride, off = part == 0 ? 0 : np;
        for (int64_t j = 0; j < n; ++j) {
            vecf v[NV];
            for (int u = 0; u < NV; ++u) v[u] = vload(base + j * stride + u * VL);
            for (int k = 0; k < KN; ++k) {
                const vecf w = vset1(e[k * width + off + j]);
                for (int u = 0; u < NV; ++u) acc[k][u] = vfma(w, v[u], acc[k][u]);
            }
        }
    }
    for (int k = 0; k < KN; ++k) {
        const vecf s = vset1(inv[k]);
        for (int u = 0; u < NV; ++u) vstore(o + k * d + u * VL, vmul(acc[k][u], s));
    }
}

template <int NV>
inline void values_heads(const float* e, int64_t width, const float* inv, int64_t G, int64_t c, const float* vp,
                         int64_t vstride, int64_t np, const float* vt, int64_t tstride, int64_t nt, float* o,
                         int64_t d) {
    for (int64_t k0 = 0; k0 < G; k0 += 4) {  // four heads at a time: 4 NV accumulators and NV values
        const float* ek = e + k0 * width;
        float* ok = o + k0 * d + c;
        const float* iv = inv + k0;
        switch (G - k0 < 4 ? G - k0 : 4) {
            case 1: values_chunk<1, NV>(ek, width, iv, vp + c, vstride, np, vt + c, tstride, nt, ok, d); break;
            case 2: values_chunk<2, NV>(ek, width, iv, vp + c, vstride, np, vt + c, tstride, nt, ok, d); break;
            case 3: values_chunk<3, NV>(ek, width, iv, vp + c, vstride, np, vt + c, tstride, nt, ok, d); break;
            default: values_chunk<4, NV>(ek, width, iv, vp + c, vstride, np, vt + c, tstride, nt, ok, d);
        }
    }
}
#endif

// The outputs o (G heads, d floats apart) of G query heads of one KV head (values_chunk), in column chunks of
// 2 VL (and one of VL) where the build has AVX2 / AVX-512 and d is a multiple of VL, else by loops.
inline void attend_values(const float* e, int64_t width, const float* inv, int64_t G, int64_t d, const float* vp,
                          int64_t vstride, int64_t np, const float* vt, int64_t tstride, int64_t nt, float* o) {
#if CCFT_AVX512 || CCFT_AVX2
    if (d % VL == 0) {
        int64_t c = 0;
        for (; c + 2 * VL <= d; c += 2 * VL) values_heads<2>(e, width, inv, G, c, vp, vstride, np, vt, tstride, nt, o, d);
        if (c < d) values_heads<1>(e, width, inv, G, c, vp, vstride, np, vt, tstride, nt, o, d);
        return;
    }
#endif
    for (int64_t k = 0; k < G; ++k) {
        float* ok = o + k * d;
        for (int64_t c = 0; c < d; ++c) ok[c] = 0.0f;
        for (int64_t j = 0; j < np + nt; ++j) {  // the prefix values, then the tail's
            const float w = e[k * width + j] * inv[k];
            const float* vv = j < np ? vp + j * vstride : vt + (j - np) * tstride;
            for (int64_t c = 0; c < d; ++c) ok[c] += w * vv[c];
        }
    }
}

// out = RMSNorm(x) = w * (x * rsqrt(mean(x²) + eps)) over n values (torch.rms_norm's arithmetic, another
// summation order).
inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
    const float r = 1.0f / std::sqrt(dot_f32(x, x, n) / (float)n + eps);
    for (int64_t j = 0; j < n; ++j) out[j] = (x[j] * r) * w[j];
}

// RoPE of one head in place: x[j] * cos[j] + x[(j + d/2) % d] * sin[j], sin with its first half negated
// (ccft.inference.model.rope).
inline void rope(float* x, const float* cos, const float* sin, int64_t d, float* tmp) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < d; ++j) tmp[j] = x[j] * cos[j] + x[(j + half) % d] * sin[j];
    std::memcpy(x, tmp, d * sizeof(float));
}

// y (out) += (B (A x)) * s, a LoRA delta (PEFT: W x + B (A x) · scaling): A (r, in), B (out, r) fp32; t: r floats.
inline void lora_add(const float* A, const float* Bm, int64_t r, int64_t in, int64_t out, float s, const float* x,
                     float* y, float* t) {
    for (int64_t j = 0; j < r; ++j) t[j] = dot_f32(A + j * in, x, in);
    for (int64_t o = 0; o < out; ++o) y[o] += dot_f32(Bm + o * r, t, r) * s;
}

// One adapter's table for the fused step (ccft.inference.blocks.lora_table): per layer i and projection j (q, k, v,
// o, gate, up, down) ptrs[2 (7 i + j)] = A, ptrs[2 (7 i + j) + 1] = B (0: not adapted), ranks[7 i + j],
// scales[7 i + j].
struct LoraTable {
    const int64_t* ptrs;
    const int64_t* ranks;
    const float* scales;
};

enum Proj { Q = 0, K = 1, V = 2, O = 3, GATE = 4, UP = 5, DOWN = 6 };

// Row r's delta of projection j in layer i, added into y (out floats), or nothing when r has no adapter there.
inline void add_row_lora(const LoraTable* tables, const int64_t* row_lora, int64_t r, int64_t i, int j, int64_t in,
                     int64_t out, const float* x, float* y, float* t) {
    if (row_lora == nullptr || row_lora[r] < 0) return;
    const LoraTable& tb = tables[row_lora[r]];
    const int64_t at = 7 * i + j;
    if (tb.ptrs[2 * at] == 0) return;
    lora_add(reinterpret_cast<const float*>(tb.ptrs[2 * at]), reinterpret_cast<const float*>(tb.ptrs[2 * at + 1]),
             tb.ranks[at], in, out, tb.scales[at], x, y, t);
}

}  // namespace

extern "C" {

// 6: the ABI version ccft.inference.blocks checks. Features: bit 0 built with AVX2 + FMA, bit 1 with
// AVX-512F (the products then run 16 weights per vector).
int ccft_blocks_abi() { return 6; }
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
#pragma omp parallel num_threads(threads)
    matmul_for(kind, w, n, k, x, m, ldx, y, ldy, STORE);
}

// y (m, n) = silu(x · Wgᵀ) * (x · Wuᵀ): Llama's gated MLP activation, gate and up (n, k) in blocks.
void ccft_blocks_mlp(int kind_gate, const uint8_t* wg, int kind_up, const uint8_t* wu, int64_t n, int64_t k,
                     const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads)
    mlp_for(kind_gate, wg, kind_up, wu, n, k, x, m, ldx, y, ldy);
}

// The arguments of ccft_blocks_decode_step, mirrored by ccft.inference.blocks.StepArgs (a ctypes.Structure;
// ccft_blocks_step_args_size lets it check the layout).
//
// dims: L, B, D (hidden), H (query heads), h (KV heads), d (head dim), I (MLP width), p (prefix width).
// x (B, D): the residual stream, updated in place. cos, sin (B, d): RoPE of each row's position (sin signed).
// norms (2L pointers): attention and MLP RMSNorm weights of each layer. weights (5L pointers) and kinds (5L):
// each layer's [q; k; v] ((H + 2h) d, D), o (D, H d), gate (I, D), up (I, D), down (D, I) blocks.
// qkv_bias (L pointers, or null: none): each layer's bias of [q; k; v] ((H + 2h) d fp32; 0: none) (qwen2).
// qk_norms (2L pointers, or null: none): each layer's per-head RMSNorm weights of q and of k (d fp32 each; 0:
// none), applied to each head after the projection (bias and LoRA deltas included), before RoPE (qwen3).
// prefix (2L pointers: keys, values of layer i, (B, h, p, d) fp32, d contiguous), prefix_strides (6L: keys'
// row, head, position strides, then values', in floats). prefix_row (B,): the prefix row batch row r reads
// (several rows may read one: agents sharing a context), or null: row r reads prefix row r. key_start (B,): the
// first real key of the prefix row batch row r reads. pool_k, pool_v: the tail pool
// (L, slots, h, capacity, d) fp32 with pool_strides (4: layer, slot, head, position, in floats); row r is
// slot r, its new K/V written at write_pos[r], tail_len[r] = write_pos[r] + 1 keys read. d <= MAX_HEAD_DIM, H / h <= MAX_GROUP.
// LoRA: n_lora adapters, lora_tables 3 pointers each (a LoraTable: ptrs, ranks, scales), row_lora (B,) the
// adapter of each row (-1: none; unread when n_lora is 0); each adapted projection adds B (A x) · scaling to
// its output, as ccft.inference.model.project does (gate and up before the SiLU). threads: OpenMP threads.
// row_prefix (3B, or null: the prefix / prefix_strides / prefix_row layout above): per batch row the address
// of its prefix row's keys and of its values in layer 0 and that row's width p_r, a contiguous (h, p_r, d)
// region each, layer i at i * prefix_layer_stride floats further: rows of several prefill handles (sessions
// with their own contexts, each its own width) in one step; `prefix` and `p` are then unread.
struct StepArgs {
    int64_t L, B, D, H, h, d, I, p;
    float eps, scale;
    float* x;
    const float* cos;
    const float* sin;
    const int64_t* norms;
    const int64_t* weights;
    const int32_t* kinds;
    const int64_t* qkv_bias;
    const int64_t* qk_norms;
    const int64_t* prefix;
    const int64_t* prefix_strides;
    const int64_t* prefix_row;
    const int64_t* key_start;
    float* pool_k;
    float* pool_v;
    const int64_t* pool_strides;
    const int64_t* write_pos;
    const int64_t* tail_len;
    int64_t n_lora;
    const int64_t* lora_tables;
    const int64_t* row_lora;
    int64_t threads;
    const int64_t* row_prefix;
    int64_t prefix_layer_stride;
};

int64_t ccft_blocks_step_args_size() { return (int64_t)sizeof(StepArgs); }

// The L decoder layers of one decode step of B rows, each row reading one prefix row (a Llama block:
// RMSNorm, [q; k; v] from blocks (+ its bias: qwen2), the per-head q / k norms (qwen3), RoPE, the new K/V
// written into the tail pool, attention over the row's prefix keys key_start[r] .. p - 1 and its tail keys
// 0 .. tail_len[r] - 1 under one softmax, o_proj and the residual, RMSNorm, the gated MLP from blocks and the
// residual), in one parallel region: the eager step's per-layer ops (ccft.inference.model.decode_step_eager,
// rowwise) without a Python or dispatcher call per op. Every product and activation is fp32, as in that step
// (another summation order; the softmax's exp within ~2 ulp of std::exp where the build has AVX2 / AVX-512:
// vexp_neg). The arguments: StepArgs (above).
void ccft_blocks_decode_step(const StepArgs* args) {
    const int64_t L = args->L, B = args->B, D = args->D, H = args->H, h = args->h, d = args->d, I = args->I,
                  p = args->p;
    const float eps = args->eps, scale = args->scale;
    float* x = args->x;
    const float *cos = args->cos, *sin = args->sin;
    const int64_t *norms = args->norms, *weights = args->weights;
    const int32_t* kinds = args->kinds;
    const int64_t *qkv_bias = args->qkv_bias, *qk_norms = args->qk_norms;
    const int64_t *prefix = args->prefix, *prefix_strides = args->prefix_strides, *prefix_row = args->prefix_row;
    const int64_t* key_start = args->key_start;
    float *pool_k = args->pool_k, *pool_v = args->pool_v;
    const int64_t *pool_strides = args->pool_strides, *write_pos = args->write_pos, *tail_len = args->tail_len;
    const int64_t n_lora = args->n_lora;
    const int64_t *lora_tables = args->lora_tables, *row_lora = args->row_lora;
    const int threads = (int)args->threads;
    const int64_t* row_prefix = args->row_prefix;
    const int64_t prefix_layer_stride = args->prefix_layer_stride;
    const int64_t nq = H * d, nkv = h * d, nqkv = nq + 2 * nkv, group = H / h;
    // the adapters' tables (lora_tables: 3 pointers per adapter) and what a delta needs: the largest rank, and
    // per layer whether some row adapts gate or up (its MLP then keeps them apart, to add the deltas before SiLU)
    LoraTable* tables = new LoraTable[n_lora > 0 ? n_lora : 1];
    int64_t max_rank = 1;
    char* mlp_lora = new char[L];
    for (int64_t i = 0; i < L; ++i) mlp_lora[i] = 0;
    for (int64_t a = 0; a < n_lora; ++a) {
        tables[a] = {reinterpret_cast<const int64_t*>(lora_tables[3 * a]),
                     reinterpret_cast<const int64_t*>(lora_tables[3 * a + 1]),
                     reinterpret_cast<const float*>(lora_tables[3 * a + 2])};
        for (int64_t at = 0; at < 7 * L; ++at) max_rank = std::max(max_rank, tables[a].ranks[at]);
    }
    if (n_lora > 0)
        for (int64_t r = 0; r < B; ++r)
            if (row_lora[r] >= 0)
                for (int64_t i = 0; i < L; ++i)
                    if (tables[row_lora[r]].ptrs[2 * (7 * i + GATE)] || tables[row_lora[r]].ptrs[2 * (7 * i + UP)])
                        mlp_lora[i] = 1;
    const int64_t* rl = n_lora > 0 ? row_lora : nullptr;
    int64_t width = 0;  // keys a row reads at most
    for (int64_t r = 0; r < B; ++r)
        width = std::max(width, (row_prefix ? row_prefix[3 * r + 2] : p) - key_start[r] + tail_len[r]);
    float* hn = new float[B * (D + nqkv + nq + 2 * I + max_rank) + B * H * width];
    float* qkv = hn + B * D;   // (B, (H + 2h) d)
    float* att = qkv + B * nqkv;  // (B, H d): attention outputs
    float* act = att + B * nq;    // (B, I): the MLP's activation
    float* up = act + B * I;      // (B, I): the up projection, in a layer whose MLP has an adapter
    float* lt = up + B * I;       // (B, max_rank): each row's A x of a LoRA delta
    float* scores = lt + B * max_rank;  // (B H, width)
    const int64_t ls = pool_strides[0], ss = pool_strides[1], hs = pool_strides[2], ps = pool_strides[3];
    const int64_t per = h * B >= 2 * threads ? group : 1, parts = group / per;  // attention tasks (below)
#pragma omp parallel num_threads(threads)
    for (int64_t i = 0; i < L; ++i) {
        const float* attn_norm = reinterpret_cast<const float*>(norms[2 * i]);
        const float* mlp_norm = reinterpret_cast<const float*>(norms[2 * i + 1]);
        const int64_t* wt = weights + 5 * i;
        const int32_t* kd = kinds + 5 * i;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B; ++r) rms_norm(x + r * D, attn_norm, D, eps, hn + r * D);
        const float* bias = qkv_bias != nullptr ? reinterpret_cast<const float*>(qkv_bias[i]) : nullptr;
        const float* q_norm = qk_norms != nullptr ? reinterpret_cast<const float*>(qk_norms[2 * i]) : nullptr;
        const float* k_norm = qk_norms != nullptr ? reinterpret_cast<const float*>(qk_norms[2 * i + 1]) : nullptr;
        matmul_for(kd[0], reinterpret_cast<const uint8_t*>(wt[0]), nqkv, D, hn, B, D, qkv, nqkv, STORE);
        if (rl != nullptr || bias != nullptr) {  // the bias, then the LoRA deltas (the layer loop's order)
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B; ++r) {
                float* y = qkv + r * nqkv;
                if (bias != nullptr)
                    for (int64_t c = 0; c < nqkv; ++c) y[c] += bias[c];
                add_row_lora(tables, rl, r, i, Q, D, nq, hn + r * D, y, lt + r * max_rank);
                add_row_lora(tables, rl, r, i, K, D, nkv, hn + r * D, y + nq, lt + r * max_rank);
                add_row_lora(tables, rl, r, i, V, D, nkv, hn + r * D, y + nq + nkv, lt + r * max_rank);
            }
        }
        // the per-head norms (qwen3) and RoPE on q and k; the row's K/V into its tail slot
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * (H + h); ++t) {
            const int64_t r = t / (H + h), head = t % (H + h);
            float* v = qkv + r * nqkv + head * d;
            const float* head_norm = head < H ? q_norm : k_norm;
            if (head_norm != nullptr) rms_norm(v, head_norm, d, eps, v);  // in place: r is taken first
            float tmp[MAX_HEAD_DIM];
            rope(v, cos + r * d, sin + r * d, d, tmp);
            if (head >= H) {
                const int64_t g = head - H, at = i * ls + r * ss + g * hs + write_pos[r] * ps;
                std::memcpy(pool_k + at, v, d * sizeof(float));
                std::memcpy(pool_v + at, v + nkv, d * sizeof(float));
            }
        }
        // attention of each (row, query head) over its prefix keys and its tail keys, one softmax. A task is
        // the `per` query heads of one row that read one KV head: its whole group (GQA: each key and value is
        // read once for them), or one head where h B tasks would leave a thread idle (few rows). Tasks run
        // KV-head-major, so a thread's consecutive rows on one prefix row read that head's keys from its cache.
        const float* kp = row_prefix ? nullptr : reinterpret_cast<const float*>(prefix[2 * i]);
        const float* vp = row_prefix ? nullptr : reinterpret_cast<const float*>(prefix[2 * i + 1]);
        const int64_t* st = row_prefix ? nullptr : prefix_strides + 6 * i;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < h * B * parts; ++t) {
            const int64_t g = t / (B * parts), r = t / parts % B, k0 = t % parts * per;
            const int64_t p0 = key_start[r], nt = tail_len[r];
            const float *kr, *vr;
            int64_t np, kpos, vpos;  // prefix keys read; the keys' and values' position strides
            if (row_prefix) {  // a contiguous (h, p_r, d) region per row, at its own address
                const int64_t pw = row_prefix[3 * r + 2], at = i * prefix_layer_stride + (g * pw + p0) * d;
                kr = reinterpret_cast<const float*>(row_prefix[3 * r]) + at;
                vr = reinterpret_cast<const float*>(row_prefix[3 * r + 1]) + at;
                np = pw - p0, kpos = d, vpos = d;
            } else {
                const int64_t pr = prefix_row ? prefix_row[r] : r;
                kr = kp + pr * st[0] + g * st[1] + p0 * st[2];
                vr = vp + pr * st[3] + g * st[4] + p0 * st[5];
                np = p - p0, kpos = st[2], vpos = st[5];
            }
            const float* kt = pool_k + i * ls + r * ss + g * hs;
            const float* vt = pool_v + i * ls + r * ss + g * hs;
            const int64_t head0 = g * group + k0;
            const float* q0 = qkv + r * nqkv + head0 * d;  // the task's query heads, d apart
            float* s0 = scores + (r * H + head0) * width;  // their scores, width apart
            float* o0 = att + r * nq + head0 * d;          // their outputs, d apart
            for (int part = 0; part < 2; ++part) {  // the prefix keys, then the tail's
                const float* keys = part == 0 ? kr : kt;
                const int64_t n = part == 0 ? np : nt, stride = part == 0 ? kpos : ps, off = part == 0 ? 0 : np;
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t k = 0; k < per; ++k)
                        s0[k * width + off + j] = dot_f32(q0 + k * d, keys + j * stride, d) * scale;
            }
            float inv[MAX_GROUP];
            for (int64_t k = 0; k < per; ++k) inv[k] = 1.0f / softmax_numerators(s0 + k * width, np + nt);
            attend_values(s0, width, inv, per, d, vr, vpos, np, vt, ps, nt, o0);
        }
        matmul_for(kd[1], reinterpret_cast<const uint8_t*>(wt[1]), D, nq, att, B, nq, x, D, ADD);
        if (rl != nullptr) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B; ++r) add_row_lora(tables, rl, r, i, O, nq, D, att + r * nq, x + r * D, lt + r * max_rank);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B; ++r) rms_norm(x + r * D, mlp_norm, D, eps, hn + r * D);
        if (!mlp_lora[i]) {
            mlp_for(kd[2], reinterpret_cast<const uint8_t*>(wt[2]), kd[3], reinterpret_cast<const uint8_t*>(wt[3]),
                    I, D, hn, B, D, act, I);
        } else {  // silu(gate h + δ_gate) * (up h + δ_up): the deltas go in before the SiLU
            matmul_for(kd[2], reinterpret_cast<const uint8_t*>(wt[2]), I, D, hn, B, D, act, I, STORE);
            matmul_for(kd[3], reinterpret_cast<const uint8_t*>(wt[3]), I, D, hn, B, D, up, I, STORE);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B; ++r) {
                add_row_lora(tables, rl, r, i, GATE, D, I, hn + r * D, act + r * I, lt + r * max_rank);
                add_row_lora(tables, rl, r, i, UP, D, I, hn + r * D, up + r * I, lt + r * max_rank);
                for (int64_t c = 0; c < I; ++c) act[r * I + c] = silu(act[r * I + c]) * up[r * I + c];
            }
        }
        matmul_for(kd[4], reinterpret_cast<const uint8_t*>(wt[4]), D, I, act, B, I, x, D, ADD);
        if (rl != nullptr) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B; ++r) add_row_lora(tables, rl, r, i, DOWN, I, D, act + r * I, x + r * D, lt + r * max_rank);
        }
    }
    delete[] hn;
    delete[] tables;
    delete[] mlp_lora;
}

}  // extern "C"
