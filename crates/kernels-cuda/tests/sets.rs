//! Set launches: a call's bf16 products of any shapes and one position
//! count in one launch (`mm_bf16_set`, `mm_bf16_rows_set`). Each product's
//! results against the scalar twin bit for bit, the launches counted.
//! Without a CUDA device every test prints why it skipped.

use fathom_kernels::backend::{Backend, Hints, MatRef, Product, Role};
use fathom_kernels::formats::Bf16Rows;
use fathom_kernels_cuda::CudaBackend;

mod common;

use common::{Lcg, drop_all, mxfp4_refs, open, same, twin};

/// Shapes (rows, cols) of one call: rows that are and are not multiples
/// of a block's 16, a lone row, columns of whole chunks, with a tail past
/// the last whole chunk, and not a multiple of 8 (the host's layout).
const SHAPES: [(usize, usize); 6] = [
    (40, 512),
    (7, 300),
    (100, 256),
    (16, 264),
    (1, 512),
    (33, 96),
];

/// Runs the products `ws` (bf16 bits, their shapes) in one batch of
/// `role` at `t` positions, twice (the second finds every weight in VRAM,
/// so nothing waits for a copy): each result against the scalar twin, and
/// the second call's kernel launches.
fn batch(
    b: &CudaBackend,
    g: &mut Lcg,
    ws: &[(Vec<u16>, usize, usize)],
    role: Role,
    t: usize,
) -> u64 {
    let mut launches = 0;
    for _ in 0..2 {
        let xs: Vec<Vec<f32>> = ws.iter().map(|(_, _, c)| g.uniform(t * c, 2.0)).collect();
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|(_, r, _)| vec![f32::NAN; t * r]).collect();
        let before = b.stats().kernel_launches;
        let mut products: Vec<Product<'_, '_>> = (ws.iter().zip(&xs).zip(ys.iter_mut()))
            .map(|(((w, rows, cols), x), y)| Product {
                w: MatRef::Bf16 {
                    w,
                    rows: *rows,
                    cols: *cols,
                },
                role,
                x,
                t,
                y,
            })
            .collect();
        assert!(b.matmul_batch(&mut products, &Hints::default()));
        drop(products);
        launches = b.stats().kernel_launches - before;
        for (((w, rows, cols), x), y) in ws.iter().zip(&xs).zip(&ys) {
            let want = twin(&Bf16Rows { w, cols: *cols }, x, t);
            assert!(want.iter().all(|v| v.is_finite()), "a real test");
            same(
                y,
                &want,
                &format!("bf16 {rows}x{cols} in a batch of {}, T = {t}", ws.len()),
            );
        }
    }
    launches
}

fn weights(g: &mut Lcg, shapes: &[(usize, usize)]) -> Vec<(Vec<u16>, usize, usize)> {
    shapes
        .iter()
        .map(|&(r, c)| (g.bf16_bits(r * c, 1.0), r, c))
        .collect()
}

fn forget(b: &CudaBackend, ws: &[(Vec<u16>, usize, usize)]) {
    for (w, rows, cols) in ws {
        drop_all(
            b,
            &MatRef::Bf16 {
                w,
                rows: *rows,
                cols: *cols,
            },
        );
    }
}

/// Spine products of six shapes share one launch at 1, 3 and 9
/// positions, each with the bits of a launch of its own.
#[test]
fn spine_products_of_any_shapes_share_one_launch() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(17);
    let ws = weights(&mut g, &SHAPES);
    for t in [1, 3, 9] {
        assert_eq!(
            batch(&b, &mut g, &ws, Role::Spine, t),
            1,
            "T = {t}: one set launch"
        );
    }
    forget(&b, &ws);
}

