//! What every routed-expert layer shares, whatever its router: the routing
//! decision, the next-layer hint order, and the union fetch.
//!
//! For a step's rows the union of the chosen experts is requested from the
//! [`ExpertSource`] once; the caller computes what does not need the
//! experts while they arrive, then each expert runs on all the rows routed
//! to it at once, and each row's outputs are summed in the router's rank
//! order, so a row's result does not depend on what else the step holds.

use std::sync::{Arc, OnceLock};

use fathom_kernels::backend::MatRef;
use fathom_kernels::ops::sigmoid;
use rayon::prelude::*;

use crate::batch::Path;
use crate::error::Result;
use crate::experts::{ExpertSlot, ExpertSource, ExpertTicket, ExpertWeights};
pub use crate::glu::GluExpert;
use crate::glu::{Grouped, TailAsk};

mod sigmoid_block;
pub use sigmoid_block::{SigmoidFirst, SigmoidMoe, SigmoidMoeWeights};

/// The early MLP side ([`crate::early`]) of the families whose MoE layers
/// are [`SigmoidMoe`]s or have a router alone (their products before the
/// experts are a [`SigmoidFirst`]).
pub type Early = crate::early::Early<SigmoidFirst>;
/// See [`Early`].
pub type Ahead = crate::early::Ahead<SigmoidFirst>;
/// See [`Early`].
pub type Ffn<'a> = crate::early::Ffn<'a, SigmoidFirst>;

/// The router's decision for one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Chosen experts, best first.
    pub ids: Vec<u32>,
    /// Their combine weights, in the same order.
    pub weights: Vec<f32>,
    /// Selection score of the k-th minus the (k+1)-th choice (tie diagnostics).
    pub margin: f32,
}

/// The experts a next-layer guess names, most confident first: every
/// position's best guess, then every position's second, … (a source may act
/// on a prefix only).
pub fn hint_order(guesses: &[Route], top_k: usize) -> Vec<u32> {
    let mut guess: Vec<u32> = Vec::with_capacity(guesses.len() * top_k);
    for rank in 0..top_k {
        for g in guesses {
            if !guess.contains(&g.ids[rank]) {
                guess.push(g.ids[rank]);
            }
        }
    }
    guess
}

/// The experts a MoE layer is guessed to use (its router applied to an
/// earlier layer's input), for the device to copy up ahead of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Guess {
    pub layer: usize,
    pub ids: Vec<u32>,
}

/// Guesses the next MoE layer's experts from this layer's input when
/// someone can use the guess: the source (it may read them ahead, see
/// [`ExpertSource::hint`]) or the device (it may copy them up ahead,
/// [`fathom_kernels::backend::experts_crowded`]). `route_next` routes the
/// input with the next layer's router; it runs only then. The device's
/// share is the `top_k` surest ids ([`hint_order`]); it goes to
/// [`ExpertFetch::with_guess`]. A guess never changes what is computed.
pub fn guess_next(
    source: &dyn ExpertSource,
    layer: usize,
    top_k: usize,
    route_next: impl FnOnce() -> Vec<Route>,
) -> Option<Guess> {
    let device = fathom_kernels::backend::experts_crowded();
    if !device && !source.wants_hints() {
        return None;
    }
    let mut ids = hint_order(&route_next(), top_k);
    source.hint(layer, &ids);
    ids.truncate(top_k);
    device.then_some(Guess { layer, ids })
}

/// Sigmoid routing with a selection bias ("noaux_tc", the Kimi and
/// DeepSeek-V3 routers), optionally group-limited:
///
/// ```text
/// s = σ(logits);  c = s + bias                       (c only chooses)
/// groups > 1: group score = sum of its two best c; keep the topk_group best
///             groups, c ← 0 outside them
/// T = top-k of c (ties to the lower index);  w_e = s_e
/// w = w / (Σ w + 1e-20) (renormalize, k > 1);  w = w · scaling
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidRouter {
    pub top_k: usize,
    /// Expert groups (1: no group limit) and how many of them are kept.
    pub groups: usize,
    pub topk_group: usize,
    pub renormalize: bool,
    pub scaling: f32,
}

