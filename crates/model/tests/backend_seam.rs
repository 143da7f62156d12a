//! The backend seam's batches, with a backend that computes on the CPU
//! kernels and records what it is handed: a model gives the same logits
//! bit for bit with no backend, with one that takes batches (a layer's
//! projections of one input together, a MoE layer's experts as two
//! grouped calls) and with one that declines them (every product alone).
//! So the grouping only changes how many calls are made, never which
//! input reaches which product or where its result lands.
//!
//! The backend is process-wide, so the tests of this binary take turns.

mod common;

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fathom_kernels::backend::{
    self, BackendStats, DeviceBackend, GluProduct, GqaWork, Hints, MatRef, MlaWork, Product, Role,
    Then, gqa_work_cpu, mla_work_cpu, then_cpu,
};
use fathom_kernels::kda::{KdaJob, kda_step_cpu};
use fathom_kernels::ops::GluAct;
use fathom_model::{CausalLm, K3Model, Logits, Qwen3MoeModel};

static TURN: Mutex<()> = Mutex::new(());

/// Computes every product on the CPU kernels; counts single products and
/// records each batch's size and role; declines batches when told to.
#[derive(Default)]
struct Recorder {
    decline_batches: bool,
    /// What [`Backend::experts_crowded`] answers.
    crowded: bool,
    /// Whether it lacks every matrix ([`Backend::missing_bytes`] says all,
    /// and it reports a host→device rate, so cold experts may go to the
    /// CPU).
    cold: bool,
    singles: AtomicUsize,
    /// (products, role, matrices handed ahead as `next`) of each batch.
    batches: Mutex<Vec<(usize, Role, usize)>>,
    expert_mats: Mutex<Vec<ExpertBatch>>,
    /// Matrices reported computed elsewhere, and how many of the hints
    /// came without products.
    elsewhere: AtomicUsize,
    alone: AtomicUsize,
    /// Whether it takes gated MLPs whole ([`Backend::glu_batch`]), and
    /// (MLPs, role, activation) of each it took.
    takes_glu: bool,
    glus: Mutex<Vec<(usize, Role, GluAct)>>,
    /// Whether it takes plain products beside gated MLPs
    /// ([`Backend::glu_mixed`]), and (products, MLPs) of each it took.
    takes_mixed: bool,
    mixed: Mutex<Vec<(usize, usize)>>,
    /// Whether it takes KDA steps and MLA attention with the layer's rest
    /// (`Then`), and (rows, earlier blocks, query?, plain products, gated
    /// MLPs) of each rest it did.
    takes_rest: bool,
    rests: Mutex<Vec<(usize, usize, bool, usize, usize)>>,
    /// MLA calls taken with and without the layer's projections.
    mla_calls: Mutex<(usize, usize)>,
    /// Grouped-query attention layers taken whole.
    gqa_calls: AtomicUsize,
}

impl Recorder {
    /// Does `then` on the CPU from the attention's output `a`, recorded.
    fn rest(&self, then: Option<&mut Then<'_>>, a: &[f32]) {
        if let Some(t) = then {
            let seen = (t.rows(), t.blocks.len(), t.query.is_some());
            self.rests
                .lock()
                .unwrap()
                .push((seen.0, seen.1, seen.2, t.plain.len(), t.glu.len()));
            then_cpu(t, a);
            t.done = true;
        }
    }
}

/// An expert batch's matrices (first byte's address), those handed ahead
/// and those guessed, in order.
struct ExpertBatch {
    mats: Vec<usize>,
    ahead: Vec<usize>,
    guessed: Vec<usize>,
}

fn addr(w: &MatRef<'_>) -> usize {
    backend::segments(w)[0].as_ptr() as usize
}

