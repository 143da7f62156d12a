
// Grouped-query attention layers (Qwen3-MoE, GPT-OSS) in one call
// (fathom-kernels `backend::gqa_work_cpu` defines the order): the heads'
// preparation, the attention over each sequence's [K | V] cache in splits
// of 256 rows (`gqa::gqa_attend_scalar`: dot_lanes scores times the scale,
// the split's max, p = exp(s − max) with exp_fixed — the CPU's exp_softmax,
// the same operations for s − max ≤ 0 —, l += p and c += p·v in
// row order, each product rounded and then added; the splits merged in
// order by the online-softmax rule, a sink last as a split with m = sink,
// l = 1, c = 0; ctx = C · (1/L)), the output projection's bias.

#define GQA_HEAD_MAX 1024

// One head of one row per block (grid: rows × heads): src's head (rows of
// heads·hd values) plus its bias (if any), RMSNormed with nw (if `normed`:
// the sum of squares in dot_lanes' order, v · inv · w), rotated with the
// row's angles cs, sn [T, hd / 2] (if `roped`: rotate-half pairs), written
// to dst + row·dst_stride + dst_off + head·hd and, when `table` is given,
// to the same place of the row's cache row: row ns[r] − 1 of the cache
// whose blocks (rows w wide) start at table[boff[r]].
extern "C" __global__ void gqa_prep(const float* __restrict__ src, int heads, int hd,
                                    const float* __restrict__ bias,
                                    const float* __restrict__ nw, float eps, int normed,
                                    const float* __restrict__ cs,
                                    const float* __restrict__ sn, int roped,
                                    float* __restrict__ dst, long long dst_stride, int dst_off,
                                    const unsigned long long* __restrict__ table,
                                    const int* __restrict__ boff, const int* __restrict__ ns,
                                    int w) {
    __shared__ float row[GQA_HEAD_MAX];
    const int r = blockIdx.x, hh = blockIdx.y, half = hd / 2;
    const float* x = src + ((size_t)r * heads + hh) * hd;
    const float* b = bias ? bias + (size_t)hh * hd : 0;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) row[c] = b ? __fadd_rn(x[c], b[c]) : x[c];
    __syncthreads();
    if (normed) {
        const float inv = mla_stage_rms(row, row, hd, eps);
        for (int c = threadIdx.x; c < hd; c += blockDim.x)
            row[c] = __fmul_rn(__fmul_rn(row[c], inv), nw[c]);
        __syncthreads();
    }
    float* out = dst + (size_t)r * dst_stride + dst_off + (size_t)hh * hd;
    float* cached = 0;
    if (table) {
        const int pos = ns[r] - 1;
        cached = (float*)table[boff[r] + pos / MLA_SPLIT] + (size_t)(pos % MLA_SPLIT) * w +
                 dst_off + (size_t)hh * hd;
    }
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        const float v = roped ? mla_rot(row, hd, c, cs + (size_t)r * half, sn + (size_t)r * half, 0)
                              : row[c];
        out[c] = v;
        if (cached) cached[c] = v;
    }
}

// The rows query qi sees: lo (the window's first) to n.
__device__ __forceinline__ int gqa_lo(int n, int window) {
    return window > 0 && n > window ? n - window : 0;
}

