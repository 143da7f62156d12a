//! The backend seam: where a matrix product may run on another device.
//!
//! Model code applies its resident matrices through [`matmul_stable`]
//! (never through a device API). With no backend installed that is the
//! CPU kernels of this crate. A process may [`install`] one backend (the
//! CLI does, for `--device cuda`); it computes the products it takes with
//! the **same reduction order** as the CPU kernels — 32 lanes of fused
//! multiply-adds over the columns `l, l + 32, …`, folded in halves
//! ([`crate::formats::fold32`]), then the format's finish — so which
//! device computes a product never changes a bit of its result. A product
//! the backend declines (a format it lacks, a matrix larger than its
//! memory) runs on the CPU.
//!
//! Residency: a backend keeps device copies of the matrices it is given,
//! keyed by the host address and length of each byte segment. That is
//! sound only because [`matmul_stable`]'s contract is that the bytes stay
//! unchanged at their address until the owner calls [`forget`] for them
//! (every owner — `Linear`, an expert's buffer — does on drop).

use std::ops::Range;
use std::sync::{Arc, RwLock};

use fathom_weights::mxfp4::Mxfp4Ref;

use crate::formats::{Fp8Rows, Int4Rows, Rows};
use crate::kda::KdaJob;
use crate::ops::GluAct;
use crate::state_buf::StateKey;

/// A weight matrix `[rows, cols]` in one of the stored formats.
#[derive(Clone, Copy)]
pub enum MatRef<'a> {
    F32 {
        w: &'a [f32],
        rows: usize,
        cols: usize,
    },
    Bf16 {
        w: &'a [u16],
        rows: usize,
        cols: usize,
    },
    /// `W[r][c] = q[r·cols + c] · scale[r]`.
    Int8 {
        q: &'a [i8],
        scale: &'a [f32],
        cols: usize,
    },
    Mxfp4(Mxfp4Ref<'a>),
    Fp8(Fp8Rows<'a>),
    Int4(Int4Rows<'a>),
}

impl MatRef<'_> {
    pub fn rows(&self) -> usize {
        match self {
            MatRef::F32 { rows, .. } | MatRef::Bf16 { rows, .. } => *rows,
            MatRef::Int8 { scale, .. } => scale.len(),
            MatRef::Mxfp4(m) => m.rows,
            MatRef::Fp8(m) => m.rows(),
            MatRef::Int4(m) => m.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            MatRef::F32 { cols, .. } | MatRef::Bf16 { cols, .. } | MatRef::Int8 { cols, .. } => {
                *cols
            }
            MatRef::Mxfp4(m) => m.cols,
            MatRef::Fp8(m) => m.cols,
            MatRef::Int4(m) => m.cols,
        }
    }

    /// Weight rows a block of 256 threads takes in the launches of the
    /// device kernels (`fathom-kernels-cuda`'s `matmul.cu`, on a GPU or on
    /// its host emulator): bf16 takes two rows a warp (16 a block), MXFP4
    /// with one position too, every other product one (8). The grid is
    /// `rows.div_ceil(this)` blocks.
    pub fn device_rows_a_block(&self, t: usize) -> usize {
        if matches!(self, MatRef::Bf16 { .. }) || (matches!(self, MatRef::Mxfp4(_)) && t == 1) {
            16
        } else {
            8
        }
    }

    /// `y[T, rows] = x[T, cols] Wᵀ` on the CPU kernels.
    pub fn cpu(&self, x: &[f32], t: usize, y: &mut [f32]) {
        let k = crate::kernels();
        match *self {
            MatRef::F32 { w, rows, cols } => k.matmul_f32(x, t, w, rows, cols, y),
            MatRef::Bf16 { w, rows, cols } => k.matmul_bf16(x, t, w, rows, cols, y),
            MatRef::Int8 { q, scale, cols } => k.matmul_int8(x, t, q, scale, cols, y),
            MatRef::Mxfp4(m) => k.matmul_mxfp4(x, t, m, y),
            MatRef::Fp8(m) => k.matmul_fp8(x, t, m, y),
            MatRef::Int4(m) => k.matmul_int4(x, t, m, y),
        }
    }
}

/// Which part of the model a product belongs to (for the backend's counts
/// and its cache policy: experts churn, the spine stays).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Spine,
    Expert,
}

