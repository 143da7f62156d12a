//! Several devices behind one backend (`fathom_kernels::multi`): with
//! three stand-in devices that compute on the CPU kernels — one taking
//! gated MLPs whole, one taking only plain batches, one declining batches
//! — a model gives the logits of no backend bit for bit; the spine and the
//! KDA core stay on the first device, every routed-expert matrix is
//! computed on one device only, and the experts spread over all three.
//! The stand-ins lack every matrix and report a fast host→device rate, so
//! each layer first asks which bytes are missing (placing its new
//! experts) before computing them.
//!
//! The backend is process-wide, so the tests of this binary take turns.

mod common;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fathom_kernels::backend::{
    self, Backend, BackendStats, DeviceBackend, GluProduct, Hints, MatRef, MoeTail, Product, Role,
    moe_tail_cpu,
};
use fathom_kernels::kda::KdaJob;
use fathom_kernels::multi::MultiBackend;
use fathom_kernels::ops::GluAct;
use fathom_model::{CausalLm, K3Model, Logits, Qwen3MoeModel};

static TURN: Mutex<()> = Mutex::new(());

/// How a stand-in device answers.
#[derive(Clone, Copy, PartialEq)]
enum Takes {
    /// Gated MLPs whole and plain batches.
    Glu,
    /// Plain batches; gated MLPs in steps.
    Batches,
    /// Single products only.
    Singles,
}

/// Computes on the CPU kernels; records the matrices (first byte's
/// address) and roles it computed.
struct Device {
    takes: Takes,
    seen: Mutex<Vec<(usize, Role)>>,
    /// KDA steps offered (declined: the CPU runs them).
    kda: AtomicUsize,
    /// Matrices handed to copy up next (`Hints::next`).
    hinted: Mutex<Vec<usize>>,
    /// MoE tails taken.
    tails: AtomicUsize,
}

impl Device {
    fn new(takes: Takes) -> Arc<Device> {
        Arc::new(Device {
            takes,
            seen: Mutex::new(Vec::new()),
            kda: AtomicUsize::new(0),
            hinted: Mutex::new(Vec::new()),
            tails: AtomicUsize::new(0),
        })
    }
    fn saw(&self, w: &MatRef<'_>, role: Role) {
        let a = backend::segments(w)[0].as_ptr() as usize;
        self.seen.lock().unwrap().push((a, role));
    }
}

impl DeviceBackend for Device {
    fn name(&self) -> String {
        "stand-in".into()
    }
    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        self.saw(w, role);
        w.cpu(x, t, y);
        true
    }
    fn matmul_batch(&self, ps: &mut [Product<'_, '_>], _: &Hints<'_, '_>) -> bool {
        if self.takes == Takes::Singles {
            return false;
        }
        for p in ps {
            self.saw(&p.w, p.role);
            p.w.cpu(p.x, p.t, p.y);
        }
        true
    }
    fn glu_batch(&self, jobs: &mut [GluProduct<'_, '_>], act: GluAct, _: &Hints<'_, '_>) -> bool {
        if self.takes != Takes::Glu {
            return false;
        }
        for j in jobs {
            let f = j.gate.rows();
            let (mut g, mut u) = (vec![0f32; j.t * f], vec![0f32; j.t * f]);
            for (w, y) in [(&j.gate, &mut g), (&j.up, &mut u)] {
                self.saw(w, j.role);
                w.cpu(j.x, j.t, y);
            }
            act.apply(&mut g, &u);
            self.saw(&j.down, j.role);
            j.down.cpu(&g, j.t, j.y);
        }
        true
    }
    /// A MoE tail on the CPU twin (gated-MLP devices only), its matrices
    /// recorded: the experts', and the up-projection's as the spine.
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, _: &Hints<'_, '_>) -> bool {
        if self.takes != Takes::Glu {
            return false;
        }
        for e in tail.experts {
            for w in [&e.gate, &e.up, &e.down] {
                self.saw(w, Role::Expert);
            }
        }
        if let Some(up) = &tail.up {
            self.saw(up, Role::Spine);
        }
        moe_tail_cpu(tail);
        self.tails.fetch_add(1, Ordering::Relaxed);
        true
    }
    fn kda_step(&self, _: &mut KdaJob<'_>) -> Result<bool, String> {
        self.kda.fetch_add(1, Ordering::Relaxed);
        Ok(false)
    }
    fn hint(&self, h: &Hints<'_, '_>) {
        let first = |w: &MatRef<'_>| backend::segments(w)[0].as_ptr() as usize;
        self.hinted.lock().unwrap().extend(h.next.iter().map(first));
    }
    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        let all = |w: &MatRef<'_>| backend::segments(w).iter().map(|s| s.len()).sum();
        ws.iter().map(all).collect()
    }
    fn forget(&self, _: Range<usize>) {}
    fn stats(&self) -> BackendStats {
        BackendStats {
            device_products: self.seen.lock().unwrap().len() as u64,
            // Fast enough that a missing expert is always copied, not
            // computed on the CPU.
            h2d_bytes_per_s: 1e18,
            ..BackendStats::default()
        }
    }
}

