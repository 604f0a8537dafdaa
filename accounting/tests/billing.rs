//! `rfaas-billing`, the real binary, on leases, usage and snapshots written
//! straight into a database of each kind: SQLite, and a real PostgreSQL
//! server.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use rfaas_testkit::on_both;
use rfaas_testkit::postgres::Postgres;
use serde_json::{json, Value};

/// 2024-01-01T00:00:00Z, ms.
const T0: u64 = 1_704_067_200_000;
/// A day, ms.
const DAY: u64 = 86_400_000;
/// A GiB-second in the counter's MiB·ms.
const GIB_S: u64 = 1024 * 1000;
/// A second in ns.
const SEC: u64 = 1_000_000_000;

/// The rates the tests price with: figures that print exactly.
const RATES: &str = "currency = \"CHF\"\n\
[rates]\n\
alloc_per_gib_s = 0.001\n\
compute_per_s = 0.01\n\
hot_per_s = 0.002\n\
harvested_discount = 0.5\n";

/// A migrated database of either kind and a private directory for
/// configuration files; both removed on drop.
struct Db {
    url: String,
    /// The URL without its password, which is in the directory's
    /// database.password: a command line may not carry it.
    cli_url: String,
    dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    pool: Option<sqlx::AnyPool>,
    _pg: Option<Postgres>,
}

impl Db {
    fn new(kind: &str) -> Db {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rfaas-billing-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let (url, pg) = match kind {
            "sqlite" => (format!("sqlite://{}", dir.join("rfaas.db").display()), None),
            "postgres" => {
                let pg = Postgres::start().unwrap_or_else(|e| panic!("{e}"));
                (pg.url().to_owned(), Some(pg))
            }
            other => panic!("no backend {other}"),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let pool = runtime
            .block_on(rfaas_service::db::open_and_migrate(&url, 2))
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
        let mut parsed = url::Url::parse(&url).unwrap();
        if let Some(password) = parsed.password() {
            use std::os::unix::fs::PermissionsExt;
            let file = dir.join("database.password");
            std::fs::write(&file, format!("{password}\n")).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
            parsed.set_password(None).unwrap();
        }
        Db {
            cli_url: parsed.into(),
            url,
            dir,
            runtime,
            pool: Some(pool),
            _pg: pg,
        }
    }

    /// Runs `;`-separated statements.
    fn exec(&self, sql: &str) {
        let pool = self.pool.as_ref().unwrap();
        self.runtime.block_on(async {
            for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                sqlx::query(stmt)
                    .execute(pool)
                    .await
                    .unwrap_or_else(|e| panic!("{stmt}: {e}"));
            }
        });
    }

    /// Writes `text` into the directory's `name`; its path.
    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The billing configuration with the test rates.
    fn config(&self) -> PathBuf {
        self.file("billing.toml", RATES)
    }

