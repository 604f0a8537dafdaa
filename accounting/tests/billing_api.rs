//! `rfaas-billing` through the manager's `GET /v1/usage`, with the
//! caller's credential and no database password: a user sees their own
//! leases and those of the accounts they belong to, nobody else's; the
//! admin token sees all, printed exactly as a report from the database.

mod common;

use std::process::{Command, Output};

use common::Env;
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

fn users_see_their_own_and_their_accounts_usage(kind: &str) {
    let env = Env::new(kind);
    // alice: physics; bob: physics and chem; carol: bio.
    lease(&env, 1, "alice", "physics", 1);
    lease(&env, 2, "bob", "physics", 2);
    lease(&env, 3, "bob", "chem", 3);
    lease(&env, 4, "carol", "bio", 4);
    let dir = TempDir::new("rfaas-billing-api");
    let config = dir.join("billing.toml");
    std::fs::write(&config, RATES).unwrap();
    // A directory with no database password: a login node's.
    let billing = |credential: &str, args: &[&str]| -> Output {
        Command::new(rfaas_testkit::accounting::billing_binary())
            .env("TZ", "UTC")
            .env("RFAAS_CONFIG_DIR", dir.path())
            .env("RFAAS_MANAGERS", env.manager.url())
            .env("RFAAS_CREDENTIAL", credential)
            .arg("--config")
            .arg(&config)
            .args(args)
            .output()
            .expect("rfaas-billing runs")
    };
    let ok = |credential: &str, args: &[&str]| -> String {
        let o = billing(credential, args);
        assert!(o.status.success(), "{args:?}: {}", output_text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let by_lease = ["--by", "lease", "-o", "Lease,User,Account", "-P", "-n"];

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
        std::fs::write(&config, format!("database = \"{}\"\n{RATES}", env.url)).unwrap();
        let mut db_args = args.clone();
        db_args.push("--database");
        let from_db = ok("", &db_args);
        std::fs::write(&config, RATES).unwrap();
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
