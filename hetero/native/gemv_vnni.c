/* A decode step's linears as int8 GEMVs on AVX-512 VNNI; see hetero/native/gemv.py.

   A job is one linear of a layer with the elementwise work around it: a prologue that builds its input rows x (x =
   in0 [+ in1], then RMSNorm, or act(gate)·up with act SiLU, GELU-tanh or ReLU, then a block Hadamard), x quantized
   to int8 per block of QB values of K (one scale per block: amax / 127), the GEMV over 8-bit weights (u8 with zero
   point 128, one float scale per output column and block, the layout MatMulNBits reads, repacked), and an epilogue
   (+ bias, + the residual res0 [+ res1]). A part is the job's column range [lo, hi) and its own scratch, so two
   threads can run the two halves of one job at once: each computes the prologue in its scratch (the same values) and
   writes only its columns (a fixed range, or tiles claimed from a shared counter). Every column's integer sums are
   exact and its float sums run in a fixed order (block after block), so a row's outputs do not depend on the other
   rows of the job nor on the split.

   No software prefetch: over the weights' one arena on huge pages the hardware prefetcher streams 26 GB/s from one
   thread (AMD EPYC Zen 4), prefetches 4 KB ahead 22 (docs/journal.md, "Issue 24 item 3 (session 15)").

   Weights (fmt 0, FMT_INT8): column tiles of TILE = 64 (4 vectors of 16), each tile a stream of K/4 quads of 256
   bytes: for each of its 64 columns 4 consecutive weights along K (vpdpbusd's layout); scales [tiles][blocks][64].

   The GGUF's own blocks of 32 values of K (fmt FMT_Q4_1, FMT_Q8_0: llama.cpp's Q4_1, w = d·q + m with q in 0..15,
   and Q8_0, w = d·q with q in -127..127; d, m fp16), each tile a stream of K/32 blocks with their scales inside:
   Q4_1 4 groups × 4 vectors of 64 bytes, byte i of a column's lane holding q[8g + i] (low nibble) and q[8g + 4 + i]
   (high nibble), then d [64] and m [64] fp16 (1,280 bytes: 0.625 bytes a weight, as the file); Q8_0 8 quads × 256
   bytes of q + 128 (u8, the INT8 form's zero point), then d [64] fp16. An activation block (AB = 32) is a weight
   block, so a block's integer sum is exact and its float terms are d·s·Σq·xq (+ m·s·Σxq for Q4_1). */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd_math.h" /* exp512 */

#define TILE 64
#define QB 128 /* values of K sharing a weight scale (MatMulNBits' block) */
#ifndef AB
#define AB 32  /* values of K sharing an activation scale: a quarter of a weight block */
#endif
#define SUB (QB / AB)

typedef struct {
    int64_t rows;          /* rows of this job (a token tree's) */
    const float *in0;      /* [rows, ld_in] */
    const float *in1;      /* [rows, ld_in] added to in0 before the norm, or NULL */
    int64_t ld_in;
    const float *norm;     /* RMSNorm weight [k], or NULL */
    double eps;
    int64_t act;           /* x = act(in0[:, :k]) * in0[:, k:2k]: ACT_SILU, ACT_GELU_TANH, ACT_RELU (0: x = in0) */
    int64_t had;           /* block Hadamard size applied to x (0: none) */
    int64_t k, n;          /* the linear: K inputs, N outputs (N a multiple of TILE) */
    const uint8_t *w;      /* packed weights (above) */
    const float *ws;       /* scales [N / TILE][nb][TILE] */
    const float *bias;     /* [n] or NULL */
    const float *res0;     /* [rows, ld_out] or NULL: out = (res0 + res1) + y */
    const float *res1;
    float *out;            /* [rows, ld_out] */
    int64_t ld_out;
    int64_t fmt;           /* the weights' form: FMT_INT8 (w, ws as above), FMT_Q4_1 or FMT_Q8_0 (w alone) */
} Job;