    /// The options that name this database (its password from the
    /// directory) and the billing configuration `config`.
    fn common<'a>(&'a self, config: &'a Path) -> [&'a str; 6] {
        [
            "--database",
            &self.cli_url,
            "--config-dir",
            self.dir.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ]
    }

    /// Runs rfaas-billing on this database with the test rates, in UTC.
    fn run(&self, args: &[&str]) -> Output {
        billing(&self.common(&self.config()), args, "UTC")
    }

    /// [`Db::run`], which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "rfaas-billing {args:?}: {:?}\nstdout: {}\nstderr: {}",
            o.status,
            stdout(&o),
            stderr(&o)
        );
        stdout(&o)
    }

    /// [`Db::run`], which must fail with `code`; its stderr.
    fn fails(&self, code: i32, args: &[&str]) -> String {
        failed(code, &self.run(args))
    }

    /// A lease row.
    fn lease(
        &self,
        id: u64,
        user: &str,
        account: &str,
        job: Option<u64>,
        node: &str,
        harvested: bool,
    ) {
        let job = job.map_or("NULL".into(), |j| j.to_string());
        self.exec(&format!(
            "INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, ended_ms, job_id, harvested) \
             VALUES ({id}, {id}, '{node}', 'o', '{user}', '{account}', 1, 1024, 0, 0, 'ended', 0, {job}, {})",
            harvested as u8
        ));
    }

    /// A snapshot of lease `id`'s totals at `at`: GiB-s, compute s, hot s
    /// (in thousandths, to keep to integers), invocations, bytes in, out.
    fn snapshot(&self, id: u64, at: u64, t: [u64; 6]) {
        self.exec(&format!(
            "INSERT INTO usage_snapshots (lease_id, at_ms, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out) \
             VALUES ({id}, {at}, {}, {}, {}, 0, {}, {}, {})",
            t[0] * GIB_S,
            t[1] * SEC / 1000,
            t[2] * SEC / 1000,
            t[3],
            t[4],
            t[5]
        ));
    }

    /// Lease `id`'s current totals, flushed at `at`.
    fn usage(&self, id: u64, at: u64, t: [u64; 6]) {
        self.exec(&format!(
            "INSERT INTO usage (lease_id, instance, slot, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out, finalized, first_ms, updated_ms) \
             VALUES ({id}, 'acct-1', {id}, {}, {}, {}, 7000000000, {}, {}, {}, 0, 0, {at})",
            t[0] * GIB_S,
            t[1] * SEC / 1000,
            t[2] * SEC / 1000,
            t[3],
            t[4],
            t[5]
        ));
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            self.runtime.block_on(pool.close());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the binary with `common` then `args` in time zone `tz`.
fn billing(common: &[&str], args: &[&str], tz: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rfaas-billing"))
        .env("TZ", tz)
        .args(common)
        .args(args)
        .output()
        .expect("rfaas-billing runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn failed(code: i32, o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
    assert!(stdout(o).is_empty(), "{}", stdout(o));
    stderr(o)
}

/// Four leases over 2024-01-01 to 03 and one flushed "now", in a few
/// snapshots each. In the day 2024-01-02 (UTC):
/// - lease 1 (alice, physics, job 100): day-2 snapshot minus day-1's,
///   20 GiB-s, 3 s compute, 2 s hot, 15 calls, 1500/3000 bytes: 0.054;
/// - lease 2 (bob, physics, job 100, harvested): all of it, 8 GiB-s, 4 s
///   compute, 4 calls, 400/800 bytes: half of 0.048 = 0.024;
/// - lease 3 (alice, chem, no job): 4 GiB-s, 2 s, 1 s hot, 2 calls,
///   300/600 bytes: 0.026;
/// - lease 4 (carol, chem, job 200): nothing (all of it in 2023);
/// - lease 5 (dave, bio): nothing (flushed only now).
fn seeded(kind: &str) -> Db {
    let db = Db::new(kind);
    db.lease(1, "alice", "physics", Some(100), "n1", false);
    db.snapshot(1, T0 + DAY / 2, [10, 2000, 1000, 10, 1000, 2000]);
    db.snapshot(1, T0 + 3 * DAY / 2, [30, 5000, 3000, 25, 2500, 5000]);
    db.usage(1, T0 + 5 * DAY / 2, [40, 6000, 4000, 30, 3000, 6000]);
    db.lease(2, "bob", "physics", Some(100), "n2", true);
    db.snapshot(2, T0 + 5 * DAY / 4, [8, 4000, 0, 4, 400, 800]);
    db.usage(2, T0 + 5 * DAY / 4, [8, 4000, 0, 4, 400, 800]);
    db.lease(3, "alice", "chem", None, "n1", false);
    db.snapshot(3, T0 + DAY / 4, [2, 1000, 500, 1, 0, 0]);
    db.snapshot(3, T0 + 7 * DAY / 4, [6, 3000, 1500, 3, 300, 600]);
    db.usage(3, T0 + 7 * DAY / 4, [6, 3000, 1500, 3, 300, 600]);
    db.lease(4, "carol", "chem", Some(200), "n2", false);
    db.snapshot(4, T0 - DAY, [1, 1000, 0, 1, 0, 0]);
    db.usage(4, T0 - DAY, [1, 1000, 0, 1, 0, 0]);
    // Flushed an hour from now, so that "today" includes it whenever the
    // test runs; no snapshot yet.
    db.lease(5, "dave", "bio", None, "n3", false);
    db.usage(5, rfaas_service::now_ms() + 3_600_000, [1, 0, 0, 1, 0, 0]);
    db
}

const DAY2: [&str; 4] = ["-S", "2024-01-02", "-E", "2024-01-03"];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

fn every_output_of_a_day(kind: &str) {
    let db = seeded(kind);
    assert_eq!(
        db.ok(&DAY2),
        "Usage by account, 2024-01-02T00:00:00 - 2024-01-03T00:00:00 (86400 s), costs in CHF\n\
         Account  AllocGiBSec  ComputeSec  HotPollSec  Invocations  BytesIn  BytesOut    Cost\n\
         chem           4.000       2.000       1.000            2      300       600  0.0260\n\
         physics       28.000       7.000       2.000           19     1900      3800  0.0780\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["--parsable2"])),
        "Account|AllocGiBSec|ComputeSec|HotPollSec|Invocations|BytesIn|BytesOut|Cost\n\
         chem|4.000|2.000|1.000|2|300|600|0.0260\n\
         physics|28.000|7.000|2.000|19|1900|3800|0.0780\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["--csv", "--noheader"])),
        "chem,4.000,2.000,1.000,2,300,600,0.0260\n\
         physics,28.000,7.000,2.000,19,1900,3800,0.0780\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["-n"])),
        "chem           4.000       2.000       1.000            2      300       600  0.0260\n\
         physics       28.000       7.000       2.000           19     1900      3800  0.0780\n"
    );
    let v: Value = serde_json::from_str(&db.ok(&with(&DAY2, &["--json"]))).unwrap();
    assert_eq!(v["start"], "2024-01-02T00:00:00+00:00", "{v}");
    assert_eq!(v["end"], "2024-01-03T00:00:00+00:00", "{v}");
    assert_eq!(
        (&v["currency"], &v["by"]),
        (&json!("CHF"), &json!(["account"]))
    );
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    let physics = &rows[1];
    let mut keys: Vec<&String> = physics.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "account",
            "alloc_gib_s",
            "bytes_in",
            "bytes_out",
            "compute_s",
            "cost",
            "hot_poll_s",
            "invocations"
        ]
    );
    assert_eq!(physics["account"], "physics");
    assert_eq!(physics["alloc_gib_s"], 28.0);
    assert_eq!(physics["compute_s"], 7.0);
    assert_eq!(physics["hot_poll_s"], 2.0);
    assert_eq!(
        (
            &physics["invocations"],
            &physics["bytes_in"],
            &physics["bytes_out"]
        ),
        (&json!(19), &json!(1900), &json!(3800))
    );
    // Unrounded in JSON: 0.054 + 0.024.
    let cost = physics["cost"].as_f64().unwrap();
    assert!((cost - 0.078).abs() < 1e-12, "{cost}");
    assert!(
        (rows[0]["cost"].as_f64().unwrap() - 0.026).abs() < 1e-12,
        "{v}"
    );
}
on_both!(every_output_of_a_day);

