//! Command-line errors whose "did you mean" tips only name close spellings.
//!
//! clap suggests the most similar flag or command it knows, however far it
//! is (`--temperature` given to a command without it was once answered with
//! `--experts`). A tip survives only when it is a plausible typo: an edit
//! distance of at most a third of the longer name (and at least 1).

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// Levenshtein distance between `a` and `b` (characters).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Whether `suggested` is a plausible typo-fix of `given` (dashes ignored).
pub fn is_close(given: &str, suggested: &str) -> bool {
    let (g, s) = (
        given.trim_start_matches('-'),
        suggested.trim_start_matches('-'),
    );
    let g = g.split('=').next().unwrap_or(g);
    let limit = (g.chars().count().max(s.chars().count()) / 3).max(1);
    edit_distance(g, s) <= limit
}

fn text(v: Option<&ContextValue>) -> Vec<String> {
    match v {
        Some(ContextValue::String(s)) => vec![s.clone()],
        Some(ContextValue::Strings(v)) => v.clone(),
        Some(ContextValue::StyledStr(s)) => vec![s.to_string()],
        _ => Vec::new(),
    }
}

/// `e` without its suggestions when none is close to what was typed.
pub fn filter(e: clap::Error, cmd: &clap::Command) -> clap::Error {
    if !matches!(
        e.kind(),
        ErrorKind::UnknownArgument | ErrorKind::InvalidSubcommand
    ) {
        return e;
    }
    let given = text(
        e.get(ContextKind::InvalidArg)
            .or(e.get(ContextKind::InvalidSubcommand)),
    );
    let suggested: Vec<String> = [ContextKind::SuggestedArg, ContextKind::SuggestedSubcommand]
        .into_iter()
        .flat_map(|k| text(e.get(k)))
        .collect();
    let close = given
        .iter()
        .any(|g| suggested.iter().any(|s| is_close(g, s)));
    if suggested.is_empty() || close {
        return e;
    }
    let mut out = clap::Error::new(e.kind()).with_cmd(cmd);
    for (k, v) in e.context() {
        if !matches!(
            k,
            ContextKind::SuggestedArg
                | ContextKind::SuggestedSubcommand
                | ContextKind::SuggestedCommand
                | ContextKind::SuggestedValue
                | ContextKind::Suggested
        ) {
            out.insert(k, v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_close_names_are_suggested() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert!(is_close("--temprature", "--temperature"));
        assert!(is_close("--ram-budge", "--ram-budget"));
        assert!(is_close("--contxt=5", "--context"));
        assert!(!is_close("--temperature", "--experts"));
        assert!(!is_close("--foo", "--json"));
    }
}
