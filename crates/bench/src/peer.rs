//! Reading a peer engine's speed from its own output.
//!
//! A peer (llama.cpp today) is run as its own process under the same memory
//! cap, and fathom trusts the peer's self-reported rates rather than timing
//! the process: process wall time would charge the peer for model loading and
//! warm-up that fathom's `decode_tok_s` leaves out too. Formats understood:
//!
//! 1. llama.cpp's performance summary (`llama-cli`, `llama-simple`,
//!    `llama-server`; printed on stderr, prefix `llama_perf_context_print:` or,
//!    in older builds, `llama_print_timings:`):
//!    `eval time = 293.49 ms / 4 runs ( 73.37 ms per token, 13.63 tokens per second)`
//!    gives the decode rate, `prompt eval time = … tokens per second)` the
//!    prefill rate and `load time = 424.98 ms` the load time.
//! 2. `llama-bench -o json` (an array of objects) or `-o jsonl` (one object a
//!    line): `n_prompt`, `n_gen`, `avg_ts`. Rows with `n_gen > 0` and
//!    `n_prompt == 0` are decode (`tg`), rows with `n_gen == 0` prefill (`pp`).
//! 3. `llama-bench`'s default markdown table: the `test` column (`tg128`,
//!    `pp512`) and the `t/s` column (`11.45 ± 0.11`).

use anyhow::{Result, bail};
use serde::Serialize;

/// Rates a peer reported about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PeerRates {
    pub decode_tok_s: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    pub load_s: Option<f64>,
    /// Decode steps behind `decode_tok_s`, where the format says.
    pub decode_tokens: Option<u64>,
    /// Which format matched: `llama-perf`, `llama-bench-json` or `llama-bench-table`.
    pub format: &'static str,
}

/// Parses a peer's stdout and stderr; fails if neither a decode nor a
/// prefill rate is found (a prefill-only run, `llama-bench -n 0`, is
/// compared on prefill alone).
pub fn parse_peer_output(stdout: &str, stderr: &str) -> Result<PeerRates> {
    for text in [stdout, stderr] {
        if let Some(r) = parse_bench_json(text) {
            return Ok(r);
        }
    }
    for text in [stdout, stderr] {
        if let Some(r) = parse_bench_table(text) {
            return Ok(r);
        }
    }
    let both = format!("{stdout}\n{stderr}");
    if let Some(r) = parse_perf_lines(&both) {
        return Ok(r);
    }
    bail!(
        "no decode or prefill rate in the peer's output (expected llama.cpp's `eval time = … tokens per second` lines, or llama-bench's table or JSON with a tg or pp test)"
    )
}

/// Format 1: `[prefix:] [prompt ]eval time = X ms / N runs|tokens ( … , R tokens per second)`.
fn parse_perf_lines(text: &str) -> Option<PeerRates> {
    let mut r = PeerRates {
        format: "llama-perf",
        ..Default::default()
    };
    for line in text.lines() {
        let Some((label, rest)) = line.split_once('=') else {
            continue;
        };
        // Drop a `llama_perf_context_print:`-style prefix, keep the label words.
        let label = label.rsplit(':').next().unwrap_or(label).trim();
        match label {
            "eval time" => {
                r.decode_tok_s = tokens_per_second(rest);
                r.decode_tokens = count_after_slash(rest);
            }
            "prompt eval time" => r.prefill_tok_s = tokens_per_second(rest),
            "load time" => r.load_s = first_number(rest).map(|ms| ms / 1e3),
            _ => {}
        }
    }
    (r.decode_tok_s.is_some() || r.prefill_tok_s.is_some()).then_some(r)
}

/// `… ( 73.37 ms per token, 13.63 tokens per second)` → 13.63.
fn tokens_per_second(s: &str) -> Option<f64> {
    let head = &s[..s.find("tokens per second")?];
    head.rsplit([',', '(']).next()?.trim().parse().ok()
}

/// ` 293.49 ms /     4 runs …` → 4.
fn count_after_slash(s: &str) -> Option<u64> {
    s.split_once('/')?.1.split_whitespace().next()?.parse().ok()
}

fn first_number(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse().ok()
}

