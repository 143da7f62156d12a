//! `--experts remote` against a fake Hub on 127.0.0.1: a synthetic model
//! whose routed experts live in their own shards is pulled with
//! `--include spine`, then runs with its expert spans fetched on demand.
//! Logits are bit-identical to the fully local model's; a restart
//! reuses the span store without a request; a fetch that fails ends the
//! step with an error naming the shard and leaves the state as it was,
//! and the same step then succeeds identically; prefetch guesses never
//! reach the network; a disk budget below one expert is refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fathom_hub::fake::{FakeHub, Fault, split_experts};
use fathom_hub::{HubConfig, Include, Progress, PullOptions, RepoRef, pull};
use fathom_model::experts::ExpertSource;
use fathom_model::{CausalLm, Logits, ModelConfig, SeqState, Spine, StepError, StepInput};
use fathom_runtime::{ExpertMode, LoadRequest, load};
use fathom_stream::{StreamConfig, StreamedExperts};

const REPO: &str = "test-org/split";
const PROMPT: [u32; 5] = [3, 17, 42, 99, 7];
const STEPS: usize = 4;

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("runtime-remote")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Served {
    hub: FakeHub,
    /// The whole model on disk.
    src: PathBuf,
    /// Its pulled snapshot: the spine only.
    snapshot: PathBuf,
    base: PathBuf,
}

/// A tiny synthetic K3 with its experts in three shards of their own,
/// served as [`REPO`] and pulled with `--include spine`.
fn served(name: &str) -> Served {
    let base = scratch(name);
    let synth = base.join("synth");
    let plan = fathom_synth::Plan::new(
        &fathom_synth::Dims::tiny(),
        11,
        fathom_synth::DEFAULT_SHARD_SIZE,
    )
    .unwrap();
    fathom_synth::write_model(
        &plan,
        &synth,
        &fathom_synth::WriteOptions::default(),
        &|_| {},
    )
    .unwrap();
    let src = base.join("src");
    split_experts(&synth, &src, 3);
    let hub = FakeHub::start();
    hub.set_repo_dir(REPO, &src);
    let o = PullOptions {
        repo: RepoRef::parse(REPO).unwrap(),
        include: Include::Spine,
        dir: None,
        jobs: 2,
    };
    let got = pull(
        &config(&hub, &base.join("hf")),
        &o,
        &Progress::default(),
        &|_| {},
    )
    .unwrap();
    assert!(got.snapshot.join("model-spine.safetensors").is_file());
    for n in 1..=3 {
        let f = format!("model-experts-{n:05}.safetensors");
        assert!(src.join(&f).is_file());
        assert!(!got.snapshot.join(&f).exists(), "{f} was pulled");
    }
    hub.clear_log();
    Served {
        hub,
        src,
        snapshot: got.snapshot,
        base,
    }
}

/// Short timeouts, two tries, and a 10 ms backoff, so faults fail fast.
fn config(hub: &FakeHub, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint: hub.endpoint(),
        token: None,
        cache: cache.to_path_buf(),
        idle_timeout: Duration::from_secs(2),
        tries: 2,
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        max_retry_after: Duration::from_secs(1),
    }
}

fn remote(s: &Served, store: &str, budget: Option<u64>, prefetch: bool) -> LoadRequest {
    LoadRequest {
        experts: ExpertMode::Remote,
        hub: Some(config(&s.hub, &s.base.join("hf"))),
        span_dir: Some(s.base.join(store)),
        disk_budget: budget,
        prefetch,
        io_threads: 4,
        ..LoadRequest::default()
    }
}