impl SigmoidRouter {
    /// Routes one token from its router logits. The margin is the smaller
    /// of the k-th minus (k+1)-th corrected score among the kept groups and
    /// the last kept minus the first dropped group score.
    pub fn route(&self, logits: &[f32], bias: &[f32]) -> Route {
        let e = logits.len();
        let k = self.top_k;
        let s: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
        let choice: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
        let descending = |v: &[f32], n: usize| {
            let mut order: Vec<u32> = (0..n as u32).collect();
            // Descending score; ties go to the lower index.
            order.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
            order
        };
        if self.groups <= 1 {
            let order = descending(&choice, e);
            let margin = if k < e {
                choice[order[k - 1] as usize] - choice[order[k] as usize]
            } else {
                f32::INFINITY
            };
            return self.finish(&s, order[..k].to_vec(), margin);
        }
        let per = e / self.groups;
        let group: Vec<f32> = choice
            .chunks_exact(per)
            .map(|c| {
                let o = descending(c, per);
                c[o[0] as usize] + c[o[1] as usize]
            })
            .collect();
        let go = descending(&group, self.groups);
        let tg = self.topk_group;
        let kept: Vec<bool> = (0..e)
            .map(|i| go[..tg].contains(&((i / per) as u32)))
            .collect();
        let masked: Vec<f32> = (0..e)
            .map(|i| if kept[i] { choice[i] } else { 0.0 })
            .collect();
        let order = descending(&masked, e);
        // Margins: among the kept experts, and between kept and dropped groups.
        let mut c: Vec<f32> = (0..e).filter(|&i| kept[i]).map(|i| choice[i]).collect();
        c.sort_by(|a, b| b.total_cmp(a));
        let mut margin = if k < c.len() {
            c[k - 1] - c[k]
        } else {
            f32::INFINITY
        };
        if tg < self.groups {
            margin = margin.min(group[go[tg - 1] as usize] - group[go[tg] as usize]);
        }
        self.finish(&s, order[..k].to_vec(), margin)
    }

    /// Combine weights of the chosen `ids` from the uncorrected scores `s`.
    fn finish(&self, s: &[f32], ids: Vec<u32>, margin: f32) -> Route {
        let k = ids.len();
        let mut weights: Vec<f32> = ids.iter().map(|&i| s[i as usize]).collect();
        if k > 1 && self.renormalize {
            let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
            weights.iter_mut().for_each(|v| *v /= sum);
        }
        weights.iter_mut().for_each(|v| *v *= self.scaling);
        Route {
            ids,
            weights,
            margin,
        }
    }
}

/// The routed experts of one layer for a step's rows, requested once.
pub struct ExpertFetch {
    union: Vec<u32>,
    /// Per expert of the union: the (row, rank) pairs that use it, in row order.
    users: Vec<Vec<(usize, usize)>>,
    ticket: ExpertTicket,
    /// The next MoE layer's guessed experts, for the device.
    guess: Option<Guess>,
    /// Where the step's work may go.
    path: Path,
}

