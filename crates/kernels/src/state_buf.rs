//! A buffer a sequence carries between steps (a KDA state, a convolution
//! window) whose newest copy may live on the installed backend's device.
//!
//! A backend that runs a step on its device ([`crate::backend::Backend::kda_step`])
//! keeps the buffers it updated there and marks them so: the host copy is
//! then stale until someone reads it, which copies the device's back
//! ([`StateBuf::read`], [`StateBuf::host_mut`]). Copies between buffers
//! whose newest copy is on the device stay there ([`StateBuf::copy_from`]),
//! so a step's undo mark costs no transfer. The device copy is named by
//! the host copy's address and length, which do not change while the
//! device holds the newest copy (the host vector is not touched then).

use std::borrow::Cow;

use crate::backend::installed;

/// How the device copy of a [`StateBuf`] is named: host address and bytes.
pub type StateKey = (usize, usize);

/// Why a buffer's device copy could not be reached.
#[derive(Debug, Clone, thiserror::Error)]
#[error("a sequence's state is on the device and could not be copied back: {0}")]
pub struct StateError(pub String);

/// See the module docs.
#[derive(Debug, Default)]
pub struct StateBuf {
    host: Vec<f32>,
    on_device: bool,
    /// Why the values are unknown: a copy ([`Clone`]) made while the
    /// device holding the newest values could not be reached. Reading it
    /// fails with this; overwriting it whole makes it good again.
    lost: Option<String>,
}

impl StateBuf {
    pub fn new(host: Vec<f32>) -> Self {
        StateBuf {
            host,
            on_device: false,
            lost: None,
        }
    }

    pub fn zeros(n: usize) -> Self {
        Self::new(vec![0.0; n])
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Whether the newest copy is on the device.
    pub fn on_device(&self) -> bool {
        self.on_device
    }

    /// `Err` when the values were lost (a copy made while the device
    /// holding them could not be reached); no transfer either way.
    pub fn check(&self) -> Result<(), StateError> {
        match &self.lost {
            Some(why) => Err(StateError(why.clone())),
            None => Ok(()),
        }
    }

    /// Marks the values unknown (a copy into this buffer failed part way):
    /// reading fails with `why` until the buffer is overwritten whole. The
    /// device copy, if any, is dropped.
    pub fn mark_lost(&mut self, why: String) {
        self.drop_device_copy();
        self.lost = Some(why);
    }

    /// The name of the device copy.
    pub fn key(&self) -> StateKey {
        (
            self.host.as_ptr() as usize,
            std::mem::size_of_val(&self.host[..]),
        )
    }

    /// The host copy, for a backend to copy up while the device holds none
    /// (`None` also when the values were lost: the device has no copy
    /// under this name either, so a backend fails the step).
    pub fn host(&self) -> Option<&[f32]> {
        (!self.on_device && self.lost.is_none()).then_some(&self.host[..])
    }

    /// For a backend: its device copy is now the newest (it has just
    /// written it); the host copy stays untouched until read.
    pub fn set_on_device(&mut self) {
        if !self.host.is_empty() {
            self.on_device = true;
        }
    }

    /// The values, copied back from the device when its copy is the newest
    /// (which stays the newest).
    pub fn read(&self) -> Result<Cow<'_, [f32]>, StateError> {
        if let Some(why) = &self.lost {
            return Err(StateError(why.clone()));
        }
        if !self.on_device {
            return Ok(Cow::Borrowed(&self.host));
        }
        let mut out = vec![0f32; self.host.len()];
        device_read(self.key(), &mut out)?;
        Ok(Cow::Owned(out))
    }

    /// The host copy to read or change: the device's copy is copied back
    /// first when it is the newest, and dropped (the host's becomes the
    /// only one).
    pub fn host_mut(&mut self) -> Result<&mut Vec<f32>, StateError> {
        if let Some(why) = &self.lost {
            return Err(StateError(why.clone()));
        }
        if self.on_device {
            // The host vector is not resized here, so the name stays valid.
            let key = self.key();
            device_read(key, &mut self.host)?;
            self.drop_device_copy();
        }
        Ok(&mut self.host)
    }

    /// `self = src`: on the device when `src`'s newest copy is there (a
    /// device-to-device copy), else on the host.
    pub fn copy_from(&mut self, src: &StateBuf) -> Result<(), StateError> {
        if src.on_device
            && src.lost.is_none()
            && self.host.len() == src.host.len()
            && let Some(b) = installed()
            && b.state_copy(src.key(), self.key()).is_ok()
        {
            self.on_device = true;
            self.lost = None;
            return Ok(());
        }
        // Overwritten whole: the device copy need not come back first.
        self.overwrite(&src.read()?);
        Ok(())
    }

    /// `self = values` (same length) on the host; the device copy is
    /// dropped unread.
    pub fn overwrite(&mut self, values: &[f32]) {
        self.drop_device_copy();
        self.lost = None;
        if self.host.len() == values.len() {
            copy_parallel(&mut self.host, values);
        } else {
            self.host.clear();
            self.host.extend_from_slice(values);
        }
    }

    fn drop_device_copy(&mut self) {
        if self.on_device {
            if let Some(b) = installed() {
                b.state_forget(self.key());
            }
            self.on_device = false;
        }
    }
}

fn device_read(key: StateKey, out: &mut [f32]) -> Result<(), StateError> {
    let b = installed().ok_or_else(|| StateError("no backend is installed".into()))?;
    b.state_read(key, out).map_err(StateError)
}

/// `dst = src` in parallel chunks (megabytes per KDA layer at K3's size;
/// a copy, so the split cannot matter).
fn copy_parallel(dst: &mut [f32], src: &[f32]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

impl Clone for StateBuf {
    /// A copy with its own device copy when the newest is on the device.
    /// When the device can no longer be reached the copy is marked lost
    /// (no panic): reading it fails with the device's error, so the step
    /// that needs it fails and names the cause.
    fn clone(&self) -> Self {
        if !self.on_device || self.lost.is_some() {
            return StateBuf {
                host: self.host.clone(),
                on_device: false,
                lost: self.lost.clone(),
            };
        }
        let mut c = StateBuf::zeros(self.host.len());
        if let Err(e) = c.copy_from(self) {
            c.lost = Some(e.0);
        }
        c
    }
}

impl Drop for StateBuf {
    fn drop(&mut self) {
        self.drop_device_copy();
    }
}

impl From<Vec<f32>> for StateBuf {
    fn from(v: Vec<f32>) -> Self {
        StateBuf::new(v)
    }
}
