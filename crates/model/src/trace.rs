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

/// Runs `f` with room for its routes when a tracer is there, then hands
/// them to it as layer `layer`'s.
pub(crate) fn routed<T>(
    tracer: &mut Option<&mut dyn Tracer>,
    layer: usize,
    f: impl FnOnce(Option<&mut Vec<Route>>) -> crate::error::Result<T>,
) -> crate::error::Result<T> {
    let mut routes = tracer.as_ref().map(|_| Vec::new());
    let out = f(routes.as_mut())?;
    if let (Some(tr), Some(r)) = (tracer.as_deref_mut(), routes) {
        tr.routes(layer, &r);
    }
    Ok(out)
}
