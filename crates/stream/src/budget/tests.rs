//! The RAM ledger's unit tests.

use super::*;

fn tiny() -> MemoryFacts {
    fathom_model::registry::memory_facts(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/k3-tiny/checkpoint"),
    )
    .unwrap()
}

#[test]
fn the_read_pool_is_in_the_io_buffers() {
    let mut s = tiny();
    // k3-tiny's experts are below the pooled size: nothing extra.
    assert_eq!(read_pool_bytes(&s), 0);
    // A K3 expert (17.5 MB): the pool's 64 MiB cap binds (its buffers
    // are admitted by their own lengths, which may be shorter than `e`).
    s.expert_bytes = 17_500_000;
    let e = expert_ram_bytes(&s);
    assert_eq!(read_pool_bytes(&s), 64 << 20);
    assert_eq!(
        io_buffer_bytes(&s, 1, 2),
        (2 + s.top_k as u64) * e + (64 << 20)
    );
    // A long pass holds each of the layer's experts once, not top-k per position.
    assert_eq!(
        io_buffer_bytes(&s, 512, 2),
        (2 + s.num_experts as u64) * e + (64 << 20)
    );
    assert_eq!(
        io_buffer_bytes(&s, 3, 2),
        (2 + 3 * s.top_k as u64) * e + (64 << 20)
    );
    // Small pooled experts: at most four buffers.
    s.expert_bytes = 1 << 20;
    assert_eq!(read_pool_bytes(&s), 4 * expert_ram_bytes(&s));
}

#[test]
fn ledger_adds_up_and_refuses_too_small() {
    let s = tiny();
    let l = Ledger::plan(&s, 200 << 20, 4096, 1, 8).unwrap();
    assert!(l.spine + l.state + l.scratch + l.io_buffers + l.cache <= l.budget);
    assert_eq!(l.cache, l.cache_experts as u64 * l.expert_bytes);
    // k3-tiny: 8 MoE layers × 32 experts, all fit in 200 MiB.
    assert_eq!(l.cache_experts, 8 * 32);
    let e = Ledger::plan(&s, 10 << 20, 4096, 1, 8).unwrap_err();
    assert!(e.contains("too small") && e.contains("spine"), "{e}");
    // The minimum the message names is one that is accepted.
    let mb: u64 = e
        .split("--ram-budget ")
        .nth(1)
        .unwrap()
        .split("MB")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let ok = crate::budget::Ledger::plan(&s, mb * 1_000_000, 4096, 1, 8);
    assert!(ok.is_ok(), "{e} → {ok:?}");
    assert!(Ledger::plan(&s, (mb - 1) * 1_000_000, 4096, 1, 8).is_err());
}

#[test]
fn int8_spine_counts_what_quantize_spine_int8_produces() {
    let s = tiny();
    // A quantised [r, c] matrix: r·c int8 bytes + 4·r of f32 scales.
    let q = |r: usize, c: usize| (r * c + 4 * r) as u64;
    // KDA (P = 4·48 = 192, d = 128): q/k/v, f_a, f_b, b, g, o quantised;
    // conv taps [192, 1, 4] f32, A_log [48] f32, dt_bias [192] f32 and
    // o_norm [48] f32 as stored.
    let kda = 3 * q(192, 128)
        + q(48, 128)
        + q(192, 48)
        + q(4, 128)
        + q(192, 128)
        + q(128, 192)
        + 3 * 192 * 4 * 4
        + 48 * 4
        + 192 * 4
        + 48 * 4;
    // MLA: q_a [64, 128], q_b [4·48, 64], kv_a [40 + 16, 128],
    // kv_b [4·(32 + 24), 40], g [4·24, 128], o [128, 96]; two bf16 norms.
    let mla =
        q(64, 128) + q(192, 64) + q(56, 128) + q(224, 40) + q(96, 128) + q(128, 96) + 2 * (64 + 40);
    // Two norms and two attention-residual (norm, [1, d] query) pairs, bf16.
    let per_layer = 6 * 128 * 2;
    let dense = 2 * q(320, 128) + q(128, 320);
    // MoE: the router [32, 128] bf16 and its f32 bias stay; latent
    // down/up and the shared experts (2·96 = 192) are quantised.
    let moe =
        32 * 128 * 2 + 32 * 4 + q(64, 128) + 64 * 2 + q(128, 64) + 2 * q(192, 128) + q(128, 192);
    // Embedding [1024, 128] bf16 stays; final norm and output
    // attention-residual pair bf16; the head is quantised.
    let global = 1024 * 128 * 2 + 3 * 128 * 2 + q(1024, 128);
    let want = 6 * kda + 3 * mla + 9 * per_layer + dense + 8 * moe + global;
    assert_eq!(want, 2_464_240);
    // The layers' own figures add up to the same, the head and
    // embedding left as the globals.
    assert_eq!(s.layers.len(), 9);
    let layers: u64 = s.layers.iter().map(|l| l.int8).sum();
    assert_eq!(layers, 6 * kda + 3 * mla + 9 * per_layer + dense + 8 * moe);
    assert_eq!(s.global_bytes(true), global);
    assert_eq!(spine_bytes_for(&s, Spine::Int8), want);
    let l = Ledger::plan_for(&s, Spine::Int8, 200 << 20, 4096, 1, 8).unwrap();
    assert_eq!((l.spine, l.spine_repr), (want, "int8"));
    let b = Ledger::plan(&s, 200 << 20, 4096, 1, 8).unwrap();
    assert_eq!((b.spine, b.spine_repr), (spine_bytes(&s), "bf16"));
    assert_eq!(l.fixed() - l.spine, b.fixed() - b.spine);
}