/// What a backend has done since it was installed (or, from
/// [`stats_since`], over an interval): `stats.gpu` of the run report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct BackendStats {
    /// Products computed on the device.
    pub device_products: u64,
    /// Round trips to the device (a batch of products is one).
    pub device_calls: u64,
    /// Products the device declined (computed on the CPU).
    pub cpu_products: u64,
    /// Expert matrices found in device memory when their product ran
    /// (including those copied there ahead of it, `h2d_ahead_bytes`).
    pub vram_expert_hits: u64,
    /// Expert matrices copied to the device.
    pub vram_expert_misses: u64,
    /// Bytes copied host → device (weights and activations).
    pub h2d_bytes: u64,
    /// Weight bytes copied up ahead of the products that use them (the
    /// `ahead` of a batch), part of `h2d_bytes`.
    pub h2d_ahead_bytes: u64,
    /// Guessed matrices ([`Hints::guessed`]) scored so far, and those used
    /// in time (see the CUDA crate's `guess` module).
    pub guesses_scored: u64,
    pub guesses_right: u64,
    /// Bytes of guessed matrices copied up, part of `h2d_ahead_bytes`.
    pub h2d_guessed_bytes: u64,
    /// Routed-expert matrices the caller computed on the CPU because the
    /// device lacked them ([`Hints::elsewhere`]), and their weight bytes.
    pub cpu_expert_products: u64,
    pub cpu_expert_bytes: u64,
    /// Weight bytes copied up from memory that was not page-locked
    /// (staged by the driver, about a third of the page-locked speed).
    pub h2d_pageable_bytes: u64,
    /// Spine bytes copied up for products of many positions by pushing
    /// other spine out (a spine larger than the device's budget), part of
    /// `h2d_bytes`.
    pub h2d_spine_displacing_bytes: u64,
    /// Spine bytes held on the device copied up (their host bytes a
    /// checkpoint map, dropped from RAM after the copy), part of
    /// `h2d_bytes`: each held matrix once unless state pushed it out.
    pub h2d_held_bytes: u64,
    /// Bytes copied device → host.
    pub d2h_bytes: u64,
    /// Wall time inside device calls (copies, kernels, synchronisation).
    pub gpu_ms: f64,
    /// The part of `gpu_ms` in calls of routed experts' products.
    pub expert_gpu_ms: f64,
    /// Device time from the first kernel of each call to the end of its
    /// last (events on the device), waits for weight copies included.
    pub kernel_ms: f64,
    /// The parts of `gpu_ms` spent waiting for the backend's lock (another
    /// thread's call) and in the call's one synchronisation (the device
    /// finishing its copies and kernels): `gpu_ms − lock − sync` is the
    /// host's own work in the calls, `sync − kernel_ms` the device's time
    /// outside the kernels (copies, launch gaps, waking the host).
    pub lock_wait_ms: f64,
    pub sync_wait_ms: f64,
    /// The part of `gpu_ms` spent issuing the calls' copies and launches
    /// (driver calls, or one graph launch); the rest of the host's work in
    /// the calls (`gpu_ms − lock − sync − issue`) prepares and stages the
    /// inputs and hands the results back.
    pub issue_ms: f64,
    /// The part of that rest before the issue: from a call's start on the
    /// device's lock (its operations' list begun) to its issue — finding
    /// and copying up its weights, staging its inputs, writing its
    /// operations. `gpu_ms − lock − stage − issue − sync` is then what the
    /// calls do before taking the lock and after their synchronisation.
    pub stage_ms: f64,
    /// Device memory holding weights now.
    pub vram_weight_bytes: u64,
    /// Device memory holding sequences' states now (KDA states and
    /// convolution windows left there by [`Backend::kda_step`]).
    pub vram_state_bytes: u64,
    /// Attention layers computed on the device ([`Backend::mla_attend`],
    /// [`Backend::gqa_attend`]), each also a device call.
    pub device_attention: u64,
    /// MoE layers whose routed experts ran through their combine on the
    /// device ([`Backend::moe_tail`]), each also a device call.
    pub device_moe_tails: u64,
    /// MoE layers a backend over several devices declined as one call
    /// because their routed experts lay on more than one device (the
    /// caller ran them as a gated batch split by owner;
    /// `crate::multi::MultiBackend`).
    pub moe_tails_split: u64,
    /// Device calls that failed (their products ran on the CPU instead).
    pub device_errors: u64,
    /// Device calls whose operations ran as one CUDA graph launch (a
    /// call repeated exactly; `fathom-kernels-cuda`'s `device/tape.rs`),
    /// the graphs captured for them, and captures the driver refused
    /// (graphs are then off, the reason in `last_error`).
    pub graph_launches: u64,
    pub graph_builds: u64,
    pub graph_failures: u64,
    /// Kernels the device calls wrote on their tapes (each launch counted,
    /// whether issued one by one or replayed in a graph; not the layout
    /// kernels run as weights land).
    pub kernel_launches: u64,
    /// Of those, launches of products of many positions in tiles of rows ×
    /// positions (`fathom-kernels-cuda`'s `tile.cu`: bf16, MXFP4, int8).
    pub tiled_launches: u64,
    /// Weight bytes the device's products read from device memory (each
    /// product reads its matrix once, whatever the number of positions).
    pub weight_bytes_read: u64,
    /// Device memory bandwidth measured when the backend opened (bytes
    /// read plus written per second by a device-to-device copy).
    pub hbm_bytes_per_s: f64,
    /// Host → device bandwidth from page-locked memory, measured likewise.
    pub h2d_bytes_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl BackendStats {
    /// The counts since `start` (device memory, the measured bandwidths
    /// and the last error as now).
    pub fn since(&self, start: &BackendStats) -> BackendStats {
        BackendStats {
            device_products: self.device_products - start.device_products,
            cpu_products: self.cpu_products - start.cpu_products,
            vram_expert_hits: self.vram_expert_hits - start.vram_expert_hits,
            vram_expert_misses: self.vram_expert_misses - start.vram_expert_misses,
            h2d_bytes: self.h2d_bytes - start.h2d_bytes,
            h2d_ahead_bytes: self.h2d_ahead_bytes - start.h2d_ahead_bytes,
            guesses_scored: self.guesses_scored - start.guesses_scored,
            guesses_right: self.guesses_right - start.guesses_right,
            h2d_guessed_bytes: self.h2d_guessed_bytes - start.h2d_guessed_bytes,
            cpu_expert_products: self.cpu_expert_products - start.cpu_expert_products,
            cpu_expert_bytes: self.cpu_expert_bytes - start.cpu_expert_bytes,
            h2d_pageable_bytes: self.h2d_pageable_bytes - start.h2d_pageable_bytes,
            h2d_held_bytes: self.h2d_held_bytes - start.h2d_held_bytes,
            h2d_spine_displacing_bytes: self.h2d_spine_displacing_bytes
                - start.h2d_spine_displacing_bytes,
            d2h_bytes: self.d2h_bytes - start.d2h_bytes,
            device_calls: self.device_calls - start.device_calls,
            gpu_ms: self.gpu_ms - start.gpu_ms,
            expert_gpu_ms: self.expert_gpu_ms - start.expert_gpu_ms,
            kernel_ms: self.kernel_ms - start.kernel_ms,
            lock_wait_ms: self.lock_wait_ms - start.lock_wait_ms,
            sync_wait_ms: self.sync_wait_ms - start.sync_wait_ms,
            issue_ms: self.issue_ms - start.issue_ms,
            stage_ms: self.stage_ms - start.stage_ms,
            vram_weight_bytes: self.vram_weight_bytes,
            vram_state_bytes: self.vram_state_bytes,
            device_attention: self.device_attention - start.device_attention,
            device_moe_tails: self.device_moe_tails - start.device_moe_tails,
            moe_tails_split: self.moe_tails_split - start.moe_tails_split,
            device_errors: self.device_errors - start.device_errors,
            graph_launches: self.graph_launches - start.graph_launches,
            graph_builds: self.graph_builds - start.graph_builds,
            graph_failures: self.graph_failures - start.graph_failures,
            kernel_launches: self.kernel_launches - start.kernel_launches,
            tiled_launches: self.tiled_launches - start.tiled_launches,
            weight_bytes_read: self.weight_bytes_read - start.weight_bytes_read,
            hbm_bytes_per_s: self.hbm_bytes_per_s,
            h2d_bytes_per_s: self.h2d_bytes_per_s,
            last_error: self.last_error.clone(),
        }
    }

    /// Several devices' figures as one: counts, times and memory added
    /// (devices that work at once add up to more than the wall time); the
    /// bandwidths and the last error of the first (`self`) unless it has
    /// none.
    pub fn plus(&self, o: &BackendStats) -> BackendStats {
        BackendStats {
            device_products: self.device_products + o.device_products,
            cpu_products: self.cpu_products + o.cpu_products,
            vram_expert_hits: self.vram_expert_hits + o.vram_expert_hits,
            vram_expert_misses: self.vram_expert_misses + o.vram_expert_misses,
            h2d_bytes: self.h2d_bytes + o.h2d_bytes,
            h2d_ahead_bytes: self.h2d_ahead_bytes + o.h2d_ahead_bytes,
            guesses_scored: self.guesses_scored + o.guesses_scored,
            guesses_right: self.guesses_right + o.guesses_right,
            h2d_guessed_bytes: self.h2d_guessed_bytes + o.h2d_guessed_bytes,
            cpu_expert_products: self.cpu_expert_products + o.cpu_expert_products,
            cpu_expert_bytes: self.cpu_expert_bytes + o.cpu_expert_bytes,
            h2d_pageable_bytes: self.h2d_pageable_bytes + o.h2d_pageable_bytes,
            h2d_held_bytes: self.h2d_held_bytes + o.h2d_held_bytes,
            h2d_spine_displacing_bytes: self.h2d_spine_displacing_bytes
                + o.h2d_spine_displacing_bytes,
            d2h_bytes: self.d2h_bytes + o.d2h_bytes,
            device_calls: self.device_calls + o.device_calls,
            gpu_ms: self.gpu_ms + o.gpu_ms,
            expert_gpu_ms: self.expert_gpu_ms + o.expert_gpu_ms,
            kernel_ms: self.kernel_ms + o.kernel_ms,
            lock_wait_ms: self.lock_wait_ms + o.lock_wait_ms,
            sync_wait_ms: self.sync_wait_ms + o.sync_wait_ms,
            issue_ms: self.issue_ms + o.issue_ms,
            stage_ms: self.stage_ms + o.stage_ms,
            vram_weight_bytes: self.vram_weight_bytes + o.vram_weight_bytes,
            vram_state_bytes: self.vram_state_bytes + o.vram_state_bytes,
            device_attention: self.device_attention + o.device_attention,
            device_moe_tails: self.device_moe_tails + o.device_moe_tails,
            moe_tails_split: self.moe_tails_split + o.moe_tails_split,
            device_errors: self.device_errors + o.device_errors,
            graph_launches: self.graph_launches + o.graph_launches,
            graph_builds: self.graph_builds + o.graph_builds,
            graph_failures: self.graph_failures + o.graph_failures,
            kernel_launches: self.kernel_launches + o.kernel_launches,
            tiled_launches: self.tiled_launches + o.tiled_launches,
            weight_bytes_read: self.weight_bytes_read + o.weight_bytes_read,
            hbm_bytes_per_s: if self.hbm_bytes_per_s > 0.0 {
                self.hbm_bytes_per_s
            } else {
                o.hbm_bytes_per_s
            },
            h2d_bytes_per_s: if self.h2d_bytes_per_s > 0.0 {
                self.h2d_bytes_per_s
            } else {
                o.h2d_bytes_per_s
            },
            last_error: self.last_error.clone().or_else(|| o.last_error.clone()),
        }
    }
}

