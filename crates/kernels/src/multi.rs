//! Several devices behind one [`Backend`]: the routed experts are
//! partitioned over them, everything else stays on the first.
//!
//! A routed-expert matrix belongs to one device, chosen when the matrix is
//! first seen (in a product, a hint or a question about missing bytes):
//! the device with the least load so far — its owned matrices' bytes, plus
//! their bytes again at every use — so new and hot experts spread over the
//! devices as they appear; a gated MLP's up and down follow its gate. Each
//! device keeps its own VRAM cache of the experts it owns. A batch of expert products (or gated
//! expert MLPs) is split by owner and the parts run on their devices at
//! once; every result lands in its caller's buffer. Spine products, the
//! KDA core and the sequences' states go to the first device.
//!
//! A MoE layer's tail ([`Backend::moe_tail`]: its routed experts, their
//! rank-order sums, the latent norm and up-projection in one call) goes
//! whole to the device that owns all of its experts — the up-projection,
//! a spine matrix, then on the first device from the sums that device
//! sends back, unless the owner is the first. A tail whose experts lie on
//! several devices is declined, so the caller runs its experts as one
//! gated batch split by owner ([`Backend::glu_batch`] here) and sums them
//! itself: that is the same work on the same devices, and the sums need
//! every expert's output in one place. Both outcomes are counted
//! ([`MultiBackend::tails`]; the split ones also as the stats'
//! `moe_tails_split`). Placement never depends on it: a tail's new experts are
//! placed as a batch's would be.
//!
//! Activations travel through the host as for one device (each part
//! copies its inputs up and its results back), so no device-to-device
//! transport is needed yet. Every device computes a product with the CPU
//! kernels' order and the caller combines the experts' outputs in its own
//! fixed order, so the bits do not depend on how many devices there are or
//! which one owns which expert.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{
    Backend, BackendStats, GluProduct, GqaWork, Hints, MatRef, MlaWork, MoeTail, Product, Role,
    batch_on, glu_steps_on, segments,
};
use crate::kda::KdaJob;
use crate::ops::GluAct;
use crate::state_buf::StateKey;

/// Devices with the routed experts partitioned over them (see the module).
pub struct MultiBackend {
    devices: Vec<Arc<dyn Backend>>,
    place: Mutex<Placement>,
    /// Expert batches split so far, and the devices they went to in all.
    batches: AtomicU64,
    parts: AtomicU64,
    /// MoE tails handed whole to one device, and those declined because
    /// their experts lay on several.
    tails_whole: AtomicU64,
    tails_split: AtomicU64,
}

/// Which device owns each routed-expert matrix, by its first segment's
/// address, and each device's load: its matrices' bytes when placed, plus
/// their bytes at every use.
#[derive(Default)]
struct Placement {
    owner: HashMap<usize, usize>,
    load: Vec<f64>,
}

impl Placement {
    /// `w`'s device (the least loaded when first seen, which adds its
    /// bytes to that load, so the next new matrix goes elsewhere); a use
    /// adds its bytes again.
    fn owner(&mut self, w: &MatRef<'_>, used: bool) -> usize {
        let (key, bytes) = key_bytes(w);
        let d = match self.owner.get(&key) {
            Some(&d) => d,
            None => {
                let least = (0..self.load.len())
                    .min_by(|&a, &b| self.load[a].total_cmp(&self.load[b]))
                    .unwrap_or(0);
                self.owner.insert(key, least);
                self.load[least] += bytes;
                least
            }
        };
        if used {
            self.load[d] += bytes;
        }
        d
    }

    /// Gives `w` to device `d` (a gated MLP's up and down follow its gate).
    fn give(&mut self, w: &MatRef<'_>, d: usize) {
        self.owner.insert(key_bytes(w).0, d);
    }
}

impl MultiBackend {
    /// `devices` in order (the first holds the spine and the states);
    /// `None` with none.
    pub fn new(devices: Vec<Arc<dyn Backend>>) -> Option<Self> {
        if devices.is_empty() {
            return None;
        }
        let load = vec![0.0; devices.len()];
        Some(MultiBackend {
            devices,
            place: Mutex::new(Placement {
                owner: HashMap::new(),
                load,
            }),
            batches: AtomicU64::new(0),
            parts: AtomicU64::new(0),
            tails_whole: AtomicU64::new(0),
            tails_split: AtomicU64::new(0),
        })
    }

