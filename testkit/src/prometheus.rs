//! A real Prometheus server (Debian's `prometheus`, or `$PROMETHEUS`) in a
//! private directory, scraping the targets a test names, and queries
//! through its HTTP API. Stopped by pid on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    url: String,
}

/// The binary: `$PROMETHEUS`, else `/usr/bin/prometheus`.
pub fn binary() -> PathBuf {
    std::env::var_os("PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"))
}

impl Prometheus {
    /// Starts Prometheus on a free 127.0.0.1 port, scraping every
    /// `host:port` in `targets` (path `/metrics`; `https://host:port`
    /// over HTTPS, checked with the test run's CA) every 200 ms, and waits
    /// until it is ready. `Err` says why it could not start (not
    /// installed: `scripts/test.sh` installs Debian's `prometheus`).
    pub fn start(targets: &[String]) -> Result<Prometheus, String> {
        let bin = binary();
        if !bin.exists() {
            return Err(format!(
                "{} is not installed; install Debian's prometheus package (scripts/test.sh does) or set PROMETHEUS",
                bin.display()
            ));
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir =
            std::env::temp_dir().join(format!("rfaas-prometheus-{}-{port}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).map_err(|e| format!("create {dir:?}: {e}"))?;
        let (https, plain): (Vec<&String>, Vec<&String>) =
            targets.iter().partition(|t| t.starts_with("https://"));
        let list = |ts: &[&String]| {
            ts.iter()
                .map(|t| format!("'{}'", t.trim_start_matches("https://")))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut config = format!(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n\
             scrape_configs:\n  - job_name: rfaas\n    static_configs:\n      - targets: [{}]\n",
            list(&plain)
        );
        if !https.is_empty() {
            config += &format!(
                "  - job_name: rfaas-tls\n    scheme: https\n    tls_config:\n      ca_file: '{}'\n\
                 \x20   static_configs:\n      - targets: [{}]\n",
                crate::tls::test_ca().ca_file().display(),
                list(&https)
            );
        }
        std::fs::write(dir.join("prometheus.yml"), config).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.join("prometheus.log")).map_err(|e| e.to_string())?;
        let child = Command::new(&bin)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start {}: {e}", bin.display()))?;
        let p = Prometheus {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        let ready_url = format!("{}/-/ready", p.url);
        let ready = crate::wait::poll_for(Duration::from_secs(60), || {
            let resp = ureq::get(&ready_url).call().ok()?;
            (resp.status() == 200).then_some(())
        });
        match ready {
            Some(()) => Ok(p),
            None => Err(format!(
                "prometheus did not become ready in 60 s; its log:\n{}",
                p.log()
            )),
        }
    }

    /// Its base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The value of the instant query `expr`, if it has exactly one result.
    pub fn query(&self, expr: &str) -> Result<Option<f64>, String> {
        let mut resp = ureq::get(&format!("{}/api/v1/query", self.url))
            .query("query", expr)
            .call()
            .map_err(|e| format!("query {expr:?}: {e}"))?;
        let body: serde_json::Value = resp
            .body_mut()
            .read_json()
            .map_err(|e| format!("query {expr:?}: unreadable answer: {e}"))?;
        if body["status"] != "success" {
            return Err(format!("query {expr:?} failed: {body}"));
        }
        let results = body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        match results.as_slice() {
            [] => Ok(None),
            [one] => one["value"][1]
                .as_str()
                .and_then(|v| v.parse().ok())
                .map(Some)
                .ok_or_else(|| format!("query {expr:?}: no number in {one}")),
            many => Err(format!("query {expr:?} has {} results: {body}", many.len())),
        }
    }

    /// Waits (up to `timeout`) until `expr` has a value for which `ok`
    /// holds, and returns it.
    pub fn wait_for(
        &self,
        expr: &str,
        timeout: Duration,
        ok: impl Fn(f64) -> bool,
    ) -> Result<f64, String> {
        let mut last = None;
        let got = crate::wait::poll_for(timeout, || match self.query(expr) {
            Ok(Some(v)) if ok(v) => Some(Ok(v)),
            Ok(v) => {
                last = v;
                None
            }
            Err(e) => Some(Err(e)),
        });
        got.unwrap_or_else(|| {
            Err(format!(
                "{expr} was {last:?} after {timeout:?}, not the value wanted; prometheus's log:\n{}",
                self.log()
            ))
        })
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        crate::process::stop(&mut self.child, crate::process::STOP_GRACE);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