impl DeviceBackend for Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    fn matmul(&self, w: &MatRef<'_>, _: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        self.singles.fetch_add(1, Ordering::Relaxed);
        w.cpu(x, t, y);
        true
    }
    fn matmul_batch(&self, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) -> bool {
        if self.decline_batches {
            return false;
        }
        let (ahead, guessed) = (hints.next, hints.guessed);
        self.elsewhere
            .fetch_add(hints.elsewhere.len(), Ordering::Relaxed);
        let role = products[0].role;
        assert!(
            products.iter().all(|p| p.role == role),
            "one role per batch"
        );
        self.batches
            .lock()
            .unwrap()
            .push((products.len(), role, ahead.len()));
        if role == Role::Expert {
            let mats = products.iter().map(|p| addr(&p.w)).collect();
            let ahead = ahead.iter().map(addr).collect();
            let guessed = guessed.iter().map(addr).collect();
            self.expert_mats.lock().unwrap().push(ExpertBatch {
                mats,
                ahead,
                guessed,
            });
        } else {
            assert!(guessed.is_empty(), "only experts are guessed");
        }
        for p in products {
            p.w.cpu(p.x, p.t, p.y);
        }
        true
    }
    fn glu_batch(&self, jobs: &mut [GluProduct<'_, '_>], act: GluAct, _: &Hints<'_, '_>) -> bool {
        if !self.takes_glu {
            return false;
        }
        let role = jobs[0].role;
        self.glus.lock().unwrap().push((jobs.len(), role, act));
        for j in jobs {
            let f = j.gate.rows();
            let (mut g, mut u) = (vec![0f32; j.t * f], vec![0f32; j.t * f]);
            j.gate.cpu(j.x, j.t, &mut g);
            j.up.cpu(j.x, j.t, &mut u);
            act.apply(&mut g, &u);
            j.down.cpu(&g, j.t, j.y);
        }
        true
    }
    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        _: &Hints<'_, '_>,
    ) -> bool {
        if !self.takes_mixed {
            return false;
        }
        self.mixed.lock().unwrap().push((plain.len(), jobs.len()));
        for p in plain {
            p.w.cpu(p.x, p.t, p.y);
        }
        backend::glu_steps_on(None, jobs, act, &Hints::default());
        true
    }
    fn hint(&self, hints: &Hints<'_, '_>) {
        self.alone.fetch_add(1, Ordering::Relaxed);
        self.elsewhere
            .fetch_add(hints.elsewhere.len(), Ordering::Relaxed);
    }
    fn experts_crowded(&self) -> bool {
        self.crowded
    }
    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        let all = |w: &MatRef<'_>| backend::segments(w).iter().map(|s| s.len()).sum();
        ws.iter()
            .map(|w| if self.cold { all(w) } else { 0 })
            .collect()
    }
    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        if !self.takes_rest {
            return Ok(false);
        }
        kda_step_cpu(job).map_err(|e| e.to_string())?;
        let a = job.out.to_vec();
        self.rest(job.then.as_mut(), &a);
        Ok(true)
    }
    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        if !self.takes_rest {
            return false;
        }
        {
            let mut c = self.mla_calls.lock().unwrap();
            *(if work.proj.is_some() {
                &mut c.0
            } else {
                &mut c.1
            }) += 1;
        }
        mla_work_cpu(work);
        let a = work.out.to_vec();
        self.rest(work.then.as_mut(), &a);
        true
    }
    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool {
        if !self.takes_rest {
            return false;
        }
        self.gqa_calls.fetch_add(1, Ordering::Relaxed);
        gqa_work_cpu(work);
        let a = work.out.to_vec();
        self.rest(work.then.as_mut(), &a);
        true
    }
    fn forget(&self, _: Range<usize>) {}
    fn stats(&self) -> BackendStats {
        BackendStats {
            // So slow that, once the CPU's rate is measured, every cold
            // expert goes there; before, half of them.
            h2d_bytes_per_s: if self.cold { 1.0 } else { 0.0 },
            ..BackendStats::default()
        }
    }
}

/// Prefill logits of every position, then three decode steps' logits.
fn run(model: &dyn CausalLm, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut st = model.new_state();
    let mut out = vec![model.forward(st.as_mut(), prompt, Logits::All).unwrap()];
    for tok in [3u32, 1, 4] {
        out.push(model.forward(st.as_mut(), &[tok], Logits::Last).unwrap());
    }
    out
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The logits' bits of [`run`] with `rec` installed (none: no backend);
/// the caller holds [`TURN`].
fn bits_with(model: &dyn CausalLm, prompt: &[u32], rec: Option<Arc<Recorder>>) -> Vec<Vec<u32>> {
    match rec {
        Some(r) => backend::install(r),
        None => drop(backend::uninstall()),
    }
    let out = bits(&run(model, prompt));
    backend::uninstall();
    out
}

fn k3_tiny() -> K3Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
    K3Model::load(&dir).expect("k3-tiny loads")
}

