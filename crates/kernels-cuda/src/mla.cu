
// Absorbed MLA attention over a latent cache (fathom-kernels `attention`:
// `mla_attend_scalar` defines the order). Per query, split of 256 rows
// and head (`mla_split`): the head's score per row, (dot_lanes(lat, q_lat)
// + dot_lanes(kr, q_rope)) · scale; the head's max; then in row order
// p = exp(s − max) (exp_fixed), l += p, c = fmaf(p, lat, c) per latent
// value. Then per query and head (`mla_merge`) the splits in order by the
// online-softmax rule, e^ by exp_fixed, and ctx = C · (1/L). Every
// operation rounded as on the CPU (--fmad=false), so the bits are the
// CPU's.

#define MLA_SPLIT 256

// One (split, query, head) per block (grid: max splits × queries × heads):
// `blocks` the caches' row blocks (MLA_SPLIT rows of lora + rope values
// each, the last of each cache may be shorter), boff[T] where each query's
// cache starts in `blocks`, q_lat with query qi's head hh at qi·q_qs +
// hh·q_hs ([T, H, lora]: q_qs = H·lora, q_hs = lora; [H, T, lora]: q_qs =
// lora, q_hs = T·lora), q_rope [T, H, rope], ns[T] the rows each query
// sees. Scratch per (query, split): ps [H, MLA_SPLIT] (scores, then
// weights), pm, pl [H], pc [H, lora], at index qi·max_splits + k. The
// rows' scores and weights are computed in parallel, each as above; the
// max and the sum of weights run in row order on one thread.
extern "C" __global__ void mla_split(const unsigned long long* __restrict__ blocks,
                                     const int* __restrict__ boff,
                                     const float* __restrict__ q_lat, long long q_qs,
                                     long long q_hs, const float* __restrict__ q_rope,
                                     const int* __restrict__ ns, int heads, int lora, int rope,
                                     float scale, int max_splits, float* ps, float* pm,
                                     float* pl, float* pc) {
    __shared__ float mx;
    const int k = blockIdx.x, qi = blockIdx.y, hh = blockIdx.z;
    const int n = ns[qi];
    if (k * MLA_SPLIT >= n) return;  // the whole block leaves together
    const int len = min(MLA_SPLIT, n - k * MLA_SPLIT);
    const int w = lora + rope;
    const float* rows = (const float*)blocks[boff[qi] + k];
    const size_t at = (size_t)qi * max_splits + k;
    float* s = ps + (at * heads + hh) * MLA_SPLIT;
    const float* ql = q_lat + qi * q_qs + hh * q_hs;
    const float* qr = q_rope + ((size_t)qi * heads + hh) * rope;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float* r = rows + (size_t)j * w;
        const float a = dot_lanes(r, ql, lora);
        const float b = dot_lanes(r + lora, qr, rope);
        s[j] = __fmul_rn(__fadd_rn(a, b), scale);
    }
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
    for (int e = threadIdx.x; e < lora; e += blockDim.x) {
        float c = 0.0f;
        for (int j = 0; j < len; ++j) c = __fmaf_rn(s[j], rows[(size_t)j * w + e], c);
        pc[(at * heads + hh) * lora + e] = c;
    }
}

// Per query and head (grid: queries × heads): the splits merged in order,
// one thread per latent value — the head's L recomputed by each of its
// threads with the same operations. Query qi's head hh goes to out + qi·o_qs
// + hh·o_hs (strides as q_lat's above).
extern "C" __global__ void mla_merge(const int* __restrict__ ns, int heads, int lora,
                                     int max_splits, const float* __restrict__ pm,
                                     const float* __restrict__ pl,
                                     const float* __restrict__ pc, float* __restrict__ out,
                                     long long o_qs, long long o_hs) {
    const int qi = blockIdx.x, hh = blockIdx.y;
    const int splits = (ns[qi] + MLA_SPLIT - 1) / MLA_SPLIT;
    const float ninf = __uint_as_float(0xff800000u);
    for (int e = threadIdx.x; e < lora; e += blockDim.x) {
        float M = ninf, L = 0.0f, C = 0.0f;
        for (int k = 0; k < splits; ++k) {
            const size_t at = (size_t)qi * max_splits + k;
            const float m = pm[at * heads + hh];
            const float mn = fmaxf(M, m);
            const float a = M == ninf ? 0.0f : exp_fixed(__fsub_rn(M, mn));
            const float b = exp_fixed(__fsub_rn(m, mn));
            L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(pl[at * heads + hh], b));
            C = __fadd_rn(__fmul_rn(C, a), __fmul_rn(pc[(at * heads + hh) * lora + e], b));
            M = mn;
        }
        out[qi * o_qs + hh * o_hs + e] = __fmul_rn(C, __fdiv_rn(1.0f, L));
    }
}

// An MLA layer's values [H, T, dv] by position [T, H·dv], each times
// σ(gate) (sigmoid_fixed, as fathom-kernels `backend::mla_out_cpu`) when
// `gated`: the output projection's input.
extern "C" __global__ void mla_gate(const float* __restrict__ vals,
                                    const float* __restrict__ gate, int gated, int heads,
                                    int t, int dv, float* __restrict__ cat) {
    const long long hdv = (long long)heads * dv, n = hdv * t;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long ti = i / hdv, hh = (i % hdv) / dv, c = i % dv;
        const float v = vals[(hh * t + ti) * dv + c];
        cat[i] = gated ? __fmul_rn(v, sigmoid_fixed(gate[i])) : v;
    }
}
