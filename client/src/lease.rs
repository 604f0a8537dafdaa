//! Leases from the resource manager: a job asks any manager replica for
//! cores and gets one node lease (with its token) per node.
//!
//! [`Managers`] holds the replicas' URLs and the job's credential.
//! [`Managers::request`] asks for a lease and, while the managers answer
//! "nothing fits" (`503`) or do not answer at all, tries again with
//! exponential backoff and full jitter, never sooner than a `Retry-After`
//! says, failing over from one URL to the next, until its deadline; a wait
//! that would end past the deadline ends there, for a last try. Other
//! refusals (a bad credential, a quota, a malformed request, a request no
//! node can ever hold) come back at once: waiting does not change them.
//!
//! A [`Lease`] releases itself when dropped (or by [`Lease::release`]), and
//! [`Lease::renew`] extends it; hand the renewed tokens to the allocations
//! made under it ([`crate::Allocation::lease_id`] names which).
//!
//! The clock and the random source are injectable ([`Clock`], [`Jitter`]),
//! so the retry schedule is tested without sleeping.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_proto::manager::{ApiError, RenewRequest};
pub use rfaas_proto::manager::{LeaseGrant, LeaseRequest, NodeLease, NodeState, NodeView};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::control::lock;
use crate::error::{Error, Result};

/// Time, as the retry schedule sees it.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> Instant;
    /// Waits `d`.
    fn sleep(&self, d: Duration);
}

/// The real clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// The random source of the backoff's jitter.
pub trait Jitter: Send + Sync + fmt::Debug {
    /// A number in `[0, max]`, uniformly.
    fn uniform(&self, max: u64) -> u64;
}

/// The default random source (a thread-local generator).
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomJitter;

impl Jitter for RandomJitter {
    fn uniform(&self, max: u64) -> u64 {
        fastrand::u64(0..=max)
    }
}

/// How long to wait between attempts: the n-th wait is uniform in
/// `[0, min(cap, base · 2^n)]` (full jitter), and never shorter than the
/// manager's `Retry-After`. A wait that would end past the caller's
/// deadline ends at the deadline instead, for one last attempt there
/// ([`Managers::request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first step's ceiling.
    pub base: Duration,
    /// The largest ceiling.
    pub cap: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            base: Duration::from_millis(50),
            cap: Duration::from_secs(10),
        }
    }
}

impl Backoff {
    /// The wait before attempt `attempt + 1` (the first retry is attempt
    /// 0), given the manager's `Retry-After`.
    pub fn wait(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        jitter: &dyn Jitter,
    ) -> Duration {
        let base = self.base.as_millis().min(u128::from(u64::MAX)) as u64;
        let cap = self.cap.as_millis().min(u128::from(u64::MAX)) as u64;
        let ceiling = base.saturating_mul(1u64 << attempt.min(32)).min(cap);
        let jittered = Duration::from_millis(jitter.uniform(ceiling).min(ceiling));
        jittered.max(retry_after.unwrap_or_default())
    }
}

/// The manager replicas a job talks to, and its credential.
#[derive(Debug, Clone)]
pub struct Managers {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    urls: Vec<String>,
    credential: String,
    agent: ureq::Agent,
    /// The replica that answered last: tried first next time.
    current: Mutex<usize>,
    clock: Arc<dyn Clock>,
    jitter: Arc<dyn Jitter>,
    backoff: Backoff,
}

/// One answer, or why there was none.
enum Attempt<T> {
    Done(T),
    /// Worth trying again later: `503` (with its `Retry-After`), another
    /// 5xx, or no answer.
    Again {
        retry_after: Option<Duration>,
        error: Error,
    },
    /// Not worth trying again.
    Fatal(Error),
}

/// The environment variable with the managers' URLs, comma-separated.
pub const MANAGERS_ENV: &str = "RFAAS_MANAGERS";
/// The environment variable with the job's credential.
pub const CREDENTIAL_ENV: &str = "RFAAS_CREDENTIAL";

