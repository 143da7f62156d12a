
// Kimi Delta Attention's per-sequence core on the GPU (fathom-kernels
// `kda`: short_conv, head_inputs, delta_rule, gated_norm), with the CPU's
// operations one for one: every multiply and add rounded on its own
// (__fmul_rn, __fadd_rn; the module is compiled with --fmad=false), the
// fused multiply-adds only where the CPU calls mul_add (exp_fixed,
// ln_fixed, dot_lanes), the
// sequential sums in the CPU's order, and the same hand-written exp. The
// bits are the CPU's for every non-NaN value; a NaN stays a NaN (its
// payload may differ: the GPU's arithmetic returns the canonical NaN).

#define EXP_MIN_ARG (-87.33654f)
#define EXP_MAX_ARG 88.72283f

// fathom-kernels `expf::exp_fixed`: Cody–Waite reduction, a degree-7
// Horner polynomial of fused multiply-adds, 2^n from its bits.
__device__ __forceinline__ float exp_fixed(float x) {
    if (x > EXP_MAX_ARG) return __uint_as_float(0x7F800000u);
    if (x < EXP_MIN_ARG) return 0.0f;
    const float n = rintf(__fmul_rn(x, 1.44269504088896340736f));
    float r = __fmaf_rn(-n, 0.6933594f, x);
    r = __fmaf_rn(-n, -2.1219444e-4f, r);
    float p = 1.0f / 5040.0f;
    p = __fmaf_rn(p, r, 1.0f / 720.0f);
    p = __fmaf_rn(p, r, 1.0f / 120.0f);
    p = __fmaf_rn(p, r, 1.0f / 24.0f);
    p = __fmaf_rn(p, r, 1.0f / 6.0f);
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const float scale = __uint_as_float(((unsigned)((int)n + 127)) << 23);
    return __fmul_rn(p, scale);
}

__device__ __forceinline__ float sigmoid_fixed(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_fixed(-x)));
}

// fathom-kernels `ops::ln_fixed` (x ≥ 1): x = m·2^k with m in [√½, √2)
// from the bits, k·ln 2 + 2·atanh((m − 1)/(m + 1)), atanh by its odd
// series (ATANH_SERIES: 1/15, 1/13, …, 1/3 as f32) in fused Horner steps.
__device__ __forceinline__ float ln_fixed(float x) {
    const unsigned bits = __float_as_uint(x);
    int k = (int)((bits >> 23) & 0xFFu) - 127;
    float m = __uint_as_float((bits & 0x007FFFFFu) | 0x3F800000u);
    if (m > 1.41421356237309504880f) {
        m = __fmul_rn(m, 0.5f);
        k += 1;
    }
    const float s = __fdiv_rn(__fsub_rn(m, 1.0f), __fadd_rn(m, 1.0f));
    const float z = __fmul_rn(s, s);
    float p = 1.0f / 15.0f;
    p = __fmaf_rn(p, z, 1.0f / 13.0f);
    p = __fmaf_rn(p, z, 1.0f / 11.0f);
    p = __fmaf_rn(p, z, 1.0f / 9.0f);
    p = __fmaf_rn(p, z, 1.0f / 7.0f);
    p = __fmaf_rn(p, z, 1.0f / 5.0f);
    p = __fmaf_rn(p, z, 1.0f / 3.0f);
    const float at = __fmaf_rn(__fmul_rn(s, z), p, s);
    return __fmaf_rn((float)k, 0.693147180559945309417f, __fmul_rn(2.0f, at));
}

// fathom-kernels `ops::softplus_fixed`: x above 20 (and NaN), else
// ln(1 + e) = ln_fixed(w)·e/(w − 1) with e = exp_fixed(x), w = 1 + e; e
// itself where w rounds to 1.
__device__ __forceinline__ float softplus_fixed(float x) {
    if (!(x <= 20.0f)) return x;
    const float e = exp_fixed(x);
    const float w = __fadd_rn(1.0f, e);
    if (w == 1.0f) return e;
    return __fmul_rn(ln_fixed(w), __fdiv_rn(e, __fsub_rn(w, 1.0f)));
}

// Σ v[i]² over i = 0, 1, … in order, from zero.
__device__ __forceinline__ float sum_sq(const float* v, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s = __fadd_rn(s, __fmul_rn(v[i], v[i]));
    return s;
}

