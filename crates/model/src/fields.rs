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
