//! MXFP4 rows whose scale bytes are all ordinary exponents (1..254) are
//! decoded without the tests for 0 (2^-127) and 0xFF (NaN); a row with
//! either, or a pair holding such a row, takes the full decode. Both
//! against the scalar twin bit for bit, side by side in one product, at
//! one position (two rows a warp) and several (a row a warp). Without a
//! CUDA device the test prints why it skipped.

use fathom_kernels::backend::{Backend, MatRef, Role};
use fathom_kernels::formats::Mxfp4Rows;
use fathom_weights::mxfp4::Mxfp4Ref;

mod common;

use common::{Lcg, drop_all, open, same, twin};

/// Scale bytes of `rows` rows of `per` groups: ordinary ones near 2^0,
/// but row r ≡ 3 (mod 5) holds tiny exponents with one 0 among them (so
/// that 2^-127 against 0 shows in the sums) and row r ≡ 4 (mod 7) one
/// 0xFF, each in one of the row's last two groups (past the 32 words a
/// warp's lanes read first when the row has more).
fn scales(g: &mut Lcg, rows: usize, per: usize) -> Vec<u8> {
    (0..rows * per)
        .map(|i| {
            let (r, k) = (i / per, i % per);
            let special = k == per - 1 - (r % 2).min(per - 1);
            if r % 5 == 3 {
                if special { 0 } else { 1 + (g.next() % 3) as u8 }
            } else if r % 7 == 4 && special {
                255
            } else {
                120 + (g.next() % 14) as u8
            }
        })
        .collect()
}

#[test]
fn rows_with_and_without_special_scales_keep_the_twins_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(11);
    // Whole chunks of 256 (the scales in 8-byte words; 9,216 columns: 36
    // words, more than a warp's lanes), a lone row, an odd row count, and
    // 2,880 columns (not whole chunks: always the full decode).
    for (rows, cols) in [
        (37usize, 256usize),
        (64, 2048),
        (9, 7168),
        (6, 9216),
        (1, 512),
        (12, 2880),
    ] {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| g.next() as u8).collect();
        let sc = scales(&mut g, rows, cols / 32);
        let r = Mxfp4Ref {
            rows,
            cols,
            packed: &packed,
            scales: &sc,
        };
        let m = MatRef::Mxfp4(r);
        for t in [1usize, 2, 9] {
            let x = g.uniform(t * cols, 2.0);
            let mut y = vec![f32::NAN; t * rows];
            assert!(b.matmul(&m, Role::Expert, &x, t, &mut y), "declined");
            let want = twin(&Mxfp4Rows(r), &x, t);
            same(&y, &want, &format!("mxfp4 {rows}x{cols}, T = {t}"));
            if rows > 4 {
                assert!(want[3].abs() < 1e-30, "row 3's sums are tiny");
                assert!(want[4].is_nan(), "row 4's sum is NaN");
            }
        }
        drop_all(&b, &m);
    }
    let st = b.stats();
    assert_eq!(st.device_errors, 0, "{:?}", st.last_error);
}
