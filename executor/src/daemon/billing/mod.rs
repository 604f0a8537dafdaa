//! Billing: the daemon adds each lease's usage into the lease's accounting
//! slot, by remote fetch-and-add, and journals every add that landed.
//!
//! The daemon, not the worker, adds: the worker runs user code, and the
//! figures come from the daemon's own measurements (see `usage`). The
//! manager signs the slot into the lease token ([`BillingSlot`]), so a
//! lease's adds go only where the manager said.
//!
//! # When
//!
//! A lease's deltas (its cumulative figures minus what already landed) are
//! posted once `granularity` has passed since its last post and something
//! changed, and at once when the lease is over on this node (expired, or
//! ended by the manager, with none of its allocations left). After the last
//! adds landed, the daemon adds 1 to the slot's `closed` word and forgets
//! the lease; once the lease is over in the manager's database too, the
//! service's flusher writes the final totals and frees the slot. A daemon
//! that stops posts every lease's figures ([`Poster::flush`]) but closes
//! none: started again, it may serve the same leases.
//!
//! # Exactly once
//!
//! Only this daemon adds into a lease's slot, so the slot holds exactly the
//! adds that landed. The daemon reads the slot when it first adds for a
//! lease (what the slot held before, say from before a restart of this
//! daemon, is not the lease's current allocations'), and keeps what the
//! slot should hold. When an add's completion is lost (the service died, the
//! connection broke), the daemon reads the slot back on the next connection
//! and counts what landed, once: a replay never double-counts. A batch is
//! journaled as `posting` before it is sent, so a daemon killed while one
//! was under way (or just after it landed) leaves the batch in its
//! journal; started again, it reads that slot and journals what of the
//! batch landed before it posts anything else for the lease.
//!
//! A daemon that adopted a lease's workers from the previous one goes on
//! with the lease's figures from where that one measured them; the slot's
//! content before the first add (kept with `carry`, see
//! `records::LeaseCarry`) tells what of them already landed, so it adds only
//! the rest.
//!
//! # Accounting down
//!
//! Invocations go on: nothing here is on their path. The daemon keeps each
//! lease's cumulative figures (one fixed-size entry per lease, so memory is
//! bounded by the leases the node has run) and reconnects with backoff. A
//! lease that ended more than `keep_ended` ago and still could not be
//! posted is dropped, logged and journaled as `dropped` with its unposted
//! figures: that, and what a kill -9 of the daemon loses (each lease's
//! figures since its last post that landed: at most `granularity` plus one
//! tick of use while the service is reachable, the whole outage's while it
//! is not), is the loss bound documented in `docs/accounting.md`.
//!
//! # Journal
//!
//! With `journal` set, the daemon appends one JSON line (one write each)
//! per event: `lease_id`, `instance`, `slot`, `region_id`, `at_ms`, and
//! one of `posting` (a batch about to be sent, with `before`, what the
//! slot held, and the slot's `provider` and `addr`), `added` (the counters
//! that landed; with `recovered: true` when a restarted daemon learned it
//! from the slot), `closed: true`, `dropped` (figures that will never be
//! posted) or `unresolved` (a batch whose outcome could not be learned).
//! Every `posting` is followed by its lease's `added` or `unresolved`.
//! Summing `added` per lease gives what the executor billed.
//!
//! # Hello
//!
//! Each connection to an accounting instance begins with a hello that
//! shows the newest accounting ticket a manager gave this node
//! ([`Tickets`], set from every registration and heartbeat reply), never
//! the node credential. Until the first ticket arrives, and while the
//! newest has expired (no manager answered for its lifetime), no new
//! connection is made; connections already accepted go on.

mod link;

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use rfaas_fabric::Fabric;
use rfaas_proto::accounting::{BillingSlot, Counter, SlotTotals, SLOT_WORDS};
use rfaas_proto::ticket::{AccountingTicket, TicketError};

use link::{Link, LinkError};

use super::metrics::PosterStats;
use super::shared::Shared;

