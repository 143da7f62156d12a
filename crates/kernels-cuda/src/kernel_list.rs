// fathom's CUDA kernels, listed once: the `.cu` files and every kernel
// (`extern "C" __global__`) the backend loads. Read with `include!` by
// this crate (`lib.rs`: the source handed to NVRTC; `device.rs`: the
// table of loaded kernels) and by fathom-cuda-emu's build script (the
// files the emulated driver compiles, its table of kernels, and the
// source its NVRTC hands back), so a new file or kernel is one edit here.
// Each list is a macro that hands its entries to the macro named.

/// Calls `$then!` with the kernels' CUDA C files, in the order they are
/// joined into one source (a file may use what an earlier one defines).
#[allow(unused_macros)]
macro_rules! cu_files {
    ($then:ident) => {
        $then!("matmul.cu", "grouped.cu", "tile.cu", "kda.cu", "glu.cu", "mla.cu", "gqa.cu")
    };
}

/// Calls `$then!` with every kernel as `field: name,`: the field of the
/// backend's table (`Funcs` in `device.rs`) that holds it, documented,
/// and the kernel's name in the source.
#[allow(unused_macros)]
macro_rules! kernels {
    ($then:ident) => {
        $then! {
            f32: mm_f32,
            bf16: mm_bf16,
            int8: mm_int8,
            mxfp4: mm_mxfp4,
            fp8: mm_fp8,
            int4: mm_int4,
            bf16_many: mm_bf16_many,
            /// bf16 products of more than one position (inputs staged for
            /// a block's rows).
            bf16_rows: mm_bf16_rows,
            bf16_rows_many: mm_bf16_rows_many,
            /// bf16 products of any shapes in one launch, one position or
            /// more (`launch::SET_MAX`).
            bf16_set: mm_bf16_set,
            bf16_rows_set: mm_bf16_rows_set,
            mxfp4_many: mm_mxfp4_many,
            /// bf16, MXFP4 and int8 products of many positions in tiles of
            /// rows × positions (`tile.cu`): alone, of one shape, bf16 in
            /// sets.
            bf16_tile: mm_bf16_tile,
            bf16_tile_many: mm_bf16_tile_many,
            bf16_tile_set: mm_bf16_tile_set,
            mxfp4_tile: mm_mxfp4_tile,
            mxfp4_tile_many: mm_mxfp4_tile_many,
            int8_tile: mm_int8_tile,
            /// bf16 values and MXFP4 codes rearranged for the products
            /// once in VRAM (`matmul.cu`).
            bf16_lanes: bf16_lanes,
            mxfp4_lanes: mxfp4_lanes,
            kda: kda_step,
            glu_act: glu_act,
            mla_split: mla_split,
            mla_merge: mla_merge,
            /// `mla_split` for a group of heads at once (`mla.cu`).
            mla_split_heads: mla_split_heads,
            moe_combine: moe_combine,
            mla_gate: mla_gate,
            mla_norm_rows: mla_norm_rows,
            mla_queries: mla_queries,
            mla_rows: mla_rows,
            gqa_prep: gqa_prep,
            gqa_split: gqa_split,
            gqa_merge: gqa_merge,
            bias_rows: bias_rows,
            res_mix_dots: res_mix_dots,
            res_mix_sum: res_mix_sum,
            res_mix_norm: res_mix_norm,
        }
    };
}
