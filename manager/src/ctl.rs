//! `rfaasctl`'s side of the REST API: [`Ctl`] calls the managers, failing
//! over to the next replica when one cannot be reached, and reads a
//! listing page by page through its `rel="next"` links
//! ([`Ctl::get_pages`]); the functions below turn the answers into the
//! tables and lines it prints for people.

use std::fmt::Write as _;
use std::time::Duration;

use rfaas_proto::manager::{ApiError, BudgetView, Credential, LeaseView, NodeView, Role};
use rfaas_service::table::Table;
use serde_json::Value;

/// Where `rfaasctl` looks for a manager when told nowhere else: the
/// manager's default `listen`, on this host.
pub const DEFAULT_MANAGER: &str = "http://127.0.0.1:7300";

/// Timeout of one request to one manager.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of connecting to one manager, before trying the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The manager answered with an error; its message says what to do.
    #[error("{message} ({kind})")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error's stable kind (`unauthorized`, `not_found`, ...).
        kind: String,
        /// The manager's sentence.
        message: String,
    },
    /// No manager could be reached: each URL tried, and why.
    #[error(
        "no manager answered; tried {}. Check --manager (or RFAAS_MANAGERS) and that rfaas-manager runs there",
        .0.iter().map(|(url, why)| format!("{url} ({why})")).collect::<Vec<_>>().join(", ")
    )]
    Unreachable(Vec<(String, String)>),
    /// A manager answered something that is not its API's JSON.
    #[error("the manager at {url} sent a reply rfaasctl cannot read ({why}); is it an rfaas-manager of this version?")]
    Protocol {
        /// The manager.
        url: String,
        /// What was wrong.
        why: String,
    },
    /// The admin token could not be had.
    #[error("{0}")]
    Token(String),
    /// The CA file (--ca-file, RFAAS_CA_FILE) or a manager URL is
    /// unusable.
    #[error("{0}")]
    Tls(#[from] rfaas_tls::TlsError),
}

/// Checks a manager URL's form given on the command line:
/// `https://host:port` or `http://host:port` (whether plain HTTP may go
/// there is [`Ctl::new`]'s check).
pub fn parse_manager_url(url: &str) -> Result<String, String> {
    rfaas_tls::manager_url(url, rfaas_tls::PlainHttp::Allowed)
        .map_err(|e| format!("{e} ({DEFAULT_MANAGER} on this host)"))
}

/// Parses a duration such as `30d`, `12h`, `90m`, `3600s` or `3600`
/// (seconds) into seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => 0,
    };
    let secs = digits
        .parse::<u64>()
        .ok()
        .filter(|_| scale != 0)
        .and_then(|n| n.checked_mul(scale));
    match secs {
        Some(0) => Err(format!("{text:?} is no time at all; give a positive duration")),
        Some(s) => Ok(s),
        None => Err(format!(
            "{text:?} is not a duration; write a number with s, m, h or d, such as 30d, 12h or 3600s"
        )),
    }
}

/// Percent-encodes one path segment.
pub fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~@".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Calls the managers with a bearer token.
#[derive(Debug)]
pub struct Ctl {
    urls: Vec<String>,
    token: String,
    agent: ureq::Agent,
}

impl Ctl {
    /// Calls the managers at `urls` (tried in order) with `token`,
    /// checking their certificates with the CAs in `ca_file` (or
    /// `RFAAS_CA_FILE`, or the system's roots). Plain `http://` goes only
    /// to loopback unless `plain` allows it.
    pub fn new(
        urls: Vec<String>,
        token: String,
        ca_file: Option<std::path::PathBuf>,
        plain: rfaas_tls::PlainHttp,
    ) -> Result<Ctl, CtlError> {
        let urls = urls
            .iter()
            .map(|u| rfaas_tls::manager_url(u, plain))
            .collect::<Result<Vec<_>, _>>()?;
        let mut options = rfaas_tls::AgentOptions::new(REQUEST_TIMEOUT).ca_file_or_env(ca_file);
        options.connect_timeout = Some(CONNECT_TIMEOUT);
        let agent = rfaas_tls::agent(&options)?;
        Ok(Ctl { urls, token, agent })
    }

