//! Every header is validated before use; errors name the file and tensor.

use std::path::{Path, PathBuf};

use fathom_weights::{Checkpoint, Dtype};
use serde_json::json;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fathom-weights-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes a safetensors file from a header object and a data section.
fn write_st(path: &Path, header: serde_json::Value, data: &[u8]) {
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = (h.len() as u64).to_le_bytes().to_vec();
    f.extend(h);
    f.extend_from_slice(data);
    std::fs::write(path, f).unwrap();
}

fn open_err(dir: &Path) -> String {
    Checkpoint::open(dir).unwrap_err().to_string()
}

#[test]
fn valid_single_file_gives_absolute_locators() {
    let d = tmpdir("ok");
    let header = json!({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [12, 16]},
    });
    write_st(
        &d.join("model.safetensors"),
        header,
        &(0u8..16).collect::<Vec<_>>(),
    );
    let ck = Checkpoint::open(&d).unwrap();
    let b = ck.get("b").unwrap();
    assert_eq!((b.dtype, b.shape.clone(), b.len), (Dtype::U8, vec![4], 4));
    assert_eq!(ck.read(b).unwrap(), vec![12, 13, 14, 15]);
    let a = ck.get("a").unwrap();
    assert_eq!(ck.read(a).unwrap(), (0u8..12).collect::<Vec<_>>());
}

#[test]
fn offsets_outside_the_file_are_rejected() {
    let d = tmpdir("outside");
    write_st(
        &d.join("model.safetensors"),
        json!({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}),
        &[0u8; 8],
    );
    let e = open_err(&d);
    assert!(
        e.contains("model.safetensors") && e.contains("tensor w") && e.contains("outside"),
        "{e}"
    );
}

#[test]
fn byte_length_must_equal_dtype_times_shape() {
    let d = tmpdir("len");
    write_st(
        &d.join("model.safetensors"),
        json!({"w": {"dtype": "BF16", "shape": [3, 3], "data_offsets": [0, 16]}}),
        &[0u8; 16],
    );
    let e = open_err(&d);
    assert!(
        e.contains("tensor w") && e.contains("needs 18 bytes but data_offsets span 16"),
        "{e}"
    );
}

#[test]
fn overlapping_tensors_are_rejected() {
    let d = tmpdir("overlap");
    write_st(
        &d.join("model.safetensors"),
        json!({
            "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
        }),
        &[0u8; 12],
    );
    let e = open_err(&d);
    assert!(e.contains("tensor b: overlaps tensor a"), "{e}");
}

#[test]
fn impossible_header_length_is_rejected() {
    let d = tmpdir("hdr");
    let mut f = (1u64 << 40).to_le_bytes().to_vec();
    f.extend_from_slice(b"{}");
    std::fs::write(d.join("model.safetensors"), f).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("invalid safetensors header") && e.contains("does not fit"),
        "{e}"
    );
    std::fs::write(d.join("model.safetensors"), [1u8, 2]).unwrap();
    assert!(open_err(&d).contains("too short"));
}

#[test]
fn index_and_shards_must_agree() {
    let d = tmpdir("index");
    write_st(
        &d.join("model-00001-of-000001.safetensors"),
        json!({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
               "extra": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}),
        &[0u8; 4],
    );
    let index = |map: serde_json::Value| {
        std::fs::write(
            d.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": map}).to_string(),
        )
        .unwrap()
    };
    index(json!({"a": "model-00001-of-000001.safetensors"}));
    let e = open_err(&d);
    assert!(
        e.contains("tensor extra: present in the shard but not listed in the index"),
        "{e}"
    );
    index(
        json!({"a": "model-00001-of-000001.safetensors", "extra": "model-00001-of-000001.safetensors", "ghost": "model-00001-of-000001.safetensors"}),
    );
    let e = open_err(&d);
    assert!(
        e.contains("tensor ghost: listed in the index but absent"),
        "{e}"
    );
    index(json!({"a": "model-00002-of-000002.safetensors"}));
    let e = open_err(&d);
    assert!(e.contains("model-00002-of-000002.safetensors"), "{e}");
    index(json!({"a": "../escape.safetensors"}));
    assert!(open_err(&d).contains("leaves the model directory"));
    std::fs::remove_file(d.join("model.safetensors.index.json")).unwrap();
    assert!(open_err(&d).contains("not a model directory"));
}