/// One lease's cumulative usage as the daemon measured it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseUsage {
    /// The lease.
    pub lease_id: u64,
    /// Where its usage goes.
    pub billing: BillingSlot,
    /// Cumulative figures since the lease's first allocation on this daemon
    /// (`closed` is ignored).
    pub totals: SlotTotals,
    /// Whether the lease is over on this node (expired or ended by the
    /// manager, no allocation left): the figures are final.
    pub ended: bool,
}

/// How the poster behaves.
#[derive(Debug, Clone)]
pub(crate) struct PosterSettings {
    /// Post a live lease's deltas at most this often.
    pub granularity: Duration,
    /// Give up on an ended lease's unposted figures after this long.
    pub keep_ended: Duration,
    /// One connection attempt, or one batch of adds, at most this long.
    pub timeout: Duration,
    /// The journal file (appended), if any.
    pub journal: Option<PathBuf>,
    /// The ticket the hello carries.
    pub tickets: Arc<Tickets>,
    /// With workers that outlive the daemon, the runtime state directory,
    /// where each lease's slot before its first add is kept (see
    /// `records::LeaseCarry`) for a daemon that adopts its workers.
    pub carry: Option<PathBuf>,
}

/// The newest accounting ticket a manager gave this node: the
/// registration thread sets it, the poster shows it at each connection.
#[derive(Debug, Default)]
pub(crate) struct Tickets {
    newest: std::sync::Mutex<Option<AccountingTicket>>,
}

impl Tickets {
    /// Keeps the ticket in `text` (as a manager's reply carries it) in
    /// place of the one held.
    pub(crate) fn set_text(&self, text: &str) -> Result<(), TicketError> {
        let t = AccountingTicket::from_text(text)?;
        self.set(t);
        Ok(())
    }

    /// Keeps `ticket` in place of the one held.
    pub(crate) fn set(&self, ticket: AccountingTicket) {
        *self.newest.lock().unwrap_or_else(|p| p.into_inner()) = Some(ticket);
    }

    /// The ticket held, if any.
    pub(crate) fn get(&self) -> Option<AccountingTicket> {
        self.newest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What is known of one lease's slot.
#[derive(Debug)]
struct Entry {
    slot: BillingSlot,
    /// The latest cumulative figures (never decrease).
    latest: SlotTotals,
    /// How much of `latest` landed.
    counted: SlotTotals,
    /// What the slot holds, as far as this daemon knows; `None` until read.
    expected: Option<SlotTotals>,
    /// What the slot held before the first add for the lease by this
    /// daemon or the one whose workers it adopted; `None` until read.
    base: Option<SlotTotals>,
    /// A batch whose completions were lost: read the slot before adding.
    uncertain: bool,
    /// The batch journaled as `posting` whose outcome is not known yet.
    in_flight: Option<[u64; SLOT_WORDS]>,
    last_post: Option<Instant>,
    ended_at: Option<Instant>,
}

impl Entry {
    fn deltas(&self) -> [u64; SLOT_WORDS] {
        let (l, c) = (self.latest.to_words(), self.counted.to_words());
        let mut d = [0u64; SLOT_WORDS];
        for i in 0..SLOT_WORDS {
            if i != Counter::Closed.index() {
                d[i] = l[i].saturating_sub(c[i]);
            }
        }
        d
    }
}

/// A link's state.
enum LinkState {
    Up(Box<Link>),
    Down {
        retry_at: Instant,
        backoff: Duration,
    },
}

/// A batch a previous run of the daemon journaled as `posting` without
/// its outcome: it was killed while the adds were under way, or just
/// after they landed. The slot, read once, tells what landed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Recovery {
    slot: BillingSlot,
    region_id: u64,
    /// What the slot held before the batch.
    before: SlotTotals,
    deltas: [u64; SLOT_WORDS],
    /// When the batch was journaled, Unix ms.
    at_ms: u64,
}

/// Where a test stops a post short, as a `kill -9` of the daemon would.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crash {
    /// After the `posting` line, before the adds are sent.
    BeforeAdd,
    /// After the adds landed, before the `added` line.
    AfterAdd,
}