    /// `method path` with an optional JSON body, on the first manager that
    /// can be reached. Its answer decides: a 2xx gives the JSON body
    /// (`Null` when empty), anything else its [`ApiError`]. A manager
    /// that cannot be reached is skipped, so a request is never sent twice.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, CtlError> {
        self.call_linked(method, path, body).map(|(v, _)| v)
    }

    /// As [`call`](Self::call), with the path of the `rel="next"` link
    /// the answer carries, if any.
    fn call_linked(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(Value, Option<String>), CtlError> {
        let mut tried = Vec::new();
        for base in &self.urls {
            let url = format!("{base}{path}");
            let req = ureq::http::Request::builder()
                .method(method)
                .uri(&url)
                .header("Authorization", format!("Bearer {}", self.token));
            let sent = match body {
                Some(b) => {
                    let req = req
                        .header("Content-Type", "application/json")
                        .body(b.to_string());
                    req.map_err(|e| e.to_string())
                        .and_then(|r| self.agent.run(r).map_err(|e| e.to_string()))
                }
                None => req
                    .body(())
                    .map_err(|e| e.to_string())
                    .and_then(|r| self.agent.run(r).map_err(|e| e.to_string())),
            };
            let mut resp = match sent {
                Ok(r) => r,
                Err(why) => {
                    tried.push((base.clone(), why));
                    continue;
                }
            };
            let status = resp.status().as_u16();
            let next = resp
                .headers()
                .get_all("link")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .find_map(next_link);
            let text = resp
                .body_mut()
                .read_to_string()
                .map_err(|e| CtlError::Protocol {
                    url: base.clone(),
                    why: e.to_string(),
                })?;
            if (200..300).contains(&status) {
                if text.trim().is_empty() {
                    return Ok((Value::Null, next));
                }
                return serde_json::from_str(&text).map(|v| (v, next)).map_err(|e| {
                    CtlError::Protocol {
                        url: base.clone(),
                        why: e.to_string(),
                    }
                });
            }
            return Err(match serde_json::from_str::<ApiError>(&text) {
                Ok(e) => CtlError::Api {
                    status,
                    kind: e.error,
                    message: e.message,
                },
                Err(_) => CtlError::Protocol {
                    url: base.clone(),
                    why: format!("HTTP {status} with a body that is not an API error"),
                },
            });
        }
        Err(CtlError::Unreachable(tried))
    }

    /// As [`call`](Self::call), with the answer read as `T`.
    pub fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<(Value, T), CtlError> {
        let v = self.call("GET", path, None)?;
        let t = typed(&self.urls, &v)?;
        Ok((v, t))
    }
}

impl Ctl {
    /// Every row of a paged listing: `path`'s first page, then each page
    /// its `Link: <...>; rel="next"` header points to, until none does;
    /// all rows as one JSON array, and as `T`.
    pub fn get_pages<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<(Value, Vec<T>), CtlError> {
        let mut rows = Vec::new();
        let mut next = Some(path.to_owned());
        while let Some(path) = next.take() {
            let (v, link) = self.call_linked("GET", &path, None)?;
            match v {
                Value::Array(page) => rows.extend(page),
                _ => {
                    return Err(CtlError::Protocol {
                        url: self.urls.join(","),
                        why: format!("GET {path} answered with something other than a list"),
                    })
                }
            }
            next = link;
        }
        let v = Value::Array(rows);
        let t = typed(&self.urls, &v)?;
        Ok((v, t))
    }
}

/// The path and query of a `Link` header's `rel="next"` target, if it
/// has one (RFC 8288; the managers give paths, a full URL is cut to its
/// path so the next page goes to the same managers).
pub fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|link| {
        let (target, params) = link.trim().split_once(';')?;
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        let is_next = params.split(';').any(|p| {
            let p = p.trim().replace(' ', "");
            p == "rel=\"next\"" || p == "rel=next"
        });
        if !is_next {
            return None;
        }
        match target.find("://") {
            Some(k) => target[k + 3..]
                .find('/')
                .map(|p| target[k + 3 + p..].to_owned()),
            None => target.starts_with('/').then(|| target.to_owned()),
        }
    })
}

