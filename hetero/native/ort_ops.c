/* hetero's own ONNX Runtime CPU ops (domain "ai.hetero"), loaded by every CPU EP session of hetero's graphs
   (`hetero/native/ort_ops.py`, `SessionOptions.register_custom_ops_library`).

   SiluHadamardQuant(gate [T, F], up [T, F]) -> (xq uint8 [T, F], row_s float32 [T, 1]), attributes block (64),
   scale, qmax, tiny: down_in's input as the layer graphs quantize it, in one pass over each row instead of a dozen
   graph nodes (QuickGelu, Mul, Reshape, a [T·F/64, 64] x [64, 64] MatMul, Reshape, Abs, ReduceMax, Max, Div, Mul,
   QuantizeLinear, Mul: a quarter of an o->FFN graph's time at 32-128 rows, docs/journal.md, "Issue 24 (session 17)"):
     m = silu(gate) * up
     y = m . T, T = diag(H_64, ...) the online block Hadamard of a rotated model (QuaRot; `outliers.rotate`), here a
         fast Walsh-Hadamard transform (6 butterfly stages) instead of a 64-wide matmul
     scale > 0 (a static site): xq = clip(rint(y / scale), -128, 127) + 128, row_s = 1
     scale = 0 (a scale per row, `outliers.rowscale`): r = max(max|y_row|, tiny), xq = clip(rint(y * (qmax / r)),
         -128, 127) + 128, row_s = r * (1 / qmax)
   The same float32 operations as the graph nodes except the order of the Hadamard's sums and SiLU's exp (a degree-7
   polynomial, relative error < 1e-7): the products differ from the nodes' at float32 rounding.

   AddRmsNormQuant(h [T, H], o [T, H], w [H]) -> (h1 float32 [T, H], xq uint8 [T, H]), attributes eps, scale: the
   residual after attention and ffn_in's input at a static scale (Add, SimplifiedLayerNormalization, QuantizeLinear):
     h1 = h + o, x = h1 / sqrt(mean(h1^2) + eps) * w, xq = clip(rint(x / scale), -128, 127) + 128

   RmsNormQuant(h [T, H], w [H]) -> xq uint8 [T, H], attributes eps, scale: attn_in's input at a static scale in the
   q|k|v graph (SimplifiedLayerNormalization, QuantizeLinear), as AddRmsNormQuant without the add.

   ScaleAdd(y [T, N], s [T, 1], h [T, N]) -> h + y * s: a per-row site's product at its rows' scales, plus the
   residual (Mul, Add).

   HadamardQuant(x [T, F]) -> xq uint8 [T, F] and HadamardQuant16(x [T, F]) -> (u_hi uint8 [T, F], u_lo uint8 [T, F]),
   attributes block (64), scale: a rotated site's input at its static scale, where no fused op above computes it
   (another activation before down_in, a post-norm before ffn_in, an online transform at attn_in): y = x . T as
   SiluHadamardQuant's, then xq = clip(rint(y / scale), -128, 127) + 128, or W8A16's int16 grid q = clip(rint(y /
   scale), -32768, 32767) as the two bytes of q + 32768 = 256 u_hi + u_lo (`npu.site_ops.a16_bytes`), in one pass
   over each row instead of a [T.F/64, 64] x [64, 64] MatMul and its quantization's nodes.

   HadamardRowQuant(x [T, F]) -> (xq uint8 [T, F], row_s float32 [T, 1]), attributes as SiluHadamardQuant's: a rotated
   site's input with a scale per row (scale = 0) where no fused op computes it: SiluHadamardQuant with m = x.

   The ONNX Runtime C API is reached through the function table it passes (`OrtApi`, slots by position in
   onnxruntime_c_api.h, append-only across releases) and `struct OrtCustomOp` as that header lays it out (version
   16: the fields up to GetEndVersion). */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h" /* exp512 (as `gemv_vnni.c`) */

typedef void *Status; /* OrtStatus*: NULL is success */
typedef struct OrtApiBase {
    const void **(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *op, const void *api, const void *info);
    const char *(*GetName)(const OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *op);
    int (*GetInputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const OrtCustomOp *op);
    int (*GetOutputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, void *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *op);
    void *CreateKernelV2, *KernelComputeV2, *InferOutputShapeFn;
    int (*GetStartVersion)(const OrtCustomOp *op);
    int (*GetEndVersion)(const OrtCustomOp *op);
};

