//! `quantization_config` of a released checkpoint → the weight formats a
//! family's loader expects, validated once when the config is read.
//!
//! Read as Hugging Face ships them, with no conversion step:
//!
//! * `fp8` (DeepSeek-V3 / R1, Kimi K2): `fmt` `e4m3`, `activation_scheme`
//!   `dynamic`, `weight_block_size [br, bc]`. A quantized linear weight `W`
//!   is `F8_E4M3 [out, in]` beside `W_scale_inv` (f32 `[⌈out/br⌉, ⌈in/bc⌉]`):
//!   `W[i, j] = e4m3(W[i, j]) · scale_inv[i / br, j / bc]`. Which matrices
//!   are quantized is read off their dtype; norms, embeddings, routers and
//!   the head stay float. Activations stay f32 here: the weights are
//!   dequantised, the reference's dynamic FP8 activation rounding is not
//!   reproduced.
//! * `compressed-tensors` `pack-quantized` (Kimi K2 Thinking's routed
//!   experts): symmetric INT4 with a bf16 scale per `group_size` columns,
//!   `weight_packed` (I32 `[out, in/8]`, eight codes per word, low nibble
//!   first, stored `+8`), `weight_scale` (`[out, in/group]`), `weight_shape`.
//!   A module is quantized when `targets` name it (`Linear`: every linear
//!   module) and `ignore` does not; a `re:` entry is a Python regular
//!   expression matched from the start of the module name, any other entry
//!   the module's exact name.
//! * `mxfp4` (GPT-OSS): the stacked experts as E2M1 `_blocks` with E8M0
//!   `_scales` per 32 inputs; `modules_to_not_convert` entries are matched
//!   as the reference does (a regular expression from the start of the
//!   module name, or a suffix of it).

use regex::Regex;
use serde_json::Value;

use crate::error::Result;
use crate::fields::Fields;

/// How a checkpoint's weights are stored, from its `quantization_config`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Quant {
    /// No `quantization_config`: float weights.
    None,
    /// FP8 E4M3 with one f32 scale per `[rows, cols]` tile.
    Fp8Block { block: [usize; 2] },
    /// compressed-tensors `pack-quantized` symmetric INT4, one bf16 scale
    /// per `group` columns, on the modules `targets` names and `ignore` does not.
    PackedInt4 {
        group: usize,
        targets: Vec<String>,
        ignore: Vec<String>,
    },
    /// GPT-OSS's MXFP4 experts; the listed modules stay float.
    Mxfp4 { modules_to_not_convert: Vec<String> },
}

/// A method a family can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Fp8Block,
    PackedInt4,
    Mxfp4,
}

impl Method {
    /// What the method means here, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Method::Fp8Block => {
                "quant_method \"fp8\" (fmt e4m3, activation_scheme dynamic, weight_block_size \
                 [rows, cols] of powers of two with cols >= 32)"
            }
            Method::PackedInt4 => {
                "quant_method \"compressed-tensors\" with format \"pack-quantized\" (weights: \
                 num_bits 4, type int, symmetric, strategy group, group_size a power of two >= 32; \
                 no activation quantization)"
            }
            Method::Mxfp4 => "quant_method \"mxfp4\" (MXFP4 expert _blocks/_scales)",
        }
    }
}

/// The supported list, for error messages.
fn supported_list(methods: &[Method]) -> String {
    let mut s: Vec<&str> = methods.iter().map(|m| m.describe()).collect();
    s.push("no quantization_config (float weights)");
    s.join("; ")
}