/// Reads an answer as `T`.
pub fn typed<T: serde::de::DeserializeOwned>(urls: &[String], v: &Value) -> Result<T, CtlError> {
    serde_json::from_value(v.clone()).map_err(|e| CtlError::Protocol {
        url: urls.join(","),
        why: e.to_string(),
    })
}

/// A span of seconds, short: `45s`, `12m`, `5h`, `3d`.
pub fn span(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 120 * 60 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// When `at` is, seen from `now` (both Unix seconds): `in 5m`, `2h ago`.
pub fn relative(now: u64, at: u64) -> String {
    if at >= now {
        format!("in {}", span(at - now))
    } else {
        format!("{} ago", span(now - at))
    }
}

fn state_name<T: serde::Serialize>(state: &T) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The nodes, by name, as `rfaasctl nodes` prints them; `now_ms` is Unix
/// milliseconds.
pub fn nodes_table(nodes: &[NodeView], now_ms: u64) -> String {
    let mut nodes: Vec<&NodeView> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut t = Table::new(&[
        ("NAME", false),
        ("STATE", false),
        ("CORES", true),
        ("LEASED", true),
        ("WITHHELD", true),
        ("MEMORY(MiB)", true),
        ("LEASED_MIB", true),
        ("DRAINING", true),
        ("DRAINING_MIB", true),
        ("LAST_HEARTBEAT", false),
        ("HARVESTED", false),
        ("ADDRESS", false),
    ]);
    for n in nodes {
        t.row(vec![
            n.name.clone(),
            state_name(&n.state),
            n.cores.to_string(),
            n.leased_cores.to_string(),
            n.withheld_cores.to_string(),
            n.memory_mib.to_string(),
            n.leased_memory_mib.to_string(),
            n.draining_cores.to_string(),
            n.draining_memory_mib.to_string(),
            heartbeat_age(n.last_heartbeat_ms, now_ms),
            yes_no(n.harvested),
            n.control_addr.clone(),
        ]);
    }
    t.render()
}

fn yes_no(v: bool) -> String {
    if v { "yes" } else { "no" }.into()
}

fn heartbeat_age(last_ms: u64, now_ms: u64) -> String {
    if last_ms == 0 {
        "never".into()
    } else {
        // A heartbeat is always past; within the clocks' skew, "0s ago".
        format!("{} ago", span(now_ms.saturating_sub(last_ms) / 1000))
    }
}

/// One node, a line per field, as `rfaasctl node NAME` prints it.
pub fn node_detail(n: &NodeView, now_ms: u64) -> String {
    let providers: Vec<String> = n
        .providers
        .iter()
        .map(|p| match &p.host {
            Some(h) => format!("{} ({h})", p.name),
            None => p.name.clone(),
        })
        .collect();
    let mut t = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(t, "{k:<16}{v}");
    };
    line("name", n.name.clone());
    line("state", state_name(&n.state));
    line(
        "address",
        format!(
            "{}{}",
            n.control_addr,
            if n.control_tls { " (TLS)" } else { "" }
        ),
    );
    line("providers", providers.join(", "));
    if !n.partitions.is_empty() {
        line("partitions", n.partitions.join(", "));
    }
    let draining = |amount: u64, unit: &str| {
        if amount == 0 {
            String::new()
        } else {
            format!(", {amount}{unit} draining: they leave as their leases end")
        }
    };
    line(
        "cores",
        format!(
            "{} ({} leased, {} withheld{})",
            n.cores,
            n.leased_cores,
            n.withheld_cores,
            draining(n.draining_cores.into(), "")
        ),
    );
    line(
        "memory",
        format!(
            "{} MiB ({} MiB leased{})",
            n.memory_mib,
            n.leased_memory_mib,
            draining(n.draining_memory_mib, " MiB")
        ),
    );
    line("last heartbeat", heartbeat_age(n.last_heartbeat_ms, now_ms));
    line("harvested", yes_no(n.harvested));
    t
}

