//! `rfaas-billing` through the manager's `GET /v1/usage`, with the
//! caller's credential and no database password: a user sees their own
//! leases and those of the accounts they belong to, nobody else's; the
//! admin token sees all, printed exactly as a report from the database;
//! a coordinator of an account in Slurm's accounting database (a real
//! slurmdbd) sees its leases and its sub-accounts', whoever held them.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::Env;
use rfaas_testkit::slurm::{SlurmCluster, SlurmOptions};
use rfaas_testkit::wait::{poll_for, TIMEOUT};
use rfaas_testkit::{on_both, output_text, TempDir};

const RATES: &str = "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.001\ncompute_per_s = 0.01\nhot_per_s = 0.002\nharvested_discount = 0.5\n";

/// Lease `id` of `user` in `account` that used `compute_s` of compute,
/// flushed now.
fn lease(env: &Env, id: i64, user: &str, account: &str, compute_s: i64) {
    let now = rfaas_service::now_ms() as i64;
    env.block(async {
        sqlx::query(
            "INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, ended_ms, harvested)
             VALUES ($1, $1, 'n1', $2, $3, $4, 1, 1024, $5, $6, 'active', 0, 0)",
        )
        .bind(id)
        .bind(format!("user:{user}"))
        .bind(user)
        .bind(account)
        .bind(now / 1000)
        .bind(now / 1000 + 3600)
        .execute(env.pool())
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO usage (lease_id, instance, slot, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out, finalized, first_ms, updated_ms)
             VALUES ($1, 'acct-1', $1, 1024000, $2, 0, 0, $1, 10, 20, 0, $3, $3)",
        )
        .bind(id)
        .bind(compute_s * 1_000_000_000)
        .bind(now)
        .execute(env.pool())
        .await
        .unwrap();
    });
}

/// `rfaas-billing` on a login node: a configuration directory with no
/// database password, asking `env`'s manager.
struct Billing {
    dir: TempDir,
    config: PathBuf,
    manager: String,
}

impl Billing {
    fn new(env: &Env) -> Billing {
        let dir = TempDir::new("rfaas-billing-api");
        let config = dir.join("billing.toml");
        std::fs::write(&config, RATES).unwrap();
        Billing {
            dir,
            config,
            manager: env.manager.url().to_owned(),
        }
    }

    /// `rfaas-billing args` with `credential`, to its end.
    fn run(&self, credential: &str, args: &[&str]) -> Output {
        Command::new(rfaas_testkit::accounting::billing_binary())
            .env("TZ", "UTC")
            .env("RFAAS_CONFIG_DIR", self.dir.path())
            .env("RFAAS_MANAGERS", &self.manager)
            .env("RFAAS_CREDENTIAL", credential)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .expect("rfaas-billing runs")
    }

