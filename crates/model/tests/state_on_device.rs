//! KDA states left on a backend's "device" between steps: a backend that
//! keeps its own copies of the states (here, host memory standing in for
//! VRAM) and runs the KDA core with the CPU twin gives a model the same
//! logits bit for bit as no backend — through batched steps, snapshots and
//! restores, undo marks, forks, speculative passes cut short (their
//! journals bring the states back to the host) and encoded states. So
//! where a sequence's state lives never changes a result.
//!
//! The backend is process-wide, so the tests of this binary take turns.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fathom_kernels::backend::{self, BackendStats, DeviceBackend, MatRef, Role};
use fathom_kernels::kda::{KdaJob, KdaSeq, kda_step_cpu};
use fathom_kernels::state_buf::{StateBuf, StateKey};
use fathom_model::{CausalLm, K3Model, Logits, StepInput};

static TURN: Mutex<()> = Mutex::new(());

/// Keeps the states it is handed in a map by their names and steps them
/// there; products stay on the CPU.
#[derive(Default)]
struct Mirror {
    states: Mutex<HashMap<StateKey, Vec<f32>>>,
    steps: AtomicUsize,
    /// Steps that carried the layer's input projections (`KdaJob::proj`).
    projected: AtomicUsize,
    reads: AtomicUsize,
    copies: AtomicUsize,
    /// When set, the next step changes the states and then fails (a device
    /// that failed after its launches).
    fail_after_change: std::sync::atomic::AtomicBool,
    /// When set, the device is gone: every read, copy and step fails.
    lost: std::sync::atomic::AtomicBool,
}

const LOST: &str = "the device was lost";

impl DeviceBackend for Mirror {
    fn name(&self) -> String {
        "mirror".into()
    }
    fn matmul(&self, _: &MatRef<'_>, _: Role, _: &[f32], _: usize, _: &mut [f32]) -> bool {
        false
    }
    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(LOST.into());
        }
        let mut map = self.states.lock().unwrap();
        // The copies here, made from the host's where those are the newest.
        let mut here: Vec<[StateBuf; 4]> = Vec::new();
        for s in &job.seqs {
            let bufs: [&StateBuf; 4] = [&*s.s, &*s.conv[0], &*s.conv[1], &*s.conv[2]];
            here.push(bufs.map(|b| {
                let v = match b.host() {
                    Some(h) => h.to_vec(),
                    None => map.get(&b.key()).expect("marked on the device").clone(),
                };
                StateBuf::new(v)
            }));
        }
        let mut out = vec![0f32; job.out.len()];
        {
            let seqs = here
                .iter_mut()
                .zip(&job.seqs)
                .map(|([s, q, k, v], seq)| KdaSeq {
                    rows: seq.rows.clone(),
                    s,
                    conv: [q, k, v],
                })
                .collect();
            let mut twin = KdaJob {
                dims: job.dims,
                w: job.w,
                x: job.x,
                proj: job.proj,
                seqs,
                out: &mut out,
                f_up: job.f_up,
                g_up: job.g_up,
                o_proj: job.o_proj,
                inputs_out: job.inputs_out.as_deref_mut(),
                then: None,
            };
            kda_step_cpu(&mut twin).expect("host copies");
        }
        job.out.copy_from_slice(&out);
        for (seq, mut copies) in job.seqs.iter_mut().zip(here) {
            let bufs: [&mut StateBuf; 4] = {
                let [q, k, v] = &mut seq.conv;
                [&mut *seq.s, &mut **q, &mut **k, &mut **v]
            };
            for (b, c) in bufs.into_iter().zip(copies.iter_mut()) {
                map.insert(b.key(), c.host_mut().unwrap().clone());
                b.set_on_device();
            }
        }
        self.steps.fetch_add(1, Ordering::Relaxed);
        if job.proj.is_some() {
            self.projected.fetch_add(1, Ordering::Relaxed);
        }
        if self.fail_after_change.swap(false, Ordering::Relaxed) {
            return Err("failed after the launches".into());
        }
        Ok(true)
    }
    fn state_read(&self, key: StateKey, out: &mut [f32]) -> Result<(), String> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(LOST.into());
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        let map = self.states.lock().unwrap();
        let v = map.get(&key).ok_or("no copy")?;
        out.copy_from_slice(v);
        Ok(())
    }
    fn state_copy(&self, src: StateKey, dst: StateKey) -> Result<(), String> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(LOST.into());
        }
        self.copies.fetch_add(1, Ordering::Relaxed);
        let mut map = self.states.lock().unwrap();
        let v = map.get(&src).ok_or("no copy")?.clone();
        map.insert(dst, v);
        Ok(())
    }
    fn forget(&self, range: Range<usize>) {
        self.states
            .lock()
            .unwrap()
            .retain(|k, _| !range.contains(&k.0));
    }
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}