    fn place(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.place.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Per device, the indices of `ws` it owns (marked used when `used`,
    /// and then counted as one batch split over its devices).
    fn split<'w>(&self, ws: impl Iterator<Item = MatRef<'w>>, used: bool) -> Vec<Vec<usize>> {
        let mut parts = vec![Vec::new(); self.devices.len()];
        let mut place = self.place();
        for (i, w) in ws.enumerate() {
            parts[place.owner(&w, used)].push(i);
        }
        if used {
            let n = parts.iter().filter(|p| !p.is_empty()).count();
            self.batches.fetch_add(1, Ordering::Relaxed);
            self.parts.fetch_add(n as u64, Ordering::Relaxed);
        }
        parts
    }

    /// Per device, the hints' matrices it owns.
    fn split_hints<'w>(&self, h: &Hints<'_, 'w>) -> Vec<[Vec<MatRef<'w>>; 3]> {
        let mut out: Vec<[Vec<MatRef<'w>>; 3]> = (0..self.devices.len())
            .map(|_| Default::default())
            .collect();
        let mut place = self.place();
        for (k, list) in [h.next, h.elsewhere, h.guessed].into_iter().enumerate() {
            for w in list {
                out[place.owner(w, false)][k].push(*w);
            }
        }
        out
    }

    /// Runs `work(device, part)` for every device with a part, at once.
    fn each<T: Send>(&self, parts: Vec<T>, work: impl Fn(&dyn Backend, T) + Sync) {
        rayon::scope(|s| {
            for (d, part) in self.devices.iter().zip(parts) {
                let work = &work;
                s.spawn(move |_| work(&**d, part));
            }
        });
    }
}

/// A matrix's key (its first segment's address) and its bytes.
fn key_bytes(w: &MatRef<'_>) -> (usize, f64) {
    let segs = segments(w);
    let key = segs.first().map_or(0, |s| s.as_ptr() as usize);
    (key, segs.iter().map(|s| s.len()).sum::<usize>() as f64)
}

/// The hints of one device's part.
fn hints_of<'a, 'w>(h: &'a [Vec<MatRef<'w>>; 3]) -> Hints<'a, 'w> {
    Hints {
        next: &h[0],
        elsewhere: &h[1],
        guessed: &h[2],
    }
}