/// Reads `quantization_config` (absent → [`Quant::None`]), accepting only
/// `methods`; anything else is refused naming the method and what is
/// supported.
pub(crate) fn parse(f: &Fields<'_>, family: &str, methods: &[Method]) -> Result<Quant> {
    let Some(q) = f.get("quantization_config") else {
        return Ok(Quant::None);
    };
    let path = if f.path.is_empty() {
        "quantization_config".to_string()
    } else {
        format!("{}.quantization_config", f.path)
    };
    let qf = Fields { v: q, path: &path };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("(unnamed)");
    let refuse = |detail: String| {
        Err(f.err(
            "quantization_config",
            format!(
                "quant_method {method:?}{detail}: not supported for {family}; supported: {}",
                supported_list(methods)
            ),
        ))
    };
    let wanted = match method {
        "fp8" => Method::Fp8Block,
        "compressed-tensors" => Method::PackedInt4,
        "mxfp4" => Method::Mxfp4,
        _ => return refuse(String::new()),
    };
    if !methods.contains(&wanted) {
        return refuse(String::new());
    }
    let bad = |name: &str, msg: String| -> Result<Quant> {
        Err(qf.err(
            name,
            format!("{msg}; supported: {}", supported_list(methods)),
        ))
    };
    match wanted {
        Method::Fp8Block => fp8(&qf, &bad),
        Method::PackedInt4 => packed_int4(&qf, q, &bad),
        Method::Mxfp4 => Ok(Quant::Mxfp4 {
            modules_to_not_convert: string_list(&qf, "modules_to_not_convert")?,
        }),
    }
}

type Bad<'a> = dyn Fn(&str, String) -> Result<Quant> + 'a;

fn fp8(qf: &Fields<'_>, bad: &Bad<'_>) -> Result<Quant> {
    if let Some(v) = qf.get("fmt").filter(|v| v.as_str() != Some("e4m3")) {
        return bad("fmt", format!("= {v}: only e4m3 is read"));
    }
    if let Some(v) = qf
        .get("activation_scheme")
        .filter(|v| v.as_str() != Some("dynamic"))
    {
        return bad(
            "activation_scheme",
            format!("= {v}: only dynamic (no stored activation scales)"),
        );
    }
    let Some(v) = qf.get("weight_block_size") else {
        return bad(
            "weight_block_size",
            "missing: per-tensor FP8 is not read, only block scales".into(),
        );
    };
    let dims: Vec<usize> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as usize)
                .collect()
        })
        .unwrap_or_default();
    match dims[..] {
        [br, bc] if br.is_power_of_two() && bc.is_power_of_two() && bc >= 32 => {
            Ok(Quant::Fp8Block { block: [br, bc] })
        }
        _ => bad(
            "weight_block_size",
            format!("= {v}: expected [rows, cols], powers of two with cols >= 32"),
        ),
    }
}

