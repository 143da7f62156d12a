//! Expert heat: what `--heat` warms and pins before the first step, and
//! where `--heat-out` adds this run's counts.

use std::sync::Arc;

use anyhow::{Result, bail};
use fathom_model::ModelConfig;
use fathom_stream::StreamedExperts;

use crate::options::{ExpertMode, LoadRequest};

/// The streamed store's heat: what `--heat` warmed, and where `--heat-out`
/// adds this run's counts.
#[derive(Clone, Default)]
pub struct HeatHandle {
    store: Option<Arc<StreamedExperts>>,
    out: Option<std::path::PathBuf>,
    model: String,
    /// Experts read before the first step, pinned among them, bytes read.
    pub warmed: Option<(usize, usize, u64)>,
}

impl std::fmt::Debug for HeatHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeatHandle")
            .field("out", &self.out)
            .field("warmed", &self.warmed)
            .finish()
    }
}

impl HeatHandle {
    /// Adds the counts so far (from `tokens` positions) to `--heat-out`.
    pub fn record(&self, tokens: u64) -> Result<()> {
        let (Some(store), Some(out)) = (&self.store, &self.out) else {
            return Ok(());
        };
        let total = store
            .heat(&self.model, tokens)
            .merge_into(out)
            .map_err(anyhow::Error::msg)?;
        tracing::info!(
            "heat: {} now holds counts from {} positions",
            out.display(),
            total.tokens
        );
        Ok(())
    }
}

/// Checks --heat / --heat-out before loading: they need streamed experts,
/// and their files must be this model's. Returns the model's digest (when
/// heat is used) and the --heat file.
pub(crate) fn heat_precheck(
    config: &ModelConfig,
    mem: &LoadRequest,
    stream: bool,
) -> Result<(String, Option<fathom_stream::Heat>)> {
    if mem.heat.is_none() && mem.heat_out.is_none() {
        return Ok((String::new(), None));
    }
    if mem.heat_out.is_some() && !mem.records_heat {
        bail!("--heat-out is recorded by `fathom run` and `fathom batch` only");
    }
    if !stream {
        if mem.experts == ExpertMode::Resident {
            bail!(
                "--heat and --heat-out keep and record what a streamed expert cache holds: \
                 with --experts resident every expert is in RAM; use --experts stream"
            );
        }
        tracing::warn!(
            "every expert fits the budget and is resident: --heat/--heat-out do nothing"
        );
        return Ok((String::new(), None));
    }
    let model = config_digest(config);
    // An existing --heat-out file must be this model's: checked now, not
    // after the run.
    if let Some(p) = mem.heat_out.as_ref().filter(|p| p.exists()) {
        fathom_stream::Heat::read(p, &model, None)
            .map_err(|e| anyhow::anyhow!("{}", e.replacen("--heat ", "--heat-out ", 1)))?;
    }
    let heat = mem
        .heat
        .as_ref()
        .map(|p| fathom_stream::Heat::read(p, &model, None).map_err(anyhow::Error::msg))
        .transpose()?;
    Ok((model, heat))
}

/// Reads the hottest experts of `heat` into the store's cache (pinning the
/// --heat-pin share) and sets up --heat-out.
pub(crate) fn warm_from_heat(
    mem: &LoadRequest,
    store: Option<Arc<StreamedExperts>>,
    model: String,
    heat: Option<fathom_stream::Heat>,
) -> Result<HeatHandle> {
    let Some(store) = store else {
        return Ok(HeatHandle::default());
    };
    let mut warmed = None;
    if let (Some(h), Some(p)) = (heat, &mem.heat) {
        h.check_shape(p, &store.experts_per_layer())
            .map_err(anyhow::Error::msg)?;
        let keys = h.ranked();
        let cap = store.cache_capacity();
        let pin = (cap as f64 * mem.heat_pin).floor() as usize;
        let n = keys.len().min(cap);
        let bytes = store.warm(&keys, pin)?;
        let pinned = store.pinned();
        tracing::info!(
            "heat: read {n} of {cap} cache places ({}) before the first step, {pinned} pinned",
            fathom_weights::units::format_bytes(bytes)
        );
        warmed = Some((n, pinned, bytes));
    }
    Ok(HeatHandle {
        store: Some(store),
        out: mem.heat_out.clone(),
        model,
        warmed,
    })
}

/// A model's identity for heat files: the first 16 hex digits of the
/// SHA-256 of its config.json.
pub fn config_digest(config: &ModelConfig) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(config.bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}
