//! Facts about this process: its resident and peak resident memory, as
//! the system reports them ([`fathom_platform::process`]).

pub use fathom_platform::process::{peak_rss_bytes, rss_bytes};
