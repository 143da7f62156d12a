//! The paged latent cache: forks share blocks and never see each other's
//! writes; rollbacks and snapshots across block boundaries are exact.

use std::sync::Arc;

use fathom_model::kimi_k3::state::{BLOCK_ROWS, LayerState, MlaCache, SequenceState};
use fathom_model::{CausalLm, KvPool, Logits};

fn tiny() -> Arc<dyn CausalLm> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
    fathom_model::load(&p, Default::default()).unwrap()
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 1000 + 3)
        .collect()
}

#[test]
fn cache_blocks_are_shared_until_written() {
    let w = 3;
    let pool = KvPool::unlimited();
    let block = (BLOCK_ROWS * w * 4) as u64;
    let rows: Vec<f32> = (0..(BLOCK_ROWS + 10) * w).map(|i| i as f32).collect();
    let mut a = MlaCache::new(w, &pool);
    a.push_rows(&rows[..7 * w]).unwrap();
    a.push_rows(&rows[7 * w..]).unwrap();
    assert_eq!(a.len(), BLOCK_ROWS + 10);
    assert_eq!(a.to_rows().unwrap(), rows);
    assert_eq!(pool.stats().ram_bytes, 2 * block, "two blocks");
    let mut b = a.clone();
    assert_eq!(pool.stats().ram_bytes, 2 * block, "a fork shares blocks");
    b.truncate(BLOCK_ROWS - 1);
    b.push_rows(&[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]).unwrap();
    assert_eq!(
        pool.stats().ram_bytes,
        4 * block,
        "the written blocks were copied"
    );
    assert_eq!(
        a.to_rows().unwrap(),
        rows,
        "the original never sees the fork's writes"
    );
    assert_eq!(b.len(), BLOCK_ROWS + 1);
    let br = b.to_rows().unwrap();
    assert_eq!(
        &br[(BLOCK_ROWS - 1) * w..BLOCK_ROWS * w],
        &[-1.0, -2.0, -3.0]
    );
    assert_eq!(&br[..(BLOCK_ROWS - 1) * w], &rows[..(BLOCK_ROWS - 1) * w]);
    drop((a, b));
    assert_eq!(pool.stats().ram_bytes, 0, "every block is given back");
}

#[test]
fn forks_and_rollbacks_across_blocks_equal_fresh_runs() {
    let m = tiny();
    let long = tokens(2 * BLOCK_ROWS + 40, 1);
    let (head, tail) = long.split_at(BLOCK_ROWS + 3);
    let mut a = m.new_state();
    m.forward(a.as_mut(), head, Logits::None).unwrap();
    let mut fork = a.fork();
    let la = m.forward(a.as_mut(), tail, Logits::All).unwrap();
    // The fork continues differently, then like the original.
    let other = tokens(20, 2);
    m.forward(fork.as_mut(), &other, Logits::None).unwrap();
    let mut fresh = m.new_state();
    let lf = m.forward(fresh.as_mut(), &long, Logits::All).unwrap();
    let v = m.info().vocab_size;
    assert_eq!(
        la[..],
        lf[head.len() * v..],
        "the original is unchanged by its fork"
    );
    let mut fork2 = a.fork();
    // Speculative pass over a block boundary, keep part, compare with a plain run.
    fork2.begin_pass();
    let extra = tokens(BLOCK_ROWS, 3);
    m.forward(fork2.as_mut(), &extra, Logits::None).unwrap();
    fork2.keep(5).unwrap();
    let lk = m.forward(fork2.as_mut(), &[7, 8], Logits::All).unwrap();
    let mut plain = m.new_state();
    let mut seq = long.clone();
    seq.extend_from_slice(&extra[..5]);
    m.forward(plain.as_mut(), &seq, Logits::None).unwrap();
    let lp = m.forward(plain.as_mut(), &[7, 8], Logits::All).unwrap();
    assert_eq!(lk, lp);
    let st = fork2.as_any().downcast_ref::<SequenceState>().unwrap();
    let mla = st.layers.iter().find_map(|l| match l {
        LayerState::Mla(c) => Some(c),
        _ => None,
    });
    assert_eq!(mla.unwrap().len(), long.len() + 7);
}
