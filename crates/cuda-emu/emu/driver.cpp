// A stand-in for the NVIDIA driver library (libcuda.so): the subset of the
// driver API fathom's CUDA backend calls through cudarc, with device
// memory in host memory and every kernel run by the host emulator
// (emu.h). It lets the whole backend — placement, caches, staging, grouped
// launches, its error paths — run on a machine without a GPU; the GPU
// tests on a real device stay the authority.
//
// Every operation runs when it is issued, in the order issued. That is one
// schedule the streams and events allow, so a program correct on the
// device gives the same results here; a missing wait between streams is not
// found. What is checked, beyond the emulator's own checks: a copy stays
// inside one device allocation, a kernel's pointer arguments lie in device
// memory of the launching device (or are null), launch shapes and shared
// memory are within the device's limits, freed and unknown pointers are
// refused, and the allocations stay within the device's memory. Fresh
// device memory is NaN bytes, as uninitialised memory might be.
//
// Stream capture (CUDA graphs) records a capturing stream's kernels and
// copies instead of running them; a graph launch runs them in order. As
// the driver does in global and thread-local mode, a capturing thread may
// not allocate, free or synchronise (the call fails and its captures end
// as invalid). Stricter than the driver, so that fathom's graphs hold only
// page-locked copies and kernels: a captured copy must name page-locked
// host memory, and an event recorded or waited for, or a memset or an
// asynchronous allocation, on a capturing stream ends its capture as
// invalid.
//
// Set FATHOM_EMU_GPUS (devices, default 1) and FATHOM_EMU_VRAM_MIB (each
// device's memory, default 16384) before the first call.
#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "emu.h"

#include "../../kernels-cuda/src/matmul.cu"
#include "../../kernels-cuda/src/grouped.cu"
#include "../../kernels-cuda/src/kda.cu"
#include "../../kernels-cuda/src/glu.cu"
#include "../../kernels-cuda/src/mla.cu"
#include "../../kernels-cuda/src/gqa.cu"

#include "emu_ptx.h"

#define API extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : int {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    HOST_MEMORY_ALREADY_REGISTERED = 712,
    HOST_MEMORY_NOT_REGISTERED = 713,
    NOT_SUPPORTED = 801,
    CAPTURE_UNSUPPORTED = 900,
    CAPTURE_INVALIDATED = 901,
    WRONG_THREAD = 908,
};

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t SHARED_LIMIT = 48 * 1024;  // without the opt-in attribute
constexpr unsigned MAX_THREADS = 1024;

struct Ctx {
    int device;
};
// A recorded operation: it runs (checked again) when its graph is launched.
using Op = std::function<int()>;

struct Stream {
    int device;
    std::vector<Op>* rec = nullptr;  // while capturing
    bool broken = false;             // an operation the capture cannot hold
    bool counted = false;            // global or thread-local mode
    std::thread::id by;              // the thread that began the capture
};
struct Graph {
    std::vector<Op> ops;
};
struct Event {
    Clock::time_point at;
    bool recorded = false;
    bool timed = true;  // not CU_EVENT_DISABLE_TIMING
};
struct Alloc {
    size_t len;
    int device;
};

struct Driver {
    std::mutex mu;
    bool init = false;
    int gpus = 1;
    size_t vram = 0;
    std::vector<Ctx> ctxs;
    std::vector<size_t> used;
    std::map<uintptr_t, Alloc> dev;     // device allocations by start
    std::map<uintptr_t, size_t> host;   // page-locked host ranges by start
    std::map<uintptr_t, bool> host_alloc;  // which of them this library allocated
};

Driver& drv() {
    static Driver d;
    return d;
}

thread_local Ctx* current = nullptr;
thread_local std::vector<Ctx*> pushed;  // contexts under `current`
thread_local std::vector<Stream*> capturing;  // this thread's counted captures

// A capturing stream, or null.
Stream* recording(void* s) {
    auto* st = static_cast<Stream*>(s);
    return st && st->rec ? st : nullptr;
}

// An allocation, free or synchronisation from a thread that is capturing:
// refused, and the thread's captures end as invalid.
bool forbidden(const char* what) {
    if (capturing.empty()) return false;
    for (Stream* st : capturing) st->broken = true;
    fprintf(stderr, "cuda-emu driver: %s while this thread captures a stream\n", what);
    return true;
}

