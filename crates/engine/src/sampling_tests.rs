//! Unit tests of `sampling`.
use super::*;

/// Tiny LCG for test data (not the sampler's randomness).
struct Lcg(u64);

impl Lcg {
    fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    /// Uniform in [-5, 5).
    fn next_f32(&mut self) -> f32 {
        (self.next_u32() as f32 / (1u64 << 31) as f32) * 10.0 - 5.0
    }

    fn logits(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

fn temp(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        ..SamplingParams::default()
    }
}

fn pick(p: &SamplingParams, logits: &[f32], position: u64) -> u32 {
    sample(p, logits, &[], &[], 0, position).token
}

/// Reference: first index holding the maximum, computed another way.
fn first_max(x: &[f32]) -> u32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    x.iter().position(|&v| v == max).unwrap() as u32
}

fn softmax(x: &[f32], t: f64) -> Vec<f64> {
    let m = x.iter().map(|&v| f64::from(v) / t).fold(f64::MIN, f64::max);
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) / t - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

fn counts(p: &SamplingParams, logits: &[f32], draws: u64) -> Vec<usize> {
    let mut c = vec![0; logits.len()];
    for pos in 0..draws {
        c[pick(p, logits, pos) as usize] += 1;
    }
    c
}

#[test]
fn greedy_equals_argmax_on_random_logits() {
    let mut rng = Lcg(7);
    let greedy = SamplingParams::default();
    for round in 0..200 {
        let mut logits = rng.logits(1 + round * 7);
        if round % 2 == 0 {
            // Integer-valued logits: ties are common.
            logits.iter_mut().for_each(|v| *v = v.round());
        }
        let expected = first_max(&logits);
        assert_eq!(argmax(&logits), expected, "round {round}");
        assert_eq!(pick(&greedy, &logits, round as u64), expected);
    }
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(pick(&greedy, &[0.5, 3.0, 2.0, 3.0], 0), 1);
}

#[test]
fn greedy_ignores_filters_and_seed() {
    let logits = [0.1, 0.9, 0.3];
    let p = SamplingParams {
        top_k: 1,
        top_p: 0.1,
        min_p: 0.9,
        seed: 99,
        ..SamplingParams::default()
    };
    assert_eq!(sample(&p, &logits, &[], &[], 3, 17).token, 1);
}

#[test]
fn nan_counts_as_negative_infinity() {
    let nan = f32::NAN;
    assert_eq!(argmax(&[nan, 1.0, nan]), 1);
    assert_eq!(argmax(&[nan, f32::NEG_INFINITY, -3.0]), 2);
    assert_eq!(argmax(&[nan, nan]), 0);
    assert_eq!(argmax(&[]), 0);
    for pos in 0..50 {
        assert_eq!(pick(&temp(1.0), &[nan, 1.0, nan], pos), 1);
        assert_eq!(pick(&temp(1.0), &[nan, nan, nan], pos), 0);
    }
    let p = SamplingParams {
        logprobs: Some(0),
        ..temp(1.0)
    };
    let s = sample(&p, &[nan, f32::INFINITY, 0.0], &[], &[], 0, 0);
    assert_eq!((s.token, s.logprob), (1, Some(0.0)));
    // Without logprobs asked for, the log-softmax is not computed.
    let s = sample(&temp(1.0), &[nan, f32::INFINITY, 0.0], &[], &[], 0, 0);
    assert!(s.token == 1 && s.logprob.is_none() && s.top.is_empty());
}

#[test]
fn rank_key_reverses_the_order_and_round_trips() {
    let values = [
        f64::NEG_INFINITY,
        f64::MIN,
        -3.5,
        -f64::MIN_POSITIVE,
        0.0,
        f64::MIN_POSITIVE,
        1.0,
        7.25,
        f64::MAX,
    ];
    for w in values.windows(2) {
        assert!(rank_key(w[0]) > rank_key(w[1]), "{w:?}");
    }
    for v in values {
        assert_eq!(rank_value(rank_key(v)), v);
    }
    assert_eq!(rank_key(-0.0), rank_key(0.0));
}

#[test]
fn zero_probability_tokens_are_never_drawn() {
    let largest_u = 1.0 - f64::EPSILON / 2.0;
    for n in 1..100 {
        let mut logits = vec![0.0; n];
        logits.push(-1000.0); // exp(-1000) underflows to 0
        for u in [0.0, 0.5, largest_u] {
            assert!((draw(&temp(1.0), &logits, u) as usize) < n, "n {n} u {u}");
        }
    }
}

