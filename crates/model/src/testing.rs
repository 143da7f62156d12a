//! Test helpers shared by the crate's unit tests.

use std::path::PathBuf;
use std::sync::Arc;

use fathom_weights::Checkpoint;

/// A checkpoint of one `[rows, cols]` matrix `name` of `dtype` (`BF16`, or
/// `F32` otherwise) in a fresh directory named after `tag`, its values
/// spread over [-7, 7.8].
pub(crate) fn one_matrix(
    tag: &str,
    name: &str,
    dtype: &str,
    rows: usize,
    cols: usize,
) -> (PathBuf, Arc<Checkpoint>) {
    let d = std::env::temp_dir().join(format!("fathom-{tag}-{dtype}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let n = rows * cols;
    let value = |i: usize| ((i * 7919) % 251) as f32 / 17.0 - 7.0;
    let data: Vec<u8> = match dtype {
        "BF16" => (0..n)
            .flat_map(|i| ((value(i).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        _ => (0..n).flat_map(|i| value(i).to_le_bytes()).collect(),
    };
    let header = format!(
        r#"{{"{name}":{{"dtype":"{dtype}","shape":[{rows},{cols}],"data_offsets":[0,{}]}}}}"#,
        data.len()
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(data);
    std::fs::write(d.join("model.safetensors"), file).unwrap();
    let ck = Arc::new(Checkpoint::open(&d).unwrap());
    (d, ck)
}