fn groupings_filters_and_periods(kind: &str) {
    let db = seeded(kind);
    // A row per lease, every key and the discount shown.
    assert_eq!(
        db.ok(&with(
            &DAY2,
            &[
                "--by",
                "lease",
                "-P",
                "--format",
                "lease,user,account,jobid,node,harvested,leases,warmsec,cost"
            ]
        )),
        "Lease|User|Account|JobID|Node|Harvested|Leases|WarmSec|Cost\n\
         1|alice|physics|100|n1|no|1|0.000|0.0540\n\
         2|bob|physics|100|n2|yes|1|0.000|0.0240\n\
         3|alice|chem||n1|no|1|0.000|0.0260\n"
    );
    assert_eq!(
        db.ok(&with(
            &DAY2,
            &["--by", "user", "-P", "-o", "User,Leases,Cost"]
        )),
        "User|Leases|Cost\nalice|2|0.0800\nbob|1|0.0240\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["--by", "job", "-P", "-o", "JobID,Cost"])),
        "JobID|Cost\n|0.0260\n100|0.0780\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["--by", "node", "-P", "-o", "Node,Cost"])),
        "Node|Cost\nn1|0.0800\nn2|0.0240\n"
    );
    assert_eq!(
        db.ok(&with(&DAY2, &["--by", "account,user", "-P"])),
        "Account|User|AllocGiBSec|ComputeSec|HotPollSec|Invocations|BytesIn|BytesOut|Cost\n\
         chem|alice|4.000|2.000|1.000|2|300|600|0.0260\n\
         physics|alice|20.000|3.000|2.000|15|1500|3000|0.0540\n\
         physics|bob|8.000|4.000|0.000|4|400|800|0.0240\n"
    );
    // The table shows a missing job as "-".
    assert_eq!(
        db.ok(&with(&DAY2, &["--by", "job", "-n", "-o", "JobID,Leases"])),
        "    -       1\n  100       2\n"
    );

    // Filters, alone and together (comma lists).
    let costs = |more: &[&str]| {
        db.ok(&with(
            &with(&DAY2, &["--by", "lease", "-Pn", "-o", "Lease,Cost"]),
            more,
        ))
    };
    assert_eq!(costs(&["-u", "alice"]), "1|0.0540\n3|0.0260\n");
    assert_eq!(
        costs(&["--user", "bob,alice", "-A", "physics"]),
        "1|0.0540\n2|0.0240\n"
    );
    assert_eq!(costs(&["--account", "chem"]), "3|0.0260\n");
    assert_eq!(costs(&["-j", "100"]), "1|0.0540\n2|0.0240\n");
    assert_eq!(costs(&["--jobs", "200,100", "-u", "bob"]), "2|0.0240\n");
    // Carol's lease is all in 2023: in the day, nothing.
    assert_eq!(costs(&["-u", "carol"]), "");

    // Edges: a snapshot at the start is the start's totals, one at the
    // end counts in the period.
    let cut = |s: &str, e: &str| {
        db.ok(&[
            "-S",
            s,
            "-E",
            e,
            "--by",
            "lease",
            "-Pn",
            "-o",
            "Lease,AllocGiBSec",
        ])
    };
    assert_eq!(
        cut("2024-01-01T12:00", "2024-01-02T12:00"),
        "1|20.000\n2|8.000\n"
    );
    assert_eq!(
        cut("2024-01-01T11:59:59", "2024-01-02T12:00"),
        "1|30.000\n2|8.000\n"
    );
    assert_eq!(cut("2024-01-01T12:00", "2024-01-02T11:59:59"), "2|8.000\n");
    // Periods between snapshots see nothing: edges are as fine as the
    // snapshots.
    assert_eq!(cut("2024-01-02T13:00", "2024-01-02T17:00"), "");
    // Up to now: the current totals stand in for the end; lease 1 flushed
    // 10 GiB-s after its last snapshot, leases 2 and 3 nothing since the
    // start, lease 5 (flushed "now") all of it.
    assert_eq!(
        db.ok(&[
            "-S",
            "2024-01-03",
            "-E",
            "now",
            "--by",
            "lease",
            "-Pn",
            "-o",
            "Lease,AllocGiBSec,ComputeSec,Invocations,Cost"
        ]),
        "1|10.000|1.000|5|0.0220\n5|1.000|0.000|1|0.0010\n"
    );
    // All time, each lease's whole usage; an end in the future is "now".
    assert_eq!(
        db.ok(&[
            "-S",
            "2023-01-01",
            "-E",
            "now+1days",
            "--by",
            "lease",
            "-Pn",
            "-o",
            "Lease,Cost"
        ]),
        "1|0.1080\n2|0.0240\n3|0.0390\n4|0.0110\n5|0.0010\n"
    );
    // The defaults: from 00:00 today to now, by account; with -j, from
    // the beginning.
    let today = db.ok(&["-P"]);
    assert_eq!(
        today,
        "Account|AllocGiBSec|ComputeSec|HotPollSec|Invocations|BytesIn|BytesOut|Cost\n\
         bio|1.000|0.000|0.000|1|0|0|0.0010\n"
    );
    assert_eq!(
        db.ok(&["-j", "200", "-Pn", "-o", "Account,Cost"]),
        "chem|0.0110\n"
    );

    // Times are local: in UTC+2 (POSIX writes it UTC-2), the same day is
    // 02:00 to 02:00.
    let config = db.config();
    let common = db.common(&config);
    let o = billing(
        &common,
        &[
            "-S",
            "2024-01-02T02:00",
            "-E",
            "2024-01-03T02:00:00",
            "--json",
        ],
        "UTC-2",
    );
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {o:?}"));
    assert_eq!(v["start"], "2024-01-02T02:00:00+02:00", "{v}");
    assert_eq!(v["rows"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["rows"][1]["alloc_gib_s"], 28.0, "{v}");
    let o = billing(&common, &DAY2, "UTC-2");
    assert!(
        stdout(&o).starts_with("Usage by account, 2024-01-02T00:00:00 - 2024-01-03T00:00:00"),
        "{}",
        stdout(&o)
    );

    // The database may come from billing.toml (--database alone: the
    // configured one; without it reports ask the manager).
    let config = db.file(
        "with-db.toml",
        &format!("database = \"{}\"\n{RATES}", db.url),
    );
    let o = billing(
        &["--config", config.to_str().unwrap(), "--database"],
        &with(&DAY2, &["-Pn", "-o", "Account"]),
        "UTC",
    );
    assert_eq!(stdout(&o), "chem\nphysics\n", "{}", stderr(&o));
}
on_both!(groupings_filters_and_periods);

fn errors_say_what_to_do(kind: &str) {
    let db = seeded(kind);
    for bad in [
        "2024-02-30",
        "yesterday",
        "now-3fortnights",
        "2024-01-02 10:00",
    ] {
        let e = db.fails(2, &["-S", bad]);
        assert!(
            e.contains("--starttime") && e.contains(bad) && e.contains("YYYY-MM-DDTHH:MM:SS"),
            "{e}"
        );
    }
    let e = db.fails(2, &["-E", "2024-13-01"]);
    assert!(e.contains("--endtime") && e.contains("month 13"), "{e}");
    let e = db.fails(2, &["-S", "2024-01-03", "-E", "2024-01-02"]);
    assert!(e.contains("the period is empty"), "{e}");

    let e = db.fails(4, &with(&DAY2, &["-u", "alice,mallory"]));
    assert!(e.contains("user \"mallory\"") && e.contains("-u"), "{e}");
    let e = db.fails(4, &["-A", "phyiscs"]);
    assert!(e.contains("account \"phyiscs\""), "{e}");
    let e = db.fails(4, &["-j", "999"]);
    assert!(e.contains("job 999"), "{e}");

    let e = db.fails(2, &["--format", "Account,CPUTime"]);
    assert!(
        e.contains("\"CPUTime\"") && e.contains("Account,JobID,Node"),
        "{e}"
    );
    let e = db.fails(2, &["--by", "account", "--format", "User"]);
    assert!(e.contains("add user to --by"), "{e}");
    let e = db.fails(2, &["--by", "project"]);
    assert!(e.contains("\"project\""), "{e}");
    // clap's own: exit 2 too.
    db.fails(2, &["-j", "abc"]);
    db.fails(2, &["--csv", "--json"]);

    let bad = db.file("bad.toml", &format!("{RATES}computeper_s = 1.0\n"));
    let o = billing(&db.common(&bad), &[], "UTC");
    let e = failed(3, &o);
    assert!(e.contains("computeper_s") && e.contains("bad.toml"), "{e}");
    let missing = db.dir.join("missing.toml");
    let o = billing(&db.common(&missing), &[], "UTC");
    let e = failed(3, &o);
    assert!(e.contains("missing.toml") && e.contains("--config"), "{e}");

    // Unreachable databases: a closed port, a missing file.
    let config = db.config();
    let closed = "postgres://rfaas@127.0.0.1:1/rfaas";
    let o = billing(
        &["--database", closed, "--config", config.to_str().unwrap()],
        &[],
        "UTC",
    );
    let e = failed(5, &o);
    assert!(e.contains(closed), "{e}");
    assert!(e.contains("refused") && e.contains("--database"), "{e}");
    // A password on the command line, which every user could read: refused
    // before anything is tried, and not repeated.
    let o = billing(
        &[
            "--database",
            "postgres://rfaas:secret@127.0.0.1:1/rfaas",
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
        "UTC",
    );
    let e = failed(2, &o);
    assert!(e.contains("postgres://rfaas:***@127.0.0.1:1/rfaas"), "{e}");
    assert!(
        !e.contains("secret") && e.contains("database_password_file"),
        "{e}"
    );
    let gone = format!("sqlite://{}", db.dir.join("gone.db").display());
    let o = billing(
        &["--database", &gone, "--config", config.to_str().unwrap()],
        &[],
        "UTC",
    );
    let e = failed(5, &o);
    assert!(e.contains("gone.db does not exist"), "{e}");
    assert!(!db.dir.join("gone.db").exists(), "a report made a database");
}
on_both!(errors_say_what_to_do);

fn budgets(kind: &str) {
    let db = seeded(kind);
    db.exec(
        "INSERT INTO account_spend (account, spend, updated_ms) VALUES ('physics', 0.078, 1);
         INSERT INTO account_spend (account, spend, updated_ms) VALUES ('chem', 0.5, 1)",
    );
    assert_eq!(
        db.ok(&["budget", "set", "physics", "0.05"]),
        "account physics: budget 0.0500 CHF (was none)\n"
    );
    assert_eq!(
        db.ok(&["budget", "set", "physics", "0.06"]),
        "account physics: budget 0.0600 CHF (was 0.0500 CHF)\n"
    );
    assert_eq!(
        db.ok(&["budget", "list"]),
        "Budgets and spend in CHF\n\
         Account  Budget   Spend  Remaining\n\
         chem          -  0.5000          -\n\
         physics  0.0600  0.0780    -0.0180\n"
    );
    assert_eq!(
        db.ok(&["budget", "list", "-P"]),
        "Account|Budget|Spend|Remaining\nchem||0.5000|\nphysics|0.0600|0.0780|-0.0180\n"
    );
    assert_eq!(
        db.ok(&["budget", "list", "--csv", "-n", "-A", "physics"]),
        "physics,0.0600,0.0780,-0.0180\n"
    );
    let v: Value = serde_json::from_str(&db.ok(&["budget", "list", "--json"])).unwrap();
    assert_eq!(v["currency"], "CHF");
    assert_eq!(
        v["rows"][0],
        json!({"account": "chem", "budget": null, "spend": 0.5, "remaining": null})
    );
    assert_eq!(v["rows"][1]["budget"], 0.06);
    // What the manager reads.
    let budget: f64 = db.runtime.block_on(async {
        sqlx::query_scalar("SELECT budget FROM budgets WHERE account = 'physics'")
            .fetch_one(db.pool.as_ref().unwrap())
            .await
            .unwrap()
    });
    assert_eq!(budget, 0.06);

    // An account no lease has used yet may get a budget, with a note.
    let o = db.run(&["budget", "set", "newlab", "10"]);
    assert!(o.status.success());
    assert_eq!(
        stdout(&o),
        "account newlab: budget 10.0000 CHF (was none)\n"
    );
    assert!(stderr(&o).contains("note: no lease"), "{}", stderr(&o));
    let o = db.run(&["budget", "set", "physics", "0.06"]);
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));

    assert_eq!(
        db.ok(&["budget", "clear", "physics"]),
        "account physics: no budget (was 0.0600 CHF)\n"
    );
    let e = db.fails(4, &["budget", "clear", "physics"]);
    assert!(
        e.contains("\"physics\" has no budget") && e.contains("budget list"),
        "{e}"
    );
    for bad in ["nan", "inf"] {
        let e = db.fails(2, &["budget", "set", "physics", bad]);
        assert!(e.contains("0 or more"), "{e}");
    }
    db.fails(2, &["budget", "set", "physics", "-1"]);
    let e = db.fails(2, &["-S", "today", "budget", "list"]);
    assert!(e.contains("--starttime is an option of reports"), "{e}");
    db.fails(2, &["budget", "set", "physics", "lots"]);

    // sync writes billing.toml's budgets, leaving others alone.
    let config = db.file(
        "budgets.toml",
        &format!("{RATES}[budgets]\nchem = 2.5\nnewlab = 10.0\n"),
    );
    let sync = |config: &Path| billing(&db.common(config), &["budget", "sync"], "UTC");
    let o = sync(&config);
    assert_eq!(
        stdout(&o),
        "account chem: budget 2.5000 CHF (was none)\n\
         account newlab: budget 10.0000 CHF (unchanged)\n",
        "{}",
        stderr(&o)
    );
    db.ok(&["budget", "set", "physics", "1"]);
    assert_eq!(
        db.ok(&["budget", "list", "-Pn"]),
        "chem|2.5000|0.5000|2.0000\nnewlab|10.0000|0.0000|10.0000\nphysics|1.0000|0.0780|0.9220\n"
    );
    let o = sync(&db.config());
    assert_eq!(
        stdout(&o),
        format!(
            "{} has no [budgets]; nothing to write\n",
            db.config().display()
        )
    );
    let e = failed(3, &sync(&db.dir.join("missing.toml")));
    assert!(e.contains("missing.toml"), "{e}");
}
on_both!(budgets);