/// A device that computes matrix products with the CPU kernels' order:
/// the seam every caller goes through (as `dyn Backend`).
///
/// No method has a default here: an implementor states each one, so a
/// backend that forwards to others ([`crate::multi::MultiBackend`]) does
/// not compile until it says what each method does — none falls back to
/// "declined" unnoticed. A device that computes the work itself
/// implements [`DeviceBackend`] instead, where every optional operation is
/// declined unless it says otherwise; that gives it this trait.
pub trait Backend: Send + Sync {
    /// Short name (`cuda:0 NVIDIA H200`).
    fn name(&self) -> String;
    /// `y = x Wᵀ`, bit-identical to [`MatRef::cpu`]; `false` when this
    /// backend does not take the product (the caller computes it on the CPU).
    /// `w`'s bytes are stable until [`Backend::forget`] names them.
    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool;
    /// `groups` products in one call: `w`'s rows split into `groups` equal
    /// blocks, block `g` applied to its own input `x[g] = x[g·t·cols..][..t·cols]`,
    /// giving `y[g] = y[g·t·rows_g..][..t·rows_g]` — each row's result the one
    /// [`Backend::matmul`] gives for it. `false` when not taken (the caller
    /// computes the blocks on the CPU).
    fn matmul_groups(
        &self,
        w: &MatRef<'_>,
        role: Role,
        groups: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> bool;
    /// Several independent products in one call (one round trip to the
    /// device instead of one each), each bit-identical to
    /// [`Backend::matmul`] of it; `false` when not taken as a whole (the
    /// caller computes them one at a time). `hints` ([`Hints`]) may start
    /// copies behind the batch's own weights.
    fn matmul_batch(&self, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) -> bool;
    /// Gated MLPs `y = down(act(gate x, up x))` in one call, each
    /// bit-identical to its three products with `act` on the host between
    /// them ([`glu_steps_on`]): `act`'s operations are
    /// defined one for one ([`GluAct`]). `false` when not taken as a whole
    /// (the caller runs the fallback). `hints` as for
    /// [`Backend::matmul_batch`].
    fn glu_batch(
        &self,
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool;
    /// Plain products and gated MLPs of one step of the model in one call
    /// (a MoE layer's router and latent projection beside its shared
    /// experts), each result bit-identical to [`Backend::matmul`] of the
    /// product or [`Backend::glu_batch`] of the MLP; `false` when not taken
    /// as a whole (the caller runs them as a batch and a gated batch).
    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool;
    /// [`Hints`] with no products to go with them (every expert of a layer
    /// computed elsewhere).
    fn hint(&self, hints: &Hints<'_, '_>);
    /// Routed experts' matrices (bytes stable as for [`matmul_stable`]) to
    /// copy up now, each group one expert's, kept together on one device:
    /// as many as fit without displacing one another (a resident model's
    /// experts at load). Only copies depend on it, never a result.
    fn preload(&self, experts: &[Vec<MatRef<'_>>]);
    /// Per matrix of `ws`, the bytes the device does not hold now (what a
    /// product on it would copy up).
    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize>;
    /// Whether the device has ever had to drop or refuse routed-expert
    /// weights for room: then guesses of the experts a caller will need
    /// next are worth handing over (a right one saves waiting for a copy),
    /// and a copy nobody waits for may push out one that is needed.
    fn experts_crowded(&self) -> bool;
    /// A KDA layer's core for one step ([`KdaJob`]), bit-identical to
    /// [`crate::kda::kda_step_cpu`], leaving the sequences' states on the
    /// device ([`crate::state_buf::StateBuf::set_on_device`]). `Ok(false)`
    /// when not taken: nothing was changed, the caller runs it on the CPU.
    /// `Err` when the device failed after a state may have changed: the
    /// step must fail (and be undone). A backend does not touch the
    /// job's `StateBuf`s' own methods while it holds its internal lock
    /// (they call back into it).
    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String>;
    /// An MLA layer's absorbed attention for a step's sequences in one
    /// call ([`MlaWork`]), each step bit-identical to its CPU kernel.
    /// `false` when not taken (nothing written: the caller runs it on the
    /// CPU).
    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool;
    /// A grouped-query attention layer for a step's sequences in one call
    /// ([`GqaWork`]), bit-identical to [`gqa_work_cpu`]. `false` when not
    /// taken (nothing written).
    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool;
    /// A MoE layer's routed experts through their combine in one call
    /// ([`MoeTail`]), `y` bit-identical to [`moe_tail_cpu`]. `false` when
    /// not taken (nothing written: the caller runs the experts another
    /// way). `hints` as for [`Backend::matmul_batch`].
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, hints: &Hints<'_, '_>) -> bool;
    /// Copies the device copy named `key` ([`crate::state_buf::StateBuf::key`]) into `out`.
    fn state_read(&self, key: StateKey, out: &mut [f32]) -> Result<(), String>;
    /// Makes a device copy named `dst` equal to the one named `src` (same
    /// length), on the device.
    fn state_copy(&self, src: StateKey, dst: StateKey) -> Result<(), String>;
    /// The device copy named `key` is no longer wanted (its `StateBuf`
    /// went back to the host or was dropped).
    fn state_forget(&self, key: StateKey);
    /// The owner of the host bytes `range` is dropping them: discard every
    /// device copy made from bytes inside it (weights and states).
    fn forget(&self, range: Range<usize>);
    fn stats(&self) -> BackendStats;
}

mod device;
pub use device::DeviceBackend;

/// What a caller tells the device beside a batch: routed-expert matrices
/// (bytes stable as for [`matmul_stable`]) to copy up behind the batch's
/// own weights, in the order of the fields, each list in order, until one
/// does not fit; and the matrices it computed on the CPU. Only copies and
/// counts depend on them, never a result.
#[derive(Default, Clone, Copy)]
pub struct Hints<'a, 'w> {
    /// Matrices the caller multiplies by next.
    pub next: &'a [MatRef<'w>],
    /// Matrices the caller computed on the CPU this time because the
    /// device lacked them: they count as used, and are copied up (to be
    /// held next time) while the device is not crowded.
    pub elsewhere: &'a [MatRef<'w>],
    /// A later layer's guessed matrices, surest first: copied while such
    /// guesses prove right.
    pub guessed: &'a [MatRef<'w>],
}