/// Budgets, as `rfaasctl budget list` prints them: what each account may
/// spend, has spent, and has left.
pub fn budgets_table(budgets: &[BudgetView]) -> String {
    let mut t = Table::new(&[
        ("ACCOUNT", false),
        ("BUDGET", true),
        ("SPENT", true),
        ("LEFT", true),
        ("STATE", false),
    ]);
    for b in budgets {
        t.row(vec![
            b.account.clone(),
            money(b.budget),
            money(b.spend),
            money((b.budget - b.spend).max(0.0)),
            if b.spend >= b.budget {
                "exhausted"
            } else {
                "ok"
            }
            .into(),
        ]);
    }
    t.render()
}

/// An amount with two decimals.
pub fn money(v: f64) -> String {
    format!("{v:.2}")
}

/// Parses a budget given on the command line: a number from 0.
pub fn parse_budget(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "{text:?} is not a budget; give a number from 0, such as 100 or 12.50"
        )),
    }
}

/// Leases, as `rfaasctl leases` prints them; `now` is Unix seconds.
pub fn leases_table(leases: &[LeaseView], now: u64) -> String {
    let mut t = Table::new(&[
        ("GRANT", true),
        ("LEASE", true),
        ("NODE", false),
        ("USER", false),
        ("ACCOUNT", false),
        ("CORES", true),
        ("MEMORY(MiB)", true),
        ("EXPIRES", false),
        ("STATE", false),
    ]);
    for l in leases {
        t.row(vec![
            l.grant_id.to_string(),
            l.lease_id.to_string(),
            l.node.clone(),
            l.user.clone(),
            l.account.clone(),
            l.cores.to_string(),
            l.memory_mib.to_string(),
            relative(now, l.expires_at),
            state_name(&l.state),
        ]);
    }
    t.render()
}

/// Credentials, as `rfaasctl credentials` prints them; `now` is Unix
/// seconds.
pub fn credentials_table(creds: &[Credential], now: u64) -> String {
    let mut t = Table::new(&[
        ("ID", false),
        ("ROLE", false),
        ("SUBJECT", false),
        ("ACCOUNT", false),
        ("EXPIRES", false),
    ]);
    for c in creds {
        t.row(vec![
            c.id.clone(),
            state_name(&c.role),
            c.subject.clone(),
            c.account.clone().unwrap_or_else(|| "-".into()),
            c.expires_at
                .map_or_else(|| "never".into(), |at| relative(now, at)),
        ]);
    }
    t.render()
}

