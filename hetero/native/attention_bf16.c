/* One prefill chunk's causal attention with BF16 dot products (AVX-512 BF16), one thread. Built and loaded by
 * hetero/native/attention.py, which documents what it computes and why (the fp32 GroupQueryAttention of
 * ONNX Runtime was 41-52% of a long prefill on a CPU whose BF16 dot product does twice the fp32 FMA's work).
 *
 * Layout: queries sit in the 16 lanes of a vector. S^T = K Q^T is a row of scores per key whose lanes are 16
 * query rows, so the online softmax (flash attention) is vertical max/add over keys, and O^T += V^T P^T takes the
 * probabilities of two keys per lane pair (vdpbf16ps). Each call repacks Q, K (bf16, blocks of 16 keys, a pair of dims
 * broadcast to every lane) and V (pairs of keys) from the fp32 cache.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 16 /* query rows per block: the lanes of a vector */
#define KB 32 /* keys per block */
#define MAXD 256

static inline uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (finite inputs) */
    return (uint16_t)(u >> 16);
}

/* 2^x for x <= 0: degree-4 polynomial on [-0.5, 0.5] (rel. error 7e-6, far below bf16's 4e-3), scaled by vscalefps;
 * x below -126 gives 2^-126 (a masked score's weight: 1e-38, nothing beside the row's own key's >= 1). */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 fi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, fi);
    __m512 p = _mm512_set1_ps(9.670767875e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.587553514e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402221166e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931272626e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000052f));
    return _mm512_scalef_ps(p, fi);
}

/* x <- x·T in place, T = diag(H_b, ...)/sqrt(b) of d/b blocks (H_b: the Sylvester Hadamard matrix of size b, a power
 * of two >= 16 dividing d; x 64-byte aligned): butterflies a, b -> a + b, a - b at every stride below b, those below
 * 16 inside a vector (a permute and a signed add). */
static inline void hadamard_row(float *x, int64_t d, int64_t b) {
    const __m512 s8 = _mm512_set_ps(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 s4 = _mm512_set_ps(-1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1);
    const __m512 s2 = _mm512_set_ps(-1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1);
    const __m512 s1 = _mm512_set_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    for (int64_t i = 0; i < d; i += 16) {
        __m512 v = _mm512_load_ps(x + i);
        v = _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));
        v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));
        v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));
        v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));
        _mm512_store_ps(x + i, v);
    }
    for (int64_t h = 16; h < b; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 16) {
                __m512 u = _mm512_load_ps(x + j), v = _mm512_load_ps(x + j + h);
                _mm512_store_ps(x + j, _mm512_add_ps(u, v));
                _mm512_store_ps(x + j + h, _mm512_sub_ps(u, v));
            }
    const __m512 norm = _mm512_set1_ps(1.0f / sqrtf((float)b));
    for (int64_t i = 0; i < d; i += 16) _mm512_store_ps(x + i, _mm512_mul_ps(_mm512_load_ps(x + i), norm));
}

/* rotate-half RoPE of one head's first r dims (the first half of them paired with the second; Phi's partial rotary:
 * r < d, the other dims pass), times mul, written to dst */
static inline void rope(const float *x, const float *c, const float *s, int64_t d, int64_t r, float *dst, float mul) {
    int64_t h = r / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        dst[i] = (a * c[i] - b * s[i]) * mul;
        dst[i + h] = (b * c[i] + a * s[i]) * mul;
    }
    for (int64_t i = r; i < d; i++) dst[i] = x[i] * mul;
}

/* RMSNorm of one head (QK-norm, Qwen3 and Gemma 3: before RoPE) into dst: x * rsqrt(mean(x^2) + eps) * w, in fp32 as
 * `model.rms_norm` (w: Gemma's 1 + w folded in at load) */
static inline void head_norm(const float *x, const float *w, int64_t d, float eps, float *dst) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) dst[i] = x[i] * r * w[i];
}

typedef struct {
    void *p;
    size_t n;
} scratch_t;