// Ends `st`'s capture: its recording dropped, its count undone.
void stop_capture(Stream* st) {
    delete st->rec;
    st->rec = nullptr;
    if (st->counted) {
        auto it = std::find(capturing.begin(), capturing.end(), st);
        if (it != capturing.end()) capturing.erase(it);
    }
}

int fail(int code, const char* what) {
    fprintf(stderr, "cuda-emu driver: %s\n", what);
    return code;
}

int env_int(const char* name, long long dflt) {
    const char* v = getenv(name);
    return v ? (int)atoll(v) : (int)dflt;
}

// The allocation holding [p, p + len), if any.
const std::pair<const uintptr_t, Alloc>* find_dev(uintptr_t p, size_t len) {
    auto& d = drv().dev;
    auto it = d.upper_bound(p);
    if (it == d.begin()) return nullptr;
    --it;
    if (len > it->second.len || p - it->first > it->second.len - len) return nullptr;
    return &*it;
}

int device_of_stream(void* s) {
    if (s) return static_cast<Stream*>(s)->device;
    return current ? current->device : -1;
}

bool checked() {
    Driver& d = drv();
    return d.init;
}

#include "launches.h"

int module_token;  // every module is the one set of kernels (launches.h)

}  // namespace

#define LOCKED                                   \
    std::lock_guard<std::mutex> guard(drv().mu); \
    if (!checked()) return NOT_INITIALIZED

// ---- initialisation, devices, contexts ----

API CUresult cuInit(unsigned) {
    Driver& d = drv();
    std::lock_guard<std::mutex> guard(d.mu);
    if (!d.init) {
        d.gpus = env_int("FATHOM_EMU_GPUS", 1);
        int mib = env_int("FATHOM_EMU_VRAM_MIB", 16384);
        if (mib < 1 || mib > (1 << 20)) mib = 16384;
        d.vram = (size_t)mib << 20;
        if (d.gpus < 0 || d.gpus > 64) d.gpus = 1;
        d.ctxs.resize(d.gpus);
        d.used.assign(d.gpus, 0);
        for (int i = 0; i < d.gpus; ++i) d.ctxs[i].device = i;
        d.init = true;
    }
    return OK;
}

API CUresult cuDriverGetVersion(int* v) {
    *v = 12080;
    return OK;
}

API CUresult cuDeviceGetCount(int* n) {
    LOCKED;
    *n = drv().gpus;
    return OK;
}

API CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
    LOCKED;
    if (ordinal < 0 || ordinal >= drv().gpus) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

API CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    LOCKED;
    if (dev < 0 || dev >= drv().gpus) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "fathom host emulator");
    return OK;
}

API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    LOCKED;
    if (dev < 0 || dev >= drv().gpus) return INVALID_DEVICE;
    *bytes = drv().vram;
    return OK;
}

API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice dev) {
    LOCKED;
    if (dev < 0 || dev >= drv().gpus) return INVALID_DEVICE;
    switch (attr) {
        case 1: *v = (int)MAX_THREADS; break;      // max threads per block
        case 8: *v = (int)SHARED_LIMIT; break;     // shared memory per block
        case 16: *v = 132; break;                  // multiprocessors
        case 75: *v = 9; break;                    // compute capability
        case 76: *v = 0; break;
        case 97: *v = (int)SHARED_LIMIT; break;    // no larger opt-in here
        case 115: *v = 1; break;                   // memory pools
        default: *v = 0;
    }
    return OK;
}

API CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice dev) {
    LOCKED;
    if (dev < 0 || dev >= drv().gpus) return INVALID_DEVICE;
    *ctx = &drv().ctxs[dev];
    return OK;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }

API CUresult cuCtxSetCurrent(void* ctx) {
    current = static_cast<Ctx*>(ctx);
    return OK;
}

API CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current;
    return OK;
}

API CUresult cuCtxPushCurrent_v2(void* ctx) {
    pushed.push_back(current);
    current = static_cast<Ctx*>(ctx);
    return OK;
}

API CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (!current) return INVALID_CONTEXT;
    if (ctx) *ctx = current;
    current = pushed.empty() ? nullptr : pushed.back();
    if (!pushed.empty()) pushed.pop_back();
    return OK;
}

API CUresult cuCtxGetDevice(CUdevice* dev) {
    if (!current) return INVALID_CONTEXT;
    *dev = current->device;
    return OK;
}

API CUresult cuCtxSynchronize() {
    return forbidden("cuCtxSynchronize") ? CAPTURE_UNSUPPORTED : OK;
}

API CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case OK: *s = "no error"; break;
        case OUT_OF_MEMORY: *s = "out of memory (emulated device)"; break;
        case ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (emulated)"; break;
        case CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing (emulated)"; break;
        case CAPTURE_INVALIDATED: *s = "operation failed due to a previous error during capture (emulated)"; break;
        default: *s = "error (emulated driver; see its message on stderr)";
    }
    return OK;
}

API CUresult cuGetErrorName(CUresult e, const char** s) {
    switch (e) {
        case OK: *s = "CUDA_SUCCESS"; break;
        case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
        case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case LAUNCH_OUT_OF_RESOURCES: *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case HOST_MEMORY_ALREADY_REGISTERED: *s = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; break;
        case HOST_MEMORY_NOT_REGISTERED: *s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
        case NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
        case CAPTURE_UNSUPPORTED: *s = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
        case CAPTURE_INVALIDATED: *s = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
        case WRONG_THREAD: *s = "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"; break;
        default: return INVALID_VALUE;
    }
    return OK;
}

API CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
    LOCKED;
    if (!current) return INVALID_CONTEXT;
    *total = drv().vram;
    *free = drv().vram - drv().used[current->device];
    return OK;
}

// ---- streams and events: everything has run when it is issued ----

API CUresult cuStreamCreate(void** s, unsigned) {
    LOCKED;
    if (!current) return INVALID_CONTEXT;
    *s = new Stream{current->device};
    return OK;
}

API CUresult cuStreamCreateWithPriority(void** s, unsigned f, int) { return cuStreamCreate(s, f); }

API CUresult cuStreamDestroy_v2(void* s) {
    LOCKED;
    if (recording(s)) return fail(CAPTURE_UNSUPPORTED, "cuStreamDestroy: the stream is capturing");
    delete static_cast<Stream*>(s);
    return OK;
}

API CUresult cuStreamSynchronize(void* s) {
    if (Stream* st = recording(s)) st->broken = true;
    if (recording(s) || forbidden("cuStreamSynchronize")) return CAPTURE_UNSUPPORTED;
    return OK;
}
API CUresult cuStreamQuery(void*) { return OK; }

// An event recorded or waited for on a capturing stream ends its capture
// as invalid.
static CUresult not_in_capture(void* s, const char* what) {
    Stream* st = recording(s);
    if (!st) return OK;
    st->broken = true;
    fprintf(stderr, "cuda-emu driver: %s on a capturing stream\n", what);
    return CAPTURE_INVALIDATED;
}

API CUresult cuStreamWaitEvent(void* s, void* e, unsigned) {
    if (!e) return INVALID_HANDLE;
    return not_in_capture(s, "cuStreamWaitEvent");
}

API CUresult cuEventCreate(void** e, unsigned flags) {
    auto* ev = new Event{};
    ev->timed = (flags & 2u) == 0;
    *e = ev;
    return OK;
}

API CUresult cuEventRecord(void* e, void* s) {
    if (!e) return INVALID_HANDLE;
    if (CUresult r = not_in_capture(s, "cuEventRecord")) return r;
    auto* ev = static_cast<Event*>(e);
    ev->at = Clock::now();
    ev->recorded = true;
    return OK;
}

API CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
API CUresult cuEventQuery(void* e) { return e ? OK : INVALID_HANDLE; }
API CUresult cuEventSynchronize(void* e) {
    if (forbidden("cuEventSynchronize")) return CAPTURE_UNSUPPORTED;
    return e ? OK : INVALID_HANDLE;
}

API CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<Event*>(e);
    return OK;
}

API CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    auto *s = static_cast<Event*>(a), *e = static_cast<Event*>(b);
    if (!s || !e) return INVALID_HANDLE;
    if (!s->recorded || !e->recorded || !s->timed || !e->timed)
        return fail(INVALID_HANDLE, "cuEventElapsedTime: an event unrecorded or without timing");
    *ms = std::chrono::duration<float, std::milli>(e->at - s->at).count();
    return OK;
}

API CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) {
    return cuEventElapsedTime(ms, a, b);
}

// ---- device memory ----

API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t len) {
    LOCKED;
    if (forbidden("cuMemAlloc")) return CAPTURE_UNSUPPORTED;
    if (!current) return INVALID_CONTEXT;
    Driver& d = drv();
    const int dev = current->device;
    if (len == 0) return INVALID_VALUE;
    if (len > d.vram - d.used[dev]) return OUT_OF_MEMORY;
    const size_t padded = (len + 255) & ~(size_t)255;
    void* m = aligned_alloc(256, padded);
    if (!m) return OUT_OF_MEMORY;
    memset(m, 0xFF, padded);
    d.dev[(uintptr_t)m] = Alloc{len, dev};
    d.used[dev] += len;
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}

API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t len, void* s) {
    if (CUresult r = not_in_capture(s, "cuMemAllocAsync")) return r;
    return cuMemAlloc_v2(p, len);
}

API CUresult cuMemFree_v2(CUdeviceptr p) {
    LOCKED;
    if (forbidden("cuMemFree")) return CAPTURE_UNSUPPORTED;
    Driver& d = drv();
    auto it = d.dev.find((uintptr_t)p);
    if (it == d.dev.end()) return fail(INVALID_VALUE, "cuMemFree: not the start of an allocation");
    d.used[it->second.device] -= it->second.len;
    free((void*)it->first);
    d.dev.erase(it);
    return OK;
}

API CUresult cuMemFreeAsync(CUdeviceptr p, void* s) {
    if (CUresult r = not_in_capture(s, "cuMemFreeAsync")) return r;
    return cuMemFree_v2(p);
}

static CUresult memset_dev(CUdeviceptr p, const void* v, size_t size, size_t n) {
    LOCKED;
    if (forbidden("cuMemset")) return CAPTURE_UNSUPPORTED;
    if (!find_dev((uintptr_t)p, size * n))
        return fail(INVALID_VALUE, "cuMemset: outside every device allocation");
    for (size_t i = 0; i < n; ++i) memcpy((char*)(uintptr_t)p + i * size, v, size);
    return OK;
}

API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    return memset_dev(p, &v, 1, n);
}
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* s) {
    if (CUresult r = not_in_capture(s, "cuMemsetD8Async")) return r;
    return memset_dev(p, &v, 1, n);
}
API CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n) {
    return memset_dev(p, &v, 4, n);
}
API CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void* s) {
    if (CUresult r = not_in_capture(s, "cuMemsetD32Async")) return r;
    return memset_dev(p, &v, 4, n);
}

// Whether [p, p + n) lies in page-locked host memory.
static bool host_locked(const void* p, size_t n) {
    auto& h = drv().host;
    auto it = h.upper_bound((uintptr_t)p);
    if (it == h.begin()) return false;
    --it;
    return n <= it->second && (uintptr_t)p - it->first <= it->second - n;
}

static CUresult copy_unlocked(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev) {
    if (dst_dev && !find_dev((uintptr_t)dst, n))
        return fail(INVALID_VALUE, "a copy's destination runs outside its device allocation");
    if (src_dev && !find_dev((uintptr_t)src, n))
        return fail(INVALID_VALUE, "a copy's source runs outside its device allocation");
    if (!dst_dev && find_dev((uintptr_t)dst, 0))
        return fail(INVALID_VALUE, "a copy to the host names device memory");
    if (!src_dev && find_dev((uintptr_t)src, 0))
        return fail(INVALID_VALUE, "a copy from the host names device memory");
    if (n) memmove(dst, src, n);
    return OK;
}

static CUresult copy(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev) {
    LOCKED;
    if (forbidden("a synchronous copy")) return CAPTURE_UNSUPPORTED;
    return copy_unlocked(dst, src, n, dst_dev, src_dev);
}

