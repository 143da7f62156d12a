//! `fathom`: run giant Mixture-of-Experts models exactly on small machines.
//!
//! One file per subcommand under `commands/`; this file only parses and
//! dispatches. Errors are printed as one `error: …` chain and exit 1
//! (usage errors exit 2, from clap).

mod commands;
mod common;
mod load;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "fathom", version, about = "Run giant Mixture-of-Experts language models exactly, on a machine whose memory is a fraction of the model", long_about = None)]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true, env = "FATHOM_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
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
    EvalQuant(commands::eval_quant::EvalQuantArgs),
}

fn main() {
    let cli = Cli::parse();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(n) = cli.threads.filter(|&n| n == 0 || n > 4 * cores) {
        eprintln!(
            "error: --threads {n}: give 1 to {} (4 × the {cores} cores here)",
            4 * cores
        );
        std::process::exit(2);
    }
    if let Some(n) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
        {
            eprintln!("warning: cannot set threads: {e}");
        }
    }
    let result = match cli.command {
        Command::Demo(a) => commands::demo::run(a),
        Command::Run(a) => commands::run::run(a),
        Command::Batch(a) => commands::batch::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::BenchServe(a) => commands::bench_serve::run(a),
        Command::Logits(a) => commands::logits::run(a),
        Command::Tokenize(a) => commands::tokenize::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::EvalQuant(a) => commands::eval_quant::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
