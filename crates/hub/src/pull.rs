//! `fathom pull`: list a revision, choose its files, download them in
//! parallel with resume, verify each, and lay out the snapshot.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::api::{Listing, RemoteFile, fetch_listing, file_url};
use crate::cache::Layout;
use crate::config::HubConfig;
use crate::download::{Progress, fetch_file, partial_name};
use crate::error::{HubError, Result};
use crate::http::Http;
use crate::repo::RepoRef;
use crate::select::{INDEX, Include, select};
use crate::verify::Hasher;

/// Largest index file read while planning.
const MAX_INDEX: u64 = 64 << 20;
/// Plans made for one pull when files change under it.
const MAX_PLANS: usize = 3;
/// Most files downloaded at once.
pub const MAX_JOBS: usize = 64;

/// What to pull and where.
#[derive(Debug, Clone)]
pub struct PullOptions {
    pub repo: RepoRef,
    pub include: Include,
    /// A model directory of its own instead of the shared cache.
    pub dir: Option<PathBuf>,
    /// Files downloaded at once (1 to [`MAX_JOBS`]).
    pub jobs: usize,
}

/// How much of a file is on disk already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileState {
    /// Verified bytes in `blobs/`.
    Have,
    /// A partial of this many bytes, to be resumed.
    Partial(u64),
    Missing,
}

#[derive(Debug, Clone)]
pub struct PlannedFile {
    pub file: RemoteFile,
    pub state: FileState,
}

impl PlannedFile {
    /// Bytes still to come over the network.
    pub fn to_fetch(&self) -> u64 {
        match self.state {
            FileState::Have => 0,
            FileState::Partial(n) => self.file.size.saturating_sub(n),
            FileState::Missing => self.file.size,
        }
    }
}

/// The revision's listing, the files chosen and their state on disk.
#[derive(Debug)]
pub struct Plan {
    pub repo: RepoRef,
    pub listing: Listing,
    pub files: Vec<PlannedFile>,
    pub layout: Layout,
    prefetched: HashMap<String, Vec<u8>>,
}

impl Plan {
    /// Bytes of the chosen files.
    pub fn bytes_total(&self) -> u64 {
        self.files.iter().map(|f| f.file.size).sum()
    }

    /// Bytes to download, which is also the disk space still needed.
    pub fn bytes_to_fetch(&self) -> u64 {
        self.files.iter().map(PlannedFile::to_fetch).sum()
    }

    /// Free bytes on the filesystem that will hold the blobs.
    pub fn free_space(&self) -> Option<u64> {
        free_space(&self.layout.blobs)
    }
}

/// What a finished pull left.
#[derive(Debug)]
pub struct Pulled {
    /// The directory to load the model from.
    pub snapshot: PathBuf,
    pub commit: String,
    pub files: usize,
}

fn http_for(cfg: &HubConfig) -> Result<Http> {
    Http::new(cfg, Arc::new(AtomicBool::new(false)))
}

/// Lists the revision and works out what is to be fetched, without
/// writing anything (the index, when `--include spine` needs it, is read
/// into memory and verified).
pub fn plan(cfg: &HubConfig, opts: &PullOptions) -> Result<Plan> {
    plan_with(&http_for(cfg)?, cfg, opts)
}

fn plan_with(http: &Http, cfg: &HubConfig, opts: &PullOptions) -> Result<Plan> {
    let listing = fetch_listing(http, &opts.repo)?;
    let layout = match &opts.dir {
        Some(d) => Layout::dir(d),
        None => Layout::cache(&cfg.cache, &opts.repo, &listing.commit),
    };
    if opts.dir.is_some()
        && let Some(f) = listing
            .files
            .iter()
            .find(|f| f.path.starts_with(".fathom/"))
    {
        return Err(HubError::protocol(
            &f.path,
            "a repository file under .fathom/ would clash with --dir's own records: pull into the cache instead",
        ));
    }
    let mut prefetched = HashMap::new();
    let index = match (opts.include, listing.file(INDEX)) {
        (Include::Spine, Some(f)) => {
            let bytes = read_index(http, &listing, &layout, f)?;
            prefetched.insert(INDEX.to_string(), bytes);
            prefetched.get(INDEX).map(Vec::as_slice)
        }
        _ => None,
    };
    let chosen = select(&listing, opts.include, index)?;
    let files = chosen
        .into_iter()
        .map(|file| {
            let state = state_of(&layout, &listing.commit, &file);
            PlannedFile { file, state }
        })
        .collect();
    Ok(Plan {
        repo: opts.repo.clone(),
        listing,
        files,
        layout,
        prefetched,
    })
}

fn state_of(layout: &Layout, commit: &str, f: &RemoteFile) -> FileState {
    if let Some(name) = f.blob_name()
        && std::fs::metadata(layout.blob(name)).is_ok_and(|m| m.is_file() && m.len() == f.size)
    {
        return FileState::Have;
    }
    match std::fs::metadata(layout.partial(&partial_name(f, commit))) {
        Ok(m) if m.len() <= f.size => FileState::Partial(m.len()),
        _ => FileState::Missing,
    }
}

