//! One sequence from start to end through the step engine: what `run`,
//! `chat` and the tests use. (Batches go through [`crate::Engine`] directly.)

use std::ops::ControlFlow;
use std::sync::Arc;

use fathom_model::CausalLm;

use crate::scheduler::{
    Decoder, Engine, EngineOptions, Event, FinishReason, Finished, Request, SubmitError, TokenEvent,
};

/// Why a single generation failed.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error("generation failed: {0}")]
    Failed(String),
}

/// Runs `req` alone to its end. `on_token` sees every token as it is
/// chosen; `Break` cancels (the result then says `Cancelled`).
pub fn generate(
    lm: &Arc<dyn CausalLm>,
    req: Request,
    decoder: Option<Decoder>,
    on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
) -> Result<Finished, GenError> {
    generate_with(lm, req, EngineOptions::default(), decoder, on_token)
}

/// [`generate`] with the engine's options (the prefill chunk is
/// `opts.max_step_tokens`; output does not depend on it).
pub fn generate_with(
    lm: &Arc<dyn CausalLm>,
    req: Request,
    opts: EngineOptions,
    decoder: Option<Decoder>,
    mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
) -> Result<Finished, GenError> {
    let mut engine = Engine::new(lm.clone(), opts, decoder);
    let id = engine.submit(req)?;
    loop {
        for ev in engine.step() {
            match ev {
                Event::Token { token, .. } => {
                    if on_token(&token).is_break() {
                        engine.cancel(id);
                    }
                }
                Event::Finished { done, .. } => {
                    if let FinishReason::Error(e) = &done.reason {
                        return Err(GenError::Failed(e.clone()));
                    }
                    return Ok(*done);
                }
                Event::Checkpoint { .. } => {}
            }
        }
    }
}

/// Greedy decoding of up to `max_new` tokens; `stop_ids` end it (the stop
/// token is kept). The plain reference that everything else must equal.
pub fn greedy(
    lm: &Arc<dyn CausalLm>,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, GenError> {
    let mut req = Request::new(prompt.to_vec(), max_new);
    req.stop_ids = stop_ids.to_vec();
    Ok(generate(lm, req, None, |_| ControlFlow::Continue(()))?.output_ids)
}