/// The runs with no backend, a batching recorder and a declining one;
/// returns the batching recorder's record.
fn same_bits_every_way(model: &dyn CausalLm, prompt: &[u32]) -> Arc<Recorder> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let plain = bits_with(model, prompt, None);
    let takes = Arc::new(Recorder::default());
    let batched = bits_with(model, prompt, Some(takes.clone()));
    let declines = Arc::new(Recorder {
        decline_batches: true,
        ..Recorder::default()
    });
    let one_by_one = bits_with(model, prompt, Some(declines.clone()));
    assert!(plain == batched, "batched products changed the logits");
    assert!(plain == one_by_one, "declined batches changed the logits");
    assert!(
        declines.singles.load(Ordering::Relaxed) > takes.singles.load(Ordering::Relaxed),
        "a declined batch's products come one by one"
    );
    takes
}

#[test]
fn k3_projections_and_experts_batch_with_the_same_bits() {
    let model = k3_tiny();
    let rec = same_bits_every_way(&model, &[1, 20, 300, 7, 42, 5]);
    let batches = rec.batches.lock().unwrap();
    // KDA layers: q, k, v, f_a, b, g of one input in one call.
    assert!(batches.contains(&(6, Role::Spine, 0)), "{batches:?}");
    // MLA: q_a, kv_a, g; dense MLP and shared experts: gate, up.
    assert!(batches.contains(&(3, Role::Spine, 0)), "{batches:?}");
    assert!(batches.contains(&(2, Role::Spine, 0)), "{batches:?}");
    // A decode step's experts: gate and up of each of the top-k (their
    // downs handed ahead), then the downs.
    let k = model.spec.top_k;
    assert!(batches.contains(&(2 * k, Role::Expert, k)), "{batches:?}");
    assert!(batches.contains(&(k, Role::Expert, 0)), "{batches:?}");
}

/// A backend that takes gated MLPs whole gets K3's dense MLP and shared
/// experts as one MLP each and a step's routed experts as one call, with
/// SiTU's parameters, and the logits keep their bits.
#[test]
fn k3_gated_mlps_in_one_call_keep_the_bits() {
    let model = k3_tiny();
    let prompt = [1, 20, 300, 7, 42, 5];
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let plain = bits_with(&model, &prompt, None);
    let rec = Arc::new(Recorder {
        takes_glu: true,
        ..Recorder::default()
    });
    assert!(plain == bits_with(&model, &prompt, Some(rec.clone())));
    let glus = rec.glus.lock().unwrap();
    let situ = GluAct::Situ {
        beta: model.spec.situ_beta,
        beta_lin: model.spec.situ_linear_beta,
    };
    assert!(glus.iter().all(|g| g.2 == situ), "{glus:?}");
    assert!(glus.contains(&(1, Role::Spine, situ)), "{glus:?}");
    assert!(
        glus.contains(&(model.spec.top_k, Role::Expert, situ)),
        "{glus:?}"
    );
    // No gate/up pairs went as plain batches.
    let batches = rec.batches.lock().unwrap();
    assert!(!batches.iter().any(|b| b.1 == Role::Expert), "{batches:?}");
}

/// A backend that takes plain products beside gated MLPs gets, per MoE
/// layer and step, the router and the latent down-projection beside the
/// shared experts in one call; the logits keep their bits.
#[test]
fn k3_router_latent_and_shared_experts_in_one_call_keep_the_bits() {
    let model = k3_tiny();
    let prompt = [1, 20, 300, 7, 42, 5];
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let plain = bits_with(&model, &prompt, None);
    let rec = Arc::new(Recorder {
        takes_mixed: true,
        ..Recorder::default()
    });
    assert!(plain == bits_with(&model, &prompt, Some(rec.clone())));
    let mixed = rec.mixed.lock().unwrap();
    let moe_layers = model.spec.num_layers - model.spec.first_k_dense_replace;
    // The prefill and three decode steps.
    assert_eq!(*mixed, vec![(2, 1); 4 * moe_layers], "{mixed:?}");
}

