// A host stand-in for the CUDA C subset fathom's kernels use, so their
// arithmetic can be checked against the CPU twins on a machine without a
// GPU (the GPU tests in fathom-kernels-cuda stay the authority).
//
// Every CUDA thread is a fiber (ucontext); a grid's blocks run one after
// another and a block's threads switch only at __syncthreads and at warp
// shuffles, so __shared__ memory is plain static storage. Arithmetic is the
// host's IEEE single precision: compiled with -ffp-contract=off and without
// fast-math, a*b, a+b, a/b, sqrtf and fmaf are each rounded once to
// nearest-even with denormals kept, which is what the kernels' explicit
// rounding (__fmul_rn, __fmaf_rn, …; NVRTC's --fmad=false --ftz=false)
// asks of the device. Not emulated: memory ordering between blocks,
// atomics, warp divergence under a partial mask (the kernels use full
// warps), anything the kernels do not use.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <functional>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {

// Switching between fibers: on x86-64 a few instructions saving the
// callee-saved registers (no system call); elsewhere ucontext.
#if defined(__x86_64__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void** save_sp, void* to_sp);
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#endif

struct Fiber {
#ifdef EMU_FAST_SWITCH
    void* sp;
#else
    ucontext_t ctx;
#endif
    uint3 tid;
    int linear;
    unsigned shuffles;  // shuffles this thread has made
    bool done;
};

// A barrier over the live members of a block or a warp; a member that
// exits no longer counts (as on the device).
constexpr size_t STACK = 128 * 1024;

struct Group {
    int live = 0, count = 0;
    unsigned gen = 0;
};

struct State {
    std::vector<Fiber> fibers;
    std::vector<std::vector<char>> stacks;
#ifdef EMU_FAST_SWITCH
    void* sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
    int cur = 0;
    uint3 block{0, 0, 0};
    dim3 bdim, gdim;
    Group blockbar;
    std::vector<Group> warps;
    // Per warp, two sets of 32 values a shuffle exchanges, used in turn: a
    // lane cannot write a set again before every lane has read it (that
    // needs every lane at the next shuffle's barrier), so one barrier a
    // shuffle suffices.
    std::vector<uint64_t> slots;
    std::vector<unsigned char> dyn;  // the launch's dynamic shared memory
    const std::function<void()>* body = nullptr;
};

inline State& st() {
    static State s;
    return s;
}

inline Fiber& me() { return st().fibers[st().cur]; }

inline void yield() {
#ifdef EMU_FAST_SWITCH
    emu_switch(&me().sp, st().sched_sp);
#else
    swapcontext(&me().ctx, &st().sched);
#endif
}

// Set whenever a thread reaches a barrier or exits: a pass of the
// scheduler over the block without it is a deadlock.
inline bool& progress() {
    static bool p = false;
    return p;
}

inline void wait(Group& g) {
    const unsigned gen = g.gen;
    progress() = true;
    if (++g.count >= g.live) {
        g.count = 0;
        ++g.gen;
        return;
    }
    while (g.gen == gen) yield();
}

inline void leave(Group& g) {
    --g.live;
    if (g.count > 0 && g.count >= g.live) {
        g.count = 0;
        ++g.gen;
    }
}

inline void trampoline() {
    State& s = st();
    (*s.body)();
    Fiber& f = me();
    f.done = true;
    leave(s.blockbar);
    leave(s.warps[f.linear / 32]);
    progress() = true;
#ifdef EMU_FAST_SWITCH
    emu_switch(&f.sp, s.sched_sp);  // never resumed
    __builtin_unreachable();
#endif
}  // (ucontext: returns to the scheduler through uc_link)

// Makes fiber i start at `trampoline` on its stack when first switched to.
inline void start(State& s, int i) {
    Fiber& f = s.fibers[i];
#ifdef EMU_FAST_SWITCH
    // The six registers emu_switch pops, then trampoline's address as the
    // return address at a 16-byte boundary (so trampoline starts as if
    // called), then a zero return address for trampoline itself.
    uintptr_t top = ((uintptr_t)s.stacks[i].data() + STACK) & ~(uintptr_t)15;
    void** at = (void**)(top - 16);
    at[1] = nullptr;
    at[0] = (void*)&trampoline;
    for (int r = 1; r <= 6; ++r) at[-r] = nullptr;
    f.sp = (void*)(at - 6);
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = s.stacks[i].data();
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &s.sched;
    makecontext(&f.ctx, trampoline, 0);
#endif
}

