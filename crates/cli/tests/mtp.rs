//! `fathom run --draft mtp` on a DeepSeek-V3 checkpoint that ships a
//! multi-token-prediction layer (written into a copy of the fixture): the
//! same ids and log-probabilities as `--draft off`, resident and streamed,
//! with the drafter reported; a checkpoint without the layer is refused
//! before loading.

mod common;
#[path = "../../model/tests/qcommon/mod.rs"]
mod qcommon;

use common::{fixture, run_json};
use qcommon::{Mix, with_mtp};

#[test]
fn draft_mtp_gives_the_undrafted_output() {
    let dir = with_mtp(&fixture("deepseek_v3-tiny"), "cli", Mix::Working);
    let d = dir.to_str().unwrap();
    for extra in [&[][..], &["--experts", "stream", "--context", "256"][..]] {
        let base = [
            &[
                "run",
                "--model",
                d,
                "--prompt-ids",
                "1,5,9,2,7,3,8",
                "--max-new",
                "12",
            ][..],
            &["--logprobs", "3", "--json", "--draft-max", "3"],
            extra,
        ]
        .concat();
        let off = run_json(&[&base[..], &["--draft", "off"]].concat());
        let mtp = run_json(&[&base[..], &["--draft", "mtp"]].concat());
        assert_eq!(off["output_ids"], mtp["output_ids"], "{extra:?}");
        assert_eq!(off["logprobs"], mtp["logprobs"], "{extra:?}");
        assert_eq!(mtp["stats"]["draft"]["drafter"], "mtp", "{}", mtp["stats"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_without_the_layer_is_refused_before_loading() {
    let plain = fixture("deepseek_v3-tiny");
    let out = common::fathom(&[
        "run",
        "--model",
        plain.to_str().unwrap(),
        "--prompt-ids",
        "1,5,9",
        "--draft",
        "mtp",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--draft mtp") && err.contains("num_nextn_predict_layers"),
        "{err}"
    );
    assert!(
        !err.contains("loading"),
        "refused only after loading: {err}"
    );
}