/// A backend that takes a layer's attention with the rest of the layer up
/// to its experts' choice (`Then`) gets it on every K3 layer (the depth
/// mix's blocks and query; a MoE layer's router and latent projection
/// beside its shared experts, a dense layer's MLP), on every DeepSeek-V3
/// layer and every Kimi-Linear layer, KDA (its projections and low-rank
/// gate in the step's call) and MLA alike (no blocks or query; the router
/// and shared experts), and the logits keep their bits.
#[test]
fn a_layers_rest_in_its_attentions_call_keeps_the_bits() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = [1, 20, 300, 7, 42, 5];
    let k3 = k3_tiny();
    let load = |name: &str| {
        fathom_model::registry::load(&common::data(name), Default::default()).expect("loads")
    };
    let (deepseek, kimi_linear) = (load("deepseek_v3-tiny"), load("kimi_linear-tiny"));
    for (name, model) in [
        ("k3", &k3 as &dyn CausalLm),
        ("deepseek_v3", deepseek.as_ref()),
        ("kimi_linear", kimi_linear.as_ref()),
    ] {
        let plain = bits_with(model, &prompt, None);
        let rec = Arc::new(Recorder {
            takes_rest: true,
            ..Recorder::default()
        });
        assert!(
            plain == bits_with(model, &prompt, Some(rec.clone())),
            "{name}: the rest in the attention's call changed the logits"
        );
        let rests = rec.rests.lock().unwrap();
        let layers = model.info().num_layers;
        // Every layer of the prefill (6 rows) and three decode steps.
        assert_eq!(rests.len(), 4 * layers, "{name}: {rests:?}");
        // Every MLA layer's call carried its projections (one round trip).
        let (projected, plain) = *rec.mla_calls.lock().unwrap();
        assert!(
            projected > 0 && plain == 0,
            "{name}: {projected} projected MLA calls, {plain} plain"
        );
        assert!(
            rests[..layers].iter().all(|r| r.0 == 6),
            "{name}: {rests:?}"
        );
        if name == "k3" {
            assert!(rests.iter().all(|r| r.1 >= 1 && r.2), "{rests:?}");
            // Dense: one gated MLP; MoE: router and latent beside the shared experts.
            assert!(rests.contains(&(1, 1, true, 0, 1)), "{rests:?}");
            assert!(rests.iter().any(|r| (r.3, r.4) == (2, 1)), "{rests:?}");
        } else {
            assert!(rests.iter().all(|r| r.1 == 0 && !r.2), "{name}: {rests:?}");
            assert!(
                rests.iter().any(|r| (r.3, r.4) == (1, 1)),
                "{name}: {rests:?}"
            );
        }
    }
}

/// Qwen3-MoE's and GPT-OSS's attention layers whole in one call each (the
/// twin of a device's `gqa_attend`: projections, norms, rotary step, the
/// cache's new rows, window and sinks, `o_proj`) with the rest of the layer
/// up to its experts' choice (`Then`): the same bits as the host.
#[test]
fn gqa_layers_in_one_call_keep_the_bits() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = [1, 20, 300, 7, 42, 5];
    for name in ["qwen3_moe-tiny", "gpt_oss-tiny"] {
        let model =
            fathom_model::registry::load(&common::data(name), Default::default()).expect("loads");
        let plain = bits_with(model.as_ref(), &prompt, None);
        let rec = Arc::new(Recorder {
            takes_rest: true,
            ..Recorder::default()
        });
        assert!(
            plain == bits_with(model.as_ref(), &prompt, Some(rec.clone())),
            "{name}: the layer in one call changed the logits"
        );
        // Every layer of the prefill and three decode steps, each with the
        // rest of its layer up to the experts' choice (the router's
        // product; a dense layer's MLP).
        let layers = model.info().num_layers;
        assert_eq!(rec.gqa_calls.load(Ordering::Relaxed), 4 * layers, "{name}");
        let rests = rec.rests.lock().unwrap();
        assert_eq!(rests.len(), 4 * layers, "{name}: {rests:?}");
        assert!(
            rests.iter().any(|r| (r.3, r.4) == (1, 0)),
            "{name}: {rests:?}"
        );
    }
}

#[test]
fn qwen3_moe_experts_batch_with_the_same_bits() {
    let model = Qwen3MoeModel::load(&common::data("qwen3_moe-tiny")).expect("loads");
    let rec = same_bits_every_way(&model, &[1, 20, 300, 7, 42, 5]);
    let batches = rec.batches.lock().unwrap();
    assert!(
        batches
            .iter()
            .any(|&(n, r, ahead)| r == Role::Expert && n > 2 && 2 * ahead == n),
        "{batches:?}"
    );
}

/// The sigmoid-routed families (Kimi-Linear: KDA and MLA layers; DeepSeek-V3)
/// batch their experts through the same seam, with the same bits.
#[test]
fn kimi_linear_and_deepseek_experts_batch_with_the_same_bits() {
    for name in ["kimi_linear-tiny", "deepseek_v3-tiny"] {
        let model = fathom_model::registry::load(&common::data(name), Default::default())
            .unwrap_or_else(|e| panic!("{name} loads: {e}"));
        let rec = same_bits_every_way(model.as_ref(), &[1, 20, 300, 7, 42, 5]);
        let batches = rec.batches.lock().unwrap();
        assert!(
            batches
                .iter()
                .any(|&(n, r, ahead)| r == Role::Expert && n > 2 && 2 * ahead == n),
            "{name}: {batches:?}"
        );
        if name.starts_with("kimi_linear") {
            // KDA's q, k, v, f_a, b, g_a; MLA's q and kv_a.
            assert!(batches.contains(&(6, Role::Spine, 0)), "{batches:?}");
            assert!(batches.contains(&(2, Role::Spine, 0)), "{batches:?}");
        }
    }
}