#[test]
fn validate_rejects_each_bad_value_naming_the_field() {
    type Edit = fn(&mut SamplingParams);
    let cases: [(&str, &str, Edit); 11] = [
        ("temperature", "-1", |p| p.temperature = -1.0),
        ("temperature", "NaN", |p| p.temperature = f32::NAN),
        ("temperature", "inf", |p| p.temperature = f32::INFINITY),
        ("top_p", "0", |p| p.top_p = 0.0),
        ("top_p", "1.5", |p| p.top_p = 1.5),
        ("min_p", "-0.1", |p| p.min_p = -0.1),
        ("min_p", "1.1", |p| p.min_p = 1.1),
        ("repetition_penalty", "0", |p| p.repetition_penalty = 0.0),
        ("presence_penalty", "3", |p| p.presence_penalty = 3.0),
        ("frequency_penalty", "-3", |p| p.frequency_penalty = -3.0),
        ("logprobs", "21", |p| p.logprobs = Some(21)),
    ];
    for (field, value, edit) in cases {
        let mut p = SamplingParams::default();
        edit(&mut p);
        let err = p.validate().expect_err(field);
        let msg = err.to_string();
        assert_eq!(err.field(), field);
        assert!(msg.starts_with(field), "{msg}");
        assert!(msg.ends_with(&format!("got {value}")), "{msg}");
    }
    let msg = temp(-1.0).validate().unwrap_err().to_string();
    assert_eq!(
        msg,
        "temperature must be a finite number in [0, 100], got -1"
    );
}

#[test]
fn validate_rejects_nan_in_every_float_field() {
    type Edit = fn(&mut SamplingParams);
    let cases: [(&str, Edit); 6] = [
        ("temperature", |p| p.temperature = f32::NAN),
        ("top_p", |p| p.top_p = f32::NAN),
        ("min_p", |p| p.min_p = f32::NAN),
        ("repetition_penalty", |p| p.repetition_penalty = f32::NAN),
        ("presence_penalty", |p| p.presence_penalty = f32::NAN),
        ("frequency_penalty", |p| p.frequency_penalty = f32::NAN),
    ];
    for (field, edit) in cases {
        let mut p = SamplingParams::default();
        edit(&mut p);
        assert_eq!(p.validate().unwrap_err().field(), field);
    }
}

#[test]
fn validate_accepts_defaults_and_edges() {
    assert_eq!(SamplingParams::default().validate(), Ok(()));
    assert!(SamplingParams::default().is_greedy());
    let edges = SamplingParams {
        temperature: 100.0,
        top_k: 40,
        top_p: 1.0,
        min_p: 1.0,
        repetition_penalty: 0.01,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        seed: u64::MAX,
        logprobs: Some(20),
    };
    assert_eq!(edges.validate(), Ok(()));
    assert!(!edges.is_greedy());
}

#[test]
fn serde_fills_missing_fields_with_defaults() {
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.5, "logprobs": 3}"#).unwrap();
    let expected = SamplingParams {
        temperature: 0.5,
        logprobs: Some(3),
        ..SamplingParams::default()
    };
    assert_eq!(p, expected);
    let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
}

#[test]
fn draws_are_reproducible_and_vary_with_choice_and_position() {
    let mut rng = Lcg(11);
    let logits = rng.logits(500);
    let p = SamplingParams {
        seed: 1234,
        ..temp(1.0)
    };
    for pos in 0..100 {
        let a = sample(&p, &logits, &[1, 2], &[3], 2, pos);
        let b = sample(&p, &logits, &[1, 2], &[3], 2, pos);
        assert_eq!(a, b);
    }
    let u = uniform(1234, 0, 5);
    assert_eq!(u, uniform(1234, 0, 5));
    assert_ne!(u, uniform(1234, 1, 5));
    assert_ne!(u, uniform(1234, 0, 6));
    assert_ne!(u, uniform(1235, 0, 5));
    assert_ne!(uniform(0, 1, 0), uniform(0, 0, 1));
    let tokens: Vec<u32> = (0..50).map(|pos| pick(&p, &logits, pos)).collect();
    let other: Vec<u32> = (0..50)
        .map(|pos| sample(&p, &logits, &[], &[], 1, pos).token)
        .collect();
    assert_ne!(tokens, other);
}

#[test]
fn uniform_is_in_unit_interval_and_balanced() {
    let n = 100_000;
    let mut sum = 0.0;
    for pos in 0..n {
        let u = uniform(5, 0, pos);
        assert!((0.0..1.0).contains(&u));
        sum += u;
    }
    assert!((sum / n as f64 - 0.5).abs() < 0.01);
}

#[test]
fn empirical_frequencies_match_softmax() {
    let logits = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2];
    let draws = 20_000;
    for t in [1.0f32, 0.5] {
        let p = SamplingParams {
            seed: 42,
            ..temp(t)
        };
        let expected = softmax(&logits, f64::from(t));
        let got = counts(&p, &logits, draws);
        for (i, (&c, &e)) in got.iter().zip(&expected).enumerate() {
            let f = c as f64 / draws as f64;
            assert!((f - e).abs() < 0.015, "t {t} token {i}: {f} vs {e}");
        }
    }
}