    /// Its standard output; it must succeed.
    fn ok(&self, credential: &str, args: &[&str]) -> String {
        let o = self.run(credential, args);
        assert!(o.status.success(), "{args:?}: {}", output_text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

/// One line per lease: `lease|user|account`.
const BY_LEASE: [&str; 6] = ["--by", "lease", "-o", "Lease,User,Account", "-P", "-n"];

fn users_see_their_own_and_their_accounts_usage(kind: &str) {
    let env = Env::new(kind);
    // alice: physics; bob: physics and chem; carol: bio.
    lease(&env, 1, "alice", "physics", 1);
    lease(&env, 2, "bob", "physics", 2);
    lease(&env, 3, "bob", "chem", 3);
    lease(&env, 4, "carol", "bio", 4);
    let b = Billing::new(&env);
    let config = &b.config;
    let billing = |credential: &str, args: &[&str]| b.run(credential, args);
    let ok = |credential: &str, args: &[&str]| b.ok(credential, args);
    let by_lease = BY_LEASE;

    let alice = env.manager.credential("user", "alice", Some("physics"));
    assert_eq!(
        ok(&alice, &by_lease),
        "1|alice|physics\n2|bob|physics\n",
        "alice sees physics, not chem nor bio"
    );
    // Asking for another's account gives nothing, not their usage.
    assert_eq!(ok(&alice, &["-A", "bio", "-P", "-n"]), "");
    assert_eq!(
        ok(
            &alice,
            &["-u", "bob", "--by", "lease", "-o", "Lease", "-P", "-n"]
        ),
        "2\n"
    );
    let bob = env.manager.credential("user", "bob", Some("chem"));
    assert_eq!(
        ok(&bob, &by_lease),
        "1|alice|physics\n2|bob|physics\n3|bob|chem\n"
    );
    let carol = env.manager.credential("user", "carol", Some("bio"));
    assert_eq!(ok(&carol, &by_lease), "4|carol|bio\n");
    // A new user with a credential in an account that has no lease yet:
    // nothing.
    let dave = env.manager.credential("user", "dave", Some("astro"));
    assert_eq!(ok(&dave, &by_lease), "");

    // The admin sees all, exactly as a report from the database prints it.
    let admin = env.manager.admin_token().to_owned();
    for format in [&["-P"][..], &["--csv"], &["--json"], &[]] {
        let args: Vec<&str> = [
            "--by",
            "account,user",
            "-S",
            "2024-01-01",
            "-E",
            "2099-01-01",
        ]
        .into_iter()
        .chain(format.iter().copied())
        .collect();
        let from_api = ok(&admin, &args);
        // The test's URL may carry a password, refused on a command line:
        // an admin's billing.toml names the database instead.
        std::fs::write(config, format!("database = \"{}\"\n{RATES}", env.url)).unwrap();
        let mut db_args = args.clone();
        db_args.push("--database");
        let from_db = ok("", &db_args);
        std::fs::write(config, RATES).unwrap();
        assert_eq!(from_api, from_db, "{format:?}");
        assert!(
            from_api.contains("carol") && from_api.contains("alice"),
            "{from_api}"
        );
    }
    // An admin's filter naming nobody is refused as from the database.
    let o = billing(&admin, &["-u", "nobody"]);
    assert_eq!(o.status.code(), Some(4), "{}", output_text(&o));

    // A node credential, a made-up one, none: refused.
    let node = env.node_credential("n1");
    let o = billing(&node, &["-P"]);
    assert_eq!(o.status.code(), Some(6), "{}", output_text(&o));
    let o = billing("made-up.credential", &["-P"]);
    assert_eq!(o.status.code(), Some(6), "{}", output_text(&o));
    let o = billing("", &["-P"]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("RFAAS_CREDENTIAL"),
        "{}",
        output_text(&o)
    );
}
on_both!(users_see_their_own_and_their_accounts_usage);

/// Slurm's accounting database says who coordinates which account: with
/// `[slurm] coordinators = true` the manager asks it (sacctmgr, against a
/// real slurmdbd), and a coordinator sees every lease charged to their
/// accounts and the accounts below them, not others; members see what
/// they saw before; a slurmdbd that cannot answer takes coordinator
/// rights away, nothing else.
fn coordinators_see_their_accounts_usage(kind: &str) {
    let mut cluster = SlurmCluster::start(SlurmOptions {
        nodes: 1,
        accounting: true,
        ..SlurmOptions::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // physics, theory below it, chem beside it; dave coordinates physics
    // (so theory too) and runs his own jobs in staff.
    for args in [
        &["add", "account", "physics,chem,staff"][..],
        &["add", "account", "theory", "parent=physics"],
        &["add", "user", "alice", "account=physics"],
        &["add", "user", "erin", "account=theory"],
        &["add", "user", "bob", "account=chem"],
        &["add", "user", "dave", "account=staff"],
        &["add", "coordinator", "account=physics", "names=dave"],
    ] {
        cluster.sacctmgr(args).unwrap_or_else(|e| panic!("{e}"));
    }
    let env = Env::with_manager_config(
        kind,
        &format!(
            "[slurm]\nconf = {:?}\ncoordinators = true\ncache_ms = 100\ntimeout_ms = 20000\n",
            cluster.conf()
        ),
    );
    lease(&env, 1, "alice", "physics", 1);
    lease(&env, 2, "erin", "theory", 2);
    lease(&env, 3, "bob", "chem", 3);
    lease(&env, 4, "dave", "staff", 4);
    let b = Billing::new(&env);

    let dave = env.manager.credential("user", "dave", Some("staff"));
    assert_eq!(
        b.ok(&dave, &BY_LEASE),
        "1|alice|physics\n2|erin|theory\n4|dave|staff\n",
        "dave coordinates physics and, below it, theory; not chem"
    );
    assert_eq!(b.ok(&dave, &["-A", "chem", "-P", "-n"]), "");
    // A member sees what they saw before: their account, not the one
    // below it, nor the coordinator's.
    let alice = env.manager.credential("user", "alice", Some("physics"));
    assert_eq!(b.ok(&alice, &BY_LEASE), "1|alice|physics\n");
    let erin = env.manager.credential("user", "erin", Some("theory"));
    assert_eq!(b.ok(&erin, &BY_LEASE), "2|erin|theory\n");

    // Once Slurm no longer names dave a coordinator, he sees his own.
    cluster
        .sacctmgr(&["delete", "coordinator", "account=physics", "names=dave"])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut last = String::new();
    poll_for(TIMEOUT, || {
        last = b.ok(&dave, &BY_LEASE);
        (last == "4|dave|staff\n").then_some(())
    })
    .unwrap_or_else(|| panic!("dave still sees {last:?} after losing coordination"));

    // Made a coordinator again, then slurmdbd is gone: requests are
    // answered without coordinator rights, a warning says why.
    cluster
        .sacctmgr(&["add", "coordinator", "account=chem", "names=dave"])
        .unwrap_or_else(|e| panic!("{e}"));
    poll_for(TIMEOUT, || {
        last = b.ok(&dave, &BY_LEASE);
        (last == "3|bob|chem\n4|dave|staff\n").then_some(())
    })
    .unwrap_or_else(|| panic!("dave sees {last:?}, not chem, as its coordinator"));
    // Its daemons stop; its slurm.conf stays, so sacctmgr fails at once.
    cluster.stop().unwrap_or_else(|e| panic!("{e}"));
    poll_for(TIMEOUT, || {
        last = b.ok(&dave, &BY_LEASE);
        (last == "4|dave|staff\n").then_some(())
    })
    .unwrap_or_else(|| panic!("dave still sees {last:?} with slurmdbd gone"));
    assert_eq!(b.ok(&alice, &BY_LEASE), "1|alice|physics\n");
    let log = env.manager.log();
    assert!(
        log.contains("without coordinator rights"),
        "no warning in the manager's log: {log}"
    );
}
on_both!(coordinators_see_their_accounts_usage);