/// Posts leases' usage; driven by [`Poster::tick`].
pub(crate) struct Poster {
    settings: PosterSettings,
    fabrics: HashMap<String, Fabric>,
    links: HashMap<(String, String, String), LinkState>,
    ledger: HashMap<u64, Entry>,
    /// Leases closed or given up, while the usage figures still list them:
    /// never posted again.
    done: std::collections::HashSet<u64>,
    /// Batches a previous run left unresolved, by lease.
    recovering: HashMap<u64, Recovery>,
    journal: Journal,
    stats: PosterStats,
    #[cfg(test)]
    pub(crate) crash: Option<Crash>,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

fn link_key(s: &BillingSlot) -> (String, String, String) {
    (s.instance.clone(), s.provider.clone(), s.addr.clone())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The counters of a journal line's object (missing ones are 0); `None`
/// when it is not an object of numbers.
fn words_from_json(v: &serde_json::Value) -> Option<[u64; SLOT_WORDS]> {
    let m = v.as_object()?;
    let mut w = [0u64; SLOT_WORDS];
    for c in Counter::ALL {
        if c != Counter::Closed {
            if let Some(n) = m.get(c.name()) {
                w[c.index()] = n.as_u64()?;
            }
        }
    }
    Some(w)
}

fn words_json(w: &[u64; SLOT_WORDS]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for c in Counter::ALL {
        if c != Counter::Closed {
            m.insert(c.name().into(), w[c.index()].into());
        }
    }
    serde_json::Value::Object(m)
}

impl Poster {
    /// A poster; opens the journal (appending) if one is set.
    /// Batches the journal shows without their outcome (a previous run
    /// was killed during them) are resolved first, by reading their slots.
    pub(crate) fn new(settings: PosterSettings) -> std::io::Result<Poster> {
        let (file, recovering) = match &settings.journal {
            Some(path) => {
                let recovering = unresolved_batches(path)?;
                (Some(open_journal(path)?), recovering)
            }
            None => (None, HashMap::new()),
        };
        if !recovering.is_empty() {
            tracing::info!(
                batches = recovering.len(),
                "the billing journal holds batches of adds whose outcome a previous run did not learn; reading their slots"
            );
        }
        Ok(Poster {
            settings,
            fabrics: HashMap::new(),
            links: HashMap::new(),
            ledger: HashMap::new(),
            done: std::collections::HashSet::new(),
            recovering,
            journal: Journal { file },
            stats: PosterStats::default(),
            #[cfg(test)]
            crash: None,
        })
    }

    /// What was posted so far.
    pub(crate) fn stats(&self) -> PosterStats {
        PosterStats {
            pending: self.ledger.len() as u64,
            ..self.stats
        }
    }

    /// Whether every lease seen so far has been closed or dropped.
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.ledger.is_empty()
    }

    /// Posts every lease's figures now, whatever the granularity; used when
    /// the daemon stops.
    pub(crate) fn flush(&mut self, usage: &[LeaseUsage], now: Instant) {
        for e in self.ledger.values_mut() {
            e.last_post = None;
        }
        self.tick(usage, now);
    }

    /// Takes the latest figures and posts what is due.
    pub(crate) fn tick(&mut self, usage: &[LeaseUsage], now: Instant) {
        // A closed lease stays in the figures for a while; it is done once
        // they forget it too.
        self.done
            .retain(|id| usage.iter().any(|u| u.lease_id == *id));
        for u in usage {
            if self.done.contains(&u.lease_id) {
                continue;
            }
            let carry = &self.settings.carry;
            let e = self.ledger.entry(u.lease_id).or_insert_with(|| Entry {
                slot: u.billing.clone(),
                latest: SlotTotals::default(),
                counted: SlotTotals::default(),
                expected: None,
                base: carry
                    .as_deref()
                    .and_then(|dir| crate::daemon::records::read_lease(dir, u.lease_id))
                    .and_then(|c| c.base),
                uncertain: false,
                in_flight: None,
                last_post: None,
                ended_at: None,
            });
            let (mut l, n) = (e.latest.to_words(), u.totals.to_words());
            for i in 0..SLOT_WORDS {
                l[i] = l[i].max(n[i]);
            }
            l[Counter::Closed.index()] = 0;
            e.latest = SlotTotals::from_words(l);
            if u.ended && e.ended_at.is_none() {
                e.ended_at = Some(now);
            }
        }
        self.recover(now);
        let due: Vec<u64> = self
            .ledger
            .iter()
            .filter(|(_, e)| {
                e.ended_at.is_some()
                    || e.last_post
                        .map_or(true, |t| now.duration_since(t) >= self.settings.granularity)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.post(id, now);
        }
    }

    fn post(&mut self, id: u64, now: Instant) {
        // What a previous run's last batch left in the slot comes first.
        if self.recovering.contains_key(&id) {
            return;
        }
        let Some(e) = self.ledger.get(&id) else {
            return;
        };
        let nothing_new = e.deltas().iter().all(|&d| d == 0);
        if nothing_new && e.ended_at.is_none() && !e.uncertain && e.expected.is_some() {
            return;
        }
        if let Some(ended) = e.ended_at {
            if now.duration_since(ended) > self.settings.keep_ended {
                self.drop_lease(id, "its accounting instance stayed unreachable");
                return;
            }
        }
        let key = link_key(&e.slot);
        if self.link(&key, now).is_none() {
            return;
        }
        match self.post_on_link(id, &key, now) {
            Ok(()) => {}
            Err(err) => self.link_failed(&key, &err, now),
        }
    }

    /// Posts lease `id` on its link, which is up: reads the slot first when
    /// what it holds is unknown, adds the deltas, and closes an ended lease.
    ///
    /// Each batch is journaled as `posting` before it is sent and as
    /// `added` once it landed (or once a read told what of it landed), so
    /// whenever the daemon dies the journal either holds the batch's
    /// outcome or says that a batch was under way.
    fn post_on_link(
        &mut self,
        id: u64,
        key: &(String, String, String),
        now: Instant,
    ) -> Result<(), LinkError> {
        let timeout = self.settings.timeout;
        let Some(LinkState::Up(link)) = self.links.get_mut(key) else {
            return Ok(());
        };
        let region = link.region_id();
        let Some(e) = self.ledger.get_mut(&id) else {
            return Ok(());
        };
        let slot = e.slot.clone();
        let journal = &mut self.journal;
        let stats = &mut self.stats;

        // Learn what the slot holds before the first add, and after a
        // batch whose completions were lost.
        let mut closed = false;
        if e.expected.is_none() || e.uncertain {
            let read = link.read_slot(slot.slot, timeout)?;
            let closed_before = e.expected.map(|x| x.closed);
            if let Some(expected) = e.expected {
                let batch = e.in_flight.take().unwrap_or([0; SLOT_WORDS]);
                let landed = landed(&expected, &read, &batch);
                e.counted = add_words(&e.counted, &landed);
                if batch.iter().any(|&w| w != 0) {
                    // Written even when nothing landed: it ends the
                    // `posting` line.
                    stats.batches += 1;
                    journal.write(id, &slot, region, &[("added", words_json(&landed))]);
                }
                let more = add_words(&expected, &landed).to_words();
                let read_words = read.to_words();
                if Counter::ALL
                    .iter()
                    .any(|c| *c != Counter::Closed && read_words[c.index()] > more[c.index()])
                {
                    tracing::warn!(lease_id = id, instance = %slot.instance, slot = slot.slot, "the slot holds more than this daemon added into it; it goes on from what it holds");
                }
            }
            if e.expected.is_none() {
                match (e.base, &self.settings.carry) {
                    // The lease's figures go on from a daemon whose
                    // workers this one adopted: what that one posted is
                    // counted.
                    (Some(base), _) => e.counted = sub_words(&read, &base),
                    (None, Some(dir)) => {
                        e.base = Some(read);
                        crate::daemon::records::update_lease(dir, id, |c| c.base = Some(read));
                    }
                    (None, None) => {}
                }
            }
            e.expected = Some(read);
            e.uncertain = false;
            // Our `closed` add landed; its completion was lost. (A slot
            // found closed on first contact belongs to a lease that was
            // renewed and used again after an earlier close: the flusher
            // keeps it while the lease is active, so adding goes on.)
            closed = closed_before.is_some_and(|before| read.closed > before);
        }
        if !closed {
            let deltas = e.deltas();
            if deltas.iter().any(|&d| d != 0) {
                let before = e.expected.unwrap_or_default();
                journal.write(
                    id,
                    &slot,
                    region,
                    &[
                        ("posting", words_json(&deltas)),
                        ("before", words_json(&before.to_words())),
                        ("provider", slot.provider.clone().into()),
                        ("addr", slot.addr.clone().into()),
                    ],
                );
                e.in_flight = Some(deltas);
                #[cfg(test)]
                if self.crash == Some(Crash::BeforeAdd) {
                    return Err(LinkError::Transient("killed before the adds".into()));
                }
                if let Err(err) = link.add(slot.slot, &deltas, timeout) {
                    e.uncertain = true;
                    return Err(err);
                }
                #[cfg(test)]
                if self.crash == Some(Crash::AfterAdd) {
                    return Err(LinkError::Transient("killed after the adds".into()));
                }
                e.in_flight = None;
                e.counted = add_words(&e.counted, &deltas);
                e.expected = e.expected.map(|x| add_words(&x, &deltas));
                stats.batches += 1;
                journal.write(id, &slot, region, &[("added", words_json(&deltas))]);
            }
            e.last_post = Some(now);
            if e.ended_at.is_some() {
                let mut close = [0u64; SLOT_WORDS];
                close[Counter::Closed.index()] = 1;
                if let Err(err) = link.add(slot.slot, &close, timeout) {
                    // Repeat it only if it did not land: the read on the
                    // next connection tells.
                    e.uncertain = true;
                    return Err(err);
                }
                closed = true;
            }
        }
        if closed {
            self.ledger.remove(&id);
            self.forget_carry(id);
            self.done.insert(id);
            self.stats.closed += 1;
            self.journal
                .write(id, &slot, region, &[("closed", true.into())]);
        }
        Ok(())
    }

    /// Resolves the batches a previous run left without their outcome:
    /// reads each one's slot (once its link is up) and journals what of it
    /// landed as `added`, with `"recovered": true`. The slot stays the
    /// lease's while the lease is not closed (a batch under way means the
    /// close was not sent) and for `slot_hold_s` after the lease ended,
    /// at least twice `keep_ended_s` (a batch comes at most `keep_ended_s`
    /// after the lease ended): a batch older than `keep_ended_s`
    /// is journaled as `unresolved` instead of read.
    fn recover(&mut self, now: Instant) {
        let ids: Vec<u64> = self.recovering.keys().copied().collect();
        for id in ids {
            let Some(r) = self.recovering.get(&id).cloned() else {
                continue;
            };
            let keep = self.settings.keep_ended.as_millis() as u64;
            if unix_ms().saturating_sub(r.at_ms) > keep {
                self.unresolved(
                    id,
                    &r,
                    "it is older than keep_ended_s: its slot may be another lease's by now",
                );
                continue;
            }
            let key = link_key(&r.slot);
            if self.link(&key, now).is_none() {
                continue;
            }
            let Some(LinkState::Up(link)) = self.links.get_mut(&key) else {
                continue;
            };
            if link.region_id() != r.region_id {
                self.unresolved(id, &r, "the accounting region was replaced since");
                continue;
            }
            match link.read_slot(r.slot.slot, self.settings.timeout) {
                Ok(read) => {
                    let landed = landed(&r.before, &read, &r.deltas);
                    self.recovering.remove(&id);
                    tracing::info!(lease_id = id, instance = %r.slot.instance, slot = r.slot.slot, landed = %words_json(&landed), "resolved a batch of adds left without its outcome by a previous run");
                    self.stats.batches += 1;
                    self.journal.write(
                        id,
                        &r.slot,
                        r.region_id,
                        &[("added", words_json(&landed)), ("recovered", true.into())],
                    );
                }
                Err(err) => self.link_failed(&key, &err, now),
            }
        }
    }

    /// Gives up learning the outcome of `r`: journals it as `unresolved`.
    fn unresolved(&mut self, id: u64, r: &Recovery, why: &str) {
        self.recovering.remove(&id);
        tracing::error!(lease_id = id, instance = %r.slot.instance, slot = r.slot.slot, why, batch = %words_json(&r.deltas), "cannot tell whether a batch of adds landed; the slot may hold up to this batch more than the journal's added lines");
        self.journal.write(
            id,
            &r.slot,
            r.region_id,
            &[("unresolved", words_json(&r.deltas))],
        );
    }

    /// The link for `key`, opening it if it is down and its backoff passed.
    fn link(&mut self, key: &(String, String, String), now: Instant) -> Option<&mut Link> {
        let retry = match self.links.get(key) {
            Some(LinkState::Up(_)) => false,
            Some(LinkState::Down { retry_at, .. }) => now >= *retry_at,
            None => true,
        };
        if retry {
            let (instance, provider, addr) = key;
            let fabric = match self.fabrics.get(provider) {
                Some(f) => f,
                None => match Fabric::open(provider) {
                    Ok(f) => self.fabrics.entry(provider.clone()).or_insert(f),
                    Err(e) => {
                        let err =
                            LinkError::Transient(format!("cannot open provider {provider}: {e}"));
                        self.link_failed(key, &err, now);
                        return None;
                    }
                },
            };
            let Some(ticket) = self.settings.tickets.get() else {
                let err = LinkError::Transient(
                    "no accounting ticket yet: it comes with the manager's reply to the node's registration".into(),
                );
                self.link_failed(key, &err, now);
                return None;
            };
            match Link::open(fabric, addr, &ticket, self.settings.timeout) {
                Ok(link) => {
                    tracing::info!(%instance, %addr, region_id = link.region_id(), slots = link.slots(), "connected to accounting instance");
                    // Every lease of this instance reads its slot again:
                    // the service may have restarted, and adds may have
                    // landed whose completions were lost.
                    for e in self.ledger.values_mut() {
                        if link_key(&e.slot) == *key && e.expected.is_some() {
                            e.uncertain = true;
                        }
                    }
                    self.links
                        .insert(key.clone(), LinkState::Up(Box::new(link)));
                }
                Err(err) => {
                    self.link_failed(key, &err, now);
                    return None;
                }
            }
        }
        match self.links.get_mut(key) {
            Some(LinkState::Up(link)) => Some(link),
            _ => None,
        }
    }

    fn link_failed(&mut self, key: &(String, String, String), err: &LinkError, now: Instant) {
        let backoff = match self.links.get(key) {
            Some(LinkState::Down { backoff, .. }) => (*backoff * 2).min(MAX_BACKOFF),
            _ => FIRST_BACKOFF,
        };
        let was_up = matches!(self.links.get(key), Some(LinkState::Up(_)) | None);
        if was_up {
            tracing::warn!(instance = %key.0, addr = %key.2, error = %err, "accounting instance unreachable; usage is kept and posted when it is back");
        } else {
            tracing::debug!(instance = %key.0, error = %err, "accounting instance still unreachable");
        }
        self.links.insert(
            key.clone(),
            LinkState::Down {
                retry_at: now + backoff,
                backoff,
            },
        );
    }

    /// Lease `id` is closed or given up: nothing of it is carried over.
    fn forget_carry(&self, id: u64) {
        if let Some(dir) = &self.settings.carry {
            crate::daemon::records::remove_lease(dir, id);
        }
    }

    fn drop_lease(&mut self, id: u64, why: &str) {
        let Some(e) = self.ledger.remove(&id) else {
            return;
        };
        self.done.insert(id);
        self.forget_carry(id);
        if let Some(batch) = e.in_flight {
            // Whether it landed is unknown: it may be in the slot.
            self.journal
                .write(id, &e.slot, 0, &[("unresolved", words_json(&batch))]);
        }
        let lost = e.deltas();
        tracing::error!(lease_id = id, instance = %e.slot.instance, slot = e.slot.slot, why, unposted = %words_json(&lost), "gave up posting a lease's usage");
        self.stats.dropped += 1;
        self.journal
            .write(id, &e.slot, 0, &[("dropped", words_json(&lost))]);
    }
}

/// The journal file, if one is set.
struct Journal {
    file: Option<File>,
}

impl Journal {
    /// Appends one line about lease `id`: its slot, the region, the time,
    /// and `fields`.
    fn write(
        &mut self,
        id: u64,
        slot: &BillingSlot,
        region_id: u64,
        fields: &[(&str, serde_json::Value)],
    ) {
        let Some(f) = &mut self.file else { return };
        let mut line = serde_json::json!({
            "at_ms": unix_ms(),
            "lease_id": id,
            "instance": slot.instance,
            "slot": slot.slot,
            "region_id": region_id,
        });
        for (k, v) in fields {
            line[*k] = v.clone();
        }
        // One write per line: a kill between two writes would leave half
        // a line for the next daemon to append to.
        let mut text = line.to_string();
        text.push('\n');
        if let Err(e) = f.write_all(text.as_bytes()) {
            tracing::error!(error = %e, "cannot append to the billing journal");
        }
    }
}

/// The batches journaled as `posting` and never followed by their
/// lease's `added` or `unresolved` line, by lease. Lines that do not
/// parse (one cut short by a crash) are skipped.
fn unresolved_batches(path: &std::path::Path) -> std::io::Result<HashMap<u64, Recovery>> {
    use std::io::BufRead;
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(e),
    };
    let mut open = HashMap::new();
    let mut skipped = 0u64;
    for line in std::io::BufReader::new(file).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            skipped += 1;
            continue;
        };
        let Some(id) = v["lease_id"].as_u64() else {
            skipped += 1;
            continue;
        };
        if v.get("posting").is_some() {
            match recovery_of(&v) {
                Some(r) => {
                    open.insert(id, r);
                }
                None => skipped += 1,
            }
        } else if v.get("added").is_some() || v.get("unresolved").is_some() {
            open.remove(&id);
        }
    }
    if skipped > 0 {
        tracing::warn!(journal = %path.display(), lines = skipped, "skipped billing journal lines that do not parse");
    }
    Ok(open)
}