#define API_VERSION 16
enum { CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
       GET_TENSOR_MUTABLE_DATA = 51, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62, GET_TENSOR_TYPE_AND_SHAPE = 65,
       KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86, KERNEL_CONTEXT_GET_INPUT = 90,
       KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_STATUS = 93, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, ORT_INVALID_ARGUMENT = 2 };

static const void **API;

#define CALL(slot, type, ...) (((type)API[slot])(__VA_ARGS__))
typedef Status (*GetTensorData)(const void *, void **);

typedef struct {
    int64_t block;
    float scale, qmax, tiny;
} Glue;

static inline __m512 silu_mul(const float *g, const float *u) {
    __m512 x = _mm512_loadu_ps(g);
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(u));
}

/* one butterfly stage of span L inside a register (p: v with lanes j and j^L swapped): lane j gets v[j] + v[j^L]
   where bit L of j is clear (hi's bit j clear), v[j^L] - v[j] where it is set */
static inline __m512 butterfly(__m512 v, __m512 p, __mmask16 hi) {
    return _mm512_mask_sub_ps(_mm512_add_ps(v, p), hi, p, v);
}

/* y = x·H_64 (orthonormal Sylvester, `rotate.hadamard`) of 64 values in four registers, in place */
static inline void hadamard64(__m512 v[4]) {
    for (int i = 0; i < 4; i++) {
        __m512 x = v[i];
        x = butterfly(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);
        x = butterfly(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);
        x = butterfly(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0);
        x = butterfly(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00);
        v[i] = x;
    }
    const __m512 eighth = _mm512_set1_ps(0.125f); /* 1/√64: exact */
    __m512 a0 = _mm512_add_ps(v[0], v[1]), a1 = _mm512_sub_ps(v[0], v[1]);
    __m512 a2 = _mm512_add_ps(v[2], v[3]), a3 = _mm512_sub_ps(v[2], v[3]);
    v[0] = _mm512_mul_ps(_mm512_add_ps(a0, a2), eighth);
    v[1] = _mm512_mul_ps(_mm512_add_ps(a1, a3), eighth);
    v[2] = _mm512_mul_ps(_mm512_sub_ps(a0, a2), eighth);
    v[3] = _mm512_mul_ps(_mm512_sub_ps(a1, a3), eighth);
}

/* xq[i] = clip(rint(y[i] · r or / r), -128, 127) + 128, rounding to nearest even (as QuantizeLinear) */
static inline void quantize_row(const float *y, int64_t n, __m512 r, int divide, uint8_t *xq) {
    const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
    const __m512i zp = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < n; i += 16) {
        __m512 x = _mm512_loadu_ps(y + i);
        x = divide ? _mm512_div_ps(x, r) : _mm512_mul_ps(x, r);
        x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
        __m512i q = _mm512_add_epi32(_mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtepi32_epi8(q));
    }
}

/* the [T, N] dims of input i (rank 2), else 0 rows */
static void dims2(void *ctx, size_t i, const void **value, int64_t dims[2]) {
    void *info;
    size_t rank = 0;
    dims[0] = dims[1] = 0;
    CALL(KERNEL_CONTEXT_GET_INPUT, Status (*)(void *, size_t, const void **), ctx, i, value);
    CALL(GET_TENSOR_TYPE_AND_SHAPE, Status (*)(const void *, void **), *value, &info);
    CALL(GET_DIMENSIONS_COUNT, Status (*)(const void *, size_t *), info, &rank);
    if (rank == 2) CALL(GET_DIMENSIONS, Status (*)(const void *, int64_t *, size_t), info, dims, 2);
    CALL(RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(void *), info);
    if (rank != 2) dims[0] = dims[1] = 0;
}

static void *output(void *ctx, size_t i, const int64_t dims[2]) {
    void *value, *data;
    CALL(KERNEL_CONTEXT_GET_OUTPUT, Status (*)(void *, size_t, const int64_t *, size_t, void **), ctx, i, dims, 2,
         &value);
    CALL(GET_TENSOR_MUTABLE_DATA, GetTensorData, value, &data);
    return data;
}

static void *input_data(const void *value) {
    void *data;
    CALL(GET_TENSOR_MUTABLE_DATA, GetTensorData, value, &data);
    return data;
}