/// Timeout of each phase (connect, send, receive) of one HTTP request to
/// a manager.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

impl Managers {
    /// The replicas at `urls` (`https://host:port`; plain `http://` to a
    /// loopback address only), trusting the CA file `RFAAS_CA_FILE` names
    /// (or the system's roots), with the job's
    /// `credential` (minted by `rfaasctl credential user`, or put in the
    /// job's environment by the Slurm plugin).
    pub fn new<I, S>(urls: I, credential: &str) -> Result<Managers>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Managers::with(
            urls,
            credential,
            Arc::new(SystemClock),
            Arc::new(RandomJitter),
            Backoff::default(),
        )
    }

    /// The replicas and credential named by `RFAAS_MANAGERS` and
    /// `RFAAS_CREDENTIAL`.
    pub fn from_env() -> Result<Managers> {
        let urls = std::env::var(MANAGERS_ENV).map_err(|_| {
            Error::InvalidArgument(format!(
                "{MANAGERS_ENV} is not set; set it to the managers' URLs, comma-separated"
            ))
        })?;
        let credential = std::env::var(CREDENTIAL_ENV).map_err(|_| {
            Error::InvalidArgument(format!(
                "{CREDENTIAL_ENV} is not set; set it to the credential `rfaasctl credential user` printed"
            ))
        })?;
        Managers::new(urls.split(','), &credential)
    }

    /// As [`new`](Self::new), with the clock, random source and backoff
    /// given (tests, and jobs that want another schedule).
    pub fn with<I, S>(
        urls: I,
        credential: &str,
        clock: Arc<dyn Clock>,
        jitter: Arc<dyn Jitter>,
        backoff: Backoff,
    ) -> Result<Managers>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list = Vec::new();
        for url in urls {
            let url = url.as_ref().trim();
            if url.is_empty() {
                continue;
            }
            let url = rfaas_tls::manager_url(url, rfaas_tls::PlainHttp::LoopbackOnly)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            list.push(url);
        }
        if list.is_empty() {
            return Err(Error::InvalidArgument(
                "no manager URL given; name at least one, such as https://manager1:7300".into(),
            ));
        }
        let credential = credential.trim();
        if credential.is_empty() || credential.contains(char::is_whitespace) {
            return Err(Error::InvalidArgument(
                "the manager credential must be one token, as rfaasctl printed it".into(),
            ));
        }
        if backoff.base.is_zero() || backoff.cap < backoff.base {
            return Err(Error::InvalidArgument(format!(
                "backoff base {:?} must be positive and at most its cap {:?}",
                backoff.base, backoff.cap
            )));
        }
        let agent =
            rfaas_tls::agent(&rfaas_tls::AgentOptions::new(REQUEST_TIMEOUT).ca_file_or_env(None))
                .map_err(|e| {
                Error::InvalidArgument(format!(
                    "{e} (the CA file comes from {})",
                    rfaas_tls::CA_FILE_ENV
                ))
            })?;
        Ok(Managers {
            inner: Arc::new(Inner {
                urls: list,
                credential: credential.to_owned(),
                agent,
                current: Mutex::new(0),
                clock,
                jitter,
                backoff,
            }),
        })
    }

    /// The replicas' URLs.
    pub fn urls(&self) -> &[String] {
        &self.inner.urls
    }

    /// The clock the retry schedule and background renewal run on.
    pub(crate) fn clock(&self) -> &dyn Clock {
        self.inner.clock.as_ref()
    }

    /// The nodes as a replica sees them, retrying while no manager answers
    /// until `deadline`.
    pub fn nodes(&self, deadline: Duration) -> Result<Vec<NodeView>> {
        self.retrying(deadline, || {
            self.inner
                .send::<(), Vec<NodeView>>("GET", "/v1/nodes", None)
        })
    }

    /// Asks for a lease, retrying while nothing fits or no manager answers,
    /// until `deadline` has passed.
    ///
    /// Between attempts it waits with exponential backoff and full jitter,
    /// never sooner than the manager's `Retry-After`, except once: a wait
    /// that would end past the deadline (a `Retry-After` of 60 s with 10 s
    /// left, say) ends at the deadline, and the last attempt is made
    /// there, because a release can free cores before the lease that
    /// `Retry-After` counts on ends. The deadline is counted from the
    /// call; a `deadline` of zero makes one attempt and no wait. What a
    /// last attempt answers is the error: `503 no_capacity` when still
    /// nothing fits ([`Error::Manager`], retryable later). A request no
    /// node can ever hold is refused at once, without waiting
    /// ([`Error::ExceedsCluster`]), as is any other refusal waiting cannot
    /// change.
    pub fn request(&self, req: &LeaseRequest, deadline: Duration) -> Result<Lease> {
        let grant = self.retrying(deadline, || {
            self.inner.send("POST", "/v1/leases", Some(req))
        })?;
        Ok(Lease {
            managers: self.clone(),
            grant: Mutex::new(grant),
            released: false,
        })
    }

    /// Runs `attempt` until it is done, fails for good, or `deadline` has
    /// passed. Between attempts it waits as [`Backoff::wait`] says, but
    /// never past the deadline: a wait that would end later (a long
    /// `Retry-After`, a long backoff step) ends at the deadline instead,
    /// for a last attempt there.
    fn retrying<T>(
        &self,
        deadline: Duration,
        mut attempt: impl FnMut() -> Attempt<T>,
    ) -> Result<T> {
        let inner = &self.inner;
        let started = inner.clock.now();
        let mut tries = 0u32;
        loop {
            match attempt() {
                Attempt::Done(t) => return Ok(t),
                Attempt::Fatal(e) => return Err(e),
                Attempt::Again { retry_after, error } => {
                    let spent = inner.clock.now().saturating_duration_since(started);
                    let left = deadline.saturating_sub(spent);
                    if left.is_zero() {
                        tracing::debug!(tries = tries + 1, ?spent, "giving up on the managers");
                        return Err(error);
                    }
                    let wait = inner
                        .backoff
                        .wait(tries, retry_after, inner.jitter.as_ref())
                        .min(left);
                    tracing::debug!(?wait, ?left, error = %error, "the managers cannot grant now; waiting");
                    inner.clock.sleep(wait);
                    tries += 1;
                }
            }
        }
    }
}

