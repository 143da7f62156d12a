//! A device's side of the seam: [`DeviceBackend`] is [`Backend`] with
//! every optional operation declined unless the device says otherwise.
//! The defaults live here and only here: a backend that forwards to
//! others implements [`Backend`] itself, where nothing has a default, so
//! an operation it does not forward is a compile error, not a silent
//! fall-back to the CPU.

use std::ops::Range;

use super::{
    Backend, BackendStats, GluProduct, GqaWork, Hints, MatRef, MlaWork, MoeTail, Product, Role,
};
use crate::kda::KdaJob;
use crate::ops::GluAct;
use crate::state_buf::StateKey;

/// A device that computes the work it takes itself (a GPU, a stand-in of
/// one in a test): every method as [`Backend`]'s of the same name; those
/// with a body here are declined (or ignored, or answered "none") unless
/// the device states them. Implementing it gives the [`Backend`].
pub trait DeviceBackend: Send + Sync {
    /// [`Backend::name`].
    fn name(&self) -> String;
    /// [`Backend::matmul`].
    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool;
    /// [`Backend::matmul_groups`]. Default: not taken.
    fn matmul_groups(
        &self,
        _w: &MatRef<'_>,
        _role: Role,
        _groups: usize,
        _x: &[f32],
        _t: usize,
        _y: &mut [f32],
    ) -> bool {
        false
    }
    /// [`Backend::matmul_batch`]. Default: not taken.
    fn matmul_batch(&self, _products: &mut [Product<'_, '_>], _hints: &Hints<'_, '_>) -> bool {
        false
    }
    /// [`Backend::glu_batch`]. Default: not taken.
    fn glu_batch(
        &self,
        _jobs: &mut [GluProduct<'_, '_>],
        _act: GluAct,
        _hints: &Hints<'_, '_>,
    ) -> bool {
        false
    }
    /// [`Backend::glu_mixed`]. Default: not taken.
    fn glu_mixed(
        &self,
        _plain: &mut [Product<'_, '_>],
        _jobs: &mut [GluProduct<'_, '_>],
        _act: GluAct,
        _hints: &Hints<'_, '_>,
    ) -> bool {
        false
    }
    /// [`Backend::hint`]. Default: ignored.
    fn hint(&self, _hints: &Hints<'_, '_>) {}
    /// [`Backend::preload`]. Default: the groups in order as one
    /// [`Hints::next`] list.
    fn preload(&self, experts: &[Vec<MatRef<'_>>]) {
        let next: Vec<MatRef<'_>> = experts.iter().flatten().copied().collect();
        self.hint(&Hints {
            next: &next,
            ..Hints::default()
        });
    }
    /// [`Backend::missing_bytes`]. Default: none.
    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        vec![0; ws.len()]
    }
    /// [`Backend::experts_crowded`]. Default: no.
    fn experts_crowded(&self) -> bool {
        false
    }
    /// [`Backend::kda_step`]. Default: not taken.
    fn kda_step(&self, _job: &mut KdaJob<'_>) -> Result<bool, String> {
        Ok(false)
    }
    /// [`Backend::mla_attend`]. Default: not taken.
    fn mla_attend(&self, _work: &mut MlaWork<'_>) -> bool {
        false
    }
    /// [`Backend::gqa_attend`]. Default: not taken.
    fn gqa_attend(&self, _work: &mut GqaWork<'_>) -> bool {
        false
    }
    /// [`Backend::moe_tail`]. Default: not taken.
    fn moe_tail(&self, _tail: &mut MoeTail<'_, '_>, _hints: &Hints<'_, '_>) -> bool {
        false
    }
    /// [`Backend::state_read`]. Default: an error (no states kept).
    fn state_read(&self, _key: StateKey, _out: &mut [f32]) -> Result<(), String> {
        Err("this backend keeps no state".into())
    }
    /// [`Backend::state_copy`]. Default: an error (no states kept).
    fn state_copy(&self, _src: StateKey, _dst: StateKey) -> Result<(), String> {
        Err("this backend keeps no state".into())
    }
    /// [`Backend::state_forget`]. Default: [`DeviceBackend::forget`] of
    /// its bytes.
    fn state_forget(&self, key: StateKey) {
        self.forget(key.0..key.0 + key.1);
    }
    /// [`Backend::forget`].
    fn forget(&self, range: Range<usize>);
    /// [`Backend::stats`].
    fn stats(&self) -> BackendStats;
}

/// Each method to the device's own: this impl states every method of
/// [`Backend`] (none has a default there), so a method added to the seam
/// must be added to [`DeviceBackend`] too before anything compiles.
impl<T: DeviceBackend> Backend for T {
    fn name(&self) -> String {
        DeviceBackend::name(self)
    }
    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        DeviceBackend::matmul(self, w, role, x, t, y)
    }
    fn matmul_groups(
        &self,
        w: &MatRef<'_>,
        role: Role,
        groups: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> bool {
        DeviceBackend::matmul_groups(self, w, role, groups, x, t, y)
    }
    fn matmul_batch(&self, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) -> bool {
        DeviceBackend::matmul_batch(self, products, hints)
    }
    fn glu_batch(
        &self,
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        DeviceBackend::glu_batch(self, jobs, act, hints)
    }
    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        DeviceBackend::glu_mixed(self, plain, jobs, act, hints)
    }
    fn hint(&self, hints: &Hints<'_, '_>) {
        DeviceBackend::hint(self, hints)
    }
    fn preload(&self, experts: &[Vec<MatRef<'_>>]) {
        DeviceBackend::preload(self, experts)
    }
    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        DeviceBackend::missing_bytes(self, ws)
    }
    fn experts_crowded(&self) -> bool {
        DeviceBackend::experts_crowded(self)
    }
    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        DeviceBackend::kda_step(self, job)
    }
    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        DeviceBackend::mla_attend(self, work)
    }
    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool {
        DeviceBackend::gqa_attend(self, work)
    }
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, hints: &Hints<'_, '_>) -> bool {
        DeviceBackend::moe_tail(self, tail, hints)
    }
    fn state_read(&self, key: StateKey, out: &mut [f32]) -> Result<(), String> {
        DeviceBackend::state_read(self, key, out)
    }
    fn state_copy(&self, src: StateKey, dst: StateKey) -> Result<(), String> {
        DeviceBackend::state_copy(self, src, dst)
    }
    fn state_forget(&self, key: StateKey) {
        DeviceBackend::state_forget(self, key)
    }
    fn forget(&self, range: Range<usize>) {
        DeviceBackend::forget(self, range)
    }
    fn stats(&self) -> BackendStats {
        DeviceBackend::stats(self)
    }
}