fn packed_int4(qf: &Fields<'_>, q: &Value, bad: &Bad<'_>) -> Result<Quant> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("(none)");
    if format != "pack-quantized" {
        return bad(
            "format",
            format!("= {format:?}: only \"pack-quantized\" (int4) is read for this family"),
        );
    }
    for name in ["kv_cache_scheme", "transform_config"] {
        if let Some(v) = qf.get(name).filter(|v| !is_empty(v)) {
            return bad(name, format!("= {v}: not supported"));
        }
    }
    if let Some(v) = qf.get("sparsity_config").filter(|v| !is_empty(v)) {
        return bad("sparsity_config", format!("= {v}: not supported"));
    }
    let Some(groups) = qf.get("config_groups").and_then(Value::as_object) else {
        return bad("config_groups", "missing".into());
    };
    let (mut group, mut targets) = (None, Vec::new());
    for (name, g) in groups {
        let at = |k: &str| format!("config_groups.{name}.{k}");
        let fmt = g.get("format").and_then(Value::as_str);
        if fmt.is_some_and(|s| s != "pack-quantized") {
            return bad(&at("format"), format!("= {fmt:?}: only pack-quantized"));
        }
        for act in ["input_activations", "output_activations"] {
            if let Some(v) = g.get(act).filter(|v| !v.is_null()) {
                return bad(
                    &at(act),
                    format!("= {v}: activation quantization is not read"),
                );
            }
        }
        let w = g.get("weights").unwrap_or(&Value::Null);
        let expect = |k: &str, want: Value| -> Result<()> {
            match w.get(k) {
                Some(v) if *v == want => Ok(()),
                v => bad(
                    &at(&format!("weights.{k}")),
                    format!("= {}: expected {want}", v.unwrap_or(&Value::Null)),
                )
                .map(drop),
            }
        };
        expect("num_bits", 4.into())?;
        expect("type", "int".into())?;
        expect("symmetric", true.into())?;
        expect("strategy", "group".into())?;
        for k in ["dynamic", "actorder", "block_structure"] {
            if let Some(v) = w
                .get(k)
                .filter(|v| !v.is_null() && **v != Value::Bool(false))
            {
                return bad(
                    &at(&format!("weights.{k}")),
                    format!("= {v}: not supported"),
                );
            }
        }
        let gs = w.get("group_size").and_then(Value::as_u64).unwrap_or(0) as usize;
        if !(gs.is_power_of_two() && gs >= 32) || group.is_some_and(|g| g != gs) {
            return bad(
                &at("weights.group_size"),
                format!("= {gs}: one group size for all groups, a power of two >= 32"),
            );
        }
        group = Some(gs);
        let gf = Fields { v: g, path: "" };
        targets.extend(string_list(&gf, "targets")?);
    }
    let Some(group) = group else {
        return bad("config_groups", "= {}: no group".into());
    };
    let ignore = string_list(qf, "ignore")?;
    for p in targets.iter().chain(&ignore) {
        if let Some(re) = p.strip_prefix("re:")
            && let Err(e) = anchored(re)
        {
            return bad(
                "ignore",
                format!("pattern {p:?} is not a regular expression: {e}"),
            );
        }
    }
    Ok(Quant::PackedInt4 {
        group,
        targets,
        ignore,
    })
}

fn is_empty(v: &Value) -> bool {
    v.is_null() || v.as_object().is_some_and(|o| o.is_empty())
}