// One (split, query, head) per block (grid: max splits × queries ×
// heads): `blocks` every cache's row blocks ([K | V] rows, w = 2·kvh·hd
// wide), boff[T] where each query's cache starts, q [T, heads, hd], ns[T]
// the rows each query sees, `window` (0: none). Scratch per (query,
// split) at qi·max_splits + k: ps [H, MLA_SPLIT], pm, pl [H], pc [H, hd].
// Splits outside the query's rows are left alone (the merge skips them).
extern "C" __global__ void gqa_split(const unsigned long long* __restrict__ blocks,
                                     const int* __restrict__ boff, const float* __restrict__ q,
                                     const int* __restrict__ ns, int heads, int kvh, int hd,
                                     float scale, int window, int max_splits, float* ps,
                                     float* pm, float* pl, float* pc) {
    __shared__ float mx;
    const int k = blockIdx.x, qi = blockIdx.y, hh = blockIdx.z;
    const int n = ns[qi], lo = gqa_lo(n, window), base = k * MLA_SPLIT;
    if (base >= n || base + MLA_SPLIT <= lo) return;  // the whole block leaves together
    const int from = max(lo, base) - base, len = min(base + MLA_SPLIT, n) - base - from;
    const int w = 2 * kvh * hd, kvw = kvh * hd, g = hh / (heads / kvh);
    const float* rows = (const float*)blocks[boff[qi] + k] + (size_t)from * w;
    const size_t at = (size_t)qi * max_splits + k;
    float* s = ps + (at * heads + hh) * MLA_SPLIT;
    const float* qh = q + ((size_t)qi * heads + hh) * hd;
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        s[j] = __fmul_rn(dot_lanes(rows + (size_t)j * w + g * hd, qh, hd), scale);
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = __uint_as_float(0xff800000u);  // −∞
        for (int j = 0; j < len; ++j) m = fmaxf(m, s[j]);
        mx = m;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < len; j += blockDim.x) s[j] = exp_fixed(__fsub_rn(s[j], mx));
    __syncthreads();
    if (threadIdx.x == 0) {
        float l = 0.0f;
        for (int j = 0; j < len; ++j) l = __fadd_rn(l, s[j]);
        pm[at * heads + hh] = mx;
        pl[at * heads + hh] = l;
    }
    const float* vals = rows + kvw + g * hd;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float c = 0.0f;
        for (int j = 0; j < len; ++j) c = __fadd_rn(c, __fmul_rn(s[j], vals[(size_t)j * w + e]));
        pc[(at * heads + hh) * hd + e] = c;
    }
}

// Per query and head (grid: queries × heads): the splits the query sees
// merged in order, then the head's sink (if `sinks`), one thread per
// value; the context goes to out [T, heads, hd] from query c0.
extern "C" __global__ void gqa_merge(const int* __restrict__ ns, int heads, int hd, int window,
                                     int max_splits, const float* __restrict__ sinks,
                                     const float* __restrict__ pm,
                                     const float* __restrict__ pl,
                                     const float* __restrict__ pc, float* __restrict__ out) {
    const int qi = blockIdx.x, hh = blockIdx.y;
    const int n = ns[qi], k0 = gqa_lo(n, window) / MLA_SPLIT, k1 = (n + MLA_SPLIT - 1) / MLA_SPLIT;
    const float ninf = __uint_as_float(0xff800000u);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float M = ninf, L = 0.0f, C = 0.0f;
        for (int k = k0; k <= k1; ++k) {
            float m, l, c;
            if (k < k1) {
                const size_t at = (size_t)qi * max_splits + k;
                m = pm[at * heads + hh];
                l = pl[at * heads + hh];
                c = pc[(at * heads + hh) * hd + e];
            } else if (sinks) {
                m = sinks[hh];
                l = 1.0f;
                c = 0.0f;
            } else {
                break;
            }
            const float mn = fmaxf(M, m);
            const float a = M == ninf ? 0.0f : exp_fixed(__fsub_rn(M, mn));
            const float b = exp_fixed(__fsub_rn(m, mn));
            L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
            C = __fadd_rn(__fmul_rn(C, a), __fmul_rn(c, b));
            M = mn;
        }
        out[((size_t)qi * heads + hh) * hd + e] = __fmul_rn(C, __fdiv_rn(1.0f, L));
    }
}

// y[i] += b[i mod cols] over n values: a product's bias.
extern "C" __global__ void bias_rows(float* __restrict__ y, const float* __restrict__ b,
                                     long long n, int cols) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = __fadd_rn(y[i], b[i % cols]);
}
