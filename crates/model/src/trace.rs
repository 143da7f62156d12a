//! Observation of a forward pass, for comparing with reference dumps.

use crate::moe::Route;

/// Observer of named intermediates (per layer; what each family reports is
/// listed with its step) and of routing decisions. Costs nothing when
/// absent.
pub trait Tracer {
    fn tensor(&mut self, _layer: usize, _name: &str, _rows: &[f32]) {}
    fn routes(&mut self, _layer: usize, _routes: &[Route]) {}
}

/// Hands `rows` to the tracer, if any.
pub(crate) fn trace(tracer: &mut Option<&mut dyn Tracer>, layer: usize, name: &str, rows: &[f32]) {
    if let Some(t) = tracer.as_deref_mut() {
        t.tensor(layer, name, rows);
    }
}
