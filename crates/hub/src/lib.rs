//! Getting a model from the Hugging Face Hub.
//!
//! - [`pull()`]: list a revision (`/api/models/ORG/NAME/revision/REV?blobs=true`),
//!   choose its files ([`Include`]), download them in parallel with resume
//!   (`blobs/<etag>.incomplete`, continued with `Range`), verify each against
//!   the Hub's digest before it is renamed into place, and lay out the
//!   snapshot in the Hub cache other clients share (or a `--dir` directory).
//! - [`resolve_model`]: what `--model ARG` names: a directory, or a pulled
//!   repository's snapshot.
//! - [`RemoteExpertStore`]: byte spans of shards that were not pulled,
//!   fetched on explicit demand and kept within a disk budget.
//!
//! The HTTP shapes are described in `docs/hub.md`.

mod api;
mod cache;
mod config;
mod download;
mod error;
mod http;
mod pull;
mod remote;
mod repo;
mod select;
mod spans;
mod verify;

#[cfg(feature = "fake-hub")]
pub mod fake;
#[cfg(feature = "fake-hub")]
mod fake_split;

pub use api::{Listing, RemoteFile};
pub use cache::{Layout, Source, pulled_snapshot, resolve_model, resolve_model_in, source_of};
pub use config::{DEFAULT_ENDPOINT, HubConfig, hf_home, hub_cache};
pub use download::Progress;
pub use error::{HubError, Result};
pub use pull::{FileState, MAX_JOBS, Plan, PlannedFile, PullOptions, Pulled, plan, pull};
pub use remote::{
    MAX_HEADER, MAX_SPAN, RemoteExpertStore, RemoteOptions, StoreStats, default_store_dir,
};
pub use repo::{DEFAULT_REVISION, RepoRef, is_commit, looks_like_repo};
pub use select::{INDEX, Include, ShardSplit, is_routed_expert, is_weight_file, split_shards};
pub use verify::{Expected, git_blob_id, sha256_hex};
