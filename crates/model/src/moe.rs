//! What every routed-expert layer shares, whatever its router: the routing
//! decision, the next-layer hint order, and the union fetch.
//!
//! For a step's rows the union of the chosen experts is requested from the
//! [`ExpertSource`] once; the caller computes what does not need the
//! experts while they arrive, then each expert runs on all the rows routed
//! to it at once, and each row's outputs are summed in the router's rank
//! order, so a row's result does not depend on what else the step holds.

use std::sync::Arc;

use rayon::prelude::*;

use crate::error::Result;
use crate::experts::{ExpertSource, ExpertTicket, ExpertWeights};

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

/// The routed experts of one layer for a step's rows, requested once.
pub struct ExpertFetch {
    union: Vec<u32>,
    /// Per expert of the union: the (row, rank) pairs that use it, in row order.
    users: Vec<Vec<(usize, usize)>>,
    ticket: ExpertTicket,
}

impl ExpertFetch {
    /// Requests the union of the experts `routes` chose.
    pub fn start(source: &dyn ExpertSource, layer: usize, routes: &[Route]) -> Result<Self> {
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
        })
    }

    /// Collects the experts and returns `y [T, out_w]` with
    /// `y_t = Σ_j w_{t,j} · expert_{t,j}(z_t)`, summed in rank order `j`.
    /// `z` is `[T, in_w]` (one row per route); `expert(e, rows, n)` maps
    /// `[n, in_w]` to `[n, out_w]`; `work_each` is its multiply-adds per row
    /// (scheduling only).
    pub fn finish(
        self,
        source: &dyn ExpertSource,
        routes: &[Route],
        z: &[f32],
        out_w: usize,
        work_each: usize,
        expert: impl Fn(&ExpertWeights, &[f32], usize) -> Vec<f32> + Sync,
    ) -> Result<Vec<f32>> {
        let t = routes.len();
        let in_w = z.len() / t.max(1);
        let experts: Vec<Arc<ExpertWeights>> = source.collect(self.ticket)?;
        let n_union = self.union.len();
        let outputs: Vec<Vec<f32>> = experts
            .par_iter()
            .zip(self.users.par_iter())
            .with_min_len(crate::par_min_len(
                n_union,
                work_each * t.div_ceil(n_union.max(1)).max(1),
            ))
            .map(|(e, us)| {
                let zin: Vec<f32> = us
                    .iter()
                    .flat_map(|&(ti, _)| z[ti * in_w..(ti + 1) * in_w].iter().copied())
                    .collect();
                expert(e, &zin, us.len())
            })
            .collect();
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
        Ok(y)
    }
}