fn k3_tiny() -> K3Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
    K3Model::load(&dir).expect("k3-tiny loads")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits' bits of a script over two sequences that exercises every
/// state operation; with `mirror` installed while it runs.
fn script(model: &dyn CausalLm, mirror: Option<Arc<Mirror>>) -> Vec<Vec<u32>> {
    match mirror {
        Some(m) => backend::install(m),
        None => drop(backend::uninstall()),
    }
    let mut out = Vec::new();
    let mut a = model.new_state();
    let mut b = model.new_state();
    // A batched prefill of two sequences of different lengths.
    let logits = {
        let mut batch = [
            StepInput {
                state: a.as_mut(),
                tokens: &[1, 20, 300, 7],
                logits: Logits::Last,
            },
            StepInput {
                state: b.as_mut(),
                tokens: &[5, 6],
                logits: Logits::All,
            },
        ];
        model.step(&mut batch).unwrap()
    };
    out.extend(logits.iter().map(|l| bits(l)));
    let snap = a.snapshot();
    for tok in [3u32, 1] {
        out.push(bits(
            &model.forward(a.as_mut(), &[tok], Logits::Last).unwrap(),
        ));
    }
    // Back to the snapshot, and the same tokens again.
    a.restore(snap.as_ref()).unwrap();
    for tok in [3u32, 1] {
        out.push(bits(
            &model.forward(a.as_mut(), &[tok], Logits::Last).unwrap(),
        ));
    }
    // A fork goes its own way.
    let mut c = a.fork();
    out.push(bits(
        &model.forward(c.as_mut(), &[9], Logits::Last).unwrap(),
    ));
    out.push(bits(
        &model.forward(a.as_mut(), &[4], Logits::Last).unwrap(),
    ));
    // A speculative pass of three, of which one is kept.
    b.begin_pass();
    out.push(bits(
        &model.forward(b.as_mut(), &[8, 2, 11], Logits::All).unwrap(),
    ));
    b.keep(1).unwrap();
    out.push(bits(
        &model.forward(b.as_mut(), &[12], Logits::Last).unwrap(),
    ));
    // An encoded state, decoded and continued.
    let bytes = a.encode().unwrap();
    out.push(
        bytes
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
            .collect(),
    );
    let mut d = model.decode_state(&bytes).unwrap();
    out.push(bits(
        &model.forward(d.as_mut(), &[7], Logits::Last).unwrap(),
    ));
    out.push(bits(
        &model.forward(a.as_mut(), &[7], Logits::Last).unwrap(),
    ));
    // Dropped while the backend is installed, so their copies go too.
    drop((a, b, c, d, snap));
    backend::uninstall();
    out
}

#[test]
fn states_kept_on_a_device_give_the_same_bits() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let model = k3_tiny();
    let plain = script(&model, None);
    let mirror = Arc::new(Mirror::default());
    let kept = script(&model, Some(mirror.clone()));
    assert_eq!(plain.len(), kept.len());
    for (i, (p, k)) in plain.iter().zip(&kept).enumerate() {
        assert!(
            p == k,
            "entry {i} of the script differs with the states on the device"
        );
    }
    let (steps, reads, copies) = (
        mirror.steps.load(Ordering::Relaxed),
        mirror.reads.load(Ordering::Relaxed),
        mirror.copies.load(Ordering::Relaxed),
    );
    // Every KDA step ran there, the speculative pass included (its journal
    // gets the delta-rule inputs back); those without a journal carried
    // their input projections, the journaling ones did not.
    assert!(steps > 10, "{steps} steps on the device");
    let projected = mirror.projected.load(Ordering::Relaxed);
    assert!(
        projected > 0 && projected < steps,
        "{projected} of {steps} steps carried their projections"
    );
    // Snapshots, undo marks and forks copied there; the journal, the
    // encoding and the dropped states read back.
    assert!(copies > 0 && reads > 0, "copies {copies}, reads {reads}");
    // Every copy was dropped with its state.
    assert!(
        mirror.states.lock().unwrap().is_empty(),
        "device copies outlived their states"
    );
}

