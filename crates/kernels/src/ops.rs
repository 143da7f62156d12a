//! The small vector operations of the forward passes, in fp32.

/// `RMSNorm(x; w, ε) = w ⊙ x / sqrt(mean(x²) + ε)`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let r = rms_inv(x, eps);
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * r * g;
    }
}

/// `1 / sqrt(mean(x²) + ε)`.
pub fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// RMSNorm of every `d`-wide row of `x`.
pub fn rms_norm_rows(x: &mut [f32], d: usize, w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(d) {
        rms_norm(row, w, eps);
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `σ(x)` from [`crate::expf::exp_fixed`]: the sigmoid of the functions a
/// device kernel repeats bit for bit (a library `expf` has no device twin).
#[inline]
pub fn sigmoid_fixed(x: f32) -> f32 {
    1.0 / (1.0 + crate::expf::exp_fixed(-x))
}

/// `x · σ(x)` with [`sigmoid_fixed`].
#[inline]
pub fn silu_fixed(x: f32) -> f32 {
    x * sigmoid_fixed(x)
}

/// Elements per task of the element-wise activations: wide rows (a dense
/// MLP's 18–34 thousand, an expert's 2–3 thousand) are split over the pool
/// (SiTU costs three transcendental functions an element); each element's
/// value does not depend on the split.
const ELEMENTWISE_CHUNK: usize = 1024;

/// `f(g_chunk, u_chunk)` over matching chunks of `g` and `u`, in parallel
/// when there are several.
fn elementwise(g: &mut [f32], u: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync) {
    use rayon::prelude::*;
    if g.len() <= ELEMENTWISE_CHUNK {
        return f(g, u);
    }
    g.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(u.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(g, u)| f(g, u));
}

/// `SwiGLU(g, u) = SiLU(g) · u`, written into `g`.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    elementwise(g, u, |g, u| {
        for (a, &b) in g.iter_mut().zip(u) {
            *a = silu(*a) * b;
        }
    })
}

/// `SiTU-GLU(g, u) = [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]`, written into `g`.
pub fn situ_glu(g: &mut [f32], u: &[f32], beta: f32, beta_lin: Option<f32>) {
    elementwise(g, u, |g, u| situ_glu_serial(g, u, beta, beta_lin))
}

fn situ_glu_serial(g: &mut [f32], u: &[f32], beta: f32, beta_lin: Option<f32>) {
    for (a, &b) in g.iter_mut().zip(u) {
        let act = beta * (*a / beta).tanh() * sigmoid(*a);
        let up = match beta_lin {
            Some(bl) => bl * (b / bl).tanh(),
            None => b,
        };
        *a = act * up;
    }
}

/// `x / sqrt(Σx² + ε)`, in place (the KDA kernels' in-kernel q/k norm).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss + eps).sqrt();
    for v in x {
        *v *= r;
    }
}

/// Numerically stable softmax, in place.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += a · x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (v, &u) in y.iter_mut().zip(x) {
        *v += a * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, &[1.0, 2.0], 0.0);
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1000.0, 1000.0, 0.0];
        softmax(&mut x);
        assert!((x[0] - 0.5).abs() < 1e-6 && x[2] < 1e-30);
    }

    #[test]
    fn situ_is_bounded() {
        let mut g = vec![1e4, -1e4, 0.0];
        situ_glu(&mut g, &[1e4, 1e4, 5.0], 4.0, Some(25.0));
        assert!((g[0] - 100.0).abs() < 1e-3);
        assert!(g[1].abs() < 1e-3 && g[2] == 0.0);
    }
}
