//! `fathom chat`: an interactive conversation, streamed token by token.
//!
//! K3 models (their tokenizer has the `<|open|>` special) are rendered with
//! the K3 "XTML" chat format, gpt-oss (`<|channel|>` and `<|message|>`)
//! with harmony, other families with their Jinja template.
//! Ctrl-C stops the current reply, not the program; Ctrl-D (end of input)
//! quits. The conversation's state is reused across turns when the rendered
//! prompt extends what the model has already read.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, bail};
use clap::Args;
use fathom_chat::{ChatFormat, ChatOptions, Message};
use fathom_engine::{FinishReason, Request, Session, TokenEvent};
use fathom_tokenizer::StreamDecoder;

use crate::common::tokenizer;
use crate::load::{MemoryArgs, check_context, load_model_with};

/// Chat with a model in the terminal.
#[derive(Args)]
pub struct ChatArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (with its tokenizer).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// A system message placed before the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most per reply.
    #[arg(long, default_value_t = 256, value_parser = crate::common::parse_max_new)]
    max_new: usize,
    /// Answer without the thinking channel (K3, templates that read
    /// `enable_thinking`; gpt-oss: reasoning effort low).
    #[arg(long)]
    no_thinking: bool,
    #[command(flatten)]
    mem: MemoryArgs,
}

pub fn run(a: ChatArgs) -> Result<()> {
    let Some(tok) = tokenizer(&a.model)? else {
        bail!("{} ships no tokenizer: chat needs one", a.model.display());
    };
    let Some(format) = ChatFormat::detect(&a.model, tok.as_ref())? else {
        bail!(
            "{} has neither the K3 or harmony chat specials nor a chat template",
            a.model.display()
        );
    };
    let opts = ChatOptions {
        thinking: Some(!a.no_thinking),
        ..ChatOptions::default()
    };
    let req = a.mem.request();
    let (model, info) = load_model_with(&a.model, &req, 1, fathom_model::Spine::Bf16)?;
    let limit = info.context;
    let load_s = info.load_s;
    if let Some(line) = info.plan_line() {
        eprintln!("{line}");
    }
    let stop: Vec<u32> = format.stop_ids(tok.as_ref(), &model.info().eos_token_ids);
    eprintln!("loaded in {load_s:.2}s; type a message, Ctrl-C stops a reply, Ctrl-D quits");

    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;
    }
    let mut messages: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let mut session = Session::new(model.clone());
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        interrupted.store(false, Ordering::SeqCst);
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        messages.push(Message::new("user", line));
        let p = format.prompt(tok.as_ref(), &messages, &opts)?;
        let (prompt, stable_len, thinking) = (p.ids, p.stable_len, p.thinking);
        if let Err(e) = check_context(limit, prompt.len(), a.max_new, "this turn") {
            eprintln!("{e:#}; the message was not sent");
            messages.pop();
            continue;
        }
        let mut stream = StreamDecoder::new(tok.as_ref());
        interrupted.store(false, Ordering::SeqCst);
        let mut req = Request::new(Vec::new(), a.max_new);
        req.stop_ids = stop.clone();
        let (g, reused) = session.generate(&prompt, stable_len, req, None, |ev: &TokenEvent| {
            let id = ev.sampled.token;
            if !stop.contains(&id) {
                let _ = out.write_all(stream.push(id).as_bytes());
                let _ = out.flush();
            }
            if interrupted.load(Ordering::SeqCst) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        let _ = out.write_all(stream.finish().as_bytes());
        writeln!(out)?;
        if g.reason == FinishReason::Cancelled {
            eprintln!("[reply stopped]");
        }
        let reply_ids: Vec<u32> = g
            .output_ids
            .iter()
            .copied()
            .filter(|id| !stop.contains(id))
            .collect();
        messages.push(format.reply_message(&tok.decode(&reply_ids), thinking));
        eprintln!(
            "[{} tokens, {:.2} tok/s, prompt {} tokens ({} reused)]",
            g.stats.generated_tokens,
            g.stats.decode_tok_s,
            prompt.len(),
            reused
        );
    }
}
