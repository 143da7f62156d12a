//! `mla.cu`'s attention over a latent cache, run on the host emulator,
//! against the CPU kernel (`attention::mla_attend`, and its scalar twin)
//! bit for bit: several queries seeing different numbers of rows (one row,
//! a split less one, a split, a split and one, several splits with a short
//! last one), head counts and widths that are and are not multiples of 8,
//! scores large enough that most weights underflow. Where the emulator was
//! not built the test prints why it skips.

use fathom_kernels::attention::{MlaQuery, MlaShape, SPLIT, mla_attend, mla_attend_scalar};

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
            .collect()
    }
}

#[test]
fn mla_kernels_match_the_cpu_bit_for_bit() {
    if !fathom_cuda_emu::available() {
        eprintln!("skipped: {}", fathom_cuda_emu::ABSENT);
        return;
    }
    for (heads, lora, rope, amp) in [(3usize, 64usize, 16usize, 0.5f32), (5, 36, 12, 3.0)] {
        let w = lora + rope;
        let mut g = Lcg((heads * 100 + lora) as u64);
        let rows = 3 * SPLIT + 77;
        let cache = g.vec(rows * w, amp);
        let blocks: Vec<&[f32]> = cache.chunks(SPLIT * w).collect();
        let ns = [1usize, SPLIT - 1, SPLIT, SPLIT + 1, rows];
        let qs: Vec<(Vec<f32>, Vec<f32>)> = ns
            .iter()
            .map(|_| (g.vec(heads * lora, amp), g.vec(heads * rope, amp)))
            .collect();
        let queries: Vec<MlaQuery<'_>> = ns
            .iter()
            .zip(&qs)
            .map(|(&n, (ql, qr))| MlaQuery {
                q_lat: ql,
                q_rope: qr,
                n,
            })
            .collect();
        let sh = MlaShape {
            heads,
            lora,
            rope,
            scale: 1.0 / ((lora + rope) as f32).sqrt(),
        };
        let len = ns.len() * heads * lora;
        let (mut cpu, mut twin, mut emu) = (vec![0f32; len], vec![0f32; len], vec![f32::NAN; len]);
        mla_attend(&sh, &blocks, &queries, &mut cpu);
        mla_attend_scalar(&sh, &blocks, &queries, &mut twin);
        fathom_cuda_emu::mla_attend(&sh, &blocks, &queries, &mut emu);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert!(bits(&cpu) == bits(&twin), "the CPU kernel and its twin");
        for (i, (e, c)) in emu.iter().zip(&cpu).enumerate() {
            let (q, hh) = (i / (heads * lora), i / lora % heads);
            assert!(
                e.to_bits() == c.to_bits(),
                "heads {heads}, lora {lora}: query {q} (n = {}), head {hh}, value {}: emulated {e:e} vs CPU {c:e}",
                ns[q],
                i % lora
            );
        }
    }
}