/// A device that wants guesses is handed, beside a MoE layer's downs, the
/// gate and up matrices of the next layer's guessed experts; the logits
/// stay bit-identical (a guess only moves copies), and a right guess's
/// matrices are products of a later batch.
#[test]
fn guessed_next_experts_are_handed_ahead_with_the_same_bits() {
    let model = k3_tiny();
    let prompt = [1, 20, 300, 7, 42, 5];
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let plain = bits_with(&model, &prompt, None);
    let guessing = Arc::new(Recorder {
        crowded: true,
        ..Recorder::default()
    });
    let guessed = bits_with(&model, &prompt, Some(guessing.clone()));
    assert!(plain == guessed, "guesses changed the logits");
    let k = model.spec.top_k;
    let mats = guessing.expert_mats.lock().unwrap();
    // Decode steps: k downs ahead, 2k guessed matrices (each MoE layer but
    // the last guesses the next one's top k, all in RAM here).
    let with_guesses: Vec<usize> = (0..mats.len())
        .filter(|&i| mats[i].mats.len() == 2 * k && mats[i].guessed.len() == 2 * k)
        .collect();
    let moe_layers = model.spec.moe_layers().count();
    assert_eq!(with_guesses.len(), 3 * (moe_layers - 1), "3 decode steps");
    let mut right = 0;
    for &i in &with_guesses {
        let ExpertBatch {
            mats: own,
            ahead: downs,
            guessed,
        } = &mats[i];
        assert_eq!(downs.len(), k);
        let next_batch = &mats[i + 2].mats;
        assert!(
            downs.iter().all(|d| mats[i + 1].mats.contains(d)),
            "the downs handed ahead are the next batch's"
        );
        // Each guess is an expert's gate and up, as the next layer's batch
        // lists an expert it does use.
        for pair in guessed.chunks(2) {
            assert!(!own.contains(&pair[0]), "a guess is another layer's matrix");
            match next_batch.iter().position(|m| *m == pair[0]) {
                Some(p) => {
                    assert_eq!(
                        next_batch[p + 1],
                        pair[1],
                        "a right guess's up follows its gate"
                    );
                    right += 1;
                }
                None => assert!(
                    !next_batch.contains(&pair[1]),
                    "a gate and up of one expert"
                ),
            }
        }
    }
    assert!(right > 0, "no guess was ever right");
}

/// A device that lacks the experts' weights computes part of a layer's
/// experts while the CPU computes the rest (split by the measured rates),
/// and is handed the CPU's ones to copy while it has room: the logits stay
/// bit-identical.
#[test]
fn cold_experts_split_between_cpu_and_device_with_the_same_bits() {
    let model = k3_tiny();
    let prompt = [1, 20, 300, 7, 42, 5];
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let plain = bits_with(&model, &prompt, None);
    let warm = Arc::new(Recorder::default());
    assert!(plain == bits_with(&model, &prompt, Some(warm.clone())));
    let cold = Arc::new(Recorder {
        cold: true,
        ..Recorder::default()
    });
    let split = bits_with(&model, &prompt, Some(cold.clone()));
    assert!(
        plain == split,
        "computing cold experts on the CPU changed the logits"
    );
    let experts = |r: &Recorder| -> usize {
        let b = r.batches.lock().unwrap();
        b.iter().filter(|x| x.1 == Role::Expert).map(|x| x.0).sum()
    };
    let (all, some) = (experts(&warm), experts(&cold));
    // The first layer splits its cold experts (rates equal before the
    // CPU's is measured), later ones send them all to the CPU; every
    // expert product the device did not compute was reported to it.
    let elsewhere = cold.elsewhere.load(Ordering::Relaxed);
    assert!(0 < some && some < all, "device products: {some} of {all}");
    assert_eq!(some + elsewhere, all, "each expert product on one side");
    assert!(
        cold.alone.load(Ordering::Relaxed) > 0,
        "a layer with every expert on the CPU still tells the device"
    );
}