fn step(
    model: &dyn CausalLm,
    st: &mut dyn SeqState,
    tokens: &[u32],
) -> Result<Vec<f32>, StepError> {
    let mut b = [StepInput {
        state: st,
        tokens,
        logits: Logits::Last,
    }];
    model.step(&mut b).map(|mut v| v.pop().unwrap())
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding: each step's logits (as bits) and token.
fn decode(model: &dyn CausalLm) -> Vec<(u32, Vec<u32>)> {
    let mut st = model.new_state();
    let mut input = PROMPT.to_vec();
    let mut out = Vec::new();
    for _ in 0..STEPS {
        let l = step(model, st.as_mut(), &input).unwrap();
        let t = argmax(&l);
        out.push((t, l.iter().map(|x| x.to_bits()).collect()));
        input = vec![t];
    }
    out
}

fn local(s: &Served) -> Vec<(u32, Vec<u32>)> {
    let req = LoadRequest {
        experts: ExpertMode::Stream,
        ..LoadRequest::default()
    };
    decode(load(&s.src, &req, 16, Spine::Bf16).unwrap().model.as_ref())
}

/// Data requests (CDN hops) so far.
fn data_requests(hub: &FakeHub) -> usize {
    hub.log()
        .iter()
        .filter(|l| l.path.starts_with("/cdn/"))
        .count()
}

#[test]
fn remote_experts_match_the_local_model_and_a_restart_needs_no_network() {
    let s = served("match");
    let want = local(&s);
    {
        let loaded = load(
            &s.snapshot,
            &remote(&s, "store", None, true),
            16,
            Spine::Bf16,
        )
        .unwrap();
        assert_eq!(loaded.info.experts, "remote");
        assert_eq!(decode(loaded.model.as_ref()), want);
        let st = loaded.info.remote_stats().unwrap();
        // Two requests per expert shard's header, one per expert span.
        assert_eq!(data_requests(&s.hub) as u64, st.fetches);
        assert!(st.fetches > 6, "{st:?}");
    }
    s.hub.clear_log();
    let loaded = load(
        &s.snapshot,
        &remote(&s, "store", None, true),
        16,
        Spine::Bf16,
    )
    .unwrap();
    assert_eq!(decode(loaded.model.as_ref()), want);
    assert!(s.hub.log().is_empty(), "a restart asked the network");
    assert_eq!(loaded.info.remote_stats().unwrap().fetches, 0);

    // Without --experts, missing shards of a pulled model mean remote.
    drop(loaded);
    let req = LoadRequest {
        span_dir: Some(s.base.join("store")),
        hub: Some(config(&s.hub, &s.base.join("hf"))),
        ..LoadRequest::default()
    };
    let loaded = load(&s.snapshot, &req, 16, Spine::Bf16).unwrap();
    assert_eq!(
        loaded.info.experts,
        "remote (expert shards are not on disk)"
    );
    assert_eq!(decode(loaded.model.as_ref()), want);
    // Streaming from the shards alone cannot work: said so.
    let req = LoadRequest {
        experts: ExpertMode::Stream,
        ..LoadRequest::default()
    };
    let e = load(&s.snapshot, &req, 16, Spine::Bf16).err().unwrap();
    assert_eq!(
        format!("{e:#}"),
        format!(
            "{}: 3 of the shards the index names are not on disk (model-experts-00001.safetensors…): pull them (`fathom pull REPO --include all`), or, for a pulled model, fetch routed experts on demand with --experts remote",
            s.snapshot.display()
        )
    );
}

#[test]
fn prefetch_guesses_never_fetch() {
    let s = served("prefetch");
    let on = load(&s.snapshot, &remote(&s, "on", None, true), 16, Spine::Bf16).unwrap();
    let want = decode(on.model.as_ref());
    let with_prefetch = on.info.remote_stats().unwrap().fetches;
    let guessed = on.model.expert_stats().hinted;
    drop(on);
    let off = load(
        &s.snapshot,
        &remote(&s, "off", None, false),
        16,
        Spine::Bf16,
    )
    .unwrap();
    assert_eq!(decode(off.model.as_ref()), want);
    // The same spans are fetched with guesses as without: only demand reads fetch.
    assert_eq!(off.info.remote_stats().unwrap().fetches, with_prefetch);
    assert!(guessed > 0, "no guesses were made");
}

#[test]
fn a_guess_reads_only_stored_spans() {
    let s = served("guess");
    let hub = config(&s.hub, &s.base.join("hf"));
    let store = s.base.join("g");
    let r = fathom_runtime::remote::open(&s.snapshot, Some(&hub), Some(&store), None).unwrap();
    let mc = ModelConfig::read(&s.snapshot).unwrap();
    let table = fathom_model::registry::expert_table(&mc, &r.checkpoint).unwrap();
    let layer = table.layers.iter().position(|l| !l.is_empty()).unwrap();
    let mut sc = StreamConfig::new(table.top_k, 64);
    // Act on every guess.
    sc.prefetch_min_precision = 0.0;
    let src = StreamedExperts::new(&r.checkpoint, &table, &sc).unwrap();
    s.hub.clear_log();
    src.hint(layer, &[0, 1]);
    src.drain();
    assert_eq!(data_requests(&s.hub), 0, "a guess fetched");
    assert!(src.peek(layer, &[0, 1]).is_empty());
    // Asked for: fetched with one request.
    let t = src.request(layer, &[0]).unwrap();
    src.collect(t).unwrap();
    assert_eq!(data_requests(&s.hub), 1);
    drop(src);
    // A guess of a stored span is read from the store, without a request.
    let src = StreamedExperts::new(&r.checkpoint, &table, &sc).unwrap();
    src.hint(layer, &[0, 1]);
    src.drain();
    assert_eq!(src.peek(layer, &[0, 1]).len(), 1);
    assert_eq!(data_requests(&s.hub), 1);
}

fn fails_then_succeeds(s: &Served, store: &str, fault: Fault, msg: &str) {
    let want = local(s);
    let loaded = load(&s.snapshot, &remote(s, store, None, true), 16, Spine::Bf16).unwrap();
    let model = loaded.model.as_ref();
    let mut st = model.new_state();
    let before = st.encode().unwrap();
    for n in 1..=3 {
        let f = format!("model-experts-{n:05}.safetensors");
        for _ in 0..200 {
            s.hub.push_fault(&f, fault.clone());
        }
    }
    let e = step(model, st.as_mut(), &PROMPT).unwrap_err();
    s.hub.clear_faults();
    assert_eq!(e.seq, None);
    let text = e.to_string();
    assert!(
        text.contains("model-experts-0000") && text.contains(msg),
        "{text}"
    );
    assert_eq!(st.pos(), 0);
    assert!(
        st.encode().unwrap() == before,
        "the failed step changed the state"
    );
    // Nothing of the failed fetches was kept; the same step now succeeds.
    let l = step(model, st.as_mut(), &PROMPT).unwrap();
    assert_eq!(l.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want[0].1);
}

#[test]
fn a_failed_fetch_ends_the_step_and_the_next_succeeds() {
    let s = served("faults");
    fails_then_succeeds(&s, "5xx", Fault::Status(503), "gave up after 2 tries");
    fails_then_succeeds(&s, "cut", Fault::Truncate(5), "gave up after 2 tries");
    fails_then_succeeds(
        &s,
        "range",
        Fault::WrongContentRange,
        "and the server answered 206 bytes",
    );
}

#[test]
fn a_disk_budget_below_one_expert_is_refused() {
    let s = served("budget");
    let e = load(
        &s.snapshot,
        &remote(&s, "b", Some(999), true),
        16,
        Spine::Bf16,
    )
    .err()
    .unwrap();
    let text = format!("{e:#}");
    let need: u64 = text
        .rsplit("give at least --disk-budget ")
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{text}"));
    assert!(
        text.contains(&format!(
            "--disk-budget 999 B cannot hold one routed expert: layer "
        )) && text.contains(&format!("({need} bytes)")),
        "{text}"
    );
    // That least budget works, and gives the local model's logits.
    let want = local(&s);
    let loaded = load(
        &s.snapshot,
        &remote(&s, "b", Some(need), true),
        16,
        Spine::Bf16,
    )
    .unwrap();
    assert_eq!(decode(loaded.model.as_ref()), want);
    let st = loaded.info.remote_stats().unwrap();
    assert!(st.stored_bytes <= need && st.evicted > 0, "{st:?}");
}

#[test]
fn the_store_works_inside_an_async_runtime() {
    let s = served("tokio");
    let want = local(&s);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Loaded, used and dropped on a runtime's worker thread.
    let got = rt.block_on(async {
        let loaded = load(&s.snapshot, &remote(&s, "t", None, true), 16, Spine::Bf16).unwrap();
        decode(loaded.model.as_ref())
    });
    assert_eq!(got, want);
}
