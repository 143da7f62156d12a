//! Large reads bypass the page cache through aligned spans and a bounce
//! buffer (the longest as parts read side by side): the bytes equal
//! buffered reads for any offset and length, the file's unaligned end
//! included.

use std::path::PathBuf;

use fathom_weights::direct::{BOUNCE, DIRECT_MIN, PARALLEL_MIN};
use fathom_weights::{Checkpoint, thread_direct_bytes_read};

/// On the target directory's filesystem (a disk; the system temp
/// directory may be tmpfs, which refuses uncached reads).
fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fathom-direct-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether this filesystem takes an uncached aligned read.
fn uncached_works(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(f) = fathom_platform::io::open_uncached(path) else {
        return false;
    };
    let mut b = fathom_weights::AlignedBuf::zeroed(4096);
    f.read_at(&mut b, 0).is_ok()
}

#[test]
fn uncached_reads_give_the_buffered_bytes_at_any_offset_and_length() {
    let d = dir();
    // A tensor long enough to be read in parallel parts, plus 2.5 bounce
    // buffers and an odd tail, starting at an unaligned offset (the
    // header's length), then a short one.
    let n = PARALLEL_MIN + BOUNCE * 5 / 2 + 12_345;
    let header = format!(
        r#"{{"a":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}},"b":{{"dtype":"U8","shape":[7],"data_offsets":[{n},{}]}}}}"#,
        n + 7
    );
    let mut h = header.into_bytes();
    h.push(b' '); // 8 + len(header) is not a multiple of 4096 either way
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    let data: Vec<u8> = (0..n + 7)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    file.extend_from_slice(&data);
    let path = d.join("model.safetensors");
    std::fs::write(&path, &file).unwrap();

    let ck = Checkpoint::open(&d).unwrap();
    let a = ck.get("a").unwrap().clone();
    assert_ne!(a.offset % 4096, 0, "the test wants an unaligned tensor");
    let ranges = [
        (0u64, n),                                 // the whole tensor
        (1, DIRECT_MIN),                           // just large enough, odd start
        (4095, BOUNCE + 1),                        // across a bounce boundary
        (3, PARALLEL_MIN + 1),                     // parts, odd start and length
        ((n - DIRECT_MIN) as u64, DIRECT_MIN + 7), // to the file's unaligned end
    ];
    let before = thread_direct_bytes_read();
    for (off, len) in ranges {
        let mut direct = vec![0u8; len];
        ck.set_buffered_only(false);
        ck.read_into(a.shard, a.offset + off, &mut direct).unwrap();
        let mut buffered = vec![0u8; len];
        ck.set_buffered_only(true);
        ck.read_into(a.shard, a.offset + off, &mut buffered)
            .unwrap();
        let want = &file[(a.offset + off) as usize..(a.offset + off) as usize + len];
        assert!(direct == want, "uncached bytes differ at {off}+{len}");
        assert!(buffered == want, "buffered bytes differ at {off}+{len}");
    }
    let direct = thread_direct_bytes_read() - before;
    if uncached_works(&path) {
        let total: usize = ranges.iter().map(|r| r.1).sum();
        assert_eq!(direct, total as u64, "every large read went uncached");
    } else {
        assert_eq!(direct, 0);
        eprintln!("skipped the uncached half: this filesystem refuses uncached reads");
    }
    // Reading past the end is an error naming the file, not short bytes.
    let mut past = vec![0u8; DIRECT_MIN];
    ck.set_buffered_only(false);
    let e = ck
        .read_into(a.shard, a.offset + n as u64, &mut past)
        .unwrap_err();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
