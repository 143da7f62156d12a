//! Hugging Face Jinja chat templates, rendered with `minijinja`.
//!
//! Parity with `transformers`' renderer needs a configured environment:
//! - `trim_blocks` and `lstrip_blocks` on (transformers sets both);
//! - Python string/dict methods (`.strip()`, `.get()`, …) via `minijinja-contrib`'s
//!   pycompat callback;
//! - `tojson` replaced: minijinja's HTML-escapes `<>&'`, HF's is plain
//!   `json.dumps(x, ensure_ascii=False, indent=…)` with `", "`/`": "` separators;
//! - `raise_exception(msg)` and `strftime_now(fmt)` globals.
//!
//! The rendered string is template output in which the template itself places special
//! tokens, so it is returned as one trusted segment (as HF tokenizes it); injection
//! safety for such models rests on the template.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value;

use crate::ChatError;
use crate::pyjson::{PyJsonOptions, dumps};
use crate::segment::Segment;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the special tokens templates commonly reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token` / `eos_token` etc. from `tokenizer_config.json`, passed to the
    /// template unless the caller's context sets them.
    defaults: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles template source.
    pub fn new(source: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
        Ok(Self {
            env,
            defaults: serde_json::Map::new(),
        })
    }

    /// Loads the template a model directory ships: `chat_template.jinja`, else
    /// `tokenizer_config.json` → `chat_template` (a string, or a list of
    /// `{name, template}` from which `default` is taken). `Ok(None)` if there is none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, ChatError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            let text = read(&config_path)?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| config_err(&config_path, "<root>", e.to_string()))?;
            Some(v)
        } else {
            None
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(read(&jinja_path)?)
        } else {
            match &config {
                Some(c) => template_from_config(c, &config_path)?,
                None => None,
            }
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let mut template = Self::new(&source)?;
        if let Some(Value::Object(c)) = &config {
            for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(tok) = special_token_text(c.get(key)) {
                    template
                        .defaults
                        .insert(key.to_string(), Value::String(tok));
                }
            }
        }
        Ok(Some(template))
    }

    /// Renders with `context` (typically `messages`, `tools`, `add_generation_prompt`,
    /// plus any template-specific switches such as `enable_thinking`).
    pub fn render(&self, context: &serde_json::Map<String, Value>) -> Result<String, ChatError> {
        let mut ctx = self.defaults.clone();
        for (k, v) in context {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        Ok(tmpl.render(JValue::from(minijinja::value::Serde(&ctx)))?)
    }

    /// Renders `messages` and returns the prompt as one trusted segment.
    pub fn render_segments(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<Segment>, ChatError> {
        self.render_segments_with(messages, add_generation_prompt, serde_json::Map::new())
    }

    /// [`ChatTemplate::render_segments`] with further template variables
    /// (`enable_thinking`, `tools`, …).
    pub fn render_segments_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        mut ctx: serde_json::Map<String, Value>,
    ) -> Result<Vec<Segment>, ChatError> {
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        Ok(vec![Segment::Trusted(self.render(&ctx)?)])
    }
}

fn read(path: &Path) -> Result<String, ChatError> {
    std::fs::read_to_string(path).map_err(|source| ChatError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn config_err(path: &Path, field: &str, message: String) -> ChatError {
    ChatError::Config {
        path: PathBuf::from(path),
        field: field.to_string(),
        message,
    }
}

fn template_from_config(config: &Value, path: &Path) -> Result<Option<String>, ChatError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |name: &str| {
                list.iter().find_map(|e| {
                    (e.get("name")?.as_str()? == name)
                        .then(|| e.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            match named("default") {
                Some(t) => Ok(Some(t)),
                None => Err(config_err(
                    path,
                    "chat_template",
                    "list form has no `default` entry".into(),
                )),
            }
        }
        Some(other) => Err(config_err(
            path,
            "chat_template",
            format!("expected a string or a list, found {other}"),
        )),
    }
}

/// `"<s>"` or `{"content": "<s>", …}` (the AddedToken form).
fn special_token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=…)`.
fn tojson(value: &JValue, kwargs: Kwargs) -> Result<JValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json: Value = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let options = PyJsonOptions {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    // Safe string: the output must not be auto-escaped again.
    Ok(JValue::from_safe_string(dumps(&json, options)))
}

fn raise_exception(message: String) -> Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(fmt)` for the directives chat templates use, in UTC
/// (the engine has no time-zone database; templates use it for "today's date").
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    crate::clock::strftime(secs, &format)
}
