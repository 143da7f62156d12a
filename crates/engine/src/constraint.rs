//! Constrained decoding: a sequence's allowed next tokens.
//!
//! A [`Constraint`] masks the full model's logits to the tokens it allows;
//! the sampler then chooses among those exactly as it would among all, so
//! the model still decides (and with no constraint nothing changes).

/// Decides which tokens may come next in one sequence.
pub trait Constraint: Send {
    /// Sets the logit of every token not allowed next to `-inf`; returns
    /// false when no token is allowed (the sequence then ends with an error).
    fn mask(&mut self, logits: &mut [f32]) -> bool;
    /// Takes the token chosen at this position.
    fn accept(&mut self, token: u32);
    /// The constrained output is complete: the sequence ends (reason stop).
    fn is_done(&self) -> bool;
}
