//! The simulated node agents: one process (`--serve fleet-agents`) speaks
//! for many nodes, as many executor daemons would, with no executor behind
//! them. Each node registers (`PUT /v1/nodes/{name}`, its own node
//! credential) and heartbeats (`POST /v1/nodes/{name}/heartbeat`, its free
//! capacity and an empty allocations list) every interval the manager
//! handed it: the `heartbeat_interval_ms` of its registration, then of each
//! heartbeat reply that carries one. Like executord it tries the replicas
//! in turn from the last one that answered (a 5xx counts as no answer),
//! and registers again when a heartbeat is answered `404`.
//!
//! A few worker threads share the nodes through one schedule (a heap of
//! due times), each with its own keep-alive agent: the process holds a
//! handful of connections per replica, whatever its number of nodes.
//!
//! The bench talks to the process through its stdin, one command a line,
//! one answer a line (see [`serve`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_proto::manager::{Heartbeat, HeartbeatReply, Registered};

use crate::child::{peer_arg, PeerSpec, Ready};
use crate::error::{Context, Error, Result};
use crate::manager::{agent, register_body};

/// The peer, for the binary's `--serve`.
pub const PEER: PeerSpec = PeerSpec {
    name: "fleet-agents",
    serve,
};

/// Longest a worker sleeps before looking at the schedule again.
const IDLE: Duration = Duration::from_millis(20);
/// The wait before a registration is tried again when no replica took it.
const RETRY: Duration = Duration::from_millis(200);
/// How long `wait-registered` waits for every node.
const REGISTER_WITHIN: Duration = Duration::from_secs(600);

/// What one node knows; locked by the worker stepping it (never by two).
#[derive(Debug)]
struct NodeState {
    registered: bool,
    /// The replica it talks to first.
    current: usize,
    interval: Duration,
    /// When its last heartbeat or registration was answered, Unix ms.
    last_ack_ms: u64,
}

#[derive(Debug)]
struct Node {
    name: String,
    auth: String,
    silent: AtomicBool,
    state: Mutex<NodeState>,
}

/// What the process's workers share.
#[derive(Debug)]
struct Fleet {
    nodes: Vec<Node>,
    urls: Vec<String>,
    register: String,
    heartbeat: String,
    due: Mutex<BinaryHeap<Reverse<(Instant, usize)>>>,
    registered: AtomicUsize,
    /// The newest interval and loss timeout a replica handed out, ms.
    interval_ms: AtomicU64,
    lost_after_ms: AtomicU64,
    heartbeats: AtomicU64,
    failures: AtomicU64,
    reregistrations: AtomicU64,
    stop: AtomicBool,
}

/// How a call to the replicas ended.
enum Answer {
    /// 2xx, with its body.
    Ok(String),
    /// A 4xx from a replica.
    Refused(u16),
    /// No replica answered, or each with a 5xx.
    Unreachable,
}

impl Fleet {
    /// `body` to `path` on one replica after another from the node's
    /// current one, until one answers.
    fn call(
        &self,
        agent: &ureq::Agent,
        node: &Node,
        st: &mut NodeState,
        put: bool,
        path: &str,
        body: &str,
    ) -> Answer {
        for _ in 0..self.urls.len() {
            let url = format!("{}{path}", self.urls[st.current]);
            let req = if put {
                agent.put(&url)
            } else {
                agent.post(&url)
            };
            let sent = req
                .header("Authorization", &node.auth)
                .content_type("application/json")
                .send(body);
            if let Ok(mut resp) = sent {
                let status = resp.status().as_u16();
                if status < 500 {
                    return match resp.body_mut().read_to_string() {
                        Ok(text) if (200..300).contains(&status) => Answer::Ok(text),
                        Ok(_) => Answer::Refused(status),
                        Err(_) => Answer::Unreachable,
                    };
                }
            }
            st.current = (st.current + 1) % self.urls.len();
        }
        Answer::Unreachable
    }