/* SiluHadamardQuant (silu: gate, up) and HadamardRowQuant (x alone): the row's 64-block Hadamard, then its
   quantization at the static scale or at its own (top) */
static void hadamard_rows(const Glue *k, void *ctx, int silu) {
    const void *in_g, *in_u;
    int64_t dims[2], dims_u[2];
    dims2(ctx, 0, &in_g, dims);
    if (silu) dims2(ctx, 1, &in_u, dims_u);
    else dims_u[0] = dims[0], dims_u[1] = dims[1], in_u = in_g;
    const int64_t T = dims[0], F = dims[1], one[2] = {T, 1};
    /* the graph builder (`export`) emits the op only on [T, F] rows with F a multiple of the block: KernelCompute
       has no error to return, so other shapes get empty outputs (and the next node's shape check fails) */
    if (dims_u[0] != T || dims_u[1] != F || F % 64 != 0 || k->block != 64) {
        const int64_t none[2] = {0, 0};
        output(ctx, 0, none), output(ctx, 1, none);
        return;
    }
    const float *g = (const float *)input_data(in_g), *u = (const float *)input_data(in_u);
    uint8_t *xq = (uint8_t *)output(ctx, 0, dims);
    float *row_s = (float *)output(ctx, 1, one);
    float *y = (float *)__builtin_alloca((size_t)F * sizeof(float)); /* one row: F <= 64K floats (ffn widths) */
    for (int64_t t = 0; t < T; t++) {
        const float *gt = g + t * F, *ut = u + t * F;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t b = 0; b < F; b += 64) {
            __m512 v[4];
            for (int i = 0; i < 4; i++)
                v[i] = silu ? silu_mul(gt + b + 16 * i, ut + b + 16 * i) : _mm512_loadu_ps(gt + b + 16 * i);
            hadamard64(v);
            for (int i = 0; i < 4; i++) {
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
                _mm512_storeu_ps(y + b + 16 * i, v[i]);
            }
        }
        if (k->scale > 0.f) {
            quantize_row(y, F, _mm512_set1_ps(k->scale), 1, xq + t * F);
            row_s[t] = 1.f;
        } else {
            float m = _mm512_reduce_max_ps(amax);
            m = m > k->tiny ? m : k->tiny;
            quantize_row(y, F, _mm512_set1_ps(k->qmax / m), 0, xq + t * F);
            row_s[t] = m * (1.f / k->qmax);
        }
    }
}

static void glue_compute(void *kernel, void *ctx) { hadamard_rows((const Glue *)kernel, ctx, 1); }
static void hrq_compute(void *kernel, void *ctx) { hadamard_rows((const Glue *)kernel, ctx, 0); }

/* A glue kernel's attributes: its "block" and the first `n_floats` of scale, qmax, tiny. A missing attribute sets
   block = 0, which makes the kernel write empty outputs (a graph built wrongly fails its tests, never a process). */
static Glue *glue_attributes(const void *info, int n_floats) {
    Glue *k = (Glue *)calloc(1, sizeof(Glue));
    if (k == NULL) return NULL;
    void *s;
    if ((s = CALL(KERNEL_INFO_GET_ATTRIBUTE_INT64, Status (*)(const void *, const char *, int64_t *), info, "block",
                  &k->block)))
        CALL(RELEASE_STATUS, void (*)(void *), s), k->block = 0;
    const char *names[3] = {"scale", "qmax", "tiny"};
    float *fields[3] = {&k->scale, &k->qmax, &k->tiny};
    for (int i = 0; i < n_floats; i++)
        if ((s = CALL(KERNEL_INFO_GET_ATTRIBUTE_FLOAT, Status (*)(const void *, const char *, float *), info, names[i],
                      fields[i])))
            CALL(RELEASE_STATUS, void (*)(void *), s), k->block = 0;
    return k;
}

static void *glue_create(const OrtCustomOp *op, const void *api, const void *info) {
    return (void)op, (void)api, glue_attributes(info, 3);
}

