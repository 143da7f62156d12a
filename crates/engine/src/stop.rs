//! Stop strings, matched on decoded text across token boundaries.
//!
//! A stop string may arrive split over several tokens, or one token may
//! hold several stop strings (or text after one). [`StopMatcher`] therefore
//! works on text, not tokens: it keeps back the *held* text, the longest
//! suffix of what it has seen that is a proper prefix of some stop string,
//! and releases everything before it at once.
//!
//! # Semantics (OpenAI-compatible)
//!
//! The output excludes the stop string and everything after it. When text
//! arrives, the matcher searches `held + text` for every stop string and
//! stops at the occurrence that *completes* first (smallest end offset);
//! among occurrences completing at the same offset, the one that starts
//! first (the longest) wins. Everything before that occurrence is emitted.
//! This choice makes the output independent of how the text is split into
//! fragments: it is exactly the point at which a character-by-character
//! stream would first contain a complete stop string. (An occurrence that
//! starts earlier but completes later, e.g. `"abcd"` vs `"bc"` in `"abcd"`,
//! loses to the one completing first.)
//!
//! No occurrence can start before the held text: any stop string that
//! began in already-released text would have a suffix of that text as a
//! proper prefix, and the held text is the longest such suffix.
//!
//! Offsets are byte offsets of `str`s; the held suffix always starts on a
//! char boundary, and a valid UTF-8 needle only matches at char boundaries,
//! so a char is never split. The held text is shorter than the longest stop
//! string. Callers must hand in whole chars (buffer incomplete UTF-8 from
//! byte-level tokens before calling [`StopMatcher::push`]).