/* Each thread's scratch, grown to the largest call it made; freed when the thread exits (a prefill's second lane is a
 * new thread each time: a plain __thread pointer would leak its buffers with every prefill). */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    scratch_t *s = p;
    for (int k = 0; k < 3; k++) free(s[k].p);
    free(s);
}

static void scratch_key_make(void) { pthread_key_create(&scratch_key, scratch_free); }

static void *grow(int k, size_t bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch_t *scratch = pthread_getspecific(scratch_key);
    if (!scratch) {
        scratch = calloc(3, sizeof(scratch_t));
        if (!scratch || pthread_setspecific(scratch_key, scratch)) {
            free(scratch);
            return NULL;
        }
    }
    if (scratch[k].n < bytes) {
        free(scratch[k].p);
        scratch[k].p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch[k].n = scratch[k].p ? bytes : 0;
    }
    return scratch[k].p;
}

/* The whole call for head size D; inlined into a copy per common D, so that every row and pair offset is a constant
 * (the 16 keys' broadcasts then need no address registers). */
static inline __attribute__((always_inline)) int attend(
    const float *qkv, int64_t n, int64_t qkv_stride, float *kc, float *vc, int64_t cap, int64_t start, int64_t base,
    const float *cosv, const float *sinv, int64_t rope_stride, float *out, int64_t out_stride, int64_t H, int64_t KV,
    const int64_t D, float scale, int64_t window, int64_t rotate, const float *qn, const float *kn, float eps,
    int64_t R) {
    const int64_t qd = H * D, kd = KV * D, P2 = D / 2, group = H / KV;
    const int64_t T = start + n - base; /* cache rows in use: 0..T-1 hold positions base..start+n-1 */
    const int64_t Tpad = (T + KB - 1) / KB * KB;
    const int64_t nrb = (n + RB - 1) / RB;
    const float qmul = scale * 1.4426950408889634f; /* softmax in base 2 */

    /* the chunk's K (QK-normed when kn is given, roped) and V rows into the fp32 cache */
    float normed[MAXD];
    for (int64_t i = 0; i < n; i++) {
        const float *row = qkv + i * qkv_stride;
        const float *c = cosv + (start + i) * rope_stride, *s = sinv + (start + i) * rope_stride;
        int64_t r = start + i - base;
        for (int64_t g = 0; g < KV; g++) {
            const float *k = row + qd + g * D;
            if (kn) {
                head_norm(k, kn, D, eps, normed);
                k = normed;
            }
            rope(k, c, s, D, R, kc + (g * cap + r) * D, 1.0f);
            memcpy(vc + (g * cap + r) * D, row + qd + kd + g * D, D * sizeof(float));
        }
    }
    uint32_t *kt = grow(0, (size_t)KV * P2 * Tpad * 4);       /* [KV][Tpad/16][D/2][16]: pairs of dims, key-minor */
    uint32_t *vp = grow(1, (size_t)KV * (Tpad / 2) * D * 4);  /* [KV][Tpad/2][D]: (V[2j][d], V[2j+1][d]) */
    uint32_t *qp = grow(2, (size_t)H * nrb * P2 * RB * 4 + (size_t)(KB * RB + KB / 2 * RB + MAXD * RB + KV * MAXD) * 4);
    if (!kt || !vp || !qp) return 1;
    float *S = (float *)(qp + (size_t)H * nrb * P2 * RB); /* [KB][RB] scores of a block */
    uint32_t *pp = (uint32_t *)(S + KB * RB);             /* [KB/2][RB] probability pairs */
    float *ot = (float *)(pp + KB / 2 * RB);              /* [D][RB] the output, transposed */
    float *vref_all = ot + MAXD * RB;                     /* [KV][MAXD] each group's V reference, added back */

    /* K and V less a reference row before rounding to bf16 (SageAttention's smoothing of K: the rounding error is
     * relative to |k - ref|, not |k|, and the channels all keys share cancel). Exact in fp32: a query's scores all
     * move by q·ref, which the softmax ignores, and sum_j p_j (v_j - ref) + ref = sum_j p_j v_j as the p_j sum to
     * one (rotate: o·H = sum_j p_j (v_j - ref)·H + ref·H, o_in's online Hadamard done here, on V's rows). The
     * reference is position 0's K and V, which every chunk of a prompt sees, so a row's numbers do not depend on
     * where its chunk ends and the prefill is the same however a prompt is cut; the mean over the
     * chunk's keys, used before, tied every row to the chunk's end. Measured the same perplexity through the prefill
     * (docs/journal.md, "Issue 40"). A windowed layer's cache drops position 0 as its window slides: no reference. */
    const int smooth = window == 0 && base == 0;
    float kref[MAXD], vref[MAXD], vref_rot[MAXD] __attribute__((aligned(64)));
    for (int64_t g = 0; g < KV; g++) {
        const float *k0 = kc + (g * cap) * D, *v0 = vc + (g * cap) * D;
        for (int64_t d = 0; d < D; d++) {
            kref[d] = smooth ? k0[d] : 0.0f;
            vref[d] = smooth ? v0[d] : 0.0f;
        }
        if (rotate) {
            memcpy(vref_rot, vref, D * sizeof(float));
            hadamard_row(vref_rot, D, rotate);
        }
        memcpy(vref_all + g * MAXD, rotate ? vref_rot : vref, D * sizeof(float));
        /* K in blocks of 16 keys, pair-major in a block: kt[g][key/16][p][key%16] = (k[2p], k[2p+1]) of the key, so the
         * score loop reads a block's 2 KB in order (rows of Tpad keys put a block's 32 pair rows in one L1 set: 1.12x the
         * kernel's time at 256 rows over 2048 keys; docs/journal.md, "Issue 24 (session 16)") */
        for (int64_t r = 0; r < Tpad; r++) {
            uint32_t row[MAXD / 2] __attribute__((aligned(64)));
            if (r < T) {
                const float *src = kc + (g * cap + r) * D;
                for (int64_t d = 0; d < D; d += 32) {
                    __m512 lo = _mm512_sub_ps(_mm512_loadu_ps(src + d), _mm512_loadu_ps(kref + d));
                    __m512 hi = _mm512_sub_ps(_mm512_loadu_ps(src + d + 16), _mm512_loadu_ps(kref + d + 16));
                    _mm512_store_si512(row + d / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            } else {
                memset(row, 0, D * 2);
            }
            uint32_t *dst = kt + g * P2 * Tpad + (r / 16) * P2 * 16 + r % 16;
            for (int64_t p = 0; p < P2; p++) dst[p * 16] = row[p];
        }
        float rows[2][MAXD] __attribute__((aligned(64)));  /* a pair of V rows less the reference (rotated: ·H) */
        for (int64_t j = 0; j < Tpad / 2; j++) {  /* V: the pair (row 2j, row 2j+1) of each dim */
            uint32_t *dst = vp + (g * (Tpad / 2) + j) * D;
            for (int t = 0; t < 2; t++) {
                const float *v = vc + (g * cap + 2 * j + t) * D;
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(rows[t] + d, 2 * j + t < T ? _mm512_sub_ps(_mm512_loadu_ps(v + d), _mm512_loadu_ps(vref + d))
                                                               : _mm512_setzero_ps());
                if (rotate && 2 * j + t < T) hadamard_row(rows[t], D, rotate);
            }
            for (int64_t d = 0; d < D; d += 16) {
                __m512 va = _mm512_load_ps(rows[0] + d), vb = _mm512_load_ps(rows[1] + d);
                __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(va));
                __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(vb));
                _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
    /* Q (QK-normed when qn is given) roped, scaled, as pairs of dims per lane: qp[h][rb][p][lane]; padded rows repeat
     * the last real row */
    float qrow[MAXD];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t i = 0; i < nrb * RB; i++) {
            int64_t src = i < n ? i : n - 1;
            const float *c = cosv + (start + src) * rope_stride, *s = sinv + (start + src) * rope_stride;
            const float *q = qkv + src * qkv_stride + h * D;
            if (qn) {
                head_norm(q, qn, D, eps, normed);
                q = normed;
            }
            rope(q, c, s, D, R, qrow, qmul);
            uint32_t *dst = qp + ((h * nrb + i / RB) * P2) * RB + i % RB;
            for (int64_t p = 0; p < P2; p++) dst[p * RB] = bf16_of(qrow[2 * p]) | ((uint32_t)bf16_of(qrow[2 * p + 1]) << 16);
        }
    }

    const __m512 neg_inf = _mm512_set1_ps(-1e30f); /* a masked score (see the softmax below) */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                              21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / group;
        const uint32_t *kg = kt + g * P2 * Tpad, *vg = vp + g * (Tpad / 2) * D;
        for (int64_t rb = 0; rb < nrb; rb++) {
            const uint32_t *qb = qp + (h * nrb + rb) * P2 * RB;
            int64_t i0 = rb * RB, ilast = (i0 + RB < n ? i0 + RB : n) - 1;
            /* each lane's position (padded lanes: the last real row's), relative to the cache's row 0 */
            __m512i qpos = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32((int)(start + i0 - base))),
                                            _mm512_set1_epi32((int)(start + ilast - base)));
            int64_t qlo = start + i0 - base, qhi = start + ilast - base;
            int64_t klo = window > 0 ? qlo - window + 1 : 0;
            if (klo < 0) klo = 0;
            klo = klo / KB * KB;
            __m512 m = neg_inf, l = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) _mm512_store_ps(ot + d * RB, _mm512_setzero_ps());
            for (int64_t k0 = klo; k0 <= qhi; k0 += KB) {
                for (int half = 0; half < KB / 16; half++) {
                    __m512 acc[16];
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
                    const uint32_t *kp = kg + (k0 + half * 16) * P2;
                    for (int64_t p = 0; p < P2; p++, kp += 16) {
                        __m512bh q = (__m512bh)_mm512_load_si512(qb + p * RB);
#pragma GCC unroll 16
                        for (int j = 0; j < 16; j++)
                            acc[j] = _mm512_dpbf16_ps(acc[j], q, (__m512bh)_mm512_set1_epi32((int)kp[j]));
                    }
                    int need_mask = (k0 + half * 16 + 15 > qlo) || (window > 0 && k0 + half * 16 <= qhi - window);
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) {
                        __m512 sj = acc[j];
                        if (need_mask) {
                            __m512i kpos = _mm512_set1_epi32((int)(k0 + half * 16 + j));
                            __mmask16 bad = _mm512_cmpgt_epi32_mask(kpos, qpos);
                            if (window > 0)
                                bad |= _mm512_cmple_epi32_mask(kpos, _mm512_sub_epi32(qpos, _mm512_set1_epi32((int)window)));
                            sj = _mm512_mask_mov_ps(sj, bad, neg_inf);
                        }
                        _mm512_store_ps(S + (half * 16 + j) * RB, sj);
                    }
                }
                /* online softmax over the block's keys (vertical: a lane is a query row). A masked score is -1e30,
                 * not -inf: its weight is 2^-126; a row whose first block is all masked gets weights of 1 there, which
                 * the next block's alpha (2^-126) erases, and every row reaches a real key (its own). */
                __m512 mb = _mm512_load_ps(S);
                for (int j = 1; j < KB; j++) mb = _mm512_max_ps(mb, _mm512_load_ps(S + j * RB));
                __m512 mn = _mm512_max_ps(m, mb);
                __m512 alpha = exp2_ps(_mm512_sub_ps(m, mn));
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < KB; j += 2) {
                    __m512 a = exp2_ps(_mm512_sub_ps(_mm512_load_ps(S + j * RB), mn));
                    __m512 b = exp2_ps(_mm512_sub_ps(_mm512_load_ps(S + (j + 1) * RB), mn));
                    /* [a0..a15 | b0..b15] as bf16, then (a_r, b_r) in lane r */
                    __m512i ab = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
                    _mm512_store_si512(pp + (j / 2) * RB, ab);
                    /* the row sums of the probabilities as rounded, the ones PV multiplies: the output is then a
                     * convex combination of V's rows (fp32 sums of unrounded ones scaled it by up to 1 + 2^-9) */
                    __m512 ar = _mm512_castsi512_ps(_mm512_slli_epi32(ab, 16));
                    __m512 br = _mm512_castsi512_ps(_mm512_and_si512(ab, _mm512_set1_epi32((int)0xFFFF0000u)));
                    sum = _mm512_add_ps(sum, _mm512_add_ps(ar, br));
                }
                l = _mm512_fmadd_ps(l, alpha, sum);
                m = mn;
                /* O^T = O^T * alpha + V^T P^T, 16 dims at a time */
                const uint32_t *vb = vg + (k0 / 2) * D;
                for (int64_t d0 = 0; d0 < D; d0 += 16) {
                    __m512 acc[16];
#pragma GCC unroll 16
                    for (int t = 0; t < 16; t++) acc[t] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + t) * RB), alpha);
                    for (int jp = 0; jp < KB / 2; jp++) {
                        __m512bh pv = (__m512bh)_mm512_load_si512(pp + jp * RB);
#pragma GCC unroll 16
                        for (int t = 0; t < 16; t++)
                            acc[t] = _mm512_dpbf16_ps(acc[t], pv, (__m512bh)_mm512_set1_epi32((int)vb[jp * D + d0 + t]));
                    }