impl Backend for MultiBackend {
    fn name(&self) -> String {
        let names: Vec<String> = self.devices.iter().map(|d| d.name()).collect();
        names.join(" + ")
    }

    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        let d = match role {
            Role::Expert => self.place().owner(w, true),
            Role::Spine => 0,
        };
        self.devices[d].matmul(w, role, x, t, y)
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
        self.devices[0].matmul_groups(w, role, groups, x, t, y)
    }

    fn matmul_batch(&self, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) -> bool {
        if products.iter().any(|p| p.role == Role::Spine) {
            return self.devices[0].matmul_batch(products, hints);
        }
        let parts = self.split(products.iter().map(|p| p.w), true);
        let hs = self.split_hints(hints);
        let mut slots: Vec<Option<&mut Product<'_, '_>>> = products.iter_mut().map(Some).collect();
        let work: Vec<(Vec<Product<'_, '_>>, &[Vec<MatRef<'_>>; 3])> = parts
            .iter()
            .zip(&hs)
            .map(|(idx, h)| {
                let mine = idx.iter().map(|&i| {
                    let p = slots[i].take().expect("each product in one part");
                    Product {
                        w: p.w,
                        role: p.role,
                        x: p.x,
                        t: p.t,
                        y: &mut *p.y,
                    }
                });
                (mine.collect(), h)
            })
            .collect();
        self.each(work, |d, (mut ps, h)| {
            batch_on(Some(d), &mut ps, &hints_of(h))
        });
        true
    }

    /// Spine work only (a MoE layer's router, latent projection and shared
    /// experts): on the first device, with the spine.
    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        let spine = plain.iter().all(|p| p.role == Role::Spine)
            && jobs.iter().all(|j| j.role == Role::Spine);
        spine && self.devices[0].glu_mixed(plain, jobs, act, hints)
    }

    fn glu_batch(
        &self,
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        if jobs.iter().any(|j| j.role == Role::Spine) {
            let d = &*self.devices[0];
            if !d.glu_batch(jobs, act, hints) {
                glu_steps_on(Some(d), jobs, act, hints);
            }
            return true;
        }
        let parts = self.split(jobs.iter().map(|j| j.gate), true);
        {
            let mut place = self.place();
            for (d, idx) in parts.iter().enumerate() {
                for &i in idx {
                    place.give(&jobs[i].up, d);
                    place.give(&jobs[i].down, d);
                }
            }
        }
        let hs = self.split_hints(hints);
        let mut slots: Vec<Option<&mut GluProduct<'_, '_>>> = jobs.iter_mut().map(Some).collect();
        let work: Vec<(Vec<GluProduct<'_, '_>>, &[Vec<MatRef<'_>>; 3])> = parts
            .iter()
            .zip(&hs)
            .map(|(idx, h)| {
                let mine = idx.iter().map(|&i| {
                    let j = slots[i].take().expect("each job in one part");
                    GluProduct {
                        gate: j.gate,
                        up: j.up,
                        down: j.down,
                        role: j.role,
                        x: j.x,
                        t: j.t,
                        y: &mut *j.y,
                    }
                });
                (mine.collect(), h)
            })
            .collect();
        self.each(work, |d, (mut js, h)| {
            let h = hints_of(h);
            if js.is_empty() {
                batch_on(Some(d), &mut [], &h);
            } else if !d.glu_batch(&mut js, act, &h) {
                glu_steps_on(Some(d), &mut js, act, &h);
            }
        });
        true
    }

    fn hint(&self, hints: &Hints<'_, '_>) {
        for (d, h) in self.devices.iter().zip(self.split_hints(hints)) {
            let h = hints_of(&h);
            if !h.is_empty() {
                d.hint(&h);
            }
        }
    }

    /// Each expert's matrices to the device its first one goes to (the
    /// least loaded, when new), as a gated MLP's up and down follow its
    /// gate; then each device's share in one list.
    fn preload(&self, experts: &[Vec<MatRef<'_>>]) {
        let mut mine: Vec<Vec<Vec<MatRef<'_>>>> = vec![Vec::new(); self.devices.len()];
        {
            let mut place = self.place();
            for group in experts.iter().filter(|g| !g.is_empty()) {
                let d = place.owner(&group[0], false);
                for w in &group[1..] {
                    place.give(w, d);
                }
                mine[d].push(group.clone());
            }
        }
        for (d, groups) in self.devices.iter().zip(mine) {
            if !groups.is_empty() {
                d.preload(&groups);
            }
        }
    }

    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        let mut out = vec![0; ws.len()];
        for (d, idx) in self
            .devices
            .iter()
            .zip(self.split(ws.iter().copied(), false))
        {
            let mine: Vec<MatRef<'_>> = idx.iter().map(|&i| ws[i]).collect();
            for (i, m) in idx.iter().zip(d.missing_bytes(&mine)) {
                out[*i] = m;
            }
        }
        out
    }

    fn experts_crowded(&self) -> bool {
        self.devices.iter().any(|d| d.experts_crowded())
    }

    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        self.devices[0].kda_step(job)
    }

    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        self.devices[0].mla_attend(work)
    }

    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool {
        self.devices[0].gqa_attend(work)
    }

    /// Whole to the device owning every expert of the tail (see the
    /// module), else declined and counted.
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, hints: &Hints<'_, '_>) -> bool {
        let Some(d) = self.tail_owner(tail) else {
            return false;
        };
        let hs = self.split_hints(hints);
        for (o, (dev, h)) in self.devices.iter().zip(&hs).enumerate() {
            let h = hints_of(h);
            if o != d && !h.is_empty() {
                dev.hint(&h);
            }
        }
        tail_on(
            &*self.devices[d],
            &*self.devices[0],
            d,
            tail,
            &hints_of(&hs[d]),
        )
    }

    fn state_read(&self, key: StateKey, out: &mut [f32]) -> Result<(), String> {
        self.devices[0].state_read(key, out)
    }

    fn state_copy(&self, src: StateKey, dst: StateKey) -> Result<(), String> {
        self.devices[0].state_copy(src, dst)
    }

    fn state_forget(&self, key: StateKey) {
        self.devices[0].state_forget(key)
    }

    fn forget(&self, range: Range<usize>) {
        self.place().owner.retain(|k, _| !range.contains(k));
        for d in &self.devices {
            d.forget(range.clone());
        }
    }

    fn stats(&self) -> BackendStats {
        let mut all = self.devices.iter().map(|d| d.stats());
        let first = all.next().unwrap_or_default();
        let mut sum = all.fold(first, |a, s| a.plus(&s));
        sum.moe_tails_split += self.tails().1;
        sum
    }
}