/// Prefill logits of every position, then three decode steps' logits, as bits.
fn run(model: &dyn CausalLm, prompt: &[u32]) -> Vec<Vec<u32>> {
    let mut st = model.new_state();
    let mut out = vec![model.forward(st.as_mut(), prompt, Logits::All).unwrap()];
    for tok in [3u32, 1, 4] {
        out.push(model.forward(st.as_mut(), &[tok], Logits::Last).unwrap());
    }
    out.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Three stand-ins (gated MLPs whole, plain batches, single products)
/// behind one `MultiBackend`.
fn three_devices() -> (Vec<Arc<Device>>, Arc<MultiBackend>) {
    let devs = vec![
        Device::new(Takes::Glu),
        Device::new(Takes::Batches),
        Device::new(Takes::Singles),
    ];
    let as_backends: Vec<Arc<dyn Backend>> =
        devs.iter().map(|d| d.clone() as Arc<dyn Backend>).collect();
    let multi = Arc::new(MultiBackend::new(as_backends).expect("three devices"));
    (devs, multi)
}

/// The run with no backend and with three stand-ins behind a
/// `MultiBackend`; checks the bits, and returns the devices and the backend.
fn split_three_ways(model: &dyn CausalLm, prompt: &[u32]) -> (Vec<Arc<Device>>, Arc<MultiBackend>) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    backend::uninstall();
    let plain = run(model, prompt);
    let (devs, multi) = three_devices();
    backend::install(multi.clone());
    let split = run(model, prompt);
    backend::uninstall();
    assert!(
        plain == split,
        "the split over three devices changed the logits"
    );
    (devs, multi)
}

/// Every routed-expert matrix on one device only, the spine on the first,
/// and experts on every device; returns the experts per device.
fn check_partition(devs: &[Arc<Device>], multi: &MultiBackend) -> Vec<usize> {
    let mut where_: HashMap<usize, HashSet<usize>> = HashMap::new();
    let mut per = vec![HashSet::new(); devs.len()];
    for (d, dev) in devs.iter().enumerate() {
        for &(a, role) in dev.seen.lock().unwrap().iter() {
            match role {
                Role::Spine => assert_eq!(d, 0, "a spine product on device {d}"),
                Role::Expert => {
                    where_.entry(a).or_default().insert(d);
                    per[d].insert(a);
                }
            }
        }
    }
    assert!(
        where_.values().all(|s| s.len() == 1),
        "an expert matrix on two devices"
    );
    let counts: Vec<usize> = per.iter().map(|s| s.len()).collect();
    assert!(
        counts.iter().all(|&n| n > 0),
        "a device without experts: {counts:?}"
    );
    assert_eq!(multi.loads().len(), devs.len());
    counts
}