impl Inner {
    /// Sends one request, failing over across the replicas: the first that
    /// answers other than with a 5xx decides.
    fn send<B: Serialize, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Attempt<T> {
        let first = *lock(&self.current);
        let mut last = None;
        for k in 0..self.urls.len() {
            let i = (first + k) % self.urls.len();
            let url = format!("{}{path}", self.urls[i]);
            let auth = format!("Bearer {}", self.credential);
            let sent = match (method, body) {
                ("POST", Some(b)) => self
                    .agent
                    .post(&url)
                    .header("Authorization", &auth)
                    .send_json(b),
                ("POST", None) => self
                    .agent
                    .post(&url)
                    .header("Authorization", &auth)
                    .send_empty(),
                ("DELETE", _) => self
                    .agent
                    .delete(&url)
                    .header("Authorization", &auth)
                    .call(),
                _ => self.agent.get(&url).header("Authorization", &auth).call(),
            };
            let mut resp = match sent {
                Ok(r) => r,
                Err(e) => {
                    last = Some(Attempt::Again {
                        retry_after: None,
                        error: Error::ManagerUnreachable {
                            url: self.urls[i].clone(),
                            why: e.to_string(),
                        },
                    });
                    continue;
                }
            };
            let status = resp.status().as_u16();
            if (200..300).contains(&status) {
                *lock(&self.current) = i;
                if status == 204 {
                    // Only release answers 204; its T is ().
                    return match serde_json::from_value(serde_json::Value::Null) {
                        Ok(t) => Attempt::Done(t),
                        Err(e) => Attempt::Fatal(Error::Protocol(format!("{url}: {e}"))),
                    };
                }
                return match resp.body_mut().read_json::<T>() {
                    Ok(t) => Attempt::Done(t),
                    Err(e) => Attempt::Fatal(Error::Protocol(format!(
                        "the manager at {url} sent an unreadable reply: {e}"
                    ))),
                };
            }
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            let api = resp
                .body_mut()
                .read_json::<ApiError>()
                .unwrap_or_else(|e| ApiError {
                    error: "unreadable_reply".into(),
                    message: format!("the manager's error reply was not JSON ({e})"),
                    details: Default::default(),
                });
            let error = Error::from_manager(status, api);
            if status == 503 {
                // Every replica shares one database: another will not fit
                // either, so wait as told.
                *lock(&self.current) = i;
                return Attempt::Again { retry_after, error };
            }
            if status >= 500 {
                last = Some(Attempt::Again { retry_after, error });
                continue;
            }
            *lock(&self.current) = i;
            return Attempt::Fatal(error);
        }
        last.unwrap_or_else(|| Attempt::Fatal(Error::InvalidArgument("no manager URL".into())))
    }
}

