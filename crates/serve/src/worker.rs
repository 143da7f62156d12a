//! The engine thread: admits queued requests into the step engine
//! (continuous batching), reuses saved prefixes, runs steps, and sends each
//! request its tokens over its own channel. A closed channel (the client
//! went away) cancels the sequence at the next step.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use fathom_engine::{
    Decoder, Engine, EngineOptions, Event, FinishReason, Request, SeqId, TokenEvent,
};
use fathom_model::CausalLm;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;
use crate::prefix::PrefixCache;

/// One HTTP request's sequences (one per choice).
pub struct Job {
    pub id: String,
    pub reqs: Vec<Request>,
    /// Where the prompt's stable part ends (a checkpoint for chat turns).
    pub stable_len: usize,
    pub tx: UnboundedSender<Msg>,
    pub arrived: Instant,
}

/// What a request hears from the engine.
pub enum Msg {
    /// The job's sequences joined the engine; `cached` prompt tokens were reused.
    Started {
        cached: usize,
    },
    Token {
        choice: u32,
        token: TokenEvent,
    },
    Done {
        choice: u32,
        done: Box<Summary>,
    },
}

/// A finished sequence, without its state (freed on the engine thread).
pub struct Summary {
    pub reason: FinishReason,
    pub text_tail: String,
}

pub enum Cmd {
    Job(Box<Job>),
    /// Stop admitting; cancel what still runs at `deadline`.
    Shutdown {
        deadline: Instant,
    },
}

pub struct WorkerConfig {
    pub max_seqs: usize,
    pub max_step_tokens: usize,
}

struct Live {
    tx: UnboundedSender<Msg>,
    choice: u32,
    arrived: Instant,
    last: Option<Instant>,
    job: String,
}

/// Requests waiting for a slot (shared with the HTTP side for 429s).
pub type QueueDepth = Arc<AtomicUsize>;

pub fn run(
    lm: Arc<dyn CausalLm>,
    decoder: Decoder,
    cfg: WorkerConfig,
    rx: Receiver<Cmd>,
    mut prefix: PrefixCache,
    metrics: Arc<Metrics>,
    queued: QueueDepth,
) {
    let opts = EngineOptions {
        max_step_tokens: cfg.max_step_tokens,
        max_batch: cfg.max_seqs,
    };
    let mut engine = Engine::new(lm.clone(), opts, Some(decoder));
    let mut waiting: VecDeque<Box<Job>> = VecDeque::new();
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let mut deadline: Option<Instant> = None;
    loop {
        if engine.is_idle() && waiting.is_empty() {
            if deadline.is_some() {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(cmd) => take(cmd, &mut waiting, &mut deadline),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            take(cmd, &mut waiting, &mut deadline);
        }
        if deadline.is_some() {
            // Refused as a running sequence cancelled at the deadline is:
            // the same answer for both.
            for job in waiting.drain(..) {
                queued.fetch_sub(1, Ordering::SeqCst);
                refuse(&job, FinishReason::Cancelled);
            }
        }
        admit(
            &mut engine,
            &mut waiting,
            &mut live,
            &mut prefix,
            &metrics,
            &queued,
            cfg.max_seqs,
        );
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        for (&id, l) in &live {
            if late || l.tx.is_closed() {
                engine.cancel(id);
            }
        }
        let batch = engine.running();
        for ev in engine.step() {
            dispatch(ev, &mut live, &mut prefix, &metrics);
        }
        metrics.step(
            batch,
            engine.running(),
            queued.load(Ordering::SeqCst),
            lm.expert_stats(),
            prefix.stats,
        );
    }
}

fn take(cmd: Cmd, waiting: &mut VecDeque<Box<Job>>, deadline: &mut Option<Instant>) {
    match cmd {
        Cmd::Job(j) => waiting.push_back(j),
        Cmd::Shutdown { deadline: d } => *deadline = Some(d),
    }
}

fn refuse(job: &Job, reason: FinishReason) {
    for (choice, _) in job.reqs.iter().enumerate() {
        let done = Box::new(Summary {
            reason: reason.clone(),
            text_tail: String::new(),
        });
        let _ = job.tx.send(Msg::Done {
            choice: choice as u32,
            done,
        });
    }
}

/// Moves waiting jobs into the engine while there are free sequence slots.
fn admit(
    engine: &mut Engine,
    waiting: &mut VecDeque<Box<Job>>,
    live: &mut HashMap<SeqId, Live>,
    prefix: &mut PrefixCache,
    metrics: &Metrics,
    queued: &QueueDepth,
    max_seqs: usize,
) {
    while let Some(job) = waiting.front() {
        let fits = engine.running() + job.reqs.len() <= max_seqs;
        if !fits && !engine.is_idle() {
            return;
        }
        let mut job = waiting.pop_front().expect("front exists");
        queued.fetch_sub(1, Ordering::SeqCst);
        if job.tx.is_closed() {
            continue;
        }
        let prompt = job.reqs[0].prompt.clone();
        let hit = prefix.lookup(engine.model().as_ref(), &prompt);
        let cached = hit.as_ref().map_or(0, |h| h.1);
        let checkpoints = prefix.checkpoints(prompt.len(), job.stable_len);
        metrics.prompt(prompt.len(), cached);
        let _ = job.tx.send(Msg::Started { cached });
        for (choice, mut req) in job.reqs.drain(..).enumerate() {
            if let Some((state, n)) = &hit {
                req.state = Some((state.fork(), *n));
            }
            if choice == 0 {
                req.checkpoints = checkpoints.clone();
            }
            match engine.submit(req) {
                Ok(id) => {
                    live.insert(
                        id,
                        Live {
                            tx: job.tx.clone(),
                            choice: choice as u32,
                            arrived: job.arrived,
                            last: None,
                            job: job.id.clone(),
                        },
                    );
                }
                Err(e) => {
                    let done = Box::new(Summary {
                        reason: FinishReason::Error(e.to_string()),
                        text_tail: String::new(),
                    });
                    let _ = job.tx.send(Msg::Done {
                        choice: choice as u32,
                        done,
                    });
                }
            }
        }
    }
}

fn dispatch(
    ev: Event,
    live: &mut HashMap<SeqId, Live>,
    prefix: &mut PrefixCache,
    metrics: &Metrics,
) {
    match ev {
        Event::Token { seq, token } => {
            let Some(l) = live.get_mut(&seq) else { return };
            let now = Instant::now();
            let ttft = l
                .last
                .is_none()
                .then(|| now.duration_since(l.arrived).as_secs_f64());
            let itl = l.last.map(|t| now.duration_since(t).as_secs_f64());
            l.last = Some(now);
            metrics.token(ttft, itl);
            let _ = l.tx.send(Msg::Token {
                choice: l.choice,
                token,
            });
        }
        Event::Checkpoint { tokens, state, .. } => prefix.insert(tokens, state),
        Event::Finished { seq, done } => {
            let Some(l) = live.remove(&seq) else { return };
            if !live.values().any(|o| o.job == l.job) {
                metrics.finished();
            }
            let f = *done;
            if let FinishReason::Error(e) = &f.reason {
                tracing::warn!(request_id = %l.job, choice = l.choice, "sequence failed: {e}");
            }
            let summary = Box::new(Summary {
                reason: f.reason,
                text_tail: f.text_tail,
            });
            let _ = l.tx.send(Msg::Done {
                choice: l.choice,
                done: summary,
            });
        }
    }
}