// An asynchronous copy on `s`: run now, or recorded while `s` captures
// (its host side page-locked).
static CUresult copy_on(void* s, void* dst, const void* src, size_t n, bool dst_dev,
                        bool src_dev) {
    LOCKED;
    Stream* st = recording(s);
    if (!st) return copy_unlocked(dst, src, n, dst_dev, src_dev);
    const void* host = dst_dev ? (src_dev ? nullptr : src) : dst;
    if (host && !host_locked(host, n)) {
        st->broken = true;
        return fail(CAPTURE_UNSUPPORTED, "a captured copy names pageable host memory");
    }
    st->rec->push_back([=] { return copy_unlocked(dst, src, n, dst_dev, src_dev); });
    return OK;
}

#define DP(p) ((void*)(uintptr_t)(p))

API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) {
    return copy(DP(d), s, n, true, false);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) {
    return copy_on(st, DP(d), s, n, true, false);
}
API CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) {
    return copy(d, DP(s), n, false, true);
}
API CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) {
    return copy_on(st, d, DP(s), n, false, true);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    return copy(DP(d), DP(s), n, true, true);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
    return copy_on(st, DP(d), DP(s), n, true, true);
}

// ---- page-locked host memory ----

API CUresult cuMemHostAlloc(void** p, size_t len, unsigned) {
    LOCKED;
    if (forbidden("cuMemHostAlloc")) return CAPTURE_UNSUPPORTED;
    void* m = aligned_alloc(4096, (len + 4095) & ~(size_t)4095);
    if (!m) return OUT_OF_MEMORY;
    drv().host[(uintptr_t)m] = len;
    drv().host_alloc[(uintptr_t)m] = true;
    *p = m;
    return OK;
}

API CUresult cuMemAllocHost_v2(void** p, size_t len) { return cuMemHostAlloc(p, len, 0); }

API CUresult cuMemFreeHost(void* p) {
    LOCKED;
    if (forbidden("cuMemFreeHost")) return CAPTURE_UNSUPPORTED;
    Driver& d = drv();
    if (!d.host_alloc.count((uintptr_t)p)) return INVALID_VALUE;
    d.host.erase((uintptr_t)p);
    d.host_alloc.erase((uintptr_t)p);
    free(p);
    return OK;
}

API CUresult cuMemHostRegister_v2(void* p, size_t len, unsigned) {
    LOCKED;
    if (!p || !len) return INVALID_VALUE;
    if (drv().host.count((uintptr_t)p)) return HOST_MEMORY_ALREADY_REGISTERED;
    drv().host[(uintptr_t)p] = len;
    return OK;
}

API CUresult cuMemHostUnregister(void* p) {
    LOCKED;
    Driver& d = drv();
    if (!d.host.count((uintptr_t)p) || d.host_alloc.count((uintptr_t)p))
        return HOST_MEMORY_NOT_REGISTERED;
    d.host.erase((uintptr_t)p);
    return OK;
}

API CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
    LOCKED;
    if (attr != 2) return fail(NOT_SUPPORTED, "cuPointerGetAttribute: only the memory type");
    if (find_dev((uintptr_t)p, 0)) {
        *static_cast<unsigned*>(data) = 2;
        return OK;
    }
    auto& h = drv().host;
    auto it = h.upper_bound((uintptr_t)p);
    if (it != h.begin() && (uintptr_t)p < std::prev(it)->first + std::prev(it)->second) {
        *static_cast<unsigned*>(data) = 1;
        return OK;
    }
    return INVALID_VALUE;
}

// ---- modules and launches ----

API CUresult cuModuleLoadData(void** m, const void* image) {
    LOCKED;
    if (strncmp(static_cast<const char*>(image), EMU_PTX_MARK, strlen(EMU_PTX_MARK)) != 0)
        return fail(INVALID_IMAGE, "cuModuleLoadData: not the emulated NVRTC's output");
    *m = &module_token;
    return OK;
}

API CUresult cuModuleUnload(void* m) { return m == &module_token ? OK : INVALID_HANDLE; }

API CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
    if (m != &module_token) return INVALID_HANDLE;
    for (const Kernel& k : KERNELS)
        if (strcmp(k.name, name) == 0) {
            *f = (void*)&k;
            return OK;
        }
    return NOT_FOUND;
}

API CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return OK;
}

API CUresult cuFuncSetAttribute(void*, int, int) { return OK; }

// An H100's three blocks of 256 threads a multiprocessor (of 132, above) for
// the bf16 products' 80 registers a thread; only the backend's kernels.
API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, void* f, int block,
                                                                  size_t, unsigned) {
    bool known = false;
    for (const Kernel& k : KERNELS) known = known || f == (const void*)&k;
    if (!known || block < 1 || block > (int)MAX_THREADS) return INVALID_VALUE;
    *n = block <= 256 ? 3 : 1;
    return OK;
}

API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, void* stream,
                            void** params, void** extra) {
    LOCKED;
    const Kernel* k = static_cast<const Kernel*>(f);
    const Kernel* end = KERNELS + sizeof KERNELS / sizeof KERNELS[0];
    if (k < KERNELS || k >= end) return fail(INVALID_HANDLE, "cuLaunchKernel: not a function");
    if (extra || !params) return INVALID_VALUE;
    const int device = device_of_stream(stream);
    if (device < 0) return INVALID_CONTEXT;
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (!gx || !gy || !gz || !threads || threads > MAX_THREADS || bx > 1024 || by > 1024 ||
        bz > 64 || gx > 0x7fffffffu || gy > 65535 || gz > 65535)
        return fail(INVALID_VALUE, "cuLaunchKernel: grid or block outside the device's limits");
    if (shared > SHARED_LIMIT)
        return fail(INVALID_VALUE, "cuLaunchKernel: more dynamic shared memory than 48 KiB");
    const dim3 g{gx, gy, gz}, b{bx, by, bz};
    if (Stream* st = recording(stream)) {
        st->rec->push_back(k->bind(g, b, shared, params, device));
        return OK;
    }
    return k->launch(g, b, shared, params, device);
}

// ---- stream capture and graphs ----

API CUresult cuStreamBeginCapture_v2(void* s, int mode) {
    LOCKED;
    auto* st = static_cast<Stream*>(s);
    if (!st || st->rec) return fail(INVALID_VALUE, "cuStreamBeginCapture: no stream, or capturing");
    st->rec = new std::vector<Op>;
    st->broken = false;
    st->counted = mode != 2;  // not CU_STREAM_CAPTURE_MODE_RELAXED
    st->by = std::this_thread::get_id();
    if (st->counted) capturing.push_back(st);
    return OK;
}

// 0: not capturing, 1: capturing, 2: capturing but invalidated.
API CUresult cuStreamIsCapturing(void* s, int* status) {
    LOCKED;
    Stream* st = recording(s);
    *status = !st ? 0 : st->broken ? 2 : 1;
    return OK;
}

API CUresult cuStreamEndCapture(void* s, void** graph) {
    LOCKED;
    Stream* st = recording(s);
    if (!st) return fail(INVALID_VALUE, "cuStreamEndCapture: the stream is not capturing");
    if (st->counted && st->by != std::this_thread::get_id())
        return fail(WRONG_THREAD, "cuStreamEndCapture: not the thread that began the capture");
    std::vector<Op> ops = std::move(*st->rec);
    const bool broken = st->broken;
    stop_capture(st);
    if (broken) {
        *graph = nullptr;
        return CAPTURE_INVALIDATED;
    }
    *graph = new Graph{std::move(ops)};
    return OK;
}

API CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    if (!graph) return INVALID_VALUE;
    *exec = new Graph{static_cast<Graph*>(graph)->ops};
    return OK;
}

API CUresult cuGraphLaunch(void* exec, void* s) {
    LOCKED;
    if (!exec) return INVALID_HANDLE;
    if (recording(s)) return fail(CAPTURE_UNSUPPORTED, "cuGraphLaunch on a capturing stream");
    for (Op& op : static_cast<Graph*>(exec)->ops)
        if (CUresult r = op()) return r;
    return OK;
}

API CUresult cuGraphUpload(void* exec, void*) { return exec ? OK : INVALID_HANDLE; }

API CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return OK;
}

API CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return OK;
}