/// A granted lease: one node lease per node, each with its own token.
/// Dropping it releases it.
#[derive(Debug)]
pub struct Lease {
    managers: Managers,
    grant: Mutex<LeaseGrant>,
    released: bool,
}

impl Lease {
    /// The grant's id.
    pub fn id(&self) -> u64 {
        lock(&self.grant).id
    }

    /// When it ends, Unix seconds.
    pub fn expires_at(&self) -> u64 {
        lock(&self.grant).expires_at
    }

    /// The node leases, with their tokens (renewed ones after
    /// [`renew`](Self::renew)).
    pub fn nodes(&self) -> Vec<NodeLease> {
        lock(&self.grant).leases.clone()
    }

    /// Cores granted in all.
    pub fn cores(&self) -> u32 {
        lock(&self.grant).leases.iter().map(|l| l.cores).sum()
    }

    /// Extends the lease to `duration` from now; returns the new node
    /// leases, whose tokens the allocations under them need.
    pub fn renew(&self, duration: Duration, deadline: Duration) -> Result<Vec<NodeLease>> {
        let path = format!("/v1/leases/{}/renew", self.id());
        let body = RenewRequest {
            duration_s: duration.as_secs().max(1),
        };
        let grant: LeaseGrant = self.managers.retrying(deadline, || {
            self.managers.inner.send("POST", &path, Some(&body))
        })?;
        let leases = grant.leases.clone();
        *lock(&self.grant) = grant;
        Ok(leases)
    }