/// `tail` on `dev` (device `d`); with an up-projection and `d` not the
/// first, the experts, sums and norm there and the up-projection on
/// `first` (else the CPU) from the sums: each part bit-identical to its
/// share of [`crate::backend::moe_tail_cpu`], so the whole is too.
fn tail_on(
    dev: &dyn Backend,
    first: &dyn Backend,
    d: usize,
    tail: &mut MoeTail<'_, '_>,
    hints: &Hints<'_, '_>,
) -> bool {
    let up = match tail.up {
        Some(up) if d != 0 => up,
        _ => return dev.moe_tail(tail, hints),
    };
    let rows = tail.rows();
    let mut s = vec![0f32; rows * tail.width()];
    let mut sums = MoeTail {
        experts: tail.experts,
        act: tail.act,
        k: tail.k,
        picks: tail.picks,
        weights: tail.weights,
        norm: tail.norm,
        up: None,
        y: &mut s,
    };
    if !dev.moe_tail(&mut sums, hints) {
        return false;
    }
    if !first.matmul(&up, Role::Spine, &s, rows, tail.y) {
        up.cpu(&s, rows, tail.y);
    }
    true
}

impl MultiBackend {
    /// Weight bytes read so far from the matrices each device owns.
    pub fn loads(&self) -> Vec<f64> {
        self.place().load.clone()
    }

    /// Expert batches split so far and the devices they ran on in all
    /// (parts ÷ batches: how many devices a batch kept busy on average).
    pub fn spread(&self) -> (u64, u64) {
        (
            self.batches.load(Ordering::Relaxed),
            self.parts.load(Ordering::Relaxed),
        )
    }

    /// MoE tails handed whole to one device ([`Backend::moe_tail`]; the
    /// device may still decline one, as a lone device may), and those
    /// declined here because their experts lay on several devices.
    pub fn tails(&self) -> (u64, u64) {
        (
            self.tails_whole.load(Ordering::Relaxed),
            self.tails_split.load(Ordering::Relaxed),
        )
    }

    /// The device owning every expert of `tail` (its new experts placed
    /// first, gate by gate as a batch's are; up and down follow the gate),
    /// counted as whole; `None`, counted as split, when they lie on
    /// several devices (or the tail has none, not counted).
    fn tail_owner(&self, tail: &MoeTail<'_, '_>) -> Option<usize> {
        if tail.experts.is_empty() {
            return None;
        }
        let mut place = self.place();
        let owners: Vec<usize> = tail
            .experts
            .iter()
            .map(|e| place.owner(&e.gate, false))
            .collect();
        let d = owners[0];
        if owners.iter().any(|&o| o != d) {
            self.tails_split.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        for e in tail.experts {
            place.owner(&e.gate, true);
            place.give(&e.up, d);
            place.give(&e.down, d);
        }
        self.tails_whole.fetch_add(1, Ordering::Relaxed);
        Some(d)
    }

    /// How many routed-expert matrices each device owns now.
    pub fn owned(&self) -> Vec<usize> {
        let mut n = vec![0; self.devices.len()];
        for &d in self.place().owner.values() {
            n[d] += 1;
        }
        n
    }
}