#[test]
fn top_k_returns_only_the_k_best() {
    let mut rng = Lcg(3);
    // Large enough that selection partitions instead of sorting outright.
    let logits: Vec<f32> = rng.logits(300).iter().map(|v| v * 0.2).collect();
    let mut best: Vec<u32> = (0..300).collect();
    best.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    for k in [1, 2, 5, 40] {
        let p = SamplingParams {
            top_k: k,
            ..temp(5.0)
        };
        let got = counts(&p, &logits, 3000);
        for (token, &c) in got.iter().enumerate() {
            let allowed = best[..k].contains(&(token as u32));
            assert_eq!(c > 0, allowed, "k {k}: token {token} drawn {c} times");
        }
    }
}

#[test]
fn top_k_ties_at_the_boundary_keep_lower_ids() {
    let logits = [1.0, 2.0, 2.0, 2.0];
    let p = SamplingParams {
        top_k: 2,
        ..temp(1.0)
    };
    let got = counts(&p, &logits, 1000);
    assert!(got[0] == 0 && got[3] == 0, "{got:?}");
    assert!(got[1] > 0 && got[2] > 0, "{got:?}");
}

#[test]
fn top_p_keeps_a_dominant_token_only() {
    let logits = [0.15f32.ln(), 0.6f32.ln(), 0.25f32.ln()];
    let open = counts(&temp(1.0), &logits, 1000);
    assert!(open.iter().all(|&c| c > 0), "{open:?}");
    let p = SamplingParams {
        top_p: 0.5,
        ..temp(1.0)
    };
    assert_eq!(counts(&p, &logits, 1000), vec![0, 1000, 0]);
    let p = SamplingParams {
        top_p: 0.7,
        ..temp(1.0)
    };
    let got = counts(&p, &logits, 1000);
    assert!(got[0] == 0 && got[1] > 0 && got[2] > 0, "{got:?}");
    // Exactly reaching top_p is enough: [0.5, 0.5] with top_p 0.5.
    let p = SamplingParams {
        top_p: 0.5,
        ..temp(1.0)
    };
    assert_eq!(counts(&p, &[0.0, 0.0], 100), vec![100, 0]);
}

#[test]
fn draw_walks_candidates_best_first() {
    let logits = [0.2f32.ln(), 0.5f32.ln(), 0.3f32.ln()];
    let p = temp(1.0);
    let walk = [
        (0.0, 1),
        (0.49, 1),
        (0.51, 2),
        (0.79, 2),
        (0.81, 0),
        (0.999, 0),
    ];
    for (u, token) in walk {
        assert_eq!(draw(&p, &logits, u), token, "u {u}");
    }
}

#[test]
fn min_p_keeps_tokens_above_threshold() {
    let logits = [0.15f32.ln(), 0.5f32.ln(), 0.05f32.ln(), 0.3f32.ln()];
    let rank = [2, 0, 3, 1]; // of each token; 0 = most likely
    for (min_p, survivors) in [(0.0, 4), (0.25, 3), (0.5, 2), (1.0, 1)] {
        let p = SamplingParams { min_p, ..temp(1.0) };
        let got = counts(&p, &logits, 2000);
        for (token, &c) in got.iter().enumerate() {
            assert_eq!(c > 0, rank[token] < survivors, "min_p {min_p}: {got:?}");
        }
    }
}

#[test]
fn repetition_penalty_lowers_repeated_tokens() {
    let logits = [3.0, 2.8, -1.0];
    let p = SamplingParams {
        repetition_penalty: 1.2,
        ..SamplingParams::default()
    };
    assert_eq!(pick(&p, &logits, 0), 0);
    assert_eq!(sample(&p, &logits, &[0], &[], 0, 1).token, 1);
    assert_eq!(sample(&p, &logits, &[], &[0, 0], 0, 1).token, 1);
    let out = apply_penalties(&p, &logits, &[0, 2, 2], &[0]);
    assert_eq!(out[..], [2.5, 2.8, -1.2][..]);
    assert!(matches!(
        apply_penalties(&temp(1.0), &logits, &[0], &[0]),
        Cow::Borrowed(_)
    ));
}