enum { FMT_INT8 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };
enum { ACT_SILU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3 };
#define GB 32 /* values of K in a GGUF block (Q4_1, Q8_0): one activation block */
#if AB != GB
#error "the GGUF block kernels take one activation scale per block of 32"
#endif

/* Bytes of a tile's block of GB values of K in a block form. */
static inline int64_t block_bytes(int64_t fmt) { return fmt == FMT_Q4_1 ? 1024 + 2 * 2 * TILE : 2048 + 2 * TILE; }

typedef struct {
    int64_t lo, hi;        /* columns, multiples of TILE */
    int64_t *next;         /* NULL: the part computes tiles lo..hi; else tiles claimed one at a time from this counter
                              (shared by the job's parts, zero before the job runs): the threads balance themselves,
                              and a thread that comes late finds the tiles done */
    float *xs;             /* scratch [rows, k] floats */
    int8_t *xq;            /* scratch [rows, nb * QB] */
    float *sa;             /* scratch [rows, nb * SUB]: a scale per activation block */
    int32_t *xsum;         /* scratch [rows, nb * SUB] */
} Part;

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* f + (acc - corr)·(w·s): one activation block's int32 sums of 16 columns, less the zero point's share (corr), at the
   columns' weight scales w times the block's activation scale s (the order every tile function keeps, bit for bit) */
static inline __m512 block_add(__m512i acc, __m512i corr, __m512 w, __m512 s, __m512 f) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr)), _mm512_mul_ps(w, s), f);
}

/* In place x·H for each block of `size` values (H the orthonormal Sylvester Hadamard: `rotate.hadamard`). */
static void block_hadamard(float *x, int64_t k, int64_t size) {
    const float norm = 1.0f / sqrtf((float)size);
    for (int64_t b = 0; b < k; b += size) {
        float *v = x + b;
        for (int64_t len = 1; len < size; len <<= 1)
            for (int64_t i = 0; i < size; i += 2 * len)
                for (int64_t j = i; j < i + len; j++) {
                    float a = v[j], c = v[j + len];
                    v[j] = a + c;
                    v[j + len] = a - c;
                }
        for (int64_t i = 0; i < size; i++) v[i] *= norm;
    }
}

/* x [k] of one row, as the job's prologue says. */
static void prologue(const Job *J, int64_t r, float *x) {
    const int64_t k = J->k;
    const float *a = J->in0 + r * J->ld_in;
    if (J->act != 0) {
        /* silu(g) = g / (1 + e^-g); gelu_tanh(g) = g·(1 + tanh(y))/2 = g / (1 + e^-2y) with
           y = √(2/π)(g + 0.044715 g³): both g / (1 + e^-z), z = g or 2y */
        const float c2 = 2.f * 0.7978845608028654f, c3 = 0.044715f;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            __m512 g = _mm512_loadu_ps(a + i), u = _mm512_loadu_ps(a + k + i), s;
            if (J->act == ACT_RELU) {
                s = _mm512_max_ps(g, _mm512_setzero_ps());
            } else {
                __m512 z = g;
                if (J->act == ACT_GELU_TANH)
                    z = _mm512_mul_ps(_mm512_mul_ps(g, _mm512_set1_ps(c2)),
                                      _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(c3), _mm512_set1_ps(1.f)));
                __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), z));
                s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            }
            _mm512_storeu_ps(x + i, _mm512_mul_ps(s, u));
        }
        for (; i < k; i++) {
            const float g = a[i];
            const float z = J->act == ACT_GELU_TANH ? c2 * g * (1.f + c3 * g * g) : g;
            x[i] = (J->act == ACT_RELU ? (g > 0.f ? g : 0.f) : g / (1.f + expf(-z))) * a[k + i];
        }
    } else if (J->in1 != NULL) {
        const float *b = J->in1 + r * J->ld_in;
        for (int64_t i = 0; i < k; i++) x[i] = a[i] + b[i];
    } else {
        for (int64_t i = 0; i < k; i++) x[i] = a[i];
    }
    if (J->norm != NULL) {
        __m512 acc = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < k; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)k + (float)J->eps);
        for (i = 0; i < k; i++) x[i] = x[i] * inv * J->norm[i];
    }
    if (J->had > 1) block_hadamard(x, k, J->had);
}