/// Holds back text that might be the beginning of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    /// Non-empty, distinct stop strings.
    stops: Vec<String>,
    /// Pending text: the longest suffix that is a proper prefix of a stop.
    held: String,
    /// A stop string was completed; every later push is empty.
    stopped: bool,
}

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StopScan {
    /// Text that can be shown now (never contains a stop string or anything after it).
    pub emit: String,
    /// A stop string was completed; generation must end. `emit` then holds the text before it.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        let mut stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        stops.sort_unstable();
        stops.dedup();
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// No stop strings: every push is released unchanged.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// A stop string has been completed.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds newly decoded text (any fragment: a token may hold part of a stop string, or several).
    pub fn push(&mut self, text: &str) -> StopScan {
        if self.stopped {
            return StopScan::default();
        }
        if self.stops.is_empty() {
            return StopScan {
                emit: text.to_owned(),
                stopped: false,
            };
        }
        let mut pending = std::mem::take(&mut self.held);
        pending.push_str(text);
        if let Some(start) = self.first_stop(&pending) {
            pending.truncate(start);
            self.stopped = true;
            return StopScan {
                emit: pending,
                stopped: true,
            };
        }
        let hold_from = self.partial_start(&pending);
        self.held = pending.split_off(hold_from);
        StopScan {
            emit: pending,
            stopped: false,
        }
    }

    /// End of generation without a stop: releases whatever was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start offset of the occurrence that completes first (ties: the one
    /// that starts first).
    fn first_stop(&self, text: &str) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at)))
            .min()
            .map(|(_, start)| start)
    }

    /// Start of the longest suffix of `text` that is a proper prefix of a
    /// stop string (`text.len()` when there is none). Assumes `text`
    /// contains no complete stop string.
    fn partial_start(&self, text: &str) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(1);
        let earliest = text.len().saturating_sub(longest - 1);
        (earliest..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&text[i..])))
            .unwrap_or(text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Pushes every piece; returns each push's scan, then the total output
    /// (including `finish()` when no stop was hit) and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<StopScan>, String, bool) {
        let mut m = matcher(stops);
        let scans: Vec<StopScan> = pieces.iter().map(|p| m.push(p)).collect();
        let mut total: String = scans.iter().map(|s| s.emit.as_str()).collect();
        let stopped = scans.iter().any(|s| s.stopped);
        if !stopped {
            total.push_str(&m.finish());
        }
        (scans, total, stopped)
    }

    fn scan(emit: &str, stopped: bool) -> StopScan {
        StopScan {
            emit: emit.to_string(),
            stopped,
        }
    }

    #[test]
    fn stop_split_across_two_fragments() {
        let (scans, total, stopped) = run(&["abc"], &["ab", "c"]);
        assert_eq!(scans, vec![scan("", false), scan("", true)]);
        assert_eq!((total.as_str(), stopped), ("", true));
    }

    #[test]
    fn stop_split_across_three_fragments() {
        let (scans, total, stopped) = run(&["<|end|>"], &["x<|e", "nd", "|>y"]);
        assert_eq!(
            scans,
            vec![scan("x", false), scan("", false), scan("", true)]
        );
        assert_eq!((total.as_str(), stopped), ("x", true));
    }

    #[test]
    fn text_before_the_stop_in_the_same_fragment_is_emitted() {
        let (scans, _, _) = run(&["STOP"], &["hello ST", "OP and more"]);
        assert_eq!(scans, vec![scan("hello ", false), scan("", true)]);
        let (scans, _, _) = run(&["STOP"], &["one", " two STOP three"]);
        assert_eq!(scans, vec![scan("one", false), scan(" two ", true)]);
    }

    #[test]
    fn false_start_is_released() {
        let (scans, total, stopped) = run(&["abc"], &["ab", "d"]);
        assert_eq!(scans, vec![scan("", false), scan("abd", false)]);
        assert_eq!((total.as_str(), stopped), ("abd", false));
        // Only the longest possible prefix is held, not the whole tail.
        let (scans, _, _) = run(&["abc"], &["xaab"]);
        assert_eq!(scans, vec![scan("xa", false)]);
        // ...but the longest one, even when a shorter one would also fit.
        let (scans, _, _) = run(&["aab"], &["xaa", "b"]);
        assert_eq!(scans, vec![scan("x", false), scan("", true)]);
    }

    #[test]
    fn earlier_stop_wins() {
        for stops in [["world", "lo"], ["lo", "world"]] {
            let (_, total, stopped) = run(&stops, &["hello world"]);
            assert_eq!((total.as_str(), stopped), ("hel", true));
        }
        let (_, total, _) = run(&["END", "STOP"], &["a STOP b END"]);
        assert_eq!(total, "a ");
    }

    #[test]
    fn overlapping_stops_first_completed_wins() {
        // "bc" completes before "abcd" does.
        let (_, total, _) = run(&["abcd", "bc"], &["xabcd"]);
        assert_eq!(total, "xa");
        // Both complete at the same offset: the longer (earlier start) wins.
        let (_, total, _) = run(&["cd", "bcd"], &["abcd"]);
        assert_eq!(total, "a");
    }

    #[test]
    fn multi_byte_chars_split_between_pushes() {
        let (scans, total, stopped) = run(&["é!"], &["caf", "é", "!"]);
        assert_eq!(
            scans,
            vec![scan("caf", false), scan("", false), scan("", true)]
        );
        assert_eq!((total.as_str(), stopped), ("caf", true));
        let (_, total, stopped) = run(&["é!"], &["café", "!"]);
        assert_eq!((total.as_str(), stopped), ("caf", true));
        // A held "é" is released when the next char breaks the match.
        let (scans, _, _) = run(&["é!"], &["café", "s"]);
        assert_eq!(scans, vec![scan("caf", false), scan("és", false)]);
        // "ê" shares its lead byte with "é" but is not a prefix of the stop.
        let (scans, _, _) = run(&["é!"], &["ê"]);
        assert_eq!(scans, vec![scan("ê", false)]);
        let (_, total, stopped) = run(&["🛑"], &["ab🛑cd"]);
        assert_eq!((total.as_str(), stopped), ("ab", true));
    }

    #[test]
    fn finish_releases_the_held_partial() {
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push("xab"), scan("x", false));
        assert_eq!(m.finish(), "ab");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn without_stops_everything_is_emitted_at_once() {
        let mut m = matcher(&[]);
        assert!(m.is_empty());
        assert_eq!(m.push("abc"), scan("abc", false));
        assert_eq!(m.push("é"), scan("é", false));
        assert_eq!(m.finish(), "");
        assert!(matcher(&["", ""]).is_empty());
        assert!(!matcher(&["", "x"]).is_empty());
    }

    #[test]
    fn pushes_after_a_stop_are_empty() {
        let mut m = matcher(&["\n\n"]);
        assert_eq!(m.push("a\n"), scan("a", false));
        assert_eq!(m.push("\nb"), scan("", true));
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), StopScan::default());
        assert_eq!(m.finish(), "");
    }

    /// Every split of the text into 1–3 fragments (at char boundaries)
    /// gives the same output as a single push.
    #[test]
    fn output_does_not_depend_on_fragmentation() {
        let stops = ["<|end|>", "ab", "bcé", "é!", "zzzy"];
        let texts = [
            "xx<|en<|end|>yy",
            "aXbcé!",
            "cabé",
            "<|e",
            "zzb",
            "é!ab",
            "zzzzy",
        ];
        for text in texts {
            let (_, whole, whole_stopped) = run(&stops, &[text]);
            let cuts: Vec<usize> = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            for &i in &cuts {
                for &j in cuts.iter().filter(|&&j| j >= i) {
                    let pieces = [&text[..i], &text[i..j], &text[j..]];
                    let (_, total, stopped) = run(&stops, &pieces);
                    assert_eq!((&total, stopped), (&whole, whole_stopped), "{pieces:?}");
                }
            }
        }
    }
}