#[test]
fn presence_and_frequency_penalties_count_generated_tokens() {
    let logits = [3.0, 2.7, 0.0];
    let freq = SamplingParams {
        frequency_penalty: 0.2,
        ..SamplingParams::default()
    };
    assert_eq!(sample(&freq, &logits, &[], &[0], 0, 1).token, 0);
    assert_eq!(sample(&freq, &logits, &[], &[0, 0], 0, 2).token, 1);
    // The prompt does not count.
    assert_eq!(sample(&freq, &logits, &[0, 0, 0], &[], 0, 3).token, 0);
    let presence = SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::default()
    };
    assert_eq!(sample(&presence, &logits, &[], &[0], 0, 1).token, 1);
    let both = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    };
    let out = apply_penalties(&both, &logits, &[], &[2, 0, 2, 9]);
    assert_eq!(out[..], [2.25, 2.7, -1.0][..]);
}

fn reference_log_softmax(x: &[f32]) -> Vec<f64> {
    softmax(x, 1.0).into_iter().map(f64::ln).collect()
}

#[test]
fn logprobs_describe_the_raw_distribution() {
    let mut rng = Lcg(5);
    let logits = rng.logits(1000);
    let reference = reference_log_softmax(&logits);
    let p = SamplingParams {
        logprobs: Some(5),
        repetition_penalty: 1.3,
        top_k: 10,
        ..temp(0.8)
    };
    for pos in 0..50 {
        let s = sample(&p, &logits, &[pos as u32], &[], 0, pos);
        let want = reference[s.token as usize];
        assert!((f64::from(s.logprob.unwrap()) - want).abs() < 1e-5);
        assert_eq!(s.top.len(), 5);
        assert_eq!(s.top[0].0, argmax(&logits));
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mass: f64 = s.top.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        assert!(mass <= 1.0 + 1e-6, "{mass}");
        for &(t, l) in &s.top {
            assert!((f64::from(l) - reference[t as usize]).abs() < 1e-5);
        }
    }
    let none = sample(&temp(0.8), &logits, &[], &[], 0, 0);
    assert!(none.top.is_empty());
}

#[test]
fn logprob_top_list_breaks_ties_by_lower_id() {
    let logits = [1.0, 3.0, 2.0, 3.0, 2.0];
    let p = SamplingParams {
        logprobs: Some(3),
        ..SamplingParams::default()
    };
    let s = sample(&p, &logits, &[], &[], 0, 0);
    let ids: Vec<u32> = s.top.iter().map(|&(t, _)| t).collect();
    assert_eq!(ids, vec![1, 3, 2]);
    assert_eq!(s.token, 1);
    assert_eq!(s.logprob, Some(s.top[0].1));
}

#[test]
fn large_vocabulary_with_top_k() {
    let mut rng = Lcg(9);
    let logits = rng.logits(163_840);
    let mut best: Vec<u32> = (0..logits.len() as u32).collect();
    best.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let p = SamplingParams {
        top_k: 40,
        top_p: 0.95,
        min_p: 0.01,
        ..temp(0.7)
    };
    for pos in 0..5 {
        let token = pick(&p, &logits, pos);
        assert!(best[..40].contains(&token));
    }
}

/// On a vocabulary past `PARALLEL_FROM` the element-wise passes run on the
/// pool: every draw, log-probability and top list has the bits of the
/// passes on one thread, in pools of one and of three threads (logits with
/// ties, NaN and `-inf`, four of them far above the rest; top-k off and
/// on, top-p, min-p).
#[test]
fn a_large_vocabulary_gives_the_same_bits_on_the_pool_and_off_it() {
    let mut rng = Lcg(17);
    let mut logits = rng.logits(PARALLEL_FROM * 5 + 123);
    for i in (0..logits.len()).step_by(997) {
        logits[i] = [f32::NAN, f32::NEG_INFINITY, 4.75, 4.75][i % 4];
    }
    // Four logits far above the rest: min-p keeps only them.
    for l in logits.iter_mut().step_by(50_001) {
        *l = 12.0;
    }
    let params = [
        temp(0.8),
        SamplingParams {
            top_k: 40,
            ..temp(1.3)
        },
        SamplingParams {
            top_p: 0.9,
            ..temp(1.0)
        },
        SamplingParams {
            min_p: 0.01,
            ..temp(0.6)
        },
    ];
    let bits = |s: &Sampled| {
        let top: Vec<(u32, u32)> = s.top.iter().map(|&(t, l)| (t, l.to_bits())).collect();
        (s.token, s.logprob.map(f32::to_bits), top)
    };
    let one = |par: bool| -> Vec<(u32, Option<u32>, Vec<(u32, u32)>)> {
        let mut out = Vec::new();
        for p in &params {
            for k in 0..24u64 {
                let u = uniform(p.seed, 0, k);
                let token = draw_in(p, &logits, u, par);
                out.push(bits(&report_in(&logits, token, 7, par)));
            }
        }
        out
    };
    let serial = one(false);
    assert!(
        serial.iter().any(|s| s.0 != serial[0].0),
        "the draws differ: a real test"
    );
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        assert_eq!(pool.install(|| one(true)), serial, "{threads} threads");
    }
}