#[test]
fn a_device_failing_after_changing_the_states_fails_the_step_and_changes_nothing() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let k3 = k3_tiny();
    let model: &dyn CausalLm = &k3;
    drop(backend::uninstall());
    let mut s = model.new_state();
    model
        .forward(s.as_mut(), &[1, 20, 300], Logits::Last)
        .unwrap();
    let want = bits(&model.forward(s.as_mut(), &[7], Logits::Last).unwrap());
    let mirror = Arc::new(Mirror::default());
    backend::install(mirror.clone());
    let mut s = model.new_state();
    model
        .forward(s.as_mut(), &[1, 20, 300], Logits::Last)
        .unwrap();
    mirror.fail_after_change.store(true, Ordering::Relaxed);
    let err = model.forward(s.as_mut(), &[7], Logits::Last).unwrap_err();
    assert!(
        err.to_string().contains("failed after the launches"),
        "{err}"
    );
    // The failed step was undone: the same token again gives the plain bits.
    let got = bits(&model.forward(s.as_mut(), &[7], Logits::Last).unwrap());
    drop(s);
    backend::uninstall();
    assert!(
        got == want,
        "a failed device step left a trace in the state"
    );
}

/// A fork or snapshot of a state whose device is gone does not panic: its
/// buffers are marked lost, and a step from it fails naming the cause,
/// on the device or (with no backend left) on the CPU.
#[test]
fn copies_of_a_state_on_a_lost_device_fail_their_steps_without_a_panic() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let k3 = k3_tiny();
    let model: &dyn CausalLm = &k3;
    let mirror = Arc::new(Mirror::default());
    backend::install(mirror.clone());
    let mut s = model.new_state();
    model
        .forward(s.as_mut(), &[1, 20, 300], Logits::Last)
        .unwrap();
    mirror.lost.store(true, Ordering::Relaxed);
    let mut fork = s.fork();
    let snap = s.snapshot();
    let err = model
        .forward(fork.as_mut(), &[7], Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains(LOST), "{err}");
    backend::uninstall();
    let err = model
        .forward(fork.as_mut(), &[7], Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains(LOST), "on the CPU: {err}");
    // Putting the snapshot back fails the same way.
    let err = s.restore(snap.as_ref()).unwrap_err();
    assert!(err.to_string().contains(LOST), "from the snapshot: {err}");
}

#[test]
fn a_declining_backend_leaves_the_states_on_the_host() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let k3 = k3_tiny();
    let model: &dyn CausalLm = &k3;
    struct Declines;
    impl DeviceBackend for Declines {
        fn name(&self) -> String {
            "declines".into()
        }
        fn matmul(&self, _: &MatRef<'_>, _: Role, _: &[f32], _: usize, _: &mut [f32]) -> bool {
            false
        }
        fn forget(&self, _: Range<usize>) {}
        fn stats(&self) -> BackendStats {
            BackendStats::default()
        }
    }
    backend::install(Arc::new(Declines));
    let mut s = model.new_state();
    let with = model.forward(s.as_mut(), &[1, 2, 3], Logits::Last).unwrap();
    backend::uninstall();
    // With no backend left, only states whose copies are on the host encode.
    s.encode().expect("the states stayed on the host");
    let mut s = model.new_state();
    let without = model.forward(s.as_mut(), &[1, 2, 3], Logits::Last).unwrap();
    assert_eq!(bits(&with), bits(&without));
}