/// Routed experts (a set names its products' addresses in its arguments:
/// experts that change from call to call would never replay a graph)
/// launch as before, a launch per shape; more products than a set holds
/// take two sets; products of one shape one grouped launch.
#[test]
fn experts_and_large_batches_launch_by_shape() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(23);
    let ws = weights(&mut g, &SHAPES);
    assert_eq!(batch(&b, &mut g, &ws, Role::Expert, 1), SHAPES.len() as u64);
    let mut nine = SHAPES.to_vec();
    nine.extend([(40, 512), (40, 512), (5, 64)]);
    let ws9 = weights(&mut g, &nine);
    // A set of eight, then the ninth alone.
    assert_eq!(batch(&b, &mut g, &ws9, Role::Spine, 1), 2);
    // Products of one shape keep their grouped launch (a table of addresses).
    let same = weights(&mut g, &[(40, 512); 3]);
    assert_eq!(batch(&b, &mut g, &same, Role::Spine, 3), 1);
    for w in [ws, ws9, same] {
        forget(&b, &w);
    }
}

/// A device that holds few warps at once gets fewer, smaller blocks, each
/// warp summing several row pairs, when the last wave would be short: a
/// set, a grouped launch and a lone product at one position keep the
/// twin's bits whatever the count (0: a block of 256 for every 16 rows; of
/// 127, 135 and 167 pairs, blocks of 256 holding 4 at once give 1, 5 and 6
/// pairs a warp, 5 give 4, 4 and 5, 7 give 3, 3 and 1).
#[test]
fn warps_taking_several_row_pairs_keep_the_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(29);
    let mixed = weights(&mut g, &[(200, 512), (37, 300), (16, 264)]);
    let same3 = weights(&mut g, &[(90, 256); 3]);
    let lone = weights(&mut g, &[(333, 520)]);
    for slots in [0, 4, 5, 7, 64] {
        b.set_bf16_slots(Some(slots));
        for ws in [&mixed, &same3, &lone] {
            assert_eq!(batch(&b, &mut g, ws, Role::Spine, 1), 1, "{slots} slots");
        }
    }
    b.set_bf16_slots(None);
    for w in [mixed, same3, lone] {
        forget(&b, &w);
    }
}

/// Products of many positions in tiles of 16 rows × 16 positions
/// (`tile.cu`): a set of shapes with rows past a tile, columns past the
/// last whole chunk and fewer than one chunk; products of one shape in a
/// grouped launch; a lone product — each at 16, 17 and 40 positions (a
/// position tile part full), against the scalar twin bit for bit, one tiled
/// launch each. A set with a product the tiles cannot take (columns not a
/// multiple of 8) keeps the set kernel, with the same bits.
#[test]
fn many_positions_take_the_tiled_kernels_with_the_twins_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(31);
    let mixed = weights(
        &mut g,
        &[
            (40, 512),
            (100, 256),
            (16, 264),
            (1, 512),
            (33, 96),
            (17, 600),
        ],
    );
    let same3 = weights(&mut g, &[(40, 520); 3]);
    let lone = weights(&mut g, &[(333, 776)]);
    for t in [16, 17, 40] {
        for ws in [&mixed, &same3, &lone] {
            let before = b.stats().tiled_launches;
            assert_eq!(batch(&b, &mut g, ws, Role::Spine, t), 1, "T = {t}");
            // `batch` calls twice.
            assert_eq!(b.stats().tiled_launches - before, 2, "T = {t}: tiled");
        }
    }
    let before = b.stats().tiled_launches;
    let untiled = weights(&mut g, &[(40, 512), (7, 300)]);
    assert_eq!(batch(&b, &mut g, &untiled, Role::Spine, 17), 1);
    assert_eq!(
        b.stats().tiled_launches,
        before,
        "a set the tiles cannot take"
    );
    // Below TILE_T positions the staged kernels run.
    assert_eq!(batch(&b, &mut g, &lone, Role::Spine, 15), 1);
    assert_eq!(b.stats().tiled_launches, before);
    for w in [mixed, same3, lone, untiled] {
        forget(&b, &w);
    }
}

