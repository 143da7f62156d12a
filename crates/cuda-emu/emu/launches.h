// The emulated driver's kernel launches: each argument checked (a pointer
// inside a device allocation of the launching device), the kernel run on
// the host emulator now or bound with its arguments' values for a graph,
// and the table of kernels a module holds (every kernel of the list).
// Part of driver.cpp, included once inside its anonymous namespace (it
// uses Op, find_dev and the kernels' source included there).
#pragma once

// A kernel's pointer argument: null, or inside a device allocation of
// `device` (one past the end allowed).
bool dev_ok(uintptr_t p, int device, const char* kernel, size_t i) {
    if (p == 0) return true;
    const auto* a = find_dev(p, 0);
    if (a && a->second.device == device) return true;
    fprintf(stderr, "cuda-emu driver: %s: argument %zu (%#llx) is not device memory of "
                    "device %d\n", kernel, i, (unsigned long long)p, device);
    return false;
}

// A pointer argument, or a set's (`Bf16Set`, grouped.cu) weight, input and
// output addresses: each null or device memory of the launching device.
template <typename T>
bool arg_ok(void* slot, int device, const char* kernel, size_t i) {
    if constexpr (std::is_pointer_v<T>) {
        return dev_ok(*static_cast<uintptr_t*>(slot), device, kernel, i);
    } else if constexpr (std::is_same_v<T, Bf16Set>) {
        const auto* set = static_cast<const Bf16Set*>(slot);
        for (const auto& e : set->e)
            for (int f = 0; f < 3; ++f)
                if (!dev_ok((uintptr_t)e[f], device, kernel, i)) return false;
        return true;
    } else {
        return true;
    }
}

template <typename... A, size_t... I>
int run_kernel(const char* name, void (*k)(A...), dim3 g, dim3 b, unsigned sh, void** p,
               int device, std::index_sequence<I...>) {
    const bool ok[] = {true, arg_ok<A>(p[I], device, name, I)...};
    for (bool o : ok)
        if (!o) return ILLEGAL_ADDRESS;
    emu::launch(g, b, sh, [&] { k(*static_cast<std::remove_reference_t<A>*>(p[I])...); });
    return OK;
}

template <typename... A>
int run(const char* name, void (*k)(A...), dim3 g, dim3 b, unsigned sh, void** p, int device) {
    return run_kernel(name, k, g, b, sh, p, device, std::index_sequence_for<A...>{});
}

// The launch with its arguments' values copied, to run later.
template <typename... A, size_t... I>
Op bind_kernel(const char* name, void (*k)(A...), dim3 g, dim3 b, unsigned sh, void** p,
               int device, std::index_sequence<I...>) {
    std::tuple<std::remove_reference_t<A>...> v{*static_cast<std::remove_reference_t<A>*>(p[I])...};
    return [=]() mutable {
        void* q[] = {static_cast<void*>(&std::get<I>(v))..., nullptr};
        return run_kernel(name, k, g, b, sh, q, device, std::index_sequence<I...>{});
    };
}

template <typename... A>
Op bind(const char* name, void (*k)(A...), dim3 g, dim3 b, unsigned sh, void** p, int device) {
    return bind_kernel(name, k, g, b, sh, p, device, std::index_sequence_for<A...>{});
}

struct Kernel {
    const char* name;
    int (*launch)(dim3, dim3, unsigned, void**, int);
    Op (*bind)(dim3, dim3, unsigned, void**, int);
};

#define KERNEL(n)                                                                              \
    Kernel {                                                                                   \
        #n, [](dim3 g, dim3 b, unsigned sh, void** p, int d) { return run(#n, n, g, b, sh, p, d); }, \
            [](dim3 g, dim3 b, unsigned sh, void** p, int d) { return bind(#n, n, g, b, sh, p, d); } \
    }

// Every kernel of the list (emu_kernels.h, from kernel_list.rs).
#define KERNEL_ENTRY(n) KERNEL(n),
const Kernel KERNELS[] = {FATHOM_KERNELS(KERNEL_ENTRY)};
#undef KERNEL_ENTRY