/// A `posting` line's batch.
fn recovery_of(v: &serde_json::Value) -> Option<Recovery> {
    Some(Recovery {
        slot: BillingSlot {
            instance: v["instance"].as_str()?.to_owned(),
            provider: v["provider"].as_str()?.to_owned(),
            addr: v["addr"].as_str()?.to_owned(),
            slot: u32::try_from(v["slot"].as_u64()?).ok()?,
        },
        region_id: v["region_id"].as_u64()?,
        before: SlotTotals::from_words(words_from_json(&v["before"])?),
        deltas: words_from_json(&v["posting"])?,
        at_ms: v["at_ms"].as_u64()?,
    })
}

/// Opens the journal for appending. A file whose last line was cut short
/// (a crash in the middle of a write, a full disk) gets a newline first,
/// so the torn line stays alone and every line written from now on is
/// whole. A new journal is created 0600; a link at the path is refused
/// (the daemon runs as root), never followed.
fn open_journal(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let len = f.metadata()?.len();
    if len > 0 {
        let mut last = [0u8; 1];
        f.seek(SeekFrom::Start(len - 1))?;
        f.read_exact(&mut last)?;
        if last[0] != b'\n' {
            tracing::warn!(journal = %path.display(), "the billing journal's last line was cut short (a crash while writing it?); it is left as it is");
            f.write_all(b"\n")?;
        }
    }
    Ok(f)
}

