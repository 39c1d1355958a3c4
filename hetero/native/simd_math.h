/* AVX-512 math shared by hetero's C kernels (`gemv_vnni.c`, `ort_ops.c`); part of each kernel's build key
   (`build.Kernel.headers`). */
#pragma once
#include <immintrin.h>

/* exp(x) for x <= 88: 2^t with t = x·log2(e) = n + f, |f| <= 0.5, 2^f by its Taylor series to degree 7 (relative
   error < 1e-7), times 2^n by vscalefps (which saturates to 0 for very negative x). */
static inline __m512 exp512(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    t = _mm512_max_ps(t, _mm512_set1_ps(-200.f));
    t = _mm512_min_ps(t, _mm512_set1_ps(200.f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