impl Hints<'_, '_> {
    pub fn is_empty(&self) -> bool {
        self.next.is_empty() && self.elsewhere.is_empty() && self.guessed.is_empty()
    }
}

/// One product of a batch: `y[t, rows] = x[t, cols] Wᵀ`, `w`'s bytes
/// stable as for [`matmul_stable`].
pub struct Product<'w, 'b> {
    pub w: MatRef<'w>,
    pub role: Role,
    pub x: &'b [f32],
    pub t: usize,
    pub y: &'b mut [f32],
}

/// One gated MLP of a [`Backend::glu_batch`]: `y[t, down.rows] =
/// down(act(x gateᵀ, x upᵀ))`, `x` `[t, gate.cols]`, the three matrices'
/// bytes stable as for [`matmul_stable`].
pub struct GluProduct<'w, 'b> {
    pub gate: MatRef<'w>,
    pub up: MatRef<'w>,
    pub down: MatRef<'w>,
    pub role: Role,
    pub x: &'b [f32],
    pub t: usize,
    pub y: &'b mut [f32],
}

/// [`Backend::mla_attend`] on the installed backend: `true` when it took
/// the work (`out` written), `false` with nothing written.
pub fn mla_attend_taken(work: &mut MlaWork<'_>) -> bool {
    installed().is_some_and(|b| b.mla_attend(work))
}