/// MXFP4 products of many positions in tiles (`tile.cu`): one, and three of
/// one shape (a MoE layer's experts) in a grouped launch, at 16, 17 and 40
/// positions, against the scalar twin bit for bit, with scale bytes of 0
/// (2^-127) and 254 among them (most rows finite); one tiled launch a call.
#[test]
fn mxfp4_products_of_many_positions_take_the_tiles() {
    use fathom_kernels::formats::Mxfp4Rows;
    let Some(b) = open(None) else { return };
    let mut g = Lcg(37);
    for (rows, cols, n) in [(40usize, 512usize, 1usize), (17, 768, 3)] {
        let bytes: Vec<(Vec<u8>, Vec<u8>)> = (0..n)
            .map(|_| {
                let packed: Vec<u8> = (0..rows * cols / 2).map(|_| g.next() as u8).collect();
                let scales: Vec<u8> = (0..rows * cols / 32)
                    .map(|i| match (i % 13, i % 64) {
                        (0, _) => 0,
                        (_, 1) => 254,
                        _ => 118 + (g.next() % 10) as u8,
                    })
                    .collect();
                (packed, scales)
            })
            .collect();
        let refs = mxfp4_refs(&bytes, rows, cols);
        for t in [16usize, 17, 40] {
            let xs: Vec<Vec<f32>> = (0..n).map(|_| g.uniform(t * cols, 2.0)).collect();
            let mut ys: Vec<Vec<f32>> = (0..n).map(|_| vec![f32::NAN; t * rows]).collect();
            let before = b.stats();
            let mut products: Vec<Product<'_, '_>> = (refs.iter().zip(&xs).zip(ys.iter_mut()))
                .map(|((r, x), y)| Product {
                    w: MatRef::Mxfp4(*r),
                    role: Role::Expert,
                    x,
                    t,
                    y,
                })
                .collect();
            assert!(b.matmul_batch(&mut products, &Hints::default()));
            drop(products);
            let st = b.stats().since(&before);
            assert_eq!(
                (st.kernel_launches, st.tiled_launches),
                (1, 1),
                "{rows}x{cols} × {n}, T = {t}"
            );
            for ((r, x), y) in refs.iter().zip(&xs).zip(&ys) {
                let want = twin(&Mxfp4Rows(*r), x, t);
                let real = want.iter().filter(|v| v.is_finite() && **v != 0.0).count();
                assert!(2 * real > want.len(), "a real test");
                same(y, &want, &format!("mxfp4 {rows}x{cols} × {n}, T = {t}"));
            }
        }
        for r in &refs {
            drop_all(&b, &MatRef::Mxfp4(*r));
        }
    }
}

/// int8 products (a scale a row) of many positions in tiles: rows past a
/// tile and columns past the last whole chunk, at 16 and 40 positions,
/// against the scalar twin bit for bit, one tiled launch a call.
#[test]
fn int8_products_of_many_positions_take_the_tiles() {
    use fathom_kernels::formats::Int8Rows;
    let Some(b) = open(None) else { return };
    let mut g = Lcg(43);
    let (rows, cols) = (33usize, 528usize);
    let q: Vec<i8> = (0..rows * cols).map(|_| g.next() as i8).collect();
    let scale = g.uniform(rows, 0.01);
    let m = MatRef::Int8 {
        q: &q,
        scale: &scale,
        cols,
    };
    for t in [16usize, 40] {
        let x = g.uniform(t * cols, 2.0);
        let mut y = vec![f32::NAN; t * rows];
        let before = b.stats();
        assert!(b.matmul(&m, Role::Spine, &x, t, &mut y));
        let st = b.stats().since(&before);
        assert_eq!(st.tiled_launches, 1, "T = {t}");
        let want = twin(
            &Int8Rows {
                q: &q,
                scale: &scale,
                cols,
            },
            &x,
            t,
        );
        assert!(want.iter().all(|v| v.is_finite()), "a real test");
        same(&y, &want, &format!("int8 {rows}x{cols}, T = {t}"));
    }
    drop_all(&b, &m);
}