/* x [k] → xq [nb·QB] (zero past k), sa[b] = amax_b / 127, xsum[b] = 128·Σ xq over activation block b (AB values). */
static void quantize(const float *x, int64_t k, int64_t nb, int8_t *xq, float *sa, int32_t *xsum) {
    for (int64_t b = 0; b < nb * SUB; b++) {
        const int64_t lo = b * AB, hi = lo + AB < k ? lo + AB : k;
        float m = 0.f;
        for (int64_t i = lo; i < hi; i++) m = fmaxf(m, fabsf(x[i]));
        const float s = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
        int32_t sum = 0;
        for (int64_t i = lo; i < hi; i++) {
            int32_t q = (int32_t)nearbyintf(x[i] * inv);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            xq[i] = (int8_t)q;
            sum += q;
        }
        for (int64_t i = hi > lo ? hi : lo; i < lo + AB; i++) xq[i] = 0;
        sa[b] = s;
        xsum[b] = 128 * sum;
    }
}

/* One tile (64 columns) of each of R rows: y_r[c] = Σ_b ws[b][c]·Σ_{a ⊂ b} sa_r[a]·(Σ_{k∈a} (w_u8 − 128)·xq_r),
   over weight blocks b and their activation blocks a; row r's xq at xq + r·kp, its sa and xsum at + r·na, its y at
   y + r·TILE. Each weight vector is loaded once for the R rows (a token tree's, two at a time), and every operation
   of a row is the same, in the same order, whatever R is, so a row's bits do not depend on its neighbour. Called
   with R a constant (1 or 2), of which gcc makes a copy each (-O3's constant-propagation clones), where the loops
   over the rows and the tile's 4 vectors unroll and the sums stay in registers; not inlined, so each copy has the
   registers to itself (inlined into the caller, the one-row copy reloaded two spilled pointers per activation block:
   0.6% slower). */