/// Format 2: llama-bench JSON array or JSON lines.
fn parse_bench_json(text: &str) -> Option<PeerRates> {
    let t = text.trim();
    let rows: Vec<serde_json::Value> = if t.starts_with('[') {
        serde_json::from_str::<Vec<serde_json::Value>>(t).ok()?
    } else {
        t.lines()
            .filter(|l| l.trim_start().starts_with('{'))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let mut r = PeerRates {
        format: "llama-bench-json",
        ..Default::default()
    };
    for row in &rows {
        let (Some(np), Some(ng), Some(ts)) = (
            row.get("n_prompt").and_then(|v| v.as_u64()),
            row.get("n_gen").and_then(|v| v.as_u64()),
            row.get("avg_ts").and_then(|v| v.as_f64()),
        ) else {
            continue;
        };
        if ng > 0 && np == 0 {
            r.decode_tok_s = Some(ts);
            r.decode_tokens = Some(ng);
        } else if ng == 0 && np > 0 {
            r.prefill_tok_s = Some(ts);
        }
    }
    (r.decode_tok_s.is_some() || r.prefill_tok_s.is_some()).then_some(r)
}

/// Format 3: llama-bench's markdown table.
fn parse_bench_table(text: &str) -> Option<PeerRates> {
    let mut cols: Option<(usize, usize)> = None;
    let mut r = PeerRates {
        format: "llama-bench-table",
        ..Default::default()
    };
    for line in text.lines() {
        let l = line.trim();
        if !l.starts_with('|') {
            continue;
        }
        let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
        if let (Some(t), Some(s)) = (
            cells.iter().position(|c| *c == "test"),
            cells.iter().position(|c| *c == "t/s"),
        ) {
            cols = Some((t, s));
            continue;
        }
        let Some((t, s)) = cols else { continue };
        let (Some(test), Some(rate)) = (cells.get(t), cells.get(s)) else {
            continue;
        };
        let Some(rate) = rate.split_whitespace().next().and_then(|x| x.parse().ok()) else {
            continue;
        };
        let test = test.split_whitespace().next().unwrap_or("");
        if let Some(n) = test.strip_prefix("tg") {
            r.decode_tok_s = Some(rate);
            r.decode_tokens = n.parse().ok();
        } else if test.starts_with("pp") && !test.contains('+') {
            r.prefill_tok_s = Some(rate);
        }
    }
    (r.decode_tok_s.is_some() || r.prefill_tok_s.is_some()).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERF: &str = "\
llama_perf_sampler_print:    sampling time =       0.63 ms /    10 runs   (    0.06 ms per token, 15923.57 tokens per second)
llama_perf_context_print:        load time =     424.98 ms
llama_perf_context_print: prompt eval time =      95.33 ms /     5 tokens (   19.07 ms per token,    52.45 tokens per second)
llama_perf_context_print:        eval time =     293.49 ms /     4 runs   (   73.37 ms per token,    13.63 tokens per second)
llama_perf_context_print:       total time =     390.57 ms /     9 tokens
";

    #[test]
    fn a_prefill_only_run_gives_its_prefill_rate() {
        let json = r#"[{"n_prompt": 512, "n_gen": 0, "avg_ts": 20595.82}]"#;
        let r = parse_peer_output(json, "").unwrap();
        assert_eq!((r.decode_tok_s, r.prefill_tok_s), (None, Some(20595.82)));
        let table =
            "| model | test | t/s |\n| --- | ---: | ---: |\n| k3 | pp4096 | 25220.60 ± 137.40 |\n";
        let r = parse_peer_output(table, "").unwrap();
        assert_eq!((r.decode_tok_s, r.prefill_tok_s), (None, Some(25220.6)));
        let e = parse_peer_output("nothing here", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no decode or prefill rate"), "{e}");
    }

    #[test]
    fn llama_perf_summary() {
        let r = parse_peer_output("some generated text", PERF).unwrap();
        assert_eq!(r.format, "llama-perf");
        assert_eq!(r.decode_tok_s, Some(13.63));
        assert_eq!(r.decode_tokens, Some(4));
        assert_eq!(r.prefill_tok_s, Some(52.45));
        assert!((r.load_s.unwrap() - 0.42498).abs() < 1e-9);
    }

    #[test]
    fn older_print_timings_and_server_lines() {
        let old = "llama_print_timings:        eval time =  1000.00 ms /    31 runs   (   32.26 ms per token,    31.00 tokens per second)\n";
        assert_eq!(parse_peer_output("", old).unwrap().decode_tok_s, Some(31.0));
        let server = "       eval time =     500.00 ms /    10 tokens (   50.00 ms per token,    20.00 tokens per second)\n";
        let r = parse_peer_output(server, "").unwrap();
        assert_eq!((r.decode_tok_s, r.decode_tokens), (Some(20.0), Some(10)));
    }

    #[test]
    fn llama_bench_table() {
        let t = "\
| model                          |       size |     params | backend    | threads |          test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | ------------: | -------------------: |
| llama 7B Q4_0                  |   3.56 GiB |     6.74 B | CPU        |      16 |         pp512 |         63.12 ± 0.52 |
| llama 7B Q4_0                  |   3.56 GiB |     6.74 B | CPU        |      16 |         tg128 |         11.45 ± 0.11 |

build: 1234abcd (4321)
";
        let r = parse_peer_output(t, "").unwrap();
        assert_eq!(r.format, "llama-bench-table");
        assert_eq!(r.decode_tok_s, Some(11.45));
        assert_eq!(r.decode_tokens, Some(128));
        assert_eq!(r.prefill_tok_s, Some(63.12));
    }

    #[test]
    fn llama_bench_json_and_jsonl() {
        let j = r#"[
  {"model_type": "llama 7B Q4_0", "n_prompt": 512, "n_gen": 0, "avg_ts": 63.12, "stddev_ts": 0.52},
  {"model_type": "llama 7B Q4_0", "n_prompt": 0, "n_gen": 128, "avg_ts": 11.45, "stddev_ts": 0.11}
]"#;
        let r = parse_peer_output(j, "loading…").unwrap();
        assert_eq!(r.format, "llama-bench-json");
        assert_eq!(
            (r.decode_tok_s, r.prefill_tok_s),
            (Some(11.45), Some(63.12))
        );
        let jl = "{\"n_prompt\": 0, \"n_gen\": 16, \"avg_ts\": 2.5}\n";
        assert_eq!(parse_peer_output(jl, "").unwrap().decode_tok_s, Some(2.5));
    }

    #[test]
    fn nothing_recognisable_is_an_error() {
        assert!(parse_peer_output("hello", "world").is_err());
        assert!(parse_peer_output("eval time = garbage", "").is_err());
        assert!(parse_peer_output("| test | t/s |\n| tg8 | n/a |", "").is_err());
        assert!(parse_peer_output("[1, 2", "").is_err());
    }
}
