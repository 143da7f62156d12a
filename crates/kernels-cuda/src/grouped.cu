// Several products in one launch, each row computed by the same code as in
// a launch of its own (matmul.cu): products of one shape through a table of
// device addresses (a MoE layer's experts), and sets of bf16 products of
// any shapes passed by value (a layer's projections of one input). Follows
// matmul.cu in the kernels' source.

// Several products of one shape in one launch (a MoE layer's experts):
// blockIdx.y picks product p, whose weight segments, input and output are
// the device addresses tab[4p .. 4p + 4) (data, scales or 0, x, y). Each
// row is computed by the same code as in a launch of its own.
extern "C" __global__ void BF16_BOUNDS mm_bf16_many(const unsigned long long* __restrict__ tab, int rows,
                                        int cols, int t) {
    const unsigned long long* e = tab + 4 * blockIdx.y;
    bf16_product((const unsigned short*)e[0], (const float*)e[2], (float*)e[3], rows, cols, t,
                 rows, nullptr, (int)blockIdx.x, (int)gridDim.x);
}

extern "C" __global__ void mm_bf16_rows_many(const unsigned long long* __restrict__ tab,
                                             int rows, int cols, int t) {
    __shared__ float xs[XS];
    const unsigned long long* e = tab + 4 * blockIdx.y;
    bf16_product((const unsigned short*)e[0], (const float*)e[2], (float*)e[3], rows, cols, t,
                 rows, xs, (int)blockIdx.x, (int)gridDim.x);
}

// Several bf16 products of one position count and any shapes in one
// launch (a layer's projections of one input: KDA's q, k, v, f_a, b, g;
// MLA's q_a, kv_a, g; an MLP's gate and up with the router): entry i of
// the set (i < n ≤ SET_MAX) holds the weights, input and output addresses
// and rows | cols << 32; its ceil(ceil(rows / R) / k) blocks follow the
// blocks of the entries before it, R = 2 rows a warp × the block's warps
// (256 threads, 16 rows, at several positions; at one position the host
// may launch blocks of 64 with k > 1, each warp taking several row pairs,
// `rows2_product1`). Each block runs
// `bf16_product` for its entry with its index among that entry's blocks:
// each row's sums are those of a launch of its own. The entries are read
// with constant indices (no copy of the set to local memory).
#define SET_MAX 8
struct Bf16Set {
    unsigned long long e[SET_MAX][4];
};
// The host writes the set as 4 · SET_MAX 64-bit values (`launch.rs`).
static_assert(sizeof(Bf16Set) == 4 * SET_MAX * 8, "Bf16Set is 4 * SET_MAX u64 values");

// The entry block `b` belongs to, its index among that entry's blocks in
// `bx` and their number in `nbx`, and the entry's fields.
__device__ __forceinline__ void set_pick(const Bf16Set& s, int n, int k, int b, int& bx,
                                         int& nbx, unsigned long long (&e)[4]) {
    int first = 0;
    bool found = false;
    const int rpb = 2 * (int)(blockDim.x >> 5);  // rows a block: two a warp
#pragma unroll
    for (int i = 0; i < SET_MAX; ++i) {
        const int blocks = (((int)(unsigned)s.e[i][3] + rpb - 1) / rpb + k - 1) / k;
        if (!found && i < n && (b < first + blocks || i == n - 1)) {
            found = true;
            bx = b - first;
            nbx = blocks;
#pragma unroll
            for (int f = 0; f < 4; ++f) e[f] = s.e[i][f];
        }
        first += blocks;
    }
}

__device__ __forceinline__ void bf16_set(const Bf16Set& s, int n, int t, int k, float* xs) {
    int bx = 0, nbx = 1;
    unsigned long long e[4] = {0, 0, 0, 0};
    set_pick(s, n, k, (int)blockIdx.x, bx, nbx, e);
    const int rows = (int)(unsigned)e[3], cols = (int)(unsigned)(e[3] >> 32);
    bf16_product((const unsigned short*)e[0], (const float*)e[1], (float*)e[2], rows, cols, t,
                 rows, xs, bx, nbx);
}

extern "C" __global__ void BF16_BOUNDS mm_bf16_set(int n, int t, int k, Bf16Set s) {
    bf16_set(s, n, t, k, nullptr);
}

extern "C" __global__ void mm_bf16_rows_set(int n, int t, int k, Bf16Set s) {
    __shared__ float xs[XS];
    bf16_set(s, n, t, k, xs);
}

extern "C" __global__ void mm_mxfp4_many(const unsigned long long* __restrict__ tab, int rows,
                                         int cols, int t) {
    __shared__ float lut[16];
    e2m1_table(lut);
    const unsigned long long* e = tab + 4 * blockIdx.y;
    mxfp4_product((const unsigned char*)e[0], (const unsigned char*)e[1], lut,
                  (const float*)e[2], (float*)e[3], rows, cols, t, rows);
}