// dot_lanes' end (below): the eight lanes' sums folded, then the tail
// from `body` fused.
__device__ __forceinline__ float fold_lanes(const float (&acc)[8], const float* a,
                                            const float* b, int body, int n) {
    float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[2], acc[6])),
                        __fadd_rn(__fadd_rn(acc[1], acc[5]), __fadd_rn(acc[3], acc[7])));
    for (int i = body; i < n; ++i) s = __fmaf_rn(a[i], b[i], s);
    return s;
}

// Σ a[i]·b[i] in fathom-kernels `attention::dot_lanes`' order: lane l
// accumulates fmaf(a[i], b[i], ·) over i ≡ l (mod 8) through the full
// chunks of 8, the lanes fold as ((0+4)+(2+6))+((1+5)+(3+7)), then the
// tail in order, fused.
__device__ __forceinline__ float dot_lanes(const float* a, const float* b, int n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int body = n / 8 * 8;
    for (int i = 0; i < body; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] = __fmaf_rn(a[i + l], b[i + l], acc[l]);
    return fold_lanes(acc, a, b, body, n);
}

// Σ v[i]² in the same order (what `ops::rms_inv` sums).
__device__ __forceinline__ float sum_sq_lanes(const float* v, int n) { return dot_lanes(v, v, n); }

#define KDA_MAX_KERNEL 8

// The launch's dynamic shared memory (a host emulator defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// Rows k0 … k0 + KDA_CHUNK − 1 (those below kd) of column j of a head's
// state, loaded together: each row's update must wait for its load, and
// one load at a time would make the state's 2·kd rows 2·kd round trips.
// Sixteen keep a thread within the 64 registers a block of 1024 (the
// widest head `fits_device_kernel` takes) allows: `kda_step` is launched
// with that bound.
#define KDA_CHUNK 16
__device__ __forceinline__ void load_rows(const float* s, int k0, int kd, int j,
                                          float (&v)[KDA_CHUNK]) {
#pragma unroll
    for (int i = 0; i < KDA_CHUNK; ++i)
        v[i] = k0 + i < kd ? s[(size_t)(k0 + i) * kd + j] : 0.0f;
}

// One pass over column j of a head's state: each row k becomes
// update(S[k][j], k), and Σ_k w[k]·S'[k][j] runs in row order; KDA_CHUNK
// rows' loads are issued before their updates.
template <typename Update>
__device__ __forceinline__ float column_pass(float* s, int kd, int j, const float* w,
                                             Update update) {
    float acc = 0.0f;
    for (int k0 = 0; k0 < kd; k0 += KDA_CHUNK) {
        float v[KDA_CHUNK];
        load_rows(s, k0, kd, j, v);
#pragma unroll
        for (int i = 0; i < KDA_CHUNK; ++i) {
            if (k0 + i < kd) {
                const float sv = update(v[i], k0 + i);
                s[(size_t)(k0 + i) * kd + j] = sv;
                acc = __fadd_rn(acc, __fmul_rn(w[k0 + i], sv));
            }
        }
    }
    return acc;
}

