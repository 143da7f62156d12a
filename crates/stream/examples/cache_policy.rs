//! Chooses the expert-cache eviction policy by measurement.
//!
//! Records the routed experts of every MoE layer while a model decodes
//! greedily from a few prompts (the trained k3-code-small by default: real
//! routing locality), then replays that request stream through LRU, FIFO,
//! LFU and Belady's optimal policy (the offline upper bound) at several
//! capacities and prints hit rates.
//!
//! `cargo run --release -p fathom-stream --example cache_policy -- MODEL_DIR [TOKENS]`

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;

use fathom_model::kimi_k3::moe::Route;
use fathom_model::{K3Model, Logits, Tracer};

#[derive(Default)]
struct Trace {
    /// One request per MoE layer per pass: (layer, expert ids in the union).
    requests: Vec<Vec<(u32, u32)>>,
}

impl Tracer for Trace {
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        let mut ids: Vec<u32> = routes.iter().flat_map(|r| r.ids.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        self.requests
            .push(ids.into_iter().map(|e| (layer as u32, e)).collect());
    }
}

fn simulate(trace: &[Vec<(u32, u32)>], cap: usize, policy: &str) -> f64 {
    let flat: Vec<(u32, u32)> = trace.iter().flatten().copied().collect();
    // Next use of each position, for Belady.
    let mut next_use = vec![usize::MAX; flat.len()];
    let mut last: HashMap<(u32, u32), usize> = HashMap::new();
    for i in (0..flat.len()).rev() {
        next_use[i] = *last.get(&flat[i]).unwrap_or(&usize::MAX);
        last.insert(flat[i], i);
    }
    let mut cache: HashMap<(u32, u32), (u64, u64)> = HashMap::new(); // key -> (last use / insert time, count)
    let mut fifo: VecDeque<(u32, u32)> = VecDeque::new();
    let mut next_of: HashMap<(u32, u32), usize> = HashMap::new();
    let (mut hits, mut t) = (0u64, 0u64);
    for (i, &k) in flat.iter().enumerate() {
        t += 1;
        if let Some(e) = cache.get_mut(&k) {
            hits += 1;
            if policy != "fifo" {
                e.0 = t;
            }
            e.1 += 1;
            next_of.insert(k, next_use[i]);
            continue;
        }
        if cap == 0 {
            continue;
        }
        let layers = trace.iter().flatten().map(|k| k.0).max().unwrap_or(0) as usize + 1;
        let full = if policy == "layer-lru" {
            // Equal share per layer, LRU within the layer.
            cache.keys().filter(|x| x.0 == k.0).count() >= (cap / layers).max(1)
        } else {
            cache.len() >= cap
        };
        if full {
            let victim = match policy {
                // The layer whose next visit is farthest away goes first: the
                // current layer (revisited only after a full cycle), then the
                // one before it, …; least recently used within a layer.
                "cyclic" => {
                    let dist = |l: u32| {
                        let d = (l as usize + layers - k.0 as usize) % layers;
                        if d == 0 { layers } else { d }
                    };
                    *cache
                        .iter()
                        .max_by_key(|(x, (u, _))| (dist(x.0), std::cmp::Reverse(*u)))
                        .unwrap()
                        .0
                }
                "layer-lru" => {
                    *cache
                        .iter()
                        .filter(|(x, _)| x.0 == k.0)
                        .min_by_key(|(_, (u, _))| *u)
                        .unwrap()
                        .0
                }
                "fifo" => fifo.pop_front().unwrap(),
                "lfu" => *cache.iter().min_by_key(|(_, (u, c))| (*c, *u)).unwrap().0,
                "belady" => *cache.keys().max_by_key(|k| next_of[*k]).unwrap(),
                _ => *cache.iter().min_by_key(|(_, (u, _))| *u).unwrap().0,
            };
            cache.remove(&victim);
            fifo.retain(|x| *x != victim);
        }
        cache.insert(k, (t, 1));
        fifo.push_back(k);
        next_of.insert(k, next_use[i]);
    }
    hits as f64 / flat.len() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(
        args.get(1)
            .map(String::as_str)
            .unwrap_or("../shared/models/k3-code-small"),
    );
    let tokens: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let model = K3Model::load(&dir).expect("model loads");
    let prompts: Vec<Vec<u32>> = match std::fs::read_to_string(dir.join("golden.json")) {
        Ok(s) => {
            let v: serde_json::Value = serde_json::from_str(&s).unwrap();
            v["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p["input_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap() as u32)
                        .collect()
                })
                .collect()
        }
        Err(_) => vec![vec![1, 2, 3]],
    };
    let mut trace = Trace::default();
    for p in &prompts {
        let mut st = model.new_state();
        let mut logits = model.forward(&mut st, p, Logits::Last).unwrap();
        for _ in 0..tokens {
            let next = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            logits = model
                .forward_traced(&mut st, &[next], Logits::Last, Some(&mut trace))
                .unwrap();
        }
    }
    let total: usize = model.spec.moe_layers().count() * model.spec.num_experts;
    let per_token = model.spec.moe_layers().count() * model.spec.top_k;
    println!(
        "model {} — {} decode steps over {} prompts, {} experts in all, {} requested per token",
        dir.display(),
        tokens * prompts.len(),
        prompts.len(),
        total,
        per_token
    );
    let policies = ["lru", "layer-lru", "cyclic", "fifo", "lfu", "belady"];
    print!("{:>10}", "capacity");
    for p in policies {
        print!(" {p:>9}");
    }
    println!();
    for frac in [0.05, 0.1, 0.25, 0.5] {
        let cap = (total as f64 * frac) as usize;
        print!("{:>9}%", (frac * 100.0) as u32);
        for p in policies {
            print!(" {:>9.3}", simulate(&trace.requests, cap, p));
        }
        println!();
    }
}
