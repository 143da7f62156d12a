//! `fathom`: run giant Mixture-of-Experts models exactly on small machines.
//!
//! One file per subcommand under `commands/`; this file only parses and
//! dispatches. Errors are printed as one `error: …` chain and exit 1
//! (usage errors exit 2, from clap).

mod commands;
mod common;
mod device;
mod load;
mod progress;
mod suggest;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "fathom", version, about = "Run giant Mixture-of-Experts language models exactly, on a machine whose memory is a fraction of the model", long_about = None)]
struct Cli {
    /// Compute threads (default: all cores; the performance cores on Apple Silicon).
    #[arg(long, global = true, env = "FATHOM_THREADS")]
    threads: Option<usize>,
    /// Pin each compute thread to one CPU, dealing threads to NUMA nodes in turn.
    #[arg(long, global = true, env = "FATHOM_PIN_THREADS")]
    pin_threads: bool,
    /// Memory placement on hosts with several NUMA nodes: `auto` interleaves
    /// the process's memory page by page over every node (as `numactl
    /// --interleave=all`) when there are two or more; `off` leaves it to the
    /// kernel (first touch).
    #[arg(long, global = true, env = "FATHOM_NUMA", default_value = "auto")]
    numa: Numa,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Numa {
    Auto,
    Off,
}

#[derive(Subcommand)]
enum Command {
    Demo(commands::demo::DemoArgs),
    Run(commands::run::RunArgs),
    Batch(commands::batch::BatchArgs),
    Bench(commands::bench::BenchArgs),
    BenchServe(commands::bench_serve::BenchServeArgs),
    Logits(commands::logits::LogitsArgs),
    Tokenize(commands::tokenize::TokenizeArgs),
    Chat(commands::chat::ChatArgs),
    Serve(commands::serve::ServeArgs),
    Synth(commands::synth::SynthArgs),
    Inspect(commands::inspect::InspectArgs),
    Verify(commands::verify::VerifyArgs),
    Convert(commands::convert::ConvertArgs),
    EvalQuant(commands::eval_quant::EvalQuantArgs),
    Pull(commands::pull::PullArgs),
}

/// Exit status of a program whose reader went away (128 + SIGPIPE), as
/// `head` and other Unix tools leave it.
const BROKEN_PIPE_EXIT: i32 = 141;

/// A closed stdout (`fathom tokenize … | head`) ends the program quietly
/// with [`BROKEN_PIPE_EXIT`]: `print!` panics on it, `write!` returns it.
fn quiet_broken_pipes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") {
            std::process::exit(BROKEN_PIPE_EXIT);
        }
        default(info);
    }));
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Runs a command on a thread of the compute pool. The parallel products
/// it starts then fork from a pool thread (work stealing) instead of being
/// injected from outside and waited for on a latch: a sleep and a wake of
/// the calling thread per product, which on small models was a fixed cost
/// per token (rayon's `LockLatch` and context switches in the profile).
/// Results do not depend on which thread runs what.
fn on_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::scope(|_| f())
}

/// NUMA memory policy and the compute pool (its size, and its threads'
/// CPUs with `--pin-threads`), before anything is allocated or run.
fn place(cli: &Cli) {
    use fathom_weights::numa;
    let topo = numa::Topology::detect();
    let interleaved = cli.numa == Numa::Auto
        && match numa::interleave(&topo.node_ids) {
            Ok(done) => done,
            Err(e) => {
                eprintln!(
                    "warning: cannot interleave memory over {} NUMA nodes: {e}",
                    topo.nodes.len()
                );
                false
            }
        };
    let mut placement = numa::Placement {
        nodes: topo.nodes.len(),
        interleaved,
        pinned: false,
    };
    // Where the machine has fast and slow cores (Apple Silicon) the compute
    // threads default to the fast ones (unless rayon's own variable is set).
    let threads = cli.threads.or_else(|| {
        std::env::var_os("RAYON_NUM_THREADS")
            .is_none()
            .then(fathom_platform::cpu::default_compute_threads)
            .flatten()
    });
    let pin = cli.pin_threads
        && match numa::thread_pinning() {
            fathom_platform::Support::Available => true,
            s => {
                eprintln!(
                    "warning: --pin-threads: pinning a thread to a CPU is {s}; the system places the compute threads"
                );
                false
            }
        };
    if threads.is_some() || pin {
        let mut pool = rayon::ThreadPoolBuilder::new();
        if let Some(n) = threads {
            pool = pool.num_threads(n.max(1));
        }
        if pin {
            pool = pool.start_handler(move |i| {
                let cpu = topo.cpu_for_thread(i);
                if let Err(e) = numa::pin_current_thread(cpu) {
                    eprintln!("warning: cannot pin compute thread {i} to CPU {cpu}: {e}");
                }
            });
        }
        match pool.build_global() {
            Ok(()) => placement.pinned = pin,
            Err(e) => eprintln!("warning: cannot set up the compute threads: {e}"),
        }
    }
    numa::set_placement(placement);
}

fn main() {
    quiet_broken_pipes();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => suggest::filter(e, &Cli::command()).exit(),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(n) = cli.threads.filter(|&n| n == 0 || n > 4 * cores) {
        eprintln!(
            "error: --threads {n}: give 1 to {} (4 × the {cores} cores here)",
            4 * cores
        );
        std::process::exit(2);
    }
    place(&cli);
    let result = match cli.command {
        Command::Demo(a) => on_pool(move || commands::demo::run(a)),
        Command::Run(a) => on_pool(move || commands::run::run(a)),
        Command::Batch(a) => on_pool(move || commands::batch::run(a)),
        Command::Bench(a) => commands::bench::run(a),
        Command::BenchServe(a) => commands::bench_serve::run(a),
        Command::Logits(a) => on_pool(move || commands::logits::run(a)),
        Command::Tokenize(a) => commands::tokenize::run(a),
        Command::Chat(a) => on_pool(move || commands::chat::run(a)),
        Command::Serve(a) => commands::serve::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Convert(a) => on_pool(move || commands::convert::run(a)),
        Command::EvalQuant(a) => commands::eval_quant::run(a),
        Command::Pull(a) => commands::pull::run(a),
    };
    if let Err(e) = result {
        if is_broken_pipe(&e) {
            std::process::exit(BROKEN_PIPE_EXIT);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