impl ExpertFetch {
    /// Requests the union of the experts `routes` chose, for a step on
    /// `path`.
    pub fn start(
        path: Path,
        source: &dyn ExpertSource,
        layer: usize,
        routes: &[Route],
    ) -> Result<Self> {
        let mut union: Vec<u32> = routes.iter().flat_map(|r| r.ids.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        let ticket = source.request(layer, &union)?;
        let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); union.len()];
        for (ti, r) in routes.iter().enumerate() {
            for (j, e) in r.ids.iter().enumerate() {
                let u = union.binary_search(e).expect("the union holds every route");
                users[u].push((ti, j));
            }
        }
        Ok(ExpertFetch {
            union,
            users,
            ticket,
            guess: None,
            path,
        })
    }

    /// Hands the device the next layer's guessed experts
    /// ([`guess_next`]): those already in RAM are copied up behind this
    /// layer's grouped expert products.
    pub fn with_guess(mut self, guess: Option<Guess>) -> Self {
        self.guess = guess;
        self
    }

    /// Collects the experts and returns `y [T, out_w]` with
    /// `y_t = Σ_j w_{t,j} · expert_{t,j}(z_t)`, summed in rank order `j`.
    /// `z` is `[T, in_w]` (one row per route); `expert(e, rows, n)` maps
    /// `[n, in_w]` to `[n, out_w]`; `work_each` is its multiply-adds per row
    /// (scheduling only). Experts already in RAM run at once; those still
    /// being read run as each arrives ([`ExpertFetch::as_they_arrive`]).
    /// Each expert's output depends only on its weights and rows, and the
    /// sum runs in rank order, so the arrival order never shows. Its time is
    /// the decode profile's `routed_experts`.
    pub fn finish(
        self,
        source: &dyn ExpertSource,
        routes: &[Route],
        z: &[f32],
        out_w: usize,
        work_each: usize,
        expert: impl Fn(&ExpertWeights, &[f32], usize) -> Vec<f32> + Sync,
    ) -> Result<Vec<f32>> {
        crate::phase::timed(crate::phase::Phase::RoutedExperts, move || {
            self.collect_and_sum(source, routes, z, (out_w, work_each), None, None, expert)
                .map(Finished::into_sums)
        })
    }

    /// [`ExpertFetch::finish`] with `batch`, which may run every expert of
    /// the union at once (given the experts, each one's gathered rows and
    /// their count) when all are in RAM on the device path —
    /// typically each of the experts' products as one batched device call
    /// — and must then give exactly `expert`'s outputs; `None` leaves them
    /// to `expert` one by one. The sums run as in `finish`.
    pub fn finish_batched(
        self,
        source: &dyn ExpertSource,
        routes: &[Route],
        z: &[f32],
        (out_w, work_each): (usize, usize),
        batch: &BatchExperts<'_>,
        expert: impl Fn(&ExpertWeights, &[f32], usize) -> Vec<f32> + Sync,
    ) -> Result<Vec<f32>> {
        crate::phase::timed(crate::phase::Phase::RoutedExperts, move || {
            let how = (out_w, work_each);
            self.collect_and_sum(source, routes, z, how, None, Some(batch), expert)
                .map(Finished::into_sums)
        })
    }

    /// [`ExpertFetch::finish`] for gated experts. With a device backend and
    /// every expert in RAM, the layer's experts and their sums run as one
    /// device call ([`GluExpert::grouped`]; two when some go to the CPU)
    /// instead of three calls each, and with them `tail`
    /// ([`fathom_kernels::backend::MoeTail`]): then the tail's output comes
    /// back ([`Finished::Tail`]; only the sums for `Tail::default()`), else
    /// the sums ([`Finished::Summed`]), for the caller to finish with the
    /// same operations ([`moe_tail_cpu`]'s order). The products and the
    /// sums' order are the same either way, so are the bits.
    ///
    /// [`moe_tail_cpu`]: fathom_kernels::backend::moe_tail_cpu
    pub fn finish_tail(
        self,
        source: &dyn ExpertSource,
        routes: &[Route],
        z: &[f32],
        out_w: usize,
        glu: &GluExpert,
        tail: Tail<'_>,
    ) -> Result<Finished> {
        let in_w = z.len() / routes.len().max(1);
        let work = 3 * glu.inter * in_w;
        crate::phase::timed(crate::phase::Phase::RoutedExperts, move || {
            let how = (out_w, work);
            self.collect_and_sum(
                source,
                routes,
                z,
                how,
                Some((glu, tail)),
                None,
                |e, zin, n| glu.forward(e, zin, n, out_w),
            )
        })
    }

    /// `tail` with every row's picks (expert of the union, row of its
    /// output; from `users`, each union expert's `(row, rank)` pairs) and
    /// weights in rank order; `None` when the rows choose different numbers
    /// of experts.
    fn tail_ask<'a>(
        users: &[Vec<(usize, usize)>],
        routes: &[Route],
        tail: Tail<'a>,
    ) -> Option<TailAsk<'a>> {
        let k = routes.first()?.ids.len();
        if k == 0
            || routes
                .iter()
                .any(|r| r.ids.len() != k || r.weights.len() != k)
        {
            return None;
        }
        let mut picks = vec![(0u32, 0u32); routes.len() * k];
        for (u, us) in users.iter().enumerate() {
            for (n, &(ti, j)) in us.iter().enumerate() {
                picks[ti * k + j] = (u as u32, n as u32);
            }
        }
        let weights = routes.iter().flat_map(|r| r.weights.iter().copied());
        Some(TailAsk {
            k,
            picks,
            weights: weights.collect(),
            norm: tail.norm,
            up: tail.up,
        })
    }

    /// `(out_w, work_each)` as for [`ExpertFetch::finish`]; `glu`, when
    /// given, may run the experts as grouped device calls, with the tail
    /// if asked; `batch` as for [`ExpertFetch::finish_batched`].
    #[allow(clippy::too_many_arguments)]
    fn collect_and_sum(
        self,
        source: &dyn ExpertSource,
        routes: &[Route],
        z: &[f32],
        (out_w, work_each): (usize, usize),
        glu: Option<(&GluExpert, Tail<'_>)>,
        batch: Option<&BatchExperts<'_>>,
        expert: impl Fn(&ExpertWeights, &[f32], usize) -> Vec<f32> + Sync,
    ) -> Result<Finished> {
        let t = routes.len();
        let in_w = z.len() / t.max(1);
        let gather = |us: &[(usize, usize)]| -> Vec<f32> {
            us.iter()
                .flat_map(|&(ti, _)| z[ti * in_w..(ti + 1) * in_w].iter().copied())
                .collect()
        };
        let run = |e: &ExpertWeights, us: &[(usize, usize)]| expert(e, &gather(us), us.len());
        let all_ready = self
            .ticket
            .slots
            .iter()
            .all(|s| matches!(s, ExpertSlot::Ready(_)));
        let device = self.path.device();
        let grouped = glu.filter(|_| all_ready && device);
        let outputs = if all_ready {
            let experts: Vec<Arc<ExpertWeights>> = source.collect(self.ticket)?;
            let n_union = self.union.len();
            let done = grouped.and_then(|(g, tail)| {
                let tail = Self::tail_ask(&self.users, routes, tail);
                let inputs: Vec<Vec<f32>> = self.users.iter().map(|us| gather(us)).collect();
                let next = self
                    .guess
                    .as_ref()
                    .map_or_else(Vec::new, |n| source.peek(n.layer, &n.ids));
                g.grouped(&experts, &inputs, out_w, &next, tail)
            });
            if let Some(Grouped::Tail(y)) = done {
                return Ok(Finished::Tail(y));
            }
            let batched = || {
                let b = batch.filter(|_| device)?;
                let inputs: Vec<Vec<f32>> = self.users.iter().map(|us| gather(us)).collect();
                let ns: Vec<usize> = self.users.iter().map(Vec::len).collect();
                b(&experts, &inputs, &ns)
            };
            if let Some(Grouped::Each(out)) = done {
                out
            } else if let Some(out) = batched() {
                out
            } else {
                experts
                    .par_iter()
                    .zip(self.users.par_iter())
                    .with_min_len(crate::par_min_len(
                        n_union,
                        work_each * t.div_ceil(n_union.max(1)).max(1),
                    ))
                    .map(|(e, us)| run(e, us))
                    .collect()
            }
        } else {
            Self::as_they_arrive(source, self.ticket, &self.users, &run)?
        };
        // Scatter to [T, k, out_w], then sum in rank order.
        let k = routes.iter().map(|r| r.ids.len()).max().unwrap_or(0);
        let mut per = vec![0f32; t * k * out_w];
        for (us, out) in self.users.iter().zip(&outputs) {
            for (n, &(ti, j)) in us.iter().enumerate() {
                per[(ti * k + j) * out_w..][..out_w]
                    .copy_from_slice(&out[n * out_w..(n + 1) * out_w]);
            }
        }
        let mut y = vec![0f32; t * out_w];
        for (ti, r) in routes.iter().enumerate() {
            let yr = &mut y[ti * out_w..(ti + 1) * out_w];
            for (j, &wj) in r.weights.iter().enumerate() {
                for (a, &b) in yr.iter_mut().zip(&per[(ti * k + j) * out_w..][..out_w]) {
                    *a += wj * b;
                }
            }
        }
        Ok(Finished::Summed(y))
    }
}