#[test]
fn tensors_must_cover_the_data_section_exactly() {
    // A hole between two tensors.
    let d = tmpdir("hole");
    write_st(
        &d.join("model.safetensors"),
        json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
               "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}),
        &[0u8; 12],
    );
    let e = open_err(&d);
    assert!(
        e.contains("4 bytes of the data section before tensor b belong to no tensor"),
        "{e}"
    );
    // A header-length prefix 3 bytes into the header's padding: every tensor
    // would be read 3 bytes early; the 3 extra data bytes give it away.
    let d = tmpdir("shifted");
    let mut h =
        serde_json::to_vec(&json!({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}))
            .unwrap();
    while !h.len().is_multiple_of(8) || h.len() < 40 {
        h.push(b' ');
    }
    let mut f = (h.len() as u64 - 3).to_le_bytes().to_vec();
    f.extend(h);
    f.extend_from_slice(&[7u8; 8]);
    std::fs::write(d.join("model.safetensors"), f).unwrap();
    let e = open_err(&d);
    assert!(e.contains("3 bytes after the last tensor"), "{e}");
}

#[test]
fn a_duplicate_key_is_called_a_duplicate() {
    let d = tmpdir("dup");
    let json = br#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
    let mut h = json.to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = (h.len() as u64).to_le_bytes().to_vec();
    f.extend(h);
    f.extend_from_slice(&[0u8; 8]);
    std::fs::write(d.join("model.safetensors"), f).unwrap();
    let e = open_err(&d);
    assert!(e.contains("tensor w") && e.contains("duplicate key"), "{e}");
}

/// Deterministic mutation fuzzing of shard headers: every mutant either
/// opens (and then reads back in bounds) or fails with an error — never a
/// panic, a hang or a huge allocation.
#[test]
fn mutated_headers_never_panic() {
    let d = tmpdir("fuzz");
    let header = json!({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [12, 16]},
        "c": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    });
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut base = (h.len() as u64).to_le_bytes().to_vec();
    base.extend(h);
    base.extend((0u8..24).collect::<Vec<_>>());
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut rnd = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    let interesting: [&[u8]; 8] = [
        b"0",
        b"-1",
        b"18446744073709551615",
        b"1e308",
        b"\"",
        b"[",
        b"}",
        b"null",
    ];
    let path = d.join("model.safetensors");
    let (mut opened, mut refused) = (0, 0);
    for i in 0..600 {
        let mut m = base.clone();
        match i % 4 {
            0 => {
                let at = rnd(m.len());
                m[at] ^= 1 << rnd(8);
            }
            1 => {
                let at = 8 + rnd(m.len() - 8);
                let ins = interesting[rnd(interesting.len())];
                m.splice(at..at, ins.iter().copied());
            }
            2 => {
                let at = rnd(8);
                m[at] = rnd(256) as u8;
            }
            _ => {
                let cut = rnd(m.len());
                m.truncate(cut);
            }
        }
        std::fs::write(&path, &m).unwrap();
        match Checkpoint::open(&d) {
            Ok(ck) => {
                opened += 1;
                let total: u64 = ck.shards().iter().map(|s| s.len).sum();
                for (_, t) in ck.tensors() {
                    assert!(t.offset + t.len <= total);
                    ck.read(t).unwrap();
                }
            }
            Err(e) => {
                refused += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(
        opened > 0 && refused > 0,
        "{opened} opened, {refused} refused"
    );
}