/// What of `deltas` landed, given what the slot held before (`expected`)
/// and holds now (`read`).
fn landed(
    expected: &SlotTotals,
    read: &SlotTotals,
    deltas: &[u64; SLOT_WORDS],
) -> [u64; SLOT_WORDS] {
    let (x, r) = (expected.to_words(), read.to_words());
    let mut out = [0u64; SLOT_WORDS];
    for i in 0..SLOT_WORDS {
        if i != Counter::Closed.index() {
            out[i] = r[i].saturating_sub(x[i]).min(deltas[i]);
        }
    }
    out
}

/// `a - b` per counter (`closed` is 0): what landed since `b`.
fn sub_words(a: &SlotTotals, b: &SlotTotals) -> SlotTotals {
    let (a, b) = (a.to_words(), b.to_words());
    let mut w = [0u64; SLOT_WORDS];
    for i in 0..SLOT_WORDS {
        if i != Counter::Closed.index() {
            w[i] = a[i].saturating_sub(b[i]);
        }
    }
    SlotTotals::from_words(w)
}

fn add_words(a: &SlotTotals, d: &[u64; SLOT_WORDS]) -> SlotTotals {
    let mut w = a.to_words();
    for i in 0..SLOT_WORDS {
        w[i] = w[i].wrapping_add(d[i]);
    }
    SlotTotals::from_words(w)
}