static void glue_destroy(void *kernel) { free(kernel); }
static const char *glue_name(const OrtCustomOp *op) { return (void)op, "SiluHadamardQuant"; }
static const char *cpu_ep(const OrtCustomOp *op) { return (void)op, "CPUExecutionProvider"; }
static int float_input(const OrtCustomOp *op, size_t i) { return (void)op, (void)i, TYPE_FLOAT; }
static size_t two(const OrtCustomOp *op) { return (void)op, 2; }
static int glue_output(const OrtCustomOp *op, size_t i) { return (void)op, i == 0 ? TYPE_UINT8 : TYPE_FLOAT; }
static int required(const OrtCustomOp *op, size_t i) { return (void)op, (void)i, 0; }
static int one_(const OrtCustomOp *op) { return (void)op, 1; }
static int latest(const OrtCustomOp *op) { return (void)op, 0x7fffffff; }

static OrtCustomOp GLUE = {API_VERSION, glue_create, glue_name, cpu_ep, float_input, two, glue_output, two,
                           glue_compute, glue_destroy, required, required, required, one_, one_, one_, one_,
                           NULL, NULL, NULL, one_, latest};

typedef struct {
    float eps, scale;
} Norm;

/* per row t: v = h (+ o where given, kept in h1), x = v / sqrt(mean(v^2) + eps) * w, xq = clip(rint(x / scale)) + 128 */
static void norm_quant_rows(const Norm *k, const float *h, const float *o, const float *w, int64_t T, int64_t H,
                            float *h1, uint8_t *xq) {
    float *x = (float *)__builtin_alloca((size_t)H * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const float *v = h + t * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __m512 a = _mm512_loadu_ps(v + i);
            if (o != NULL) {
                a = _mm512_add_ps(a, _mm512_loadu_ps(o + t * H + i));
                _mm512_storeu_ps(h1 + t * H + i, a);
            }
            ss = _mm512_fmadd_ps(a, a, ss);
        }
        if (o != NULL) v = h1 + t * H;
        const __m512 r = _mm512_set1_ps(sqrtf(_mm512_reduce_add_ps(ss) / (float)H + k->eps));
        for (int64_t i = 0; i < H; i += 16)
            _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_div_ps(_mm512_loadu_ps(v + i), r), _mm512_loadu_ps(w + i)));
        quantize_row(x, H, _mm512_set1_ps(k->scale), 1, xq + t * H);
    }
}

static void norm_compute(void *kernel, void *ctx) {
    const void *vh, *vo, *vw;
    int64_t dims[2], dims_o[2];
    dims2(ctx, 0, &vh, dims);
    dims2(ctx, 1, &vo, dims_o);
    CALL(KERNEL_CONTEXT_GET_INPUT, Status (*)(void *, size_t, const void **), ctx, 2, &vw);
    const int64_t T = dims[0], H = dims[1];
    if (dims_o[0] != T || dims_o[1] != H || H % 16 != 0) { /* (as glue_compute) */
        const int64_t none[2] = {0, 0};
        output(ctx, 0, none), output(ctx, 1, none);
        return;
    }
    float *h1 = (float *)output(ctx, 0, dims);
    norm_quant_rows((const Norm *)kernel, (const float *)input_data(vh), (const float *)input_data(vo),
                    (const float *)input_data(vw), T, H, h1, (uint8_t *)output(ctx, 1, dims));
}

static void rms_quant_compute(void *kernel, void *ctx) {
    const void *vh, *vw;
    int64_t dims[2];
    dims2(ctx, 0, &vh, dims);
    CALL(KERNEL_CONTEXT_GET_INPUT, Status (*)(void *, size_t, const void **), ctx, 1, &vw);
    if (dims[1] % 16 != 0) { /* (as glue_compute) */
        const int64_t none[2] = {0, 0};
        output(ctx, 0, none);
        return;
    }
    norm_quant_rows((const Norm *)kernel, (const float *)input_data(vh), NULL, (const float *)input_data(vw), dims[0],
                    dims[1], NULL, (uint8_t *)output(ctx, 0, dims));
}