#define MAX_ROWS 2
static __attribute__((noinline)) void tile_rows(const int R, const uint8_t *wt, const float *wst, int64_t quads,
                                                int64_t nb, const int8_t *xq, int64_t kp, const float *sa,
                                                const int32_t *xsum, int64_t na, float *y) {
    __m512 f[MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) f[r][u] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float *ws = wst + b * TILE;
        __m512 w[4];
        for (int u = 0; u < 4; u++) w[u] = _mm512_loadu_ps(ws + 16 * u);
        for (int64_t a = b * SUB; a < (b + 1) * SUB; a++) {
            const int64_t q0 = a * (AB / 4), q1 = q0 + AB / 4 < quads ? q0 + AB / 4 : quads;
            if (q0 >= q1) break;
            __m512i acc[MAX_ROWS][4];
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_si512();
            for (int64_t j = q0; j < q1; j++) {
                const __m512i *p = (const __m512i *)(wt + j * 256);
                __m512i v[4];
                for (int u = 0; u < 4; u++) v[u] = _mm512_loadu_si512(p + u);
                for (int r = 0; r < R; r++) {
                    const __m512i x = _mm512_set1_epi32(((const int32_t *)(xq + r * kp))[j]);
                    for (int u = 0; u < 4; u++) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], v[u], x);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m512i corr = _mm512_set1_epi32(xsum[r * na + a]);
                const __m512 s = _mm512_set1_ps(sa[r * na + a]);
                for (int u = 0; u < 4; u++) f[r][u] = block_add(acc[r][u], corr, w[u], s, f[r][u]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(y + r * TILE + 16 * u, f[r][u]);
}

/* One tile (64 columns) of R rows over a GGUF block form (fmt, a constant at each call: gcc's clones, as tile_rows):
   y_r[c] = Σ_b sa_r[b]·(d[b][c]·Σ_{k∈b} q·xq_r [+ m[b][c]·Σ_{k∈b} xq_r]), block after block, so a row's bits do
   not depend on R. Q8_0's q is stored + 128 and its share of 128 (xsum) taken off as in tile_rows. Inlined into one
   function per (R, fmt) below (gcc's clones made two of the four: the form stayed a run-time branch). */
static inline __attribute__((always_inline)) void tile_blocks(const int R, const int fmt, const uint8_t *wt,
                                                              int64_t nbk, const int8_t *xq, int64_t kp,
                                                              const float *sa, const int32_t *xsum, int64_t na,
                                                              float *y) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t bb = block_bytes(fmt), wbytes = fmt == FMT_Q4_1 ? 1024 : 2048;
    __m512 f[MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) f[r][u] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *blk = wt + b * bb;
        __m512i acc[MAX_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_si512();
        if (fmt == FMT_Q4_1) {
            for (int g = 0; g < 4; g++) {
                __m512i lo[4], hi[4];
                for (int u = 0; u < 4; u++) {
                    const __m512i v = _mm512_loadu_si512(blk + 256 * g + 64 * u);
                    lo[u] = _mm512_and_si512(v, low);
                    hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                for (int r = 0; r < R; r++) {
                    const int32_t *xr = (const int32_t *)(xq + r * kp) + b * (GB / 4) + 2 * g;
                    const __m512i x0 = _mm512_set1_epi32(xr[0]), x1 = _mm512_set1_epi32(xr[1]);
                    for (int u = 0; u < 4; u++)
                        acc[r][u] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][u], lo[u], x0), hi[u], x1);
                }
            }
        } else {
            for (int j = 0; j < GB / 4; j++) {
                __m512i v[4];
                for (int u = 0; u < 4; u++) v[u] = _mm512_loadu_si512(blk + 256 * j + 64 * u);
                for (int r = 0; r < R; r++) {
                    const __m512i x = _mm512_set1_epi32(((const int32_t *)(xq + r * kp))[b * (GB / 4) + j]);
                    for (int u = 0; u < 4; u++) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], v[u], x);
                }
            }
        }
        const uint16_t *d16 = (const uint16_t *)(blk + wbytes);
        for (int u = 0; u < 4; u++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + 16 * u)));
            const __m512 m = fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + TILE + 16 * u)))
                                             : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m512 s = _mm512_set1_ps(sa[r * na + b]);
                if (fmt == FMT_Q4_1) {
                    const __m512 sx = _mm512_set1_ps(sa[r * na + b] * (float)(xsum[r * na + b] / 128));
                    f[r][u] = _mm512_fmadd_ps(m, sx, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][u]),
                                                                     _mm512_mul_ps(d, s), f[r][u]));
                } else {
                    f[r][u] = block_add(acc[r][u], _mm512_set1_epi32(xsum[r * na + b]), d, s, f[r][u]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(y + r * TILE + 16 * u, f[r][u]);
}

#define TILE_BLOCKS(name, R, fmt)                                                                              \
    static __attribute__((noinline)) void name(const uint8_t *wt, int64_t nbk, const int8_t *xq, int64_t kp,       \
                                               const float *sa, const int32_t *xsum, int64_t na, float *y) {       \
        tile_blocks(R, fmt, wt, nbk, xq, kp, sa, xsum, na, y);                                                     \
    }
TILE_BLOCKS(tile_q4_1_r1, 1, FMT_Q4_1)
TILE_BLOCKS(tile_q4_1_r2, 2, FMT_Q4_1)
TILE_BLOCKS(tile_q8_0_r1, 1, FMT_Q8_0)
TILE_BLOCKS(tile_q8_0_r2, 2, FMT_Q8_0)

/* One tile of R rows (1 or 2, constants) in the job's weight form. */
static inline void tile(const int R, const Job *J, int64_t t, int64_t quads, int64_t nb, const int8_t *xq,
                        int64_t kp, const float *sa, const int32_t *xsum, int64_t na, float *y) {
    const int64_t nbk = J->k / GB;
    if (J->fmt == FMT_Q4_1)
        (R == 1 ? tile_q4_1_r1 : tile_q4_1_r2)(J->w + t * nbk * block_bytes(FMT_Q4_1), nbk, xq, kp, sa, xsum, na, y);
    else if (J->fmt == FMT_Q8_0)
        (R == 1 ? tile_q8_0_r1 : tile_q8_0_r2)(J->w + t * nbk * block_bytes(FMT_Q8_0), nbk, xq, kp, sa, xsum, na, y);
    else
        tile_rows(R, J->w + t * (quads * 256), J->ws + t * (nb * TILE), quads, nb, xq, kp, sa, xsum, na, y);
}

/* The epilogue of one row's tile: out = [res0 (+ res1) +] (y [+ bias]). */
static void store_row(const Job *J, int64_t r, int64_t c, const float *y) {
    float *o = J->out + r * J->ld_out + c;
    const int64_t m = J->n - c < TILE ? J->n - c : TILE;
    for (int64_t i = 0; i < m; i++) {
        float v = y[i];
        if (J->bias != NULL) v += J->bias[c + i];
        if (J->res0 != NULL) {
            const float base = J->res1 != NULL ? J->res0[r * J->ld_out + c + i] + J->res1[r * J->ld_out + c + i]
                                               : J->res0[r * J->ld_out + c + i];
            v = base + v;
        }
        o[i] = v;
    }
}

/* Run one job's part: the prologue and quantization of every row into the part's scratch, then its tiles.
   Returns NULL (the signature of ONNX Runtime's RunWithBinding, so the decode step's two-core stage runner calls
   it as it calls a graph half: `twocore.attnpool`). */
void *hetero_gemv_part(void *job, void *unused, void *part) {
    (void)unused;
    const Job *J = (const Job *)job;
    const Part *P = (const Part *)part;
    const int64_t k = J->k, nb = (k + QB - 1) / QB, kp = nb * QB, quads = (k + 3) / 4, na = nb * SUB;
    for (int64_t r = 0; r < J->rows; r++) {
        prologue(J, r, P->xs + r * k);
        quantize(P->xs + r * k, k, nb, P->xq + r * kp, P->sa + r * na, P->xsum + r * na);
    }
    float y[MAX_ROWS * TILE];
    const int64_t t0 = P->lo / TILE, t1 = P->hi / TILE;
    for (int64_t t = t0;; t++) {
        if (P->next != NULL) t = t0 + __atomic_fetch_add(P->next, 1, __ATOMIC_RELAXED);
        if (t >= t1) break;
        const int64_t c = t * TILE;
        int64_t r = 0;
        for (; r + 1 < J->rows; r += 2) {  /* a tree's rows in pairs: one load of each weight vector for two rows */
            tile(2, J, t, quads, nb, P->xq + r * kp, kp, P->sa + r * na, P->xsum + r * na, na, y);
            store_row(J, r, c, y);
            store_row(J, r + 1, c, y + TILE);
        }
        if (r < J->rows) {
            tile(1, J, t, quads, nb, P->xq + r * kp, kp, P->sa + r * na, P->xsum + r * na, na, y);
            store_row(J, r, c, y);
        }
    }
    return NULL;
}

/* Jobs first..last-1 in order on this thread, each with its own part (a layer's o→FFN chain in one call). */
void hetero_gemv_run(void **jobs, void **parts, int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++) hetero_gemv_part(jobs[i], NULL, parts[i]);
}