inline void resume(State& s, int i) {
    s.cur = i;
#ifdef EMU_FAST_SWITCH
    emu_switch(&s.sched_sp, s.fibers[i].sp);
#else
    swapcontext(&s.sched, &s.fibers[i].ctx);
#endif
}

// Runs `body` as every thread of every block of the grid.
inline void launch(dim3 grid, dim3 block, size_t shared, const std::function<void()>& body) {
    State& s = st();
    const int n = (int)(block.x * block.y * block.z);
    s.bdim = block;
    s.gdim = grid;
    s.body = &body;
    s.fibers.assign(n, Fiber{});
    if ((int)s.stacks.size() < n) s.stacks.resize(n);
    for (auto& k : s.stacks) k.resize(STACK);
    const int nw = (n + 31) / 32;
    s.slots.assign((size_t)nw * 64, 0);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                s.block = uint3{bx, by, bz};
                // Uninitialised on the device: NaN bytes here, so a kernel
                // reading shared memory it did not write shows it.
                s.dyn.assign(shared, 0xFF);
                s.blockbar = Group{n, 0, 0};
                s.warps.assign(nw, Group{});
                for (int w = 0; w < nw; ++w) s.warps[w].live = (n - 32 * w < 32) ? n - 32 * w : 32;
                for (int i = 0; i < n; ++i) {
                    Fiber& f = s.fibers[i];
                    f.linear = i;
                    f.done = false;
                    f.shuffles = 0;
                    f.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
                    start(s, i);
                }
                int left = n;
                while (left > 0) {
                    progress() = false;
                    for (int i = 0; i < n; ++i) {
                        if (s.fibers[i].done) continue;
                        resume(s, i);
                        if (s.fibers[i].done) --left;
                    }
                    if (left > 0 && !progress()) {
                        fprintf(stderr,
                                "cuda-emu: block (%u, %u, %u): %d threads wait at a barrier "
                                "that can never complete\n",
                                bx, by, bz, left);
                        abort();
                    }
                }
            }
}

template <typename T>
inline T exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 64 bits");
    State& s = st();
    const int w = me().linear / 32;
    // The lanes of a warp meet the same shuffles in the same order, so each
    // lane's own count of them picks the same set.
    Fiber& f = me();
    uint64_t* set = &s.slots[((size_t)w * 2 + f.shuffles++ % 2) * 32];
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    set[me().linear % 32] = b;
    wait(s.warps[w]);
    const uint64_t got = set[src];
    T r;
    memcpy(&r, &got, sizeof(T));
    return r;
}

inline unsigned lane() { return (unsigned)me().linear % 32; }

}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __shared__ static
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(emu::st().dyn.data())
#define threadIdx (emu::me().tid)
#define blockIdx (emu::st().block)
#define blockDim (emu::st().bdim)
#define gridDim (emu::st().gdim)

inline void __syncthreads() { emu::wait(emu::st().blockbar); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emu::exchange(v, src & 31);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned d) {
    const unsigned l = emu::lane();
    return emu::exchange(v, (int)(l + d < 32 ? l + d : l));
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
    return emu::exchange(v, (int)(emu::lane() ^ (unsigned)m) & 31);
}

// A warp vote: every lane's predicate true (a butterfly of shuffles here).
inline int __all_sync(unsigned, int p) {
    int a = p != 0;
    for (int m = 16; m > 0; m >>= 1) a &= __shfl_xor_sync(0xffffffffu, a, m);
    return a;
}

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// CUDA's integer min/max (floats go through fminf/fmaxf; a float call of
// these would not compile here rather than truncate).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
float min(float, float) = delete;
float max(float, float) = delete;