/// [`Backend::gqa_attend`] on the installed backend: `true` when it took
/// the work (`out` and `rows_out` written), `false` with nothing written.
pub fn gqa_attend_taken(work: &mut GqaWork<'_>) -> bool {
    installed().is_some_and(|b| b.gqa_attend(work))
}

mod gqa_work;
mod mla;
mod mla_proj;
pub use gqa_work::{Biased, GqaWork, gqa_rows_cpu, gqa_work_cpu};
pub use mla::{MlaOut, MlaSeqWork, MlaWork, mla_out_cpu, mla_work_cpu};
pub use mla_proj::{
    DEVICE_MAX_NORM, MlaAngles, MlaProj, MlaProjected, MlaQueryProj, blocks_with, mla_proj_cpu,
    rotate_heads,
};

/// [`Backend::moe_tail`] on the installed backend: `true` when it took
/// the work (`y` written), `false` with nothing written.
pub fn moe_tail_taken(tail: &mut MoeTail<'_, '_>, hints: &Hints<'_, '_>) -> bool {
    tail.is_consistent() && installed().is_some_and(|b| b.moe_tail(tail, hints))
}

mod tail;
pub use tail::{MoeTail, TailExpert, moe_tail_cpu};

mod then;
pub use then::{
    DEVICE_MAX_SOURCES, Then, ThenGlu, ThenProduct, depth_mix, dot32, rms_inv32, rms_norm32_rows,
    softmax_fixed, then_cpu, then_mix,
};