// One sequence's T positions (rows row0 … row0 + T − 1 of the step's
// inputs) for one head per block (gridDim.x = heads), one thread per
// channel of the head (blockDim.x = kd, keys and values kd wide).
// S: the sequence's state [H, kd, kd]; win_*: its conv windows
// [kernel − 1, P]; pre_*, f, g, out: [N, P]; b: [N, H]; taps: [P, kernel].
// Positions run in order, so T positions give the bits of T single steps.
// hin, when not null, receives each position's delta-rule inputs (what a
// journal keeps): q, k, v, log α as [4, n_rows, P], then β as [n_rows, H].
extern "C" __global__ void __launch_bounds__(1024) kda_step(
    float* S, float* win_q, float* win_k, float* win_v,
    const float* pre_q, const float* pre_k, const float* pre_v,
    const float* f, const float* b, const float* g,
    const float* taps_q, const float* taps_k, const float* taps_v,
    const float* a, const float* dt, const float* onorm, float* out,
    int row0, int t, int heads, int kd, int kernel,
    float q_scale, float l2_eps, float norm_eps, int bounded, float lb, float* hin, int n_rows) {
    DYNAMIC_SHARED(float, sh);
    float* qs = sh;            // [kd] normalised, scaled q
    float* ks = sh + kd;       // [kd] normalised k
    float* alpha = sh + 2 * kd;  // [kd] decays
    float* os = sh + 3 * kd;   // [kd] head output
    float* rs = sh + 4 * kd;   // [2] norms' factors
    const int hh = blockIdx.x, j = threadIdx.x;
    const int p = heads * kd, c = hh * kd + j, hist = kernel - 1;
    float* s = S + (size_t)hh * kd * kd;
    float* wins[3] = {win_q, win_k, win_v};
    const float* pres[3] = {pre_q, pre_k, pre_v};
    const float* taps[3] = {taps_q, taps_k, taps_v};
    for (int ti = 0; ti < t; ++ti) {
        const size_t row = (size_t)(row0 + ti);
        // Short convolution + SiLU of this channel of q, k and v.
        float cv[3];
        for (int m = 0; m < 3; ++m) {
            float acc = 0.0f;
            for (int tap = 0; tap < kernel; ++tap) {
                const int r = ti + tap;  // row of window ++ pre
                const float x = r < hist ? wins[m][(size_t)r * p + c]
                                         : pres[m][(size_t)(row0 + r - hist) * p + c];
                acc = __fadd_rn(acc, __fmul_rn(taps[m][(size_t)c * kernel + tap], x));
            }
            cv[m] = __fmul_rn(acc, sigmoid_fixed(acc));
        }
        qs[j] = cv[0];
        ks[j] = cv[1];
        const float z = __fadd_rn(f[row * p + c], dt[c]);
        // log α: lb·σ(a·z) with a lower bound (K3), else −a·softplus(z).
        const float la = bounded ? __fmul_rn(lb, sigmoid_fixed(__fmul_rn(a[c], z)))
                                 : __fmul_rn(-a[c], softplus_fixed(z));
        alpha[j] = exp_fixed(la);
        __syncthreads();
        if (j == 0) {
            rs[0] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sum_sq(qs, kd), l2_eps)));
            rs[1] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sum_sq(ks, kd), l2_eps)));
        }
        __syncthreads();
        const float qj = __fmul_rn(__fmul_rn(qs[j], rs[0]), q_scale);
        const float kj = __fmul_rn(ks[j], rs[1]);
        __syncthreads();
        qs[j] = qj;
        ks[j] = kj;
        const float beta = sigmoid_fixed(b[row * heads + hh]);
        if (hin) {
            const size_t np = (size_t)n_rows * p, at = row * p + c;
            hin[at] = qj;
            hin[np + at] = kj;
            hin[2 * np + at] = cv[2];
            hin[3 * np + at] = la;
            if (j == 0) hin[4 * np + row * heads + hh] = beta;
        }
        __syncthreads();
        // Gated delta rule, column j of the state.
        const float pred = column_pass(s, kd, j, ks, [&](float v, int k) {
            return __fmul_rn(v, alpha[k]);
        });
        const float u = __fmul_rn(beta, __fsub_rn(cv[2], pred));
        const float o = column_pass(s, kd, j, qs, [&](float v, int k) {
            return __fadd_rn(v, __fmul_rn(ks[k], u));
        });
        // RMSNorm of the head output (ops::rms_norm), gated by σ(g).
        os[j] = o;
        __syncthreads();
        if (j == 0) {
            const float ms = __fdiv_rn(sum_sq_lanes(os, kd), (float)kd);
            rs[0] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, norm_eps)));
        }
        __syncthreads();
        const float on = __fmul_rn(__fmul_rn(o, rs[0]), onorm[j]);
        out[row * p + c] = __fmul_rn(on, sigmoid_fixed(g[row * p + c]));
        __syncthreads();
    }
    // Each channel's new window: the last kernel − 1 rows of window ++ pre.
    for (int m = 0; m < 3; ++m) {
        float keep[KDA_MAX_KERNEL];
        for (int i = 0; i < hist; ++i) {
            const int r = t + i;  // rows t … t + hist − 1 of window ++ pre
            keep[i] = r < hist ? wins[m][(size_t)r * p + c]
                               : pres[m][(size_t)(row0 + r - hist) * p + c];
        }
        for (int i = 0; i < hist; ++i) wins[m][(size_t)i * p + c] = keep[i];
    }
}