/// The index's bytes: from a verified blob on disk, else fetched whole
/// and checked against the listing's digest.
fn read_index(http: &Http, listing: &Listing, layout: &Layout, f: &RemoteFile) -> Result<Vec<u8>> {
    if let Some(name) = f.blob_name() {
        let p = layout.blob(name);
        if std::fs::metadata(&p).is_ok_and(|m| m.len() == f.size) {
            return std::fs::read(&p).map_err(|e| HubError::io(&p, e));
        }
    }
    if f.size > MAX_INDEX {
        return Err(HubError::protocol(
            INDEX,
            format!("{} bytes, over {MAX_INDEX}", f.size),
        ));
    }
    let url = file_url(http.endpoint(), &listing.repo, &listing.commit, INDEX);
    let (_, bytes) = http.get_small(INDEX, &url, MAX_INDEX)?;
    let expected = f.expected();
    let mut h = Hasher::new(&expected, bytes.len() as u64);
    h.update(&bytes);
    let got = h.hex();
    if bytes.len() as u64 != f.size || expected.digest().is_some_and(|d| d != got) {
        return Err(HubError::Digest {
            file: INDEX.into(),
            algo: expected.algo(),
            expected: expected.digest().unwrap_or("(none listed)").into(),
            got: format!("{got} ({} bytes)", bytes.len()),
        });
    }
    Ok(bytes)
}

/// Pulls: plans, downloads what is missing (`opts.jobs` files at once),
/// and lays out the snapshot; `on_plan` sees each plan before its
/// downloads start. A file whose contents change on the server under the
/// same name restarts the pull from a fresh listing (verified blobs are
/// kept), at most [`MAX_PLANS`] times.
pub fn pull(
    cfg: &HubConfig,
    opts: &PullOptions,
    progress: &Progress,
    on_plan: &dyn Fn(&Plan),
) -> Result<Pulled> {
    let mut last = None;
    for _ in 0..MAX_PLANS {
        let http = http_for(cfg)?;
        let plan = plan_with(&http, cfg, opts)?;
        on_plan(&plan);
        match run(&http, &plan, opts.jobs, progress) {
            Err(e @ HubError::Changed { .. }) => last = Some(e),
            other => return other,
        }
    }
    Err(last.expect("at least one plan"))
}

/// Downloads a plan's files and lays out its snapshot.
fn run(http: &Http, plan: &Plan, jobs: usize, progress: &Progress) -> Result<Pulled> {
    progress.done.store(0, Ordering::Relaxed);
    progress.files_done.store(0, Ordering::Relaxed);
    progress.total.store(plan.bytes_total(), Ordering::Relaxed);
    progress
        .files_total
        .store(plan.files.len() as u64, Ordering::Relaxed);
    // Largest first, so the last files to finish are small ones.
    let mut order: Vec<&PlannedFile> = plan.files.iter().collect();
    order.sort_by(|a, b| {
        b.file
            .size
            .cmp(&a.file.size)
            .then(a.file.path.cmp(&b.file.path))
    });
    let next = AtomicUsize::new(0);
    let names = Mutex::new(HashMap::new());
    let first_err: Mutex<Option<HubError>> = Mutex::new(None);
    let workers = jobs.clamp(1, MAX_JOBS).min(order.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while !http.stopped() {
                    let Some(pf) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    let f = &pf.file;
                    let pre = plan.prefetched.get(&f.path).map(Vec::as_slice);
                    let r = fetch_file(
                        http,
                        &plan.listing.repo,
                        &plan.listing.commit,
                        &plan.layout,
                        f,
                        pre,
                        progress,
                    );
                    match r {
                        Ok(name) => {
                            names.lock().unwrap().insert(f.path.clone(), name);
                            progress.files_done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            http.stop_all();
                            let mut slot = first_err.lock().unwrap();
                            if slot.is_none() || matches!(*slot, Some(HubError::Stopped)) {
                                *slot = Some(e);
                            }
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().unwrap() {
        return Err(e);
    }
    let names = names.into_inner().unwrap();
    // config.json last: a snapshot with one is taken as pulled.
    let mut paths: Vec<&String> = names.keys().collect();
    paths.sort_by_key(|p| (p.as_str() == "config.json", p.as_str()));
    for p in paths {
        plan.layout.link(p, &names[p])?;
    }
    plan.layout.record(&plan.repo, &plan.listing.commit)?;
    Ok(Pulled {
        snapshot: plan.layout.snapshot.clone(),
        commit: plan.listing.commit.clone(),
        files: names.len(),
    })
}

/// Free bytes for an unprivileged user on the filesystem holding `path`
/// (or its nearest existing ancestor).
fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let mut p = path;
    while !p.exists() {
        p = p.parent()?;
    }
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable
    // statvfs; the struct is read only when the call succeeds.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}