/// What follows a MoE layer's routed experts that a device may run in the
/// same call as them ([`ExpertFetch::finish_tail`]): the sums' RMS norm
/// (its weight and ε) and their projection, each optional.
#[derive(Clone, Copy, Default)]
pub struct Tail<'a> {
    pub norm: Option<(&'a [f32], f32)>,
    pub up: Option<MatRef<'a>>,
}

/// What [`ExpertFetch::finish_tail`] returns.
pub enum Finished {
    /// Each row's rank-order sum `[T, out_w]`: the caller runs the tail.
    Summed(Vec<f32>),
    /// The tail's output, computed with the experts in one device call.
    Tail(Vec<f32>),
}

impl Finished {
    /// The sums of a call made with `Tail::default()` (no norm, no
    /// projection: a device's output is then the sums). Never for a call
    /// that asked for a norm or a projection: its `Tail` is not the sums.
    pub(crate) fn into_sums(self) -> Vec<f32> {
        match self {
            Finished::Summed(y) | Finished::Tail(y) => y,
        }
    }
}

/// Every expert of a layer's union at once ([`ExpertFetch::finish_batched`]):
/// the experts, each one's gathered rows and their count → each one's
/// output, or `None` to leave them to the one-by-one path.
pub type BatchExperts<'a> =
    dyn Fn(&[Arc<ExpertWeights>], &[Vec<f32>], &[usize]) -> Option<Vec<Vec<f32>>> + 'a;