#[test]
fn an_int8_spine_is_quantised_a_layer_at_a_time() {
    let s = tiny();
    let (l, b) = (
        Ledger::plan_for(&s, Spine::Int8, 200 << 20, 4096, 1, 8).unwrap(),
        Ledger::plan(&s, 200 << 20, 4096, 1, 8).unwrap(),
    );
    // Loading holds the int8 spine and one piece as stored: the
    // largest layer, or the head before it is quantised.
    let largest = s.layers.iter().map(|x| x.stored).max().unwrap();
    let head = s.global_bytes(false) - s.global_bytes(true);
    assert_eq!(
        l.load_peak,
        spine_bytes_for(&s, Spine::Int8) + l.scratch + largest.max(head)
    );
    assert_eq!(b.load_peak, spine_bytes(&s) + b.scratch);
    assert!(l.load_peak < b.load_peak);
    assert!(l.peak() < b.peak(), "{} vs {}", l.peak(), b.peak());
    assert_eq!(
        b.peak() - l.peak(),
        spine_bytes(&s) - spine_bytes_for(&s, Spine::Int8),
        "every expert cached in both: the int8 plan saves the spine difference"
    );
}

#[test]
fn layers_stream_when_the_spine_does_not_fit() {
    let s = tiny();
    let all = Ledger::plan(&s, 200 << 20, 4096, 1, 8).unwrap();
    assert_eq!(all.tiers.streamed_layers, 0);
    assert_eq!((all.tiers.ring, all.tiers.ring_bytes), (0, 0));
    assert_eq!(all.spine, spine_bytes(&s));
    // One byte short of the resident plan: the embedding goes first (a
    // pass reads only its tokens' rows), every layer stays.
    let least_resident = Ledger::plan(&s, 200 << 20, 1, 1, 8).unwrap();
    let fixed = least_resident.fixed();
    let l = Ledger::plan(&s, fixed - 1, 1, 1, 8).unwrap();
    assert!(l.tiers.embedding_on_disk && l.tiers.streamed_layers == 0);
    assert_eq!(l.spine, spine_bytes(&s) - s.embedding_bytes);
    assert!(l.tiers.plan().embedding_on_disk);
    // Short by more than the embedding: a layer streams, the cache
    // gets nothing, and what is counted fits.
    let l = Ledger::plan(&s, fixed - s.embedding_bytes - 1, 1, 1, 8).unwrap();
    let t = l.tiers.clone();
    assert!(t.streamed_layers >= 1 && t.embedding_on_disk, "{t:?}");
    assert_eq!(t.resident_layers + t.streamed_layers, 9);
    assert_eq!(
        t.global_bytes + s.embedding_bytes + t.resident_bytes + t.streamed_bytes,
        spine_bytes(&s)
    );
    assert_eq!(l.spine, t.global_bytes + t.resident_bytes);
    assert!(l.fixed() < fixed, "{} vs {fixed}", l.fixed());
    // The largest layers stay (ranked by what a pass reads of them).
    let sizes: Vec<u64> = s.layers.iter().map(|x| x.stored).collect();
    let keep = fathom_model::tiers::ranked_layers(&sizes, t.resident_layers);
    assert_eq!(t.keep, keep);
    let kept_least = (0..9).filter(|&i| keep[i]).map(|i| sizes[i]).min();
    let streamed_most = (0..9).filter(|&i| !keep[i]).map(|i| sizes[i]).max();
    assert!(kept_least >= streamed_most, "{sizes:?} {keep:?}");
    assert_eq!(
        t.ring,
        ring_layers(t.resident_layers, t.streamed_layers).max(crate::spine_tiers::ring_for(&keep))
    );
    let streamed: Vec<u64> = (0..9).filter(|&i| !keep[i]).map(|i| sizes[i]).collect();
    let m = streamed.len();
    let window = (0..m)
        .map(|j| {
            (0..t.ring.min(m))
                .map(|x| streamed[(j + x) % m])
                .sum::<u64>()
        })
        .max()
        .unwrap();
    assert_eq!(t.ring_bytes, window);
    assert_eq!(
        t.plan(),
        fathom_model::LayerPlan {
            keep: Some(keep),
            ..fathom_model::LayerPlan::streamed(t.resident_layers, t.ring)
        }
    );
    // Forced to none resident: a ring of two, the two largest
    // neighbours (k3-tiny: layer 0, dense, beside a MoE layer), and the
    // head read in row blocks, two of its eight blocks held.
    let none = Ledger::minimum(&s, Spine::Bf16, 1, l.kv, 1, 8).cap_resident_layers(&s, 0);
    let b: Vec<u64> = s.layers.iter().map(|x| x.stored).collect();
    let pairs = (0..9).map(|i| b[i] + b[(i + 1) % 9]).max().unwrap();
    let (rows, h) = (s.vocab_size as u64, s.head);
    assert!(h.stored > 0 && h.int8 < h.stored);
    let block = fathom_model::head::block_rows(rows as usize, h.stored / rows) as u64;
    assert_eq!(block, rows.div_ceil(8));
    let head_ring = 2 * block * (h.stored / rows);
    assert!(none.tiers.head_on_disk && none.tiers.plan().head_on_disk);
    assert_eq!(
        (none.tiers.ring, none.tiers.ring_bytes),
        (2, pairs + head_ring)
    );
    // Reading k3-tiny's 262 kB head in blocks frees less than
    // HEAD_BLOCKS_SAVE: the least plan keeps it.
    let least = Ledger::minimum(&s, Spine::Bf16, 1, l.kv, 1, 8).all_streamed(&s);
    assert!(!least.tiers.head_on_disk);
    assert!(least.fixed() > none.fixed() && least.fixed() < none.fixed() + HEAD_BLOCKS_SAVE);
    assert_eq!(crate::spine_tiers::ring_window(&[5, 1, 1, 4], 2), 9);
    assert_eq!(crate::spine_tiers::ring_window(&[5, 1, 1, 4], 9), 11);
    assert_eq!(
        none.spine,
        s.global_bytes(false) - s.embedding_bytes - h.stored
    );
    assert_eq!(
        none.tiers.streamed_bytes,
        s.layers.iter().map(|x| x.stored).sum::<u64>()
    );
    assert_eq!(none.tiers.read_bytes, none.tiers.streamed_bytes + h.stored);
    // An int8 spine holds its layers quantised but reads them as stored.
    let int8 = Ledger::minimum(&s, Spine::Int8, 1, l.kv, 1, 8).cap_resident_layers(&s, 0);
    assert_eq!(
        int8.tiers.streamed_bytes,
        s.layers.iter().map(|x| x.int8).sum::<u64>()
    );
    assert_eq!(int8.tiers.read_bytes, none.tiers.read_bytes);
    // Its ring also holds the layer being read as stored until it is
    // quantised, and a head block likewise.
    let q: Vec<u64> = s.layers.iter().map(|x| x.int8).collect();
    let pairs = (0..9).map(|i| q[i] + q[(i + 1) % 9]).max().unwrap();
    let head_ring = 2 * block * h.int8.div_ceil(rows) + block * (h.stored / rows);
    assert_eq!(
        int8.tiers.ring_bytes,
        pairs + b.iter().max().unwrap() + head_ring
    );
}

