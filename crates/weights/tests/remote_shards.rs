//! A shard the index names that is not on disk opens through a
//! `RemoteShards` source: its header comes from there and is validated as
//! a local one is, and its tensors are read through it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fathom_weights::{Checkpoint, RemoteShards};
use serde_json::json;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fathom-remote-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A safetensors file's bytes from a header object and a data section.
fn st(header: serde_json::Value, data: &[u8]) -> Vec<u8> {
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut f = (h.len() as u64).to_le_bytes().to_vec();
    f.extend(h);
    f.extend_from_slice(data);
    f
}

/// Files held in memory; every span asked for is logged with `fetch`.
#[derive(Default)]
struct Memory {
    files: HashMap<String, Vec<u8>>,
    log: Mutex<Vec<(String, u64, u64, bool)>>,
}

impl RemoteShards for Memory {
    fn size(&self, file: &str) -> Option<u64> {
        self.files.get(file).map(|b| b.len() as u64)
    }
    fn header(&self, file: &str) -> Result<Vec<u8>, String> {
        let b = &self.files[file];
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        Ok(b[..8 + n].to_vec())
    }
    fn span(&self, file: &str, off: u64, len: u64, fetch: bool) -> Result<Option<Vec<u8>>, String> {
        self.log
            .lock()
            .unwrap()
            .push((file.to_string(), off, len, fetch));
        Ok(Some(
            self.files[file][off as usize..(off + len) as usize].to_vec(),
        ))
    }
}

fn model(d: &Path) -> Vec<u8> {
    let index = json!({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}});
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        d.join("one.safetensors"),
        st(
            json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}),
            &[1, 2, 3, 4],
        ),
    )
    .unwrap();
    st(
        json!({"b": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 6]}}),
        &[10, 11, 12, 13, 14, 15],
    )
}

#[test]
fn a_missing_shard_opens_and_reads_through_the_remote_source() {
    let d = tmpdir("ok");
    let two = model(&d);
    let mem = Arc::new(Memory {
        files: HashMap::from([("two.safetensors".to_string(), two.clone())]),
        ..Memory::default()
    });
    // Without the source, the missing file is an error naming it.
    let e = Checkpoint::open(&d).unwrap_err().to_string();
    assert!(
        e.starts_with(&d.join("two.safetensors").display().to_string()),
        "{e}"
    );
    let ck = Checkpoint::open_with(&d, Some(mem.clone())).unwrap();
    let (one, two_s) = (&ck.shards()[0], &ck.shards()[1]);
    assert!(!one.is_remote() && two_s.is_remote());
    assert_eq!(
        (two_s.name.as_str(), two_s.len),
        ("two.safetensors", two.len() as u64)
    );
    let b = ck.get("b").unwrap();
    assert_eq!(b.offset, two.len() as u64 - 6);
    assert_eq!(ck.read(b).unwrap(), [10, 11, 12, 13, 14, 15]);
    assert_eq!(ck.read(ck.get("a").unwrap()).unwrap(), [1, 2, 3, 4]);
    // Only the remote tensor went through the source, as a demand read.
    assert_eq!(
        *mem.log.lock().unwrap(),
        [("two.safetensors".to_string(), b.offset, 6, true)]
    );
}

#[test]
fn a_remote_header_is_validated_like_a_local_one() {
    let d = tmpdir("bad");
    model(&d);
    // Its tensor needs 6 bytes; the header says 5.
    let bad = st(
        json!({"b": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 5]}}),
        &[10, 11, 12, 13, 14],
    );
    let mem = Arc::new(Memory {
        files: HashMap::from([("two.safetensors".to_string(), bad)]),
        ..Memory::default()
    });
    let e = Checkpoint::open_with(&d, Some(mem))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "{}: tensor b: U8 [2, 3] needs 6 bytes but data_offsets span 5",
            d.join("two.safetensors").display()
        )
    );
}