static void scale_add_compute(void *kernel, void *ctx) {
    (void)kernel;
    const void *vy, *vs, *vh;
    int64_t dims[2], dims_s[2], dims_h[2];
    dims2(ctx, 0, &vy, dims);
    dims2(ctx, 1, &vs, dims_s);
    dims2(ctx, 2, &vh, dims_h);
    const int64_t T = dims[0], N = dims[1];
    if (dims_s[0] != T || dims_s[1] != 1 || dims_h[0] != T || dims_h[1] != N || N % 16 != 0) {
        const int64_t none[2] = {0, 0};
        output(ctx, 0, none);
        return;
    }
    const float *y = (const float *)input_data(vy), *s = (const float *)input_data(vs), *h = (const float *)input_data(vh);
    float *out = (float *)output(ctx, 0, dims);
    for (int64_t t = 0; t < T; t++) {
        const __m512 st = _mm512_set1_ps(s[t]);
        for (int64_t i = 0; i < N; i += 16)
            _mm512_storeu_ps(out + t * N + i, _mm512_add_ps(_mm512_loadu_ps(h + t * N + i),
                                                            _mm512_mul_ps(_mm512_loadu_ps(y + t * N + i), st)));
    }
}

static void *norm_create(const OrtCustomOp *op, const void *api, const void *info) {
    (void)op, (void)api;
    Norm *k = (Norm *)calloc(1, sizeof(Norm));
    if (k == NULL) return NULL;
    const char *names[2] = {"eps", "scale"};
    float *fields[2] = {&k->eps, &k->scale};
    for (int i = 0; i < 2; i++) {
        void *s = CALL(KERNEL_INFO_GET_ATTRIBUTE_FLOAT, Status (*)(const void *, const char *, float *), info, names[i],
                       fields[i]);
        if (s) CALL(RELEASE_STATUS, void (*)(void *), s), k->scale = 1.f; /* (the builder always sets both) */
    }
    return k;
}

static void *no_state(const OrtCustomOp *op, const void *api, const void *info) {
    (void)op, (void)api, (void)info;
    return calloc(1, 1);
}

static const char *norm_name(const OrtCustomOp *op) { return (void)op, "AddRmsNormQuant"; }
static const char *scale_add_name(const OrtCustomOp *op) { return (void)op, "ScaleAdd"; }
static const char *rms_quant_name(const OrtCustomOp *op) { return (void)op, "RmsNormQuant"; }
static size_t three(const OrtCustomOp *op) { return (void)op, 3; }
static size_t one_output(const OrtCustomOp *op) { return (void)op, 1; }
static int norm_output(const OrtCustomOp *op, size_t i) { return (void)op, i == 0 ? TYPE_FLOAT : TYPE_UINT8; }
static int float_output(const OrtCustomOp *op, size_t i) { return (void)op, (void)i, TYPE_FLOAT; }
static int uint8_output(const OrtCustomOp *op, size_t i) { return (void)op, (void)i, TYPE_UINT8; }

static OrtCustomOp NORM = {API_VERSION, norm_create, norm_name, cpu_ep, float_input, three, norm_output, two,
                           norm_compute, glue_destroy, required, required, required, one_, one_, one_, one_,
                           NULL, NULL, NULL, one_, latest};
static OrtCustomOp RMS_QUANT = {API_VERSION, norm_create, rms_quant_name, cpu_ep, float_input, two, uint8_output,
                                one_output, rms_quant_compute, glue_destroy, required, required, required, one_, one_,
                                one_, one_, NULL, NULL, NULL, one_, latest};
static OrtCustomOp SCALE_ADD = {API_VERSION, no_state, scale_add_name, cpu_ep, float_input, three, float_output,
                                one_output, scale_add_compute, glue_destroy, required, required, required, one_, one_,
                                one_, one_, NULL, NULL, NULL, one_, latest};

/* HadamardQuant(16): y = x . T per 64-block, quantized at the static scale to u8 or to W8A16's two bytes (top) */
static void hadamard_quant(const Glue *k, void *ctx, int bytes16) {
    const void *in;
    int64_t dims[2];
    dims2(ctx, 0, &in, dims);
    const int64_t T = dims[0], F = dims[1];
    if (F % 64 != 0 || k->block != 64 || !(k->scale > 0.f)) { /* (as glue_compute) */
        const int64_t none[2] = {0, 0};
        output(ctx, 0, none);
        if (bytes16) output(ctx, 1, none);
        return;
    }
    const float *x = (const float *)input_data(in);
    uint8_t *o0 = (uint8_t *)output(ctx, 0, dims), *o1 = bytes16 ? (uint8_t *)output(ctx, 1, dims) : NULL;
    const __m512 s = _mm512_set1_ps(k->scale);
    const __m512 lo = _mm512_set1_ps(bytes16 ? -32768.f : -128.f), hi = _mm512_set1_ps(bytes16 ? 32767.f : 127.f);
    const __m512i zp = _mm512_set1_epi32(bytes16 ? 32768 : 128), low_byte = _mm512_set1_epi32(255);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < F; b += 64) {
            __m512 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_ps(x + t * F + b + 16 * i);
            hadamard64(v);
            for (int i = 0; i < 4; i++) {
                __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v[i], s), lo), hi);
                __m512i q = _mm512_add_epi32(_mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
                int64_t at = t * F + b + 16 * i;
                if (bytes16) {
                    _mm_storeu_si128((__m128i *)(o0 + at), _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 8)));
                    _mm_storeu_si128((__m128i *)(o1 + at), _mm512_cvtepi32_epi8(_mm512_and_si512(q, low_byte)));
                } else {
                    _mm_storeu_si128((__m128i *)(o0 + at), _mm512_cvtepi32_epi8(q));
                }
            }
        }
}