/// A list of strings (absent → empty).
fn string_list(f: &Fields<'_>, name: &str) -> Result<Vec<String>> {
    let Some(v) = f.get(name) else {
        return Ok(Vec::new());
    };
    v.as_array()
        .and_then(|a| {
            a.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| f.err(name, format!("= {v}: expected a list of strings")))
}

/// `re` matched from the start of the text (Python's `re.match`).
fn anchored(re: &str) -> std::result::Result<Regex, regex::Error> {
    Regex::new(&format!("^(?:{re})"))
}

/// compressed-tensors' module matching: `re:` entries are regular
/// expressions from the start of the module name, `Linear` names every
/// linear module (the only kind asked about), anything else a module name.
pub struct ModuleMatcher {
    exact: Vec<String>,
    patterns: Vec<Regex>,
    every_linear: bool,
}

impl ModuleMatcher {
    /// From entries already validated by [`parse`].
    pub fn new(entries: &[String]) -> Self {
        let mut m = ModuleMatcher {
            exact: Vec::new(),
            patterns: Vec::new(),
            every_linear: false,
        };
        for e in entries {
            match e.strip_prefix("re:") {
                Some(re) => m.patterns.extend(anchored(re).ok()),
                None if e == "Linear" => m.every_linear = true,
                None => m.exact.push(e.clone()),
            }
        }
        m
    }

    /// Whether the linear module `name` (no `.weight` suffix) is named.
    pub fn matches(&self, name: &str) -> bool {
        self.every_linear
            || self.exact.iter().any(|e| e == name)
            || self.patterns.iter().any(|p| p.is_match(name))
    }
}

/// Which linear modules a `pack-quantized` config quantizes.
pub struct Int4Modules {
    targets: ModuleMatcher,
    ignore: ModuleMatcher,
}

impl Int4Modules {
    pub fn new(targets: &[String], ignore: &[String]) -> Self {
        Int4Modules {
            targets: ModuleMatcher::new(targets),
            ignore: ModuleMatcher::new(ignore),
        }
    }

    /// Whether the linear module `name` is stored pack-quantized.
    pub fn quantized(&self, name: &str) -> bool {
        self.targets.matches(name) && !self.ignore.matches(name)
    }
}

/// Whether an `mxfp4` config converts the module `name`: no entry of
/// `modules_to_not_convert` matches it from its start (as a regular
/// expression, or literally when it is not one) or ends it.
pub fn mxfp4_converts(not_convert: &[String], name: &str) -> bool {
    !not_convert.iter().any(|p| {
        name.ends_with(p.as_str())
            || match anchored(p) {
                Ok(re) => re.is_match(name),
                Err(_) => name.starts_with(p.as_str()),
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_q(q: Value, methods: &[Method]) -> std::result::Result<Quant, String> {
        let root = json!({ "quantization_config": q });
        let f = Fields { v: &root, path: "" };
        parse(&f, "Test", methods).map_err(|e| e.to_string())
    }

    #[test]
    fn kimi_k2_thinking_ignore_list() {
        let q = parse_q(
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                    "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                        "strategy": "group", "group_size": 32, "dynamic": false, "actorder": null}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}),
            &[Method::Fp8Block, Method::PackedInt4],
        )
        .unwrap();
        let Quant::PackedInt4 {
            group,
            targets,
            ignore,
        } = q
        else {
            panic!("{q:?}")
        };
        assert_eq!(group, 32);
        let m = Int4Modules::new(&targets, &ignore);
        assert!(m.quantized("model.layers.1.mlp.experts.7.down_proj"));
        assert!(!m.quantized("model.layers.1.mlp.shared_experts.down_proj"));
        assert!(!m.quantized("model.layers.0.mlp.gate_proj"));
        assert!(!m.quantized("model.layers.3.self_attn.kv_b_proj"));
        assert!(!m.quantized("lm_head"));
    }

    #[test]
    fn refusals_name_the_method_and_what_is_supported() {
        let both = [Method::Fp8Block, Method::PackedInt4];
        let e = parse_q(json!({"quant_method": "awq"}), &both).unwrap_err();
        assert!(
            e.contains("\"awq\"") && e.contains("fp8") && e.contains("pack-quantized"),
            "{e}"
        );
        let e = parse_q(json!({"quant_method": "mxfp4"}), &both).unwrap_err();
        assert!(e.contains("\"mxfp4\"") && e.contains("supported"), "{e}");
        let e = parse_q(
            json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            &both,
        )
        .unwrap_err();
        assert!(e.contains("fmt") && e.contains("e5m2"), "{e}");
        let e = parse_q(
            json!({"quant_method": "fp8", "weight_block_size": [128, 16]}),
            &both,
        )
        .unwrap_err();
        assert!(e.contains("weight_block_size"), "{e}");
        let e = parse_q(
            json!({"quant_method": "compressed-tensors", "format": "float-quantized"}),
            &both,
        )
        .unwrap_err();
        assert!(
            e.contains("float-quantized") && e.contains("pack-quantized"),
            "{e}"
        );
        let e = parse_q(
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                    "symmetric": true, "strategy": "group", "group_size": 32}}}}),
            &both,
        )
        .unwrap_err();
        assert!(e.contains("num_bits") && e.contains("= 8"), "{e}");
        let e = parse_q(json!({"quant_method": "fp8"}), &[Method::Mxfp4]).unwrap_err();
        assert!(e.contains("\"fp8\"") && e.contains("mxfp4"), "{e}");
    }

    #[test]
    fn gpt_oss_modules_to_not_convert() {
        let keep: Vec<String> = [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ]
        .map(String::from)
        .to_vec();
        assert!(mxfp4_converts(&keep, "model.layers.3.mlp.experts"));
        assert!(!mxfp4_converts(&keep, "model.layers.3.self_attn.q_proj"));
        assert!(!mxfp4_converts(&keep, "lm_head"));
        assert!(!mxfp4_converts(
            &["model.layers.*.mlp.experts".into()],
            "model.layers.0.mlp.experts"
        ));
    }
}