    /// One step of node `i`: its registration or its heartbeat. Returns
    /// when its next step is due.
    fn step(&self, agent: &ureq::Agent, i: usize) -> Duration {
        let node = &self.nodes[i];
        let mut st = node.state.lock().unwrap_or_else(|p| p.into_inner());
        if node.silent.load(Ordering::Acquire) {
            return st.interval;
        }
        if !st.registered {
            let path = format!("/v1/nodes/{}", node.name);
            return match self.call(agent, node, &mut st, true, &path, &self.register) {
                Answer::Ok(text) => {
                    if let Ok(r) = serde_json::from_str::<Registered>(&text) {
                        st.interval = interval(r.heartbeat_interval_ms);
                        self.interval_ms
                            .store(r.heartbeat_interval_ms, Ordering::Relaxed);
                        self.lost_after_ms.store(r.lost_after_ms, Ordering::Relaxed);
                    }
                    st.registered = true;
                    st.last_ack_ms = rfaas_service::now_ms();
                    self.registered.fetch_add(1, Ordering::Relaxed);
                    // The first heartbeat at a random point of the
                    // interval, so the nodes' beats spread over it.
                    st.interval.mul_f64(fastrand::f64())
                }
                _ => {
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    RETRY
                }
            };
        }
        let path = format!("/v1/nodes/{}/heartbeat", node.name);
        match self.call(agent, node, &mut st, false, &path, &self.heartbeat) {
            Answer::Ok(text) => {
                self.heartbeats.fetch_add(1, Ordering::Relaxed);
                st.last_ack_ms = rfaas_service::now_ms();
                // A manager that hands a new interval with its replies.
                if let Some(ms) = newer_interval(&text) {
                    st.interval = interval(ms);
                    self.interval_ms.store(ms, Ordering::Relaxed);
                }
                st.interval
            }
            Answer::Refused(404) => {
                self.reregistrations.fetch_add(1, Ordering::Relaxed);
                self.registered.fetch_sub(1, Ordering::Relaxed);
                st.registered = false;
                Duration::ZERO
            }
            Answer::Refused(_) | Answer::Unreachable => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                st.interval
            }
        }
    }

    /// A worker: takes the next due node, steps it, puts it back.
    fn work(&self) {
        let agent = agent();
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let next = {
                let mut due = self.due.lock().unwrap_or_else(|p| p.into_inner());
                match due.peek() {
                    Some(Reverse((at, _))) if *at <= now => due.pop().map(|Reverse((_, i))| i),
                    Some(Reverse((at, _))) => {
                        let wait = (*at - now).min(IDLE);
                        drop(due);
                        std::thread::sleep(wait);
                        None
                    }
                    None => {
                        drop(due);
                        std::thread::sleep(IDLE);
                        None
                    }
                }
            };
            if let Some(i) = next {
                let after = self.step(&agent, i);
                self.due
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Reverse((Instant::now() + after, i)));
            }
        }
    }
}

/// executord's bounds on an interval a manager hands out.
fn interval(ms: u64) -> Duration {
    Duration::from_millis(ms.clamp(50, 60_000))
}

/// The `heartbeat_interval_ms` of a heartbeat reply, when it has one.
fn newer_interval(reply: &str) -> Option<u64> {
    serde_json::from_str::<HeartbeatReply>(reply)
        .ok()?
        .heartbeat_interval_ms
}