static void hq_compute(void *kernel, void *ctx) { hadamard_quant((const Glue *)kernel, ctx, 0); }
static void hq16_compute(void *kernel, void *ctx) { hadamard_quant((const Glue *)kernel, ctx, 1); }

static void *hq_create(const OrtCustomOp *op, const void *api, const void *info) {
    return (void)op, (void)api, glue_attributes(info, 1);
}

static const char *hq_name(const OrtCustomOp *op) { return (void)op, "HadamardQuant"; }
static const char *hq16_name(const OrtCustomOp *op) { return (void)op, "HadamardQuant16"; }
static const char *hrq_name(const OrtCustomOp *op) { return (void)op, "HadamardRowQuant"; }
static size_t one_input(const OrtCustomOp *op) { return (void)op, 1; }

static OrtCustomOp HADAMARD_QUANT = {API_VERSION, hq_create, hq_name, cpu_ep, float_input, one_input, uint8_output,
                                     one_output, hq_compute, glue_destroy, required, required, required, one_, one_,
                                     one_, one_, NULL, NULL, NULL, one_, latest};
static OrtCustomOp HADAMARD_QUANT16 = {API_VERSION, hq_create, hq16_name, cpu_ep, float_input, one_input,
                                       uint8_output, two, hq16_compute, glue_destroy, required, required, required,
                                       one_, one_, one_, one_, NULL, NULL, NULL, one_, latest};
static OrtCustomOp HADAMARD_ROW_QUANT = {API_VERSION, glue_create, hrq_name, cpu_ep, float_input, one_input,
                                         glue_output, two, hrq_compute, glue_destroy, required, required, required,
                                         one_, one_, one_, one_, NULL, NULL, NULL, one_, latest};

static void *DOMAIN;
static Status DOMAIN_STATUS;
static pthread_once_t DOMAIN_ONCE = PTHREAD_ONCE_INIT;

static void make_domain(void) {
    DOMAIN_STATUS = CALL(CREATE_CUSTOM_OP_DOMAIN, Status (*)(const char *, void **), "ai.hetero", &DOMAIN);
    const OrtCustomOp *ops[7] = {&GLUE, &NORM, &RMS_QUANT, &SCALE_ADD, &HADAMARD_QUANT, &HADAMARD_QUANT16,
                                 &HADAMARD_ROW_QUANT};
    for (int i = 0; i < 7 && DOMAIN_STATUS == NULL; i++)
        DOMAIN_STATUS = CALL(CUSTOM_OP_DOMAIN_ADD, Status (*)(void *, const OrtCustomOp *), DOMAIN, ops[i]);
}

/* Called by ONNX Runtime for each session options that registers this library: one domain for the process. */
Status RegisterCustomOps(void *options, const OrtApiBase *base) {
    if (API == NULL) API = base->GetApi(API_VERSION);
    if (API == NULL) return NULL; /* cannot happen with a runtime that serves version 16; nothing to report with */
    pthread_once(&DOMAIN_ONCE, make_domain);
    if (DOMAIN_STATUS != NULL)
        return CALL(CREATE_STATUS, Status (*)(int, const char *), ORT_INVALID_ARGUMENT,
                    "hetero's op domain ai.hetero could not be made");
    return CALL(ADD_CUSTOM_OP_DOMAIN, Status (*)(void *, void *), options, DOMAIN);
}