    /// Releases the lease now: the executors stop its workers.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.release_once()
    }

    fn release_once(&self) -> Result<()> {
        let path = format!("/v1/leases/{}", self.id());
        match self.managers.inner.send::<(), ()>("DELETE", &path, None) {
            Attempt::Done(()) => Ok(()),
            Attempt::Again { error, .. } | Attempt::Fatal(error) => Err(error),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.released {
            if let Err(e) = self.release_once() {
                tracing::warn!(lease = self.id(), error = %e, "cannot release the lease; it ends at its expiry");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(u64);
    impl Jitter for Fixed {
        fn uniform(&self, max: u64) -> u64 {
            self.0.min(max)
        }
    }
    #[derive(Debug)]
    struct Top;
    impl Jitter for Top {
        fn uniform(&self, max: u64) -> u64 {
            max
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_honours_retry_after() {
        let b = Backoff {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(400),
        };
        let waits: Vec<u128> = (0..6).map(|n| b.wait(n, None, &Top).as_millis()).collect();
        assert_eq!(waits, vec![50, 100, 200, 400, 400, 400]);
        assert_eq!(b.wait(3, None, &Fixed(0)), Duration::ZERO, "full jitter");
        assert_eq!(
            b.wait(0, Some(Duration::from_secs(3)), &Top),
            Duration::from_secs(3),
            "never sooner than Retry-After"
        );
        assert_eq!(b.wait(200, None, &Top), Duration::from_millis(400));
    }

    /// Virtual time: `sleep` moves it on and records the wait.
    #[derive(Debug)]
    struct Virtual {
        start: Instant,
        slept: Mutex<Vec<Duration>>,
    }

    impl Clock for Virtual {
        fn now(&self) -> Instant {
            self.start + lock(&self.slept).iter().sum::<Duration>()
        }
        fn sleep(&self, d: Duration) {
            lock(&self.slept).push(d);
        }
    }

    /// Runs `retrying` to `deadline` over attempts that answer "nothing
    /// fits, retry after `retry_after`" until the `granted_at`-th (1-based;
    /// 0: never): the result, and the waits in milliseconds.
    fn schedule(
        deadline: Duration,
        retry_after: Option<Duration>,
        granted_at: u32,
    ) -> (Result<u32>, Vec<u128>) {
        let clock = Arc::new(Virtual {
            start: Instant::now(),
            slept: Mutex::new(Vec::new()),
        });
        let backoff = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
        };
        let m =
            Managers::with(["https://m:1"], "c", clock.clone(), Arc::new(Top), backoff).unwrap();
        let mut n = 0;
        let result = m.retrying(deadline, || {
            n += 1;
            if n == granted_at {
                return Attempt::Done(n);
            }
            Attempt::Again {
                retry_after,
                error: Error::Manager {
                    status: 503,
                    kind: "no_capacity".into(),
                    message: format!("attempt {n}"),
                },
            }
        });
        let waits = lock(&clock.slept).iter().map(Duration::as_millis).collect();
        (result, waits)
    }

    #[test]
    fn a_retry_after_past_the_deadline_waits_for_the_deadline_and_tries_there() {
        let long = Some(Duration::from_secs(60));
        // Cores freed before the manager's estimate: the try at the
        // deadline gets them.
        let (granted, waits) = schedule(Duration::from_secs(10), long, 2);
        assert_eq!(granted.unwrap(), 2);
        assert_eq!(waits, [10_000]);
        // Still nothing: the last try's answer is the error.
        let (refused, waits) = schedule(Duration::from_secs(10), long, 0);
        assert!(
            matches!(&refused, Err(Error::Manager { message, .. }) if message == "attempt 2"),
            "{refused:?}"
        );
        assert_eq!(waits, [10_000]);
        // Retry-After is honoured while the deadline is further.
        let (_, waits) = schedule(Duration::from_secs(150), long, 0);
        assert_eq!(waits, [60_000, 60_000, 30_000]);
    }

    #[test]
    fn the_backoff_runs_to_the_deadline_and_a_zero_deadline_tries_once() {
        // 100, 200, 400 ms fit in 1 s; the next step (800) ends at it.
        let (refused, waits) = schedule(Duration::from_secs(1), None, 0);
        assert!(refused.is_err());
        assert_eq!(waits, [100, 200, 400, 300]);
        let (refused, waits) = schedule(Duration::ZERO, None, 0);
        assert!(
            matches!(&refused, Err(Error::Manager { message, .. }) if message == "attempt 1"),
            "{refused:?}"
        );
        assert!(waits.is_empty(), "{waits:?}");
    }

    #[test]
    fn urls_and_credentials_are_checked() {
        let err = Managers::new(["ftp://x"], "c").unwrap_err();
        assert!(err.to_string().contains("https://"), "{err}");
        let err = Managers::new(Vec::<String>::new(), "c").unwrap_err();
        assert!(err.to_string().contains("no manager URL"), "{err}");
        let err = Managers::new(["https://m:1"], " ").unwrap_err();
        assert!(err.to_string().contains("one token"), "{err}");
        // The credential would cross the network in clear.
        let err = Managers::new(["http://m:1"], "c").unwrap_err();
        assert!(err.to_string().contains("in clear"), "{err}");
        let m = Managers::new(["https://m:1/", " http://127.0.0.1:2"], "c").unwrap();
        assert_eq!(m.urls(), ["https://m:1", "http://127.0.0.1:2"]);
    }
}