fn k3_tiny() -> K3Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
    K3Model::load(&dir).expect("k3-tiny loads")
}

#[test]
fn k3_experts_split_over_three_devices_keep_the_bits() {
    let model = k3_tiny();
    let (devs, multi) = split_three_ways(&model, &[1, 20, 300, 7, 42, 5]);
    let counts = check_partition(&devs, &multi);
    assert!(
        devs[0].kda.load(Ordering::Relaxed) > 0,
        "KDA steps reach the first device"
    );
    assert!(devs[1..].iter().all(|d| d.kda.load(Ordering::Relaxed) == 0));
    // A layer's experts run on several devices at once (not all the new
    // experts of a layer placed on one device).
    let (batches, parts) = multi.spread();
    assert!(
        parts as f64 >= 1.8 * batches as f64,
        "{parts} parts in {batches} batches"
    );
    // The balance goes by bytes read: no device reads more than twice
    // another's share of the experts' bytes.
    let loads = multi.loads();
    let (lo, hi) = loads
        .iter()
        .fold((f64::MAX, 0f64), |(a, b), &l| (a.min(l), b.max(l)));
    assert!(hi <= 2.0 * lo, "loads {loads:?} (matrices {counts:?})");
    // Every MoE layer's tail offered: whole to the owner of its experts
    // (taken there only by the gated-MLP device) or, split over devices,
    // declined and counted.
    let (whole, split) = multi.tails();
    let taken = devs[0].tails.load(Ordering::Relaxed);
    eprintln!("MoE tails: {whole} whole ({taken} taken), {split} split");
    assert!(split > 0, "a prefill's tail spans devices");
    assert!(whole > 0 && taken > 0, "{whole} whole, {taken} taken");
    assert!(
        devs[1..]
            .iter()
            .all(|d| d.tails.load(Ordering::Relaxed) == 0)
    );
}

#[test]
fn qwen3_moe_experts_split_over_three_devices_keep_the_bits() {
    let model = Qwen3MoeModel::load(&common::data("qwen3_moe-tiny")).expect("loads");
    let (devs, multi) = split_three_ways(&model, &[1, 20, 300, 7, 42, 5]);
    check_partition(&devs, &multi);
}

/// A resident model's experts handed over at load (`Backend::preload`):
/// each expert's matrices go to one device together (the gate's, as a
/// gated MLP's up and down follow it), every expert to one device, and the
/// experts spread over the devices.
#[test]
fn preloaded_experts_keep_each_experts_matrices_on_one_device() {
    let (devs, multi) = three_devices();
    let bytes: Vec<Vec<u16>> = (0..18u16).map(|i| vec![i; 64 * 32]).collect();
    let mats: Vec<MatRef<'_>> = bytes
        .iter()
        .map(|w| MatRef::Bf16 {
            w,
            rows: 64,
            cols: 32,
        })
        .collect();
    let experts: Vec<Vec<MatRef<'_>>> = mats.chunks(3).map(|c| c.to_vec()).collect();
    multi.preload(&experts);
    let holders = |w: &MatRef<'_>| -> Vec<usize> {
        let a = backend::segments(w)[0].as_ptr() as usize;
        (0..devs.len())
            .filter(|&d| devs[d].hinted.lock().unwrap().contains(&a))
            .collect()
    };
    for (e, group) in experts.iter().enumerate() {
        let first = holders(&group[0]);
        assert_eq!(first.len(), 1, "expert {e}'s gate on {first:?}");
        for w in &group[1..] {
            assert_eq!(holders(w), first, "expert {e}'s matrices apart");
        }
    }
    let used = devs.iter().filter(|d| !d.hinted.lock().unwrap().is_empty());
    assert_eq!(used.count(), 3, "six experts over three devices");
    assert_eq!(multi.owned(), vec![6, 6, 6]);
}