/// The daemon's billing thread: posts every billed lease's figures from
/// the usage ledger every 100 ms (each at most once per granularity), all
/// of them at once after a take-back (a drain, a Slurm job), and
/// when the daemon stops, waits for its workers' final figures and flushes
/// them. A lease counts as over when its last allocation ended and its
/// token expired or the manager ended it.
pub(crate) fn run(shared: Arc<Shared>, tickets: Arc<Tickets>) {
    let b = &shared.settings.billing;
    let settings = PosterSettings {
        granularity: Duration::from_millis(b.granularity_ms),
        keep_ended: Duration::from_secs(b.keep_ended_s),
        timeout: Duration::from_millis(b.timeout_ms),
        journal: b.journal.clone(),
        tickets,
        carry: shared
            .settings
            .workers_outlive()
            .then(|| crate::daemon::records::state_dir(&shared.settings.runtime_dir)),
    };
    let mut poster = match Poster::new(settings) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(journal = ?b.journal, error = %e, "cannot open the billing journal; no usage is posted");
            return;
        }
    };
    let tick = Duration::from_millis(100).min(Duration::from_millis(b.granularity_ms));
    loop {
        let st = shared.lock();
        // Woken by a stop or by a take-back's flush: only a stop ends the
        // thread, which posts and closes every lease of the node.
        let (mut st, _) = shared.wait_until(st, tick, |st| st.stopping || st.flush_billing);
        let flush = std::mem::take(&mut st.flush_billing);
        let stopping = st.stopping;
        drop(st);
        if stopping {
            break;
        }
        if flush {
            // Allocations were taken back: every lease's figures go out
            // now, not at their granularity.
            poster.flush(&billed_now(&shared), Instant::now());
            tracing::info!("billing flushed after a take-back");
        } else {
            poster.tick(&billed_now(&shared), Instant::now());
        }
        shared.metrics.billing(poster.stats());
    }
    // The workers are being stopped: wait for their final figures, then
    // post everything once more.
    let st = shared.lock();
    let (st, _) = shared.wait_until(st, STOP_WAIT, |st| st.allocations.is_empty());
    drop(st);
    poster.flush(&billed_now(&shared), Instant::now());
    let left = poster.stats().pending;
    tracing::info!(pending = left, "billing flushed for shutdown");
}

/// How long a stopping daemon waits for its workers' final figures.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The ledger's billed leases as the poster takes them.
fn billed_now(shared: &Shared) -> Vec<LeaseUsage> {
    let ended_by_manager: Vec<u64> = shared.lock().ended_leases.keys().copied().collect();
    let now_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    shared
        .usage
        .billed()
        .into_iter()
        .map(|b| {
            let u = &b.usage;
            LeaseUsage {
                lease_id: u.lease_id,
                billing: b.slot,
                totals: SlotTotals {
                    usage: u.usage,
                    closed: 0,
                },
                ended: u.ended && (b.expires_at <= now_s || ended_by_manager.contains(&u.lease_id)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
