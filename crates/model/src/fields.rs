//! Typed, validated reads of `config.json` fields, shared by the families'
//! spec parsers: every error names the dotted JSON path and the value.

use serde_json::Value;

use crate::error::{ModelError, Result};

/// Typed access to one JSON object, reporting the dotted path on error.
pub(crate) struct Fields<'a> {
    pub(crate) v: &'a Value,
    pub(crate) path: &'a str,
}

impl<'a> Fields<'a> {
    pub(crate) fn err(&self, name: &str, msg: impl Into<String>) -> ModelError {
        let field = if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.path, name)
        };
        ModelError::Config {
            field,
            msg: msg.into(),
        }
    }
    /// `eps` (field `rms_norm_eps`): a number in (0, 1).
    pub(crate) fn check_eps(&self, eps: f32) -> Result<()> {
        if eps.is_finite() && eps > 0.0 && eps < 1.0 {
            return Ok(());
        }
        let msg = format!("= {eps}: must be a number in (0, 1)");
        Err(self.err("rms_norm_eps", msg))
    }
    /// `rsf` (field `routed_scaling_factor`): a number in (0, 10000].
    pub(crate) fn check_scaling(&self, rsf: f32) -> Result<()> {
        if rsf.is_finite() && rsf > 0.0 && rsf <= 1e4 {
            return Ok(());
        }
        let msg = format!("= {rsf}: must be a number in (0, 10000]");
        Err(self.err("routed_scaling_factor", msg))
    }
    /// A grouped sigmoid router's sizes: `g.experts` in groups of at least
    /// 2, `topk_group` ≤ groups, `top_k` within the kept groups; `first_k`
    /// dense layers ≤ `layers`.
    pub(crate) fn check_groups(&self, g: &GroupFields<'_>) -> Result<()> {
        let (e, g_n, tg, k) = (g.experts, g.groups, g.topk_group, g.top_k);
        if !e.is_multiple_of(g_n) || (g_n > 1 && e / g_n < 2) || tg > g_n {
            let msg = format!(
                "= {g_n} with topk_group {tg}: needs groups of at least 2 of the {e} experts and topk_group ≤ {}",
                g.groups_word
            );
            return Err(self.err(g.groups_key, msg));
        }
        if k > tg * (e / g_n) {
            let msg = format!("= {k} exceeds the experts of the kept groups");
            return Err(self.err(g.top_k_key, msg));
        }
        if g.first_k > g.layers {
            let msg = format!("= {}: exceeds num_hidden_layers", g.first_k);
            return Err(self.err("first_k_dense_replace", msg));
        }
        Ok(())
    }
    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        self.v.get(name).filter(|v| !v.is_null())
    }
    pub(crate) fn req(&self, name: &str) -> Result<&'a Value> {
        self.get(name).ok_or_else(|| self.err(name, "missing"))
    }
    pub(crate) fn usize(&self, name: &str) -> Result<usize> {
        let v = self.req(name)?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(name, format!("= {v}: expected a non-negative integer")))
    }
    /// A positive size, at most [`MAX_DIM`] (bounded before anything is
    /// allocated with it).
    pub(crate) fn positive(&self, name: &str) -> Result<usize> {
        let x = self.usize(name)?;
        if x == 0 {
            return Err(self.err(name, "= 0: must be positive"));
        }
        if x > MAX_DIM {
            return Err(self.err(
                name,
                format!("= {x}: larger than any model this reads (at most {MAX_DIM})"),
            ));
        }
        Ok(x)
    }
    pub(crate) fn f32(&self, name: &str) -> Result<f32> {
        let v = self.req(name)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.err(name, format!("= {v}: expected a number")))
    }
    pub(crate) fn opt_f32(&self, name: &str) -> Result<Option<f32>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.f32(name).map(Some),
        }
    }
    pub(crate) fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(name, format!("= {v}: expected true or false"))),
        }
    }
    pub(crate) fn str_or(&self, name: &str, default: &'a str) -> Result<&'a str> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(name, format!("= {v}: expected a string"))),
        }
    }
    pub(crate) fn usize_list(&self, name: &str) -> Result<Vec<usize>> {
        let v = self.req(name)?;
        v.as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|u| u as usize)).collect())
            .ok_or_else(|| self.err(name, format!("= {v}: expected a list of integers")))
    }
    pub(crate) fn expect_str(&self, name: &str, default: &str, allowed: &str) -> Result<()> {
        let s = self.str_or(name, default)?;
        if s != allowed {
            return Err(self.err(name, format!("= {s:?}: only {allowed:?} is supported")));
        }
        Ok(())
    }
    pub(crate) fn expect_true(&self, name: &str, default: bool) -> Result<()> {
        if !self.bool_or(name, default)? {
            return Err(self.err(name, "= false: only true is supported"));
        }
        Ok(())
    }
}

/// Largest size field accepted (layers, experts, widths, vocabulary).
pub const MAX_DIM: usize = 1 << 24;

/// The sizes [`Fields::check_groups`] checks, with the families' field names.
pub(crate) struct GroupFields<'k> {
    pub experts: usize,
    pub groups: usize,
    pub groups_key: &'k str,
    /// How the message names the group count.
    pub groups_word: &'k str,
    pub topk_group: usize,
    pub top_k: usize,
    pub top_k_key: &'k str,
    pub first_k: usize,
    pub layers: usize,
}
