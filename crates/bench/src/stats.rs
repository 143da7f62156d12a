//! Min / median / max of a handful of samples.
//!
//! Bench reps are few (3–10) and the machines are noisy, so fathom reports
//! the median with the extremes rather than a mean and a standard deviation:
//! one descheduled rep moves the mean but not the median.

use serde::Serialize;

/// The spread of one metric over an arm's measured reps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    /// Samples that had the metric (NaN and missing values are left out).
    pub n: usize,
}

/// Summarises `values`, ignoring non-finite ones; `None` when nothing is left.
/// The median of an even count is the mean of the two middle values.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Summary {
        min: v[0],
        median,
        max: v[n - 1],
        n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_count_takes_the_middle() {
        let s = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.n), (1.0, 2.0, 3.0, 3));
    }

    #[test]
    fn even_count_averages_the_two_middles() {
        let s = summarize(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.n), (1.0, 2.5, 4.0, 4));
    }

    #[test]
    fn one_sample_is_all_three() {
        let s = summarize(&[7.5]).unwrap();
        assert_eq!((s.min, s.median, s.max), (7.5, 7.5, 7.5));
    }

    #[test]
    fn empty_and_non_finite_are_none_or_skipped() {
        assert_eq!(summarize(&[]), None);
        assert_eq!(summarize(&[f64::NAN]), None);
        let s = summarize(&[f64::NAN, 2.0, f64::INFINITY, 4.0]).unwrap();
        assert_eq!((s.median, s.n), (3.0, 2));
    }
}