#[test]
fn ring_layers_cover_the_resident_runs() {
    assert_eq!(ring_layers(0, 9), 2);
    assert_eq!(ring_layers(4, 5), 3);
    assert_eq!(ring_layers(8, 1), MAX_RING);
    assert_eq!(ring_layers(45, 48), 3);
}

#[test]
fn the_least_budget_with_the_default_share_is_exact() {
    for base in 0..200u64 {
        for need in 0..80u64 {
            let fits = |m: u64| m >= base + (m / 4).min(need);
            let brute = (0..).find(|&m| fits(m)).unwrap();
            assert_eq!(
                super::least_with_quarter_share(base, need),
                brute,
                "base {base}, need {need}"
            );
        }
    }
}

#[test]
fn state_counts_kda_and_mla() {
    let s = tiny();
    // 6 KDA layers: 4·(4·48·48 + 3·3·192), and its undo mark; 3 MLA
    // layers: 4·56 per token.
    let kda = 2 * 6 * 4 * (4 * 48 * 48 + 3 * 3 * 192) as u64;
    assert_eq!(kda_state_bytes(&s), kda);
    // The latent cache is counted in whole 256-row blocks.
    assert_eq!(kv_bytes(&s, 0, KvDtype::F32), 0);
    assert_eq!(kv_bytes(&s, 10, KvDtype::F32), 3 * 4 * 56 * 256);
    assert_eq!(kv_bytes(&s, 257, KvDtype::Bf16), 3 * 2 * 56 * 512);
}

