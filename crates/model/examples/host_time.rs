//! The host's own time in a decode step: a model run with a backend that
//! takes every product, gated MLP and KDA step and answers zeros at once —
//! an infinitely fast device — so what is left of a token's wall time is
//! the host's work between and around device calls (norms, routing,
//! attention over the cache, mixing, the head's logits, the expert
//! source's bookkeeping, allocation, the pool's fork-joins), split by the
//! step's phase clocks. The CUDA backend's own per-call host work (staging,
//! copies, launches) is not in it: see `stats.gpu` on a GPU.
//!
//! `cargo run --release -p fathom-model --example host_time -- MODEL_DIR [TOKENS]`
//!
//! The outputs are garbage by construction (every product is zero); only
//! the times mean anything.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fathom_kernels::backend::{
    self, BackendStats, DeviceBackend, GluProduct, GqaWork, Hints, MatRef, MlaWork, MoeTail,
    Product, Role,
};
use fathom_kernels::kda::KdaJob;
use fathom_kernels::ops::GluAct;
use fathom_kernels::state_buf::StateKey;
use fathom_model::Logits;
use fathom_model::phase::{self, PhaseMs};

/// Takes everything and writes zeros; counts its calls, in all and by
/// operation.
#[derive(Default)]
struct Zeros {
    calls: AtomicU64,
    by_op: Mutex<BTreeMap<&'static str, u64>>,
}

impl Zeros {
    fn call(&self, op: &'static str) -> bool {
        self.calls.fetch_add(1, Ordering::Relaxed);
        *self
            .by_op
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(op)
            .or_default() += 1;
        true
    }

    fn by_op(&self) -> BTreeMap<&'static str, u64> {
        self.by_op.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl DeviceBackend for Zeros {
    fn name(&self) -> String {
        "zeros (an infinitely fast device)".into()
    }
    fn matmul(&self, _: &MatRef<'_>, _: Role, _: &[f32], _: usize, y: &mut [f32]) -> bool {
        y.fill(0.0);
        self.call("matmul")
    }
    fn matmul_groups(
        &self,
        _: &MatRef<'_>,
        _: Role,
        _: usize,
        _: &[f32],
        _: usize,
        y: &mut [f32],
    ) -> bool {
        y.fill(0.0);
        self.call("matmul_groups")
    }
    fn matmul_batch(&self, ps: &mut [Product<'_, '_>], _: &Hints<'_, '_>) -> bool {
        ps.iter_mut().for_each(|p| p.y.fill(0.0));
        self.call("matmul_batch")
    }
    fn glu_batch(&self, jobs: &mut [GluProduct<'_, '_>], _: GluAct, _: &Hints<'_, '_>) -> bool {
        jobs.iter_mut().for_each(|j| j.y.fill(0.0));
        self.call("glu_batch")
    }
    fn glu_mixed(
        &self,
        ps: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        _: GluAct,
        _: &Hints<'_, '_>,
    ) -> bool {
        ps.iter_mut().for_each(|p| p.y.fill(0.0));
        jobs.iter_mut().for_each(|j| j.y.fill(0.0));
        self.call("glu_mixed")
    }
    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        work.out.fill(0.0);
        if let Some(p) = work.proj.as_mut() {
            p.rows_out.fill(0.0);
        }
        self.call("mla_attend")
    }
    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool {
        work.out.fill(0.0);
        work.rows_out.fill(0.0);
        self.call("gqa_attend")
    }
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, _: &Hints<'_, '_>) -> bool {
        tail.y.fill(0.0);
        self.call("moe_tail")
    }
    /// States stay "on the device", as the CUDA backend leaves them: the
    /// step's undo marks are then device copies, not host ones.
    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        job.out.fill(0.0);
        if let Some(b) = job.inputs_out.as_deref_mut() {
            b.fill(0.0);
        }
        for s in job.seqs.iter_mut() {
            s.s.set_on_device();
            s.conv.iter_mut().for_each(|c| c.set_on_device());
        }
        Ok(self.call("kda_step"))
    }
    fn state_read(&self, _: StateKey, out: &mut [f32]) -> Result<(), String> {
        out.fill(0.0);
        Ok(())
    }
    fn state_copy(&self, _: StateKey, _: StateKey) -> Result<(), String> {
        self.call("state_copy");
        Ok(())
    }
    fn forget(&self, _: Range<usize>) {}
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}

fn plus(a: &PhaseMs, b: &PhaseMs) -> PhaseMs {
    PhaseMs {
        linear_attention: a.linear_attention + b.linear_attention,
        full_attention: a.full_attention + b.full_attention,
        mlp: a.mlp + b.mlp,
        moe: a.moe + b.moe,
        mix_and_head: a.mix_and_head + b.mix_and_head,
        linear_core: a.linear_core + b.linear_core,
        full_core: a.full_core + b.full_core,
        routed_experts: a.routed_experts + b.routed_experts,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // On a thread of the compute pool, as the CLI runs a model.
    rayon::scope(|_| run())
}

fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: host_time MODEL_DIR [TOKENS]")?);
    let tokens: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let model = fathom_model::registry::load(&dir, Default::default())?;
    let zeros = Arc::new(Zeros::default());
    backend::install(zeros.clone());
    // Decode runs of at most RUN positions after an 8-token prompt (the
    // bench's short context), prompts and warm-up steps not timed.
    const RUN: usize = 48;
    let (mut ph, mut calls, mut secs, mut done) = (PhaseMs::default(), 0u64, 0f64, 0usize);
    let mut ops: BTreeMap<&'static str, u64> = BTreeMap::new();
    while done < tokens {
        let mut st = model.new_state();
        model.forward(st.as_mut(), &[1, 2, 3, 4, 5, 6, 7, 8], Logits::Last)?;
        model.forward(st.as_mut(), &[9], Logits::Last)?;
        let n = RUN.min(tokens - done);
        let (p0, c0, o0, t0) = (
            phase::snapshot(),
            zeros.calls.load(Ordering::Relaxed),
            zeros.by_op(),
            Instant::now(),
        );
        for i in 0..n {
            model.forward(st.as_mut(), &[10 + i as u32], Logits::Last)?;
        }
        secs += t0.elapsed().as_secs_f64();
        calls += zeros.calls.load(Ordering::Relaxed) - c0;
        for (op, c) in zeros.by_op() {
            *ops.entry(op).or_default() += c - o0.get(op).copied().unwrap_or(0);
        }
        ph = plus(&ph, &phase::snapshot().since(&p0));
        done += n;
    }
    let calls = calls as f64 / tokens as f64;
    let wall = secs * 1e3 / tokens as f64;
    let per = |v: f64| v / tokens as f64;
    println!(
        "host ms a token: {wall:.3} ({calls:.1} device calls a token, {} threads)",
        rayon::current_num_threads()
    );
    println!(
        "  linear attention {:.3} (core {:.3}), full attention {:.3} (core {:.3}), mlp {:.3}, moe {:.3} (routed experts {:.3}), mix and head {:.3}",
        per(ph.linear_attention),
        per(ph.linear_core),
        per(ph.full_attention),
        per(ph.full_core),
        per(ph.mlp),
        per(ph.moe),
        per(ph.routed_experts),
        per(ph.mix_and_head)
    );
    let ops: Vec<String> = ops
        .iter()
        .map(|(op, c)| format!("{op} {:.1}", *c as f64 / tokens as f64))
        .collect();
    println!("  calls a token by operation: {}", ops.join(", "));
    Ok(())
}