/// Peer side. Arguments: the nodes file (`name token` a line), worker
/// threads, cores per node, the replicas' URLs (comma-separated).
///
/// Commands on stdin, each answered with one line on stdout:
/// - `wait-registered`: `registered <nodes> <interval_ms> <lost_after_ms>`
///   once every node is registered;
/// - `silence <name>...`: the nodes stop heartbeating (after a step under
///   way); `silenced <name>:<last answer, Unix ms>...`;
/// - `resume`: every silent node heartbeats again; `resumed`;
/// - `stats`: `stats <heartbeats> <failures> <registrations again>
///   <interval_ms> <lost_after_ms>`, the last two as a replica handed them
///   out last.
///
/// Ends when stdin closes.
fn serve(args: &[String], ready: Ready) -> Result<()> {
    let file: String = peer_arg(args, 0, "nodes file")?;
    let threads: usize = peer_arg(args, 1, "worker threads")?;
    let cores: u32 = peer_arg(args, 2, "cores per node")?;
    let urls: String = peer_arg(args, 3, "replica URLs")?;
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let text =
        std::fs::read_to_string(&file).context(|| format!("could not read the nodes of {file}"))?;
    let mut nodes = Vec::new();
    for (k, line) in text.lines().enumerate() {
        let (name, token) = line
            .split_once(' ')
            .ok_or_else(|| Error::new(format!("{file}:{}: not `name token`", k + 1)))?;
        nodes.push(Node {
            name: name.to_owned(),
            auth: format!("Bearer {token}"),
            silent: AtomicBool::new(false),
            state: Mutex::new(NodeState {
                registered: false,
                current: k % urls.len(),
                interval: Duration::from_secs(1),
                last_ack_ms: 0,
            }),
        });
    }
    let heartbeat = serde_json::to_string(&Heartbeat {
        free_cores: cores,
        free_memory_mib: crate::manager::NODE_MEMORY_MIB,
        draining: false,
        withheld_cores: 0,
        allocations: Vec::new(),
    })
    .map_err(|e| Error::new(format!("could not write a heartbeat: {e}")))?;
    let now = Instant::now();
    let fleet = Arc::new(Fleet {
        due: Mutex::new((0..nodes.len()).map(|i| Reverse((now, i))).collect()),
        nodes,
        urls,
        register: register_body(0, cores),
        heartbeat,
        registered: AtomicUsize::new(0),
        interval_ms: AtomicU64::new(0),
        lost_after_ms: AtomicU64::new(0),
        heartbeats: AtomicU64::new(0),
        failures: AtomicU64::new(0),
        reregistrations: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let fleet = fleet.clone();
            std::thread::spawn(move || fleet.work())
        })
        .collect();
    ready.announce(&fleet.nodes.len().to_string())?;
    let by_name: HashMap<&str, usize> = fleet
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.context(|| "could not read the bench's command".to_owned())?;
        let mut words = line.split_whitespace();
        let answer = match words.next() {
            Some("wait-registered") => {
                let until = Instant::now() + REGISTER_WITHIN;
                while fleet.registered.load(Ordering::Relaxed) < fleet.nodes.len()
                    && Instant::now() < until
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                format!(
                    "registered {} {} {}",
                    fleet.registered.load(Ordering::Relaxed),
                    fleet.interval_ms.load(Ordering::Relaxed),
                    fleet.lost_after_ms.load(Ordering::Relaxed)
                )
            }
            Some("silence") => {
                let mut said = String::from("silenced");
                for name in words {
                    let i = *by_name
                        .get(name)
                        .ok_or_else(|| Error::new(format!("no node {name} here")))?;
                    let node = &fleet.nodes[i];
                    // Taken after a step under way ends.
                    let st = node.state.lock().unwrap_or_else(|p| p.into_inner());
                    node.silent.store(true, Ordering::Release);
                    said.push_str(&format!(" {name}:{}", st.last_ack_ms));
                }
                said
            }
            Some("resume") => {
                for node in &fleet.nodes {
                    node.silent.store(false, Ordering::Release);
                }
                "resumed".to_owned()
            }
            Some("stats") => format!(
                "stats {} {} {} {} {}",
                fleet.heartbeats.load(Ordering::Relaxed),
                fleet.failures.load(Ordering::Relaxed),
                fleet.reregistrations.load(Ordering::Relaxed),
                fleet.interval_ms.load(Ordering::Relaxed),
                fleet.lost_after_ms.load(Ordering::Relaxed)
            ),
            _ => format!("error: unknown command {line:?}"),
        };
        writeln!(out, "{answer}")
            .and_then(|()| out.flush())
            .context(|| "could not answer the bench".to_owned())?;
    }
    fleet.stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_with_an_interval_changes_it() {
        assert_eq!(newer_interval(r#"{"ended_leases":[]}"#), None);
        assert_eq!(
            newer_interval(r#"{"ended_leases":[],"heartbeat_interval_ms":30000}"#),
            Some(30_000)
        );
        assert_eq!(interval(1), Duration::from_millis(50));
        assert_eq!(interval(3_600_000), Duration::from_secs(60));
    }
}
