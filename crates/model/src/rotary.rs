//! Rotary position embedding as the families configure and apply it: the
//! `config.json` rope parameters (plain or YaRN) → a
//! [`fathom_kernels::rope::Rope`], the angles of a step's rows, and the
//! interleaved-pair layout some checkpoints use.

use fathom_kernels::rope::{Rope, Yarn, yarn_mscale};
use serde_json::Value;

use crate::batch::Segment;
use crate::error::Result;
use crate::fields::Fields;

/// The rotary angles of every row of a step: `cos`, `sin`, `[N, head_dim/2]`.
pub struct Angles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    half: usize,
}

impl Angles {
    /// Angles of the positions `starts[i] + j` of segment `segs[i]`'s rows.
    pub fn new(rope: &Rope, segs: &[Segment], starts: &[usize]) -> Self {
        let half = rope.head_dim() / 2;
        let n = segs.last().map_or(0, |s| s.end);
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for (seg, &p0) in segs.iter().zip(starts) {
            for (j, r) in seg.clone().enumerate() {
                let (c, s) = (&mut cos[r * half..][..half], &mut sin[r * half..][..half]);
                rope.angles(p0 + j, c, s);
            }
        }
        Angles { cos, sin, half }
    }

    /// Row `r`'s `cos` and `sin`.
    pub fn row(&self, r: usize) -> (&[f32], &[f32]) {
        let h = self.half;
        (&self.cos[r * h..][..h], &self.sin[r * h..][..h])
    }
}

/// Reorders every head of `x` (`[heads, head_dim]`) from interleaved pairs
/// `(x0, x1), (x2, x3), …` to the rotate-half layout `x0 x2 … | x1 x3 …`,
/// so [`Rope::rotate`] rotates the pairs a checkpoint trained with
/// interleaved rotary embedding expects (DeepSeek-V3's `rope_interleave`).
/// Queries and keys get the same reordering, so their dot products are
/// those of the interleaved rotation.
pub fn deinterleave(x: &mut [f32], head_dim: usize) {
    let half = head_dim / 2;
    let mut tmp = vec![0f32; head_dim];
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            tmp[i] = head[2 * i];
            tmp[half + i] = head[2 * i + 1];
        }
        head.copy_from_slice(&tmp);
    }
}

/// YaRN as a config declares it (`rope_scaling` or `rope_parameters` with
/// `rope_type`/`type` `"yarn"`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// DeepSeek's magnitude scales (`mscale`, `mscale_all_dim`), if given.
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// An explicit `attention_factor`, if given.
    pub attention_factor: Option<f64>,
    /// Whether the correction range is rounded outward (default true).
    pub truncate: bool,
}

impl YarnConfig {
    /// What `cos` and `sin` are multiplied by: the explicit factor, else
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both
    /// are set (DeepSeek), else `0.1·ln(factor) + 1`.
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                yarn_mscale(self.factor, m) / yarn_mscale(self.factor, a)
            }
            _ => yarn_mscale(self.factor, 1.0),
        }
    }
}

/// A config's rotary embedding: the base and, if scaled, YaRN.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RopeConfig {
    pub theta: f64,
    pub yarn: Option<YarnConfig>,
}

impl RopeConfig {
    /// The rotation of heads `head_dim` wide.
    pub fn rope(&self, head_dim: usize) -> Rope {
        match &self.yarn {
            None => Rope::new(head_dim, self.theta),
            Some(y) => Rope::yarn(
                head_dim,
                self.theta,
                &Yarn {
                    factor: y.factor,
                    original_max_position: y.original_max_position_embeddings,
                    beta_fast: y.beta_fast,
                    beta_slow: y.beta_slow,
                    truncate: y.truncate,
                    attention_factor: y.attention_factor() as f32,
                },
            ),
        }
    }

