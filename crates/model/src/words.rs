//! A matrix's values: in RAM, or the checkpoint's bytes mapped for a
//! matrix held on the device (`fathom_weights::mapped`; the device tier of
//! `crate::tiers`). Either reads as a slice with the same values; a
//! mapped one written to becomes a RAM copy first.

use fathom_weights::mapped::{self, Mapped, Word};
use fathom_weights::{Checkpoint, TensorLoc};

use crate::error::Result;

pub enum Words<T: Word> {
    Ram(Vec<T>),
    /// Mapped and registered as held ([`mapped::hold`]) until dropped.
    Held(Mapped),
}

impl<T: Word> Words<T> {
    /// `m` as `T`s, registered as held; `None` when its bytes are not
    /// aligned for `T` (the caller reads them instead).
    pub fn held(m: Mapped) -> Option<Self> {
        m.words::<T>()?;
        mapped::hold(&m);
        Some(Words::Held(m))
    }

    /// Tensor `loc` mapped and held when a [`crate::linear::loading_held`]
    /// load is running and the map is given; `None` otherwise (the caller
    /// reads it).
    pub fn held_if_holding(ck: &Checkpoint, loc: &TensorLoc) -> Result<Option<Self>> {
        if !crate::linear::holding() {
            return Ok(None);
        }
        Ok(ck.map(loc)?.and_then(Words::held))
    }

    /// Whether the values are the checkpoint's mapped bytes.
    pub fn is_held(&self) -> bool {
        matches!(self, Words::Held(_))
    }

    /// Drops a held matrix's pages from RAM (read through, e.g. checked at
    /// load): the next read faults them in from the file again.
    pub fn release(&self) {
        if self.is_held() {
            mapped::release_copied(self.as_ptr() as usize, std::mem::size_of_val(&**self));
        }
    }

    /// The values as a RAM vector (a held matrix copied first).
    pub fn vec_mut(&mut self) -> &mut Vec<T> {
        if let Words::Held(_) = self {
            *self = Words::Ram(self.to_vec());
        }
        match self {
            Words::Ram(v) => v,
            Words::Held(_) => unreachable!("made a RAM copy above"),
        }
    }
}

impl<T: Word> std::ops::Deref for Words<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Words::Ram(v) => v,
            Words::Held(m) => m.words().expect("checked aligned when made"),
        }
    }
}

impl<T: Word> std::ops::DerefMut for Words<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.vec_mut()
    }
}

impl<T: Word> FromIterator<T> for Words<T> {
    fn from_iter<I: IntoIterator<Item = T>>(it: I) -> Self {
        Words::Ram(it.into_iter().collect())
    }
}

impl<T: Word> From<Vec<T>> for Words<T> {
    fn from(v: Vec<T>) -> Self {
        Words::Ram(v)
    }
}

/// A clone is a RAM copy (a held matrix's clone is no longer on the device).
impl<T: Word> Clone for Words<T> {
    fn clone(&self) -> Self {
        Words::Ram(self.to_vec())
    }
}

impl<T: Word + std::fmt::Debug> std::fmt::Debug for Words<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Words::Ram(v) => write!(f, "Ram({} values)", v.len()),
            Words::Held(m) => write!(f, "Held({} bytes)", m.bytes().len()),
        }
    }
}

impl<T: Word> Drop for Words<T> {
    fn drop(&mut self) {
        if let Words::Held(m) = self {
            mapped::unhold(m);
        }
    }
}