static BACKEND: RwLock<Option<Arc<dyn Backend>>> = RwLock::new(None);

/// Makes `b` the process's backend (replacing any earlier one).
pub fn install(b: Arc<dyn Backend>) {
    *BACKEND.write().unwrap_or_else(|e| e.into_inner()) = Some(b);
}

/// Removes the installed backend (products run on the CPU again).
pub fn uninstall() -> Option<Arc<dyn Backend>> {
    BACKEND.write().unwrap_or_else(|e| e.into_inner()).take()
}

/// The installed backend, if any.
pub fn installed() -> Option<Arc<dyn Backend>> {
    BACKEND.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// `y[T, rows] = x[T, cols] Wᵀ` for a matrix whose bytes stay unchanged at
/// their address until its owner calls [`forget`] on them: on the installed
/// backend when it takes the product, else on the CPU. Same bits either way.
pub fn matmul_stable(w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) {
    if let Some(b) = installed()
        && b.matmul(w, role, x, t, y)
    {
        return;
    }
    w.cpu(x, t, y)
}

/// [`Backend::matmul_groups`] on the installed backend, if there is one
/// and it takes the call (`w`'s bytes stable as for [`matmul_stable`]);
/// `false` tells the caller to compute the blocks on the CPU.
pub fn matmul_groups_stable(
    w: &MatRef<'_>,
    role: Role,
    groups: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) -> bool {
    installed().is_some_and(|b| b.matmul_groups(w, role, groups, x, t, y))
}

/// Independent products, on the installed backend in one call when it
/// takes them all, else each through [`matmul_stable`]. The same bits
/// either way: grouping only saves round trips. With no products the
/// `hints` still go to the backend ([`Backend::hint`]).
pub fn matmul_batch_stable(products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) {
    batch_on(installed().as_deref(), products, hints)
}

/// [`matmul_batch_stable`] on `b` rather than the installed backend: in
/// one call when `b` takes the batch, else each product on `b` or, where
/// it declines one, on the CPU (all on the CPU with none).
pub fn batch_on(b: Option<&dyn Backend>, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) {
    if let Some(b) = b {
        if products.is_empty() {
            if !hints.is_empty() {
                b.hint(hints);
            }
            return;
        }
        if b.matmul_batch(products, hints) {
            return;
        }
    }
    for p in products {
        if !b.is_some_and(|b| b.matmul(&p.w, p.role, p.x, p.t, p.y)) {
            p.w.cpu(p.x, p.t, p.y)
        }
    }
}

/// Gated MLPs on the installed backend in one call when it takes them
/// all ([`Backend::glu_batch`]); else [`glu_steps_on`] it. The same bits
/// either way.
pub fn glu_batch_stable(jobs: &mut [GluProduct<'_, '_>], act: GluAct, hints: &Hints<'_, '_>) {
    let b = installed();
    if jobs.is_empty() {
        batch_on(b.as_deref(), &mut [], hints);
        return;
    }
    if let Some(b) = &b
        && b.glu_batch(jobs, act, hints)
    {
        return;
    }
    glu_steps_on(b.as_deref(), jobs, act, hints)
}

/// Plain products and gated MLPs on the installed backend in one call
/// ([`Backend::glu_mixed`]; with no MLPs, [`Backend::matmul_batch`]):
/// `true` when it took them (every output written, each with the bits of
/// its own call), `false` with nothing computed — no backend, or it
/// declined — so the caller can order the work for the CPU instead.
pub fn glu_mixed_taken(
    plain: &mut [Product<'_, '_>],
    jobs: &mut [GluProduct<'_, '_>],
    act: GluAct,
    hints: &Hints<'_, '_>,
) -> bool {
    installed().is_some_and(|b| {
        if jobs.is_empty() {
            !plain.is_empty() && b.matmul_batch(plain, hints)
        } else {
            b.glu_mixed(plain, jobs, act, hints)
        }
    })
}

/// Gated MLPs in steps through [`batch_on`] `b`: the gate and up products
/// of all in one batch (with `hints`, the routed experts' downs named next
/// in place of `hints.next`), `act` on the host, the downs in a second
/// batch.
pub fn glu_steps_on(
    b: Option<&dyn Backend>,
    jobs: &mut [GluProduct<'_, '_>],
    act: GluAct,
    hints: &Hints<'_, '_>,
) {
    let mut g: Vec<Vec<f32>> = jobs
        .iter()
        .map(|j| vec![0f32; j.t * j.gate.rows()])
        .collect();
    let mut u = g.clone();
    let mut ps = Vec::with_capacity(2 * jobs.len());
    for ((j, g), u) in jobs.iter().zip(g.iter_mut()).zip(u.iter_mut()) {
        for (w, y) in [(j.gate, g), (j.up, u)] {
            ps.push(Product {
                w,
                role: j.role,
                x: j.x,
                t: j.t,
                y,
            });
        }
    }
    // Routed experts' downs are copied ahead of the first batch.
    let downs: Vec<MatRef<'_>> = jobs
        .iter()
        .filter(|j| j.role == Role::Expert)
        .map(|j| j.down)
        .collect();
    let first = Hints {
        next: &downs,
        ..*hints
    };
    batch_on(b, &mut ps, &first);
    drop(ps);
    {
        use rayon::prelude::*;
        g.par_iter_mut().zip(&u).for_each(|(g, u)| act.apply(g, u));
    }
    let mut ps: Vec<Product<'_, '_>> = jobs
        .iter_mut()
        .zip(&g)
        .map(|(j, g)| Product {
            w: j.down,
            role: j.role,
            x: g,
            t: j.t,
            y: &mut *j.y,
        })
        .collect();
    batch_on(b, &mut ps, &Hints::default());
}

/// A KDA layer's core on the installed backend when it takes it
/// ([`Backend::kda_step`]); `Ok(false)` tells the caller to run it on the
/// CPU, `Err` that the step failed on the device.
pub fn kda_step(job: &mut KdaJob<'_>) -> Result<bool, String> {
    installed().map_or(Ok(false), |b| b.kda_step(job))
}

/// Per matrix, the bytes the installed backend lacks
/// ([`Backend::missing_bytes`]); none with no backend.
pub fn missing_bytes(ws: &[MatRef<'_>]) -> Vec<usize> {
    installed().map_or_else(|| vec![0; ws.len()], |b| b.missing_bytes(ws))
}

/// Whether the installed backend's routed experts are crowded
/// ([`Backend::experts_crowded`]); no with none.
pub fn experts_crowded() -> bool {
    installed().is_some_and(|b| b.experts_crowded())
}

/// Hands the installed backend the routed experts `experts` lists to copy
/// up now ([`Backend::preload`]); with none, nothing (the list is not made).
pub fn preload<'a>(experts: impl FnOnce() -> Vec<Vec<MatRef<'a>>>) {
    if let Some(b) = installed() {
        b.preload(&experts());
    }
}

/// The installed backend's counters now (zero with none).
pub fn snapshot() -> BackendStats {
    installed().map_or_else(BackendStats::default, |b| b.stats())
}

/// The installed backend's figures since `start` (a [`snapshot`]); `None`
/// with no backend.
pub fn stats_since(start: &BackendStats) -> Option<BackendStats> {
    installed().map(|b| b.stats().since(start))
}

/// The owner of `bytes` is about to free or change them.
pub fn forget<T>(bytes: &[T]) {
    if bytes.is_empty() {
        return;
    }
    if let Some(b) = installed() {
        let start = bytes.as_ptr() as usize;
        b.forget(start..start + std::mem::size_of_val(bytes));
    }
}

/// The byte segments of `w` (data, then scales): what a backend copies.
pub fn segments<'a>(w: &MatRef<'a>) -> Vec<&'a [u8]> {
    fn bytes<T>(s: &[T]) -> &[u8] {
        // SAFETY: any initialised slice may be viewed as bytes (plain numbers, no padding).
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
    }
    match *w {
        MatRef::F32 { w, .. } => vec![bytes(w)],
        MatRef::Bf16 { w, .. } => vec![bytes(w)],
        MatRef::Int8 { q, scale, .. } => vec![bytes(q), bytes(scale)],
        MatRef::Mxfp4(m) => vec![m.packed, m.scales],
        MatRef::Fp8(m) => vec![m.q, bytes(m.scale)],
        MatRef::Int4(m) => vec![m.packed, bytes(m.scale)],
    }
}