/// The line `rfaasctl credential` prints on stderr about a new credential.
pub fn credential_note(c: &Credential, now: u64) -> String {
    let who = match (c.role, &c.account) {
        (Role::User, Some(a)) => format!("user {} (account {a})", c.subject),
        (Role::User, None) => format!("user {}", c.subject),
        (Role::Node, _) => format!("node {}", c.subject),
    };
    let expiry = c.expires_at.map_or_else(
        || "never expires".into(),
        |at| format!("expires {}", relative(now, at)),
    );
    format!(
        "credential {} for {who}, {expiry}; revoke it with `rfaasctl revoke {}`",
        c.id, c.id
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::manager::{NodeProvider, NodeState};

    #[test]
    fn durations_in_a_users_words() {
        assert_eq!(parse_duration("30d"), Ok(30 * 86_400));
        assert_eq!(parse_duration("12h"), Ok(12 * 3600));
        assert_eq!(parse_duration("90m"), Ok(5400));
        assert_eq!(parse_duration("3600s"), Ok(3600));
        assert_eq!(parse_duration("3600"), Ok(3600));
        for bad in [
            "",
            "0",
            "0d",
            "d",
            "12x",
            "1.5h",
            "-3s",
            "99999999999999999999d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn manager_urls_are_https_or_http_host_port() {
        assert_eq!(
            parse_manager_url("http://m1:7300/"),
            Ok("http://m1:7300".into())
        );
        assert_eq!(
            parse_manager_url("https://m1:7300"),
            Ok("https://m1:7300".into())
        );
        for bad in ["m1:7300", "ftp://m1:7300", "http://", "http://m1:7300/v1"] {
            assert!(parse_manager_url(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(path_segment("node-1.a_b@c"), "node-1.a_b@c");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn next_links_are_found_among_others() {
        assert_eq!(
            next_link(r#"</v1/nodes?after=n2&limit=2>; rel="next""#).as_deref(),
            Some("/v1/nodes?after=n2&limit=2")
        );
        assert_eq!(
            next_link(r#"<https://m:7000/v1/nodes?after=a>; rel="prev", <https://m:7000/v1/nodes?after=b>; rel="next""#)
                .as_deref(),
            Some("/v1/nodes?after=b")
        );
        assert_eq!(next_link(r#"</v1/nodes?after=a>; rel="prev""#), None);
    }

    #[test]
    fn spans_read_short() {
        assert_eq!(span(45), "45s");
        assert_eq!(span(600), "10m");
        assert_eq!(span(5 * 3600), "5h");
        assert_eq!(span(30 * 86_400), "30d");
        assert_eq!(relative(100, 160), "in 60s");
        assert_eq!(relative(7300, 100), "2h ago");
    }

    #[test]
    fn tables_align_their_columns() {
        let node = |name: &str, cores: u32| NodeView {
            name: name.into(),
            state: NodeState::Drained,
            control_addr: "10.0.0.1:7100".into(),
            control_tls: false,
            providers: vec![NodeProvider {
                name: "tcp".into(),
                host: None,
            }],
            cores,
            memory_mib: 4096,
            leased_cores: 1,
            leased_memory_mib: 64,
            last_heartbeat_ms: 95_000,
            harvested: cores > 64,
            withheld_cores: if cores > 64 { 0 } else { 2 },
            draining_cores: 0,
            draining_memory_mib: 0,
            partitions: Vec::new(),
        };
        // Registered at 1 core and 1000 MiB under 4 and 2048 leased.
        let shrunk = NodeView {
            leased_cores: 4,
            draining_cores: 3,
            memory_mib: 2048,
            leased_memory_mib: 2048,
            draining_memory_mib: 1048,
            withheld_cores: 0,
            ..node("n2", 4)
        };
        let text = nodes_table(
            &[node("node10", 128), node("n1", 4), shrunk.clone()],
            100_000,
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "NAME    STATE    CORES  LEASED  WITHHELD  MEMORY(MiB)  LEASED_MIB  DRAINING  DRAINING_MIB  LAST_HEARTBEAT  HARVESTED  ADDRESS",
                "n1      drained      4       1         2         4096          64         0             0  5s ago          no         10.0.0.1:7100",
                "n2      drained      4       4         0         2048        2048         3          1048  5s ago          no         10.0.0.1:7100",
                "node10  drained    128       1         0         4096          64         0             0  5s ago          yes        10.0.0.1:7100",
            ]
        );
        let detail = node_detail(&shrunk, 100_000);
        assert!(
            detail.contains("cores           4 (4 leased, 0 withheld, 3 draining: they leave as their leases end)"),
            "{detail}"
        );
        assert!(
            detail.contains("memory          2048 MiB (2048 MiB leased, 1048 MiB draining: they leave as their leases end)"),
            "{detail}"
        );
        assert!(
            node_detail(&node("n1", 4), 100_000)
                .contains("cores           4 (1 leased, 2 withheld)\n"),
            "nothing drains"
        );
    }

    #[test]
    fn budgets_show_what_is_left() {
        let b = |account: &str, budget: f64, spend: f64| BudgetView {
            account: account.into(),
            budget,
            spend,
            updated_ms: 0,
        };
        let text = budgets_table(&[b("chem", 10.0, 12.5), b("physics", 100.0, 2.126)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "ACCOUNT  BUDGET  SPENT   LEFT  STATE",
                "chem      10.00  12.50   0.00  exhausted",
                "physics  100.00   2.13  97.87  ok",
            ]
        );
        assert_eq!(parse_budget(" 12.5"), Ok(12.5));
        for bad in ["", "-1", "NaN", "inf", "1e400", "ten"] {
            assert!(parse_budget(bad).is_err(), "{bad:?} parsed");
        }
    }
}