    /// Reads `rope_theta` (top level, or inside the rope parameters as newer
    /// configs write it) and `rope_scaling` / `rope_parameters`: plain
    /// (`"default"` or absent) or `"yarn"`; any other kind is refused with
    /// its name. `max_position_embeddings` stands in for a missing
    /// `original_max_position_embeddings`, as in the reference.
    pub(crate) fn from_config(f: &Fields<'_>) -> Result<Self> {
        let mut yarn = None;
        let mut theta_in = None;
        for name in ["rope_scaling", "rope_parameters"] {
            let Some(v) = f.get(name) else { continue };
            let p = Fields { v, path: name };
            let kind = match p.get("rope_type") {
                Some(_) => p.str_or("rope_type", "default")?,
                None => p.str_or("type", "default")?,
            };
            match kind {
                "default" => {}
                "yarn" => yarn = Some(yarn_config(f, &p)?),
                other => {
                    return Err(p.err(
                        "rope_type",
                        format!(
                            "= {other:?}: only plain (\"default\") and \"yarn\" rotary embedding are supported"
                        ),
                    ));
                }
            }
            theta_in = theta_in.or(p.get("rope_theta"));
        }
        let theta = match f.get("rope_theta").or(theta_in) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| f.err("rope_theta", format!("= {v}: expected a number")))?,
            None => 10_000.0,
        };
        if !(theta.is_finite() && theta > 1.0) {
            return Err(f.err("rope_theta", format!("= {theta}: must be a number above 1")));
        }
        Ok(RopeConfig { theta, yarn })
    }
}

fn yarn_config(f: &Fields<'_>, p: &Fields<'_>) -> Result<YarnConfig> {
    let num = |name: &str, default: Option<f64>| -> Result<Option<f64>> {
        match p.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| p.err(name, format!("= {v}: expected a number"))),
        }
    };
    let factor = num("factor", None)?.ok_or_else(|| p.err("factor", "missing"))?;
    if !(1.0..=1e6).contains(&factor) {
        return Err(p.err("factor", format!("= {factor}: must be in [1, 1e6]")));
    }
    let top_max = f.get("max_position_embeddings").and_then(Value::as_f64);
    let original = num("original_max_position_embeddings", top_max)?
        .ok_or_else(|| p.err("original_max_position_embeddings", "missing"))?;
    let y = YarnConfig {
        factor,
        original_max_position_embeddings: original,
        beta_fast: num("beta_fast", Some(32.0))?.unwrap_or(32.0),
        beta_slow: num("beta_slow", Some(1.0))?.unwrap_or(1.0),
        mscale: num("mscale", None)?,
        mscale_all_dim: num("mscale_all_dim", None)?,
        attention_factor: num("attention_factor", None)?,
        truncate: p.bool_or("truncate", true)?,
    };
    for (name, v) in [
        (
            "original_max_position_embeddings",
            y.original_max_position_embeddings,
        ),
        ("beta_fast", y.beta_fast),
        ("beta_slow", y.beta_slow),
    ] {
        if v <= 0.0 {
            return Err(p.err(name, format!("= {v}: must be positive")));
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<RopeConfig> {
        RopeConfig::from_config(&Fields { v: &v, path: "" })
    }

    #[test]
    fn reads_plain_and_yarn() {
        let r = read(json!({"rope_theta": 5e5})).unwrap();
        assert_eq!((r.theta, r.yarn), (5e5, None));
        let r = read(json!({"rope_theta": 1e4, "max_position_embeddings": 163840,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}))
        .unwrap();
        let y = r.yarn.unwrap();
        assert_eq!(
            (y.factor, y.original_max_position_embeddings),
            (40.0, 4096.0)
        );
        assert_eq!(y.attention_factor(), 1.0);
        assert!(y.truncate);
        let r = read(
            json!({"rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn",
            "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": false}}),
        )
        .unwrap();
        let y = r.yarn.unwrap();
        assert!((y.attention_factor() - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
        assert!(!y.truncate);
    }

    #[test]
    fn refuses_other_kinds_by_name() {
        let e = read(json!({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rope_scaling.rope_type") && e.contains("longrope"),
            "{e}"
        );
        let e = read(json!({"rope_scaling": {"type": "yarn"}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling.factor: missing"), "{e}");
    }

    #[test]
    fn deinterleave_pairs_each_head() {
        let mut x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        deinterleave(&mut x, 4);
        assert_eq!(x, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
    }
}
