//! Recording an int8 spine as a load quantises it, for `fathom convert
//! --spine int8` (`fathom_weights::int8_spine`).
//!
//! While a [`Recording`] is held, every float matrix the binder reads is
//! noted by its name, the address and length of its data and a hash of
//! its values; when `Linear::quantize_int8` then quantises a matrix with
//! that data, its codes and row scales go to the sink under that name. So
//! the file holds exactly the matrices a `--spine int8` load quantises
//! (never a router, which stays exact), each named by the tensor it came
//! from. A matrix made from another (a tied head's copy of the embedding,
//! a split of one) has other data and is not recorded: a load quantises it
//! itself. One recording at a time, per process: a conversion runs alone in
//! its process (`fathom convert`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fathom_weights::int8_spine::Int8Sink;

use crate::linear::{Linear, WeightData};

static ACTIVE: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<State>> = Mutex::new(None);

/// A matrix's data: its address, its length and a hash of its values.
pub(crate) type Key = (usize, usize, u64);

struct State {
    sink: Arc<dyn Int8Sink>,
    noted: HashMap<Key, String>,
}

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends what is quantised to a sink until dropped.
pub struct Recording(());

/// Starts recording into `sink`; `None` while another recording runs.
pub fn record(sink: Arc<dyn Int8Sink>) -> Option<Recording> {
    let mut g = state();
    if g.is_some() {
        return None;
    }
    *g = Some(State {
        sink,
        noted: HashMap::new(),
    });
    ACTIVE.store(true, Ordering::SeqCst);
    Some(Recording(()))
}

impl Drop for Recording {
    fn drop(&mut self) {
        let mut g = state();
        ACTIVE.store(false, Ordering::SeqCst);
        *g = None;
    }
}

/// Whether a recording runs (one atomic load: loads outside `convert`
/// pay nothing else).
pub(crate) fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Notes that `l` was read as tensor `name`.
pub(crate) fn note(name: &str, l: &Linear) {
    if !active() {
        return;
    }
    if let Some(k) = key(l)
        && let Some(s) = state().as_mut()
    {
        s.noted.insert(k, name.to_string());
    }
}

/// The key of a float matrix's data (`None` for other formats).
pub(crate) fn key(l: &Linear) -> Option<Key> {
    match &l.data {
        WeightData::Bf16(w) => Some((
            w.as_ptr() as usize,
            w.len(),
            hash(w.iter().map(|&v| v as u64), 16),
        )),
        WeightData::F32(w) => Some((
            w.as_ptr() as usize,
            w.len(),
            hash(w.iter().map(|v| v.to_bits() as u64), 32),
        )),
        _ => None,
    }
}

/// Hands the matrix noted under `key`, now quantised, to the sink.
pub(crate) fn quantized(key: Key, rows: usize, cols: usize, q: &[i8], scale: &[f32]) {
    let (sink, name) = {
        let mut g = state();
        let Some(s) = g.as_mut() else { return };
        let Some(name) = s.noted.remove(&key) else {
            return;
        };
        (s.sink.clone(), name)
    };
    sink.put(&name, rows, cols, q, scale);
}

/// A 64-bit hash of `bits`-wide values, packed into words.
fn hash(values: impl Iterator<Item = u64>, bits: u32) -> u64 {
    let per = 64 / bits as usize;
    let (mut h, mut word, mut n) = (0x9E37_79B9_7F4A_7C15u64, 0u64, 0usize);
    for v in values {
        word |= v << (bits as usize * (n % per));
        n += 1;
        if n % per == 0 {
            h = (h ^ word)
                .wrapping_mul(0x0000_0100_0000_01B3)
                .rotate_left(23);
            word = 0;
        }
    }
    (h ^ word ^ n as u64).wrapping_mul(0x0000_0100_0000_01B3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_sees_every_value_and_the_length() {
        let a: Vec<u64> = (0..9).collect();
        let mut b = a.clone();
        b[8] = 9;
        assert_ne!(hash(a.iter().copied(), 16), hash(b.iter().copied(), 16));
        assert_ne!(
            hash(a[..8].iter().copied(), 16),
            hash(a.iter().copied(), 16)
        );
        assert_ne!(
            hash([0u64].into_iter(), 16),
            hash([0u64, 0].into_iter(), 16)
        );
        assert_eq!(hash(a.iter().copied(), 32), hash(a.iter().copied(), 32));
    }
}