#[test]
fn layers_read_for_every_pass_go_to_the_device_as_far_as_its_room_goes() {
    let s = tiny();
    let all = Ledger::plan(&s, 100 << 20, 4096, 1, 8)
        .unwrap()
        .cap_resident_layers(&s, 0);
    assert_eq!(all.tiers.streamed_layers, 9);
    let one = s.layers.iter().map(|l| l.matrices).max().unwrap();
    // No room, or an int8 spine quantised in RAM: nothing held.
    assert_eq!(all.clone().with_device(&s, 0), all);
    let i8 = Ledger::plan_for(&s, Spine::Int8, 100 << 20, 4096, 1, 8)
        .unwrap()
        .cap_resident_layers(&s, 0);
    assert_eq!(i8.clone().with_device(&s, u64::MAX), i8);
    // Room for every layer and the head: nothing read for every pass, no
    // ring; the layers' matrices and the head on the device, the rest of
    // each layer in RAM.
    let d = all.clone().with_device(&s, u64::MAX);
    let t = &d.tiers;
    assert_eq!(
        (t.device_layers, t.streamed_layers, t.ring, t.ring_bytes),
        (9, 0, 0, 0)
    );
    assert!(t.head_on_device && t.head_on_disk);
    let matrices: u64 = s.layers.iter().map(|l| l.matrices).sum();
    let stored: u64 = s.layers.iter().map(|l| l.stored).sum();
    assert_eq!(t.device_bytes, matrices + s.head.stored);
    assert_eq!(t.resident_bytes, stored - matrices);
    assert_eq!(t.read_bytes, 0);
    assert!(d.fixed() < all.fixed() && d.cache >= all.cache);
    let plan = t.plan();
    assert_eq!(plan.device, vec![true; 9]);
    assert!((0..9).all(|i| plan.on_device(i)));
    assert_eq!(plan.head_place(), fathom_model::HeadPlace::Device);
    // Room for the layers but not the head: the head stays in row blocks,
    // its ring alone left.
    let head_ring = SpineTiers::new(&s, false, usize::MAX)
        .with_head_on_disk(&s, false)
        .ring_bytes;
    let d = all.clone().with_device(&s, matrices);
    let t = &d.tiers;
    assert!(!t.head_on_device && head_ring > 0);
    assert_eq!((t.device_layers, t.ring, t.ring_bytes), (9, 0, head_ring));
    assert_eq!(t.read_bytes, s.head.stored);
    assert_eq!(t.plan().head_place(), fathom_model::HeadPlace::Disk);
    // Room for three of the largest: three held, spread over the depth
    // among layers of one size; the ring never grows.
    let d = all.clone().with_device(&s, 3 * one);
    let t = &d.tiers;
    assert_eq!((t.device_layers, t.streamed_layers), (3, 6));
    assert!(t.device_bytes <= 3 * one && t.ring <= all.tiers.ring);
    let streamed: u64 = (0..9)
        .filter(|&i| !t.device[i])
        .map(|i| s.layers[i].stored)
        .sum();
    assert_eq!(t.streamed_bytes, streamed);
    assert_eq!(
        t.read_bytes,
        streamed + s.head.stored * u64::from(t.head_on_disk)
    );
    assert_eq!(d.clone().with_device(&s, u64::MAX), d, "placed once");
}