/// One expert on the rows of its users (`(row, rank)` pairs).
type RunExpert<'a> = dyn Fn(&ExpertWeights, &[(usize, usize)]) -> Vec<f32> + Sync + 'a;

impl ExpertFetch {
    /// Runs every expert of `ticket` on its users' rows: those in RAM are
    /// handed to the pool at once; of the rest, any whose read has ended
    /// goes next (a prefetch may end before a read asked earlier), else the
    /// oldest is awaited; each is handed to the pool as it arrives, so the
    /// reads still outstanding overlap the compute of the experts already
    /// here. Before blocking, this thread runs queued pool work itself (with
    /// one pool thread nothing would run otherwise). Outputs come back in
    /// the ticket's order; a failed read is returned once the ticket's other
    /// reads have ended.
    fn as_they_arrive(
        source: &dyn ExpertSource,
        ticket: ExpertTicket,
        users: &[Vec<(usize, usize)>],
        run: &RunExpert<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let done: Vec<OnceLock<Vec<f32>>> = users.iter().map(|_| OnceLock::new()).collect();
        let mut failed = None;
        rayon::in_place_scope(|s| {
            let mut pending = Vec::new();
            for (i, slot) in ticket.slots.into_iter().enumerate() {
                match slot {
                    ExpertSlot::Ready(e) => {
                        let (out, us) = (&done[i], &users[i]);
                        s.spawn(move |_| {
                            let _ = out.set(run(&e, us));
                        });
                    }
                    ExpertSlot::Pending(p) => pending.push((i, p)),
                }
            }
            while !pending.is_empty() {
                let at = pending.iter().position(|(_, p)| p.is_ready());
                // Nothing has arrived: run queued pool work (the experts
                // handed over so far) on this thread rather than block.
                if at.is_none() && matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                    continue;
                }
                let (i, p) = pending.remove(at.unwrap_or(0));
                match source.wait_one(p.as_ref()) {
                    Ok(e) => {
                        let (out, us) = (&done[i], &users[i]);
                        s.spawn(move |_| {
                            let _ = out.set(run(&e, us));
                        });
                    }
                    Err(err) => {
                        // The step fails, but only once its other reads
                        // have ended: a read left running would be joined
                        // by the next step and could fail that one too.
                        for (_, p) in pending.drain(..) {
                            let _ = p.wait();
                        }
                        failed = Some(err);
                        break;
                    }
                }
            }
        });
        if let Some(err) = failed {
            return Err(err);
        }
        Ok(done
            .into_iter()
            .map(|c| c.into_inner().expect("every expert ran"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    use fathom_weights::AlignedBuf;

    use super::*;
    use crate::error::ModelError;
    use crate::experts::{ExpertFormat, ExpertStats, PendingExpert};

    /// Experts told apart by their buffer length (64·(id+1) bytes).
    fn expert(id: usize) -> Arc<ExpertWeights> {
        Arc::new(ExpertWeights {
            buf: AlignedBuf::zeroed(64 * (id + 1)),
            parts: [(0, 0, [1, 1]); 3],
            format: ExpertFormat::F32,
        })
    }

    /// Which experts have started computing.
    #[derive(Default)]
    struct Ran(Mutex<Vec<usize>>, Condvar);

    /// A read that ends only once `needs` have started computing (or fails
    /// after a while: under wait-for-all it would never end).
    struct Gate {
        ran: Arc<Ran>,
        needs: Vec<usize>,
        e: Arc<ExpertWeights>,
        ready: bool,
    }

    impl PendingExpert for Gate {
        fn wait(&self) -> Result<Arc<ExpertWeights>> {
            let g = self.ran.0.lock().unwrap();
            let (_g, t) = self
                .ran
                .1
                .wait_timeout_while(g, Duration::from_secs(10), |r| {
                    !self.needs.iter().all(|n| r.contains(n))
                })
                .unwrap();
            if t.timed_out() {
                return Err(ModelError::Experts(format!(
                    "experts {:?} never ran while this one was read",
                    self.needs
                )));
            }
            Ok(self.e.clone())
        }
        fn is_ready(&self) -> bool {
            self.ready
        }
    }

    struct NoSource;

    impl ExpertSource for NoSource {
        fn request(&self, _: usize, _: &[u32]) -> Result<ExpertTicket> {
            Err(ModelError::Experts("not used".into()))
        }
        fn stats(&self) -> ExpertStats {
            ExpertStats::default()
        }
    }

    /// One row routed to experts 0 and 1 (weights 1 and 1), and the fetch
    /// of those two with `slots`.
    fn two_experts(slots: Vec<ExpertSlot>) -> (Vec<Route>, ExpertFetch) {
        let routes = vec![Route {
            ids: vec![0, 1],
            weights: vec![1.0, 1.0],
            margin: 1.0,
        }];
        let fetch = ExpertFetch {
            union: vec![0, 1],
            users: vec![vec![(0, 0)], vec![(0, 1)]],
            ticket: ExpertTicket {
                layer: 0,
                ids: vec![0, 1],
                slots,
            },
            guess: None,
            path: Path::Host,
        };
        (routes, fetch)
    }

    /// With one pool thread, the layer (on that thread) runs the expert in
    /// RAM itself while the other is read: blocking first would never end.
    #[test]
    fn one_pool_thread_computes_while_waiting() {
        let ran = Arc::new(Ran::default());
        let (routes, fetch) = two_experts(vec![
            ExpertSlot::Ready(expert(0)),
            ExpertSlot::Pending(Arc::new(Gate {
                ran: ran.clone(),
                needs: vec![0],
                e: expert(1),
                ready: false,
            })),
        ]);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let y = pool
            .install(|| {
                fetch.finish(&NoSource, &routes, &[1.0], 1, 1, |e, _, _| {
                    let id = e.buf.len() / 64 - 1;
                    ran.0.lock().unwrap().push(id);
                    ran.1.notify_all();
                    vec![(id + 1) as f32]
                })
            })
            .unwrap();
        assert_eq!(y, vec![3.0]);
    }

    /// Expert 0 is in RAM, expert 1's read ends only after experts 0 and 2
    /// have started, expert 2's read has ended: the layer must compute 0 at
    /// once and take 2 before waiting on 1 (waiting for the whole union, or
    /// for the reads in the order asked, never ends). The sum keeps rank
    /// order whatever ran first.
    #[test]
    fn arrived_experts_run_while_others_are_read() {
        let ran = Arc::new(Ran::default());
        let gate = |id: usize, needs: Vec<usize>, ready: bool| {
            ExpertSlot::Pending(Arc::new(Gate {
                ran: ran.clone(),
                needs,
                e: expert(id),
                ready,
            }))
        };
        let routes = vec![Route {
            ids: vec![1, 0, 2],
            weights: vec![0.5, 0.25, 2.0],
            margin: 1.0,
        }];
        let fetch = ExpertFetch {
            union: vec![0, 1, 2],
            users: vec![vec![(0, 1)], vec![(0, 0)], vec![(0, 2)]],
            ticket: ExpertTicket {
                layer: 0,
                ids: vec![0, 1, 2],
                slots: vec![
                    ExpertSlot::Ready(expert(0)),
                    gate(1, vec![0, 2], false),
                    gate(2, vec![], true),
                ],
            },
            guess: None,
            path: Path::Host,
        };
        let y = fetch
            .finish(&NoSource, &routes, &[1.0, 2.0], 2, 1, |e, rows, n| {
                let id = e.buf.len() / 64 - 1;
                ran.0.lock().unwrap().push(id);
                ran.1.notify_all();
                assert_eq!((rows, n), (&[1.0, 2.0][..], 1));
                vec![(id + 1) as f32; 2]
            })
            .unwrap();
        // ranks: expert 1 (×0.5), expert 0 (×0.25), expert 2 (×2.0).
        let want = 0.5 * 2.0 + 0.25 * 1.0 + 2.0 * 3.0;
        assert_eq!(y, vec![want; 2]);
    }
    /// A read that fails at once, and one that ends a while later.
    struct Fails;

    impl PendingExpert for Fails {
        fn wait(&self) -> Result<Arc<ExpertWeights>> {
            Err(ModelError::Experts("expert 0: the read failed".into()))
        }
        fn is_ready(&self) -> bool {
            true
        }
    }

    struct Slow(Arc<std::sync::atomic::AtomicBool>);

    impl PendingExpert for Slow {
        fn wait(&self) -> Result<Arc<ExpertWeights>> {
            std::thread::sleep(Duration::from_millis(200));
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(expert(1))
        }
        fn is_ready(&self) -> bool {
            false
        }
    }

    /// A failed read fails the layer, but only after the ticket's other
    /// read has ended: none of the failed step's reads outlives it.
    #[test]
    fn a_failed_read_returns_once_the_other_reads_end() {
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (routes, fetch) = two_experts(vec![
            ExpertSlot::Pending(Arc::new(Fails)),
            ExpertSlot::Pending(Arc::new(Slow(ended.clone()))),
        ]);
        let e = fetch
            .finish(&NoSource, &routes, &[1.0], 1, 1, |_, _, _| vec![1.0])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            ModelError::Experts("expert 0: the read failed".into()).to_string()
        );
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "returned while a read ran"
        );
    }
}
