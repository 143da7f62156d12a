//! What one bench run compares: arms (a name plus `fathom run` flags, or a
//! peer engine's command template) and the prompts they all get.
//!
//! Arms come from the command line as `NAME=FLAGS`; the flags are split into
//! words here (quotes and backslashes as a POSIX shell would treat them) so
//! no shell ever sees user text — a prompt substituted into a peer's command
//! becomes exactly one argument, whatever characters it holds.

use anyhow::{Result, bail};

/// Flags the harness itself passes to every `fathom run`; an arm may not set them.
const RESERVED: [&str; 6] = [
    "--model",
    "--prompt",
    "--prompt-ids",
    "--max-new",
    "--json",
    "--stats",
];

/// Placeholders a peer's command template may use.
pub const PLACEHOLDERS: [&str; 5] = [
    "{prompt}",
    "{prompt_ids}",
    "{max_new}",
    "{model}",
    "{threads}",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArmKind {
    /// `fathom run --json` with these extra flags.
    Fathom { flags: Vec<String> },
    /// Another engine: argv template with placeholders.
    Peer { template: Vec<String> },
}

/// One arm: a named configuration measured in fresh processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arm {
    pub name: String,
    pub kind: ArmKind,
    /// The text after `=`, as given (for reports).
    pub spec: String,
}

impl Arm {
    pub fn is_peer(&self) -> bool {
        matches!(self.kind, ArmKind::Peer { .. })
    }

    /// Parses `NAME=FLAGS` for a fathom arm.
    pub fn parse_fathom(text: &str) -> Result<Arm> {
        let (name, spec) = split_named(text, "--arm")?;
        let flags = split_words(spec)?;
        for f in &flags {
            let flag = f.split('=').next().unwrap_or(f);
            if RESERVED.contains(&flag) {
                bail!("--arm {name}: {flag} is set by the bench itself; remove it from the arm");
            }
        }
        Ok(Arm {
            name: name.to_string(),
            kind: ArmKind::Fathom { flags },
            spec: spec.to_string(),
        })
    }

    /// Parses `NAME=COMMAND TEMPLATE` for a peer arm.
    pub fn parse_peer(text: &str) -> Result<Arm> {
        let (name, spec) = split_named(text, "--peer")?;
        let template = split_words(spec)?;
        if template.is_empty() {
            bail!("--peer {name}: the command is empty");
        }
        Ok(Arm {
            name: name.to_string(),
            kind: ArmKind::Peer { template },
            spec: spec.to_string(),
        })
    }
}

fn split_named<'a>(text: &'a str, flag: &str) -> Result<(&'a str, &'a str)> {
    let Some((name, rest)) = text.split_once('=') else {
        bail!("{flag} {text:?}: expected NAME=\"...\" (e.g. {flag} stream=\"--experts stream\")");
    };
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        bail!("{flag} {text:?}: the name must be letters, digits, '_', '-' or '.'");
    }
    Ok((name, rest))
}

/// Rejects two arms with the same name (their samples would be merged).
pub fn check_unique(arms: &[Arm]) -> Result<()> {
    for (i, a) in arms.iter().enumerate() {
        if arms[..i].iter().any(|b| b.name == a.name) {
            bail!("two arms are named {:?}; names must be unique", a.name);
        }
    }
    Ok(())
}

/// Splits text into words like a POSIX shell, without expansions: blanks
/// separate words, '…' is literal, "…" allows \" \\ \$ \` escapes, and a
/// backslash outside quotes escapes the next character.
pub fn split_words(text: &str) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => bail!("unterminated ' in {text:?}"),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => bail!("unterminated \" in {text:?}"),
                        },
                        Some(c) => cur.push(c),
                        None => bail!("unterminated \" in {text:?}"),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => cur.push(c),
                    None => bail!("trailing backslash in {text:?}"),
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// A prompt as token ids, as text, or as one user message in the model's
/// chat format (text and chat need the model's tokenizer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Ids(Vec<u32>),
    Text(String),
    /// `fathom run --chat --prompt TEXT`; a peer gets TEXT as `{prompt}`.
    Chat(String),
}

impl Prompt {
    /// The `fathom run` flags that pass this prompt.
    pub fn run_flags(&self) -> Vec<String> {
        match self {
            Prompt::Ids(ids) => vec!["--prompt-ids".into(), join_ids(ids)],
            Prompt::Text(t) => vec!["--prompt".into(), t.clone()],
            Prompt::Chat(t) => vec!["--chat".into(), "--prompt".into(), t.clone()],
        }
    }

    /// The text a peer gets as `{prompt}`.
    pub fn text(&self) -> Option<&str> {
        match self {
            Prompt::Ids(_) => None,
            Prompt::Text(t) | Prompt::Chat(t) => Some(t),
        }
    }

    /// A short label for tables.
    pub fn describe(&self) -> String {
        match self {
            Prompt::Ids(ids) => format!("{} token ids", ids.len()),
            Prompt::Text(t) => format!("{} chars of text", t.chars().count()),
            Prompt::Chat(t) => format!("a chat turn of {} chars", t.chars().count()),
        }
    }

    /// The prompt as the report's JSON shows it.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Prompt::Ids(ids) => serde_json::json!({ "ids": ids }),
            Prompt::Text(t) => serde_json::json!({ "text": t }),
            Prompt::Chat(t) => serde_json::json!({ "chat": t }),
        }
    }
}