/// rfaas-billing with nothing but `RFAAS_CONFIG_DIR` = `dir`.
fn billing_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rfaas-billing"))
        .env("TZ", "UTC")
        .env("RFAAS_CONFIG_DIR", dir)
        .args(args)
        .output()
        .expect("rfaas-billing runs")
}

#[test]
fn rates_and_the_database_come_from_the_configuration_directory() {
    let db = Db::new("sqlite");
    db.file("billing.toml", RATES);
    // On an accounting host: the accounting service's database.
    db.file("accounting.toml", &format!("database = \"{}\"\n", db.url));
    let o = billing_in(&db.dir, &["budget", "set", "physics", "0.05"]);
    assert_eq!(
        stdout(&o),
        "account physics: budget 0.0500 CHF (was none)\n",
        "{}",
        stderr(&o)
    );
    // On a manager host: the manager's.
    std::fs::remove_file(db.dir.join("accounting.toml")).unwrap();
    db.file("manager.toml", &format!("database = \"{}\"\n", db.url));
    let o = billing_in(&db.dir, &["budget", "list", "-P", "-n"]);
    assert_eq!(
        stdout(&o),
        "physics|0.0500|0.0000|0.0500\n",
        "{}",
        stderr(&o)
    );
    // --config-dir beats the variable.
    let o = Command::new(env!("CARGO_BIN_EXE_rfaas-billing"))
        .env("RFAAS_CONFIG_DIR", "/nonexistent")
        .arg("--config-dir")
        .arg(&db.dir)
        .args(["budget", "list", "-P", "-n"])
        .output()
        .unwrap();
    assert_eq!(
        stdout(&o),
        "physics|0.0500|0.0000|0.0500\n",
        "{}",
        stderr(&o)
    );

    // Without billing.toml, what moves it is named.
    std::fs::remove_file(db.dir.join("billing.toml")).unwrap();
    let o = billing_in(&db.dir, &["budget", "sync"]);
    let err = failed(3, &o);
    for words in [
        &format!(
            "cannot read the billing configuration {}",
            db.dir.join("billing.toml").display()
        ),
        "--config",
        &format!(
            "the configuration directory {} was set by RFAAS_CONFIG_DIR",
            db.dir.display()
        ),
    ] {
        assert!(err.contains(words), "{words:?} missing: {err}");
    }
}