#pragma GCC unroll 16
                    for (int t = 0; t < 16; t++) _mm512_store_ps(ot + (d0 + t) * RB, acc[t]);
                }
            }
            __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
            for (int64_t d = 0; d < D; d++) _mm512_store_ps(ot + d * RB, _mm512_mul_ps(_mm512_load_ps(ot + d * RB), inv));
            const float *vm = vref_all + g * MAXD;
            for (int64_t i = i0; i <= ilast; i++) {
                float *o = out + i * out_stride + h * D;
                for (int64_t d = 0; d < D; d++) o[d] = ot[d * RB + (i - i0)] + vm[d];
            }
        }
    }
    return 0;
}

/* Returns 0, or 1 when a scratch buffer could not be allocated, 2 for a head size or Hadamard block it does not take.
 * rotate: 0, or the block b of o_in's online Hadamard diag(H_b, ...) (a power of two from 16 to D) applied to V's rows.
 * qn/kn: each q/k head's RMSNorm weights [D] (QK-norm before RoPE, eps), or NULL for none. R: the dims of a head RoPE
 * rotates (even, up to D; the tables' rows hold R/2 angles, rope_stride apart). */
int hetero_attention_bf16(const float *qkv, int64_t n, int64_t qkv_stride, float *kc, float *vc, int64_t cap,
                          int64_t start, int64_t base, const float *cosv, const float *sinv, int64_t rope_stride,
                          float *out, int64_t out_stride, int64_t H, int64_t KV, int64_t D, float scale,
                          int64_t window, int64_t rotate, const float *qn, const float *kn, float eps, int64_t R) {
    if (D % 32 || D > MAXD || (rotate && (rotate < 16 || rotate > D || (rotate & (rotate - 1)) || D % rotate))) return 2;
    if (R < 2 || R > D || R % 2) return 2;
#define CALL(d) attend(qkv, n, qkv_stride, kc, vc, cap, start, base, cosv, sinv, rope_stride, out, out_stride, H, KV, d, \
                       scale, window, rotate, qn, kn, eps, R)
    switch (D) {
    case 64: return CALL(64);
    case 128: return CALL(128);
    case 256: return CALL(256);
    default: return CALL(D);
    }
#undef CALL
}
