//! Loading a fathom model as one library call.
//!
//! [`load`] takes a checkpoint directory and typed options ([`LoadRequest`]:
//! RAM and VRAM budgets, device, where routed experts live, expert heat,
//! context, the attention cache's placement, drafting's share of the
//! budget) and returns a [`Loaded`]: the model, what the RAM ledger
//! planned, and the backend that computes its products. `config.json` is
//! read once per load. The CLI, the server and the bench parse their flags
//! into a `LoadRequest` and call this; none of them loads a model another
//! way.

pub mod convert;
pub mod device;
pub mod dir;
pub mod draft;
pub mod heat;
mod load;
pub mod options;
pub mod plan;
mod progress;
pub use progress::byte_bar;
pub mod remote;

pub use device::Device;
pub use draft::DraftChoice;
pub use load::{LoadInfo, Loaded, device_room, load, load_config, read_config};
pub use options::{ASSUMED_CONTEXT, ExpertMode, LoadRequest, check_context, default_kv_dir};
pub use plan::{LoadPlan, plan};
