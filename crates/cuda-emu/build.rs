//! Compiles the CUDA kernels' source with the host emulator (`emu/emu.h`).
//! Without a C++ compiler the crate still builds, `available()` is false,
//! and its tests say why they skip.

fn main() {
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-changed=../kernels-cuda/src");
    println!("cargo:rustc-check-cfg=cfg(emu_built)");
    let mut b = cc::Build::new();
    b.cpp(true)
        .file("emu/kernels.cpp")
        .std("c++17")
        .opt_level(2)
        // Every operation rounded on its own, as the kernels' explicit
        // rounding asks of the device; no fast-math.
        .flag("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false);
    match b.try_compile("fathom_cuda_emu") {
        Ok(()) => println!("cargo:rustc-cfg=emu_built"),
        Err(e) => println!(
            "cargo:warning=the CUDA kernels' host emulator was not built ({e}); its tests will skip"
        ),
    }
}