pub fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Parses `1,591,25` (spaces allowed).
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("{s:?} is not a token id (in {text:?})"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("no token ids in {text:?}");
    }
    Ok(ids)
}

/// Parses a prompts file: one prompt per line; `ids: 1,2,3` lines are token
/// ids, other lines text; blank lines and lines starting with `#` are skipped.
pub fn parse_prompts_file(text: &str) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        if let Some(ids) = l.strip_prefix("ids:") {
            out.push(Prompt::Ids(
                parse_ids(ids).map_err(|e| anyhow::anyhow!("line {}: {e}", i + 1))?,
            ));
        } else {
            out.push(Prompt::Text(l.to_string()));
        }
    }
    if out.is_empty() {
        bail!("the prompts file has no prompts (one per line; `ids: 1,2,3` for token ids)");
    }
    Ok(out)
}

/// Values for a peer template's placeholders.
pub struct PeerVars<'a> {
    pub prompt: &'a Prompt,
    pub max_new: usize,
    pub model: &'a str,
    pub threads: usize,
}

/// Substitutes the placeholders in every word of `template`. A word may hold
/// several placeholders; `{prompt}` needs a text prompt.
pub fn substitute(template: &[String], v: &PeerVars) -> Result<Vec<String>> {
    template
        .iter()
        .map(|w| {
            let mut w = w.replace("{max_new}", &v.max_new.to_string());
            w = w.replace("{model}", v.model);
            w = w.replace("{threads}", &v.threads.to_string());
            if w.contains("{prompt_ids}") {
                let ids = match v.prompt {
                    Prompt::Ids(ids) => join_ids(ids),
                    Prompt::Text(_) | Prompt::Chat(_) => bail!(
                        "the peer template uses {{prompt_ids}} but the prompt is text; use {{prompt}}"
                    ),
                };
                w = w.replace("{prompt_ids}", &ids);
            }
            if w.contains("{prompt}") {
                let Some(t) = v.prompt.text() else {
                    bail!(
                        "the peer template uses {{prompt}} but the prompt is token ids; give --prompt TEXT (peers tokenize for themselves)"
                    );
                };
                w = w.replace("{prompt}", t);
            }
            Ok(w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_a_shell() {
        let w = split_words(r#"--a 1  --b "two words" 'it''s' x\ y "q\"" "#).unwrap();
        assert_eq!(w, ["--a", "1", "--b", "two words", "its", "x y", "q\""]);
        assert_eq!(split_words("").unwrap(), Vec::<String>::new());
        assert_eq!(split_words("''").unwrap(), [""]);
        assert!(split_words("'open").is_err());
        assert!(split_words("\"open").is_err());
    }

    #[test]
    fn parses_arms_and_refuses_reserved_flags() {
        let a = Arm::parse_fathom("stream=--experts stream --ram-budget 100MB").unwrap();
        assert_eq!(a.name, "stream");
        assert_eq!(
            a.kind,
            ArmKind::Fathom {
                flags: vec![
                    "--experts".into(),
                    "stream".into(),
                    "--ram-budget".into(),
                    "100MB".into()
                ]
            }
        );
        let d = Arm::parse_fathom("default=").unwrap();
        assert_eq!(d.kind, ArmKind::Fathom { flags: vec![] });
        assert!(Arm::parse_fathom("noequals").is_err());
        assert!(Arm::parse_fathom("=x").is_err());
        assert!(Arm::parse_fathom("a b=x").is_err());
        let e = Arm::parse_fathom("x=--max-new=3").unwrap_err().to_string();
        assert!(e.contains("--max-new"), "{e}");
        assert!(Arm::parse_peer("p=").is_err());
        let arms = [d.clone(), d];
        assert!(check_unique(&arms).is_err());
    }

    #[test]
    fn prompts_file_and_ids() {
        let p = parse_prompts_file("# c\n\nids: 1, 2,3\nhello world\n").unwrap();
        assert_eq!(
            p,
            [
                Prompt::Ids(vec![1, 2, 3]),
                Prompt::Text("hello world".into())
            ]
        );
        assert!(parse_prompts_file("# only\n").is_err());
        assert!(parse_prompts_file("ids: 1,x").is_err());
        assert!(parse_ids(",").is_err());
    }

    #[test]
    fn substitutes_placeholders_per_word() {
        let t =
            split_words("llama-cli -m m.gguf -p {prompt} -n {max_new} -t {threads} --x={model}")
                .unwrap();
        let prompt = Prompt::Text("a \"quoted\" $(prompt)".into());
        let v = PeerVars {
            prompt: &prompt,
            max_new: 8,
            model: "dir",
            threads: 2,
        };
        let out = substitute(&t, &v).unwrap();
        assert_eq!(out[4], "a \"quoted\" $(prompt)");
        assert_eq!(out[6], "8");
        assert_eq!(out[8], "2");
        assert_eq!(out[9], "--x=dir");
        let ids = Prompt::Ids(vec![1, 2]);
        let v = PeerVars {
            prompt: &ids,
            max_new: 8,
            model: "dir",
            threads: 2,
        };
        assert!(substitute(&t, &v).is_err());
        let t2 = split_words("x {prompt_ids}").unwrap();
        assert_eq!(substitute(&t2, &v).unwrap()[1], "1,2");
    }
}
