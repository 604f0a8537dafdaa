//! Least privilege in the database: only the manager changes the schema;
//! the accounting service and `rfaas-billing` refuse one it has not made
//! current. On PostgreSQL each runs as its own role (`rfaas-manager
//! db-roles`), which cannot do what the others do, with its password from
//! a private file and never on a command line or in a log.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use rfaas_testkit::accounting::{billing_binary, Accounting, AccountingOptions};
use rfaas_testkit::manager::{manager_binary, Manager, ManagerOptions};
use rfaas_testkit::postgres::Postgres;
use rfaas_testkit::{on_both, output_text, TempDir};

const RATES: &str = "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.001\ncompute_per_s = 0.01\nhot_per_s = 0.002\nharvested_discount = 0.5\n";

/// Writes `text` to `path` with `mode`.
fn write(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A PostgreSQL URL for `user` on `pg`'s database, without a password.
fn role_url(pg: &Postgres, user: &str) -> String {
    let mut url = url::Url::parse(pg.url()).unwrap();
    url.set_username(user).unwrap();
    url.set_password(None).unwrap();
    url.into()
}

/// `rfaas-manager` with `args` on the configuration `config`.
fn manager(config: &Path, args: &[&str]) -> Output {
    Command::new(manager_binary())
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("rfaas-manager runs")
}

/// `rfaas-billing` with the billing configuration `config` and `args`,
/// on the database it names.
fn billing(config: &Path, args: &[&str]) -> Output {
    Command::new(billing_binary())
        .env("TZ", "UTC")
        .arg("--database")
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("rfaas-billing runs")
}

/// Whether the database at `url` has any rfaas table, read with psql
/// (PostgreSQL) or by the file's size (SQLite: an empty file has none).
fn has_schema(pg: Option<&Postgres>, url: &str) -> bool {
    match pg {
        Some(pg) => {
            pg.psql("SELECT to_regclass('public.rfaas_migrations') IS NOT NULL")
                .unwrap()
                .trim()
                == "t"
        }
        None => {
            let file = rfaas_service::db::sqlite_file(url).unwrap();
            std::fs::metadata(file).is_ok_and(|m| m.len() > 0)
        }
    }
}

/// The accounting service and reports find a database no manager has
/// migrated and refuse it, saying to run `rfaas-manager migrate`, without
/// touching it; after `rfaas-manager migrate` both run. A SQLite file the
/// manager makes is its owner's only.
fn only_the_manager_migrates(kind: &str) {
    let dir = TempDir::new("rfaas-migrate");
    let pg = (kind == "postgres").then(|| Postgres::start().unwrap_or_else(|e| panic!("{e}")));
    let (url, password_line) = match &pg {
        Some(pg) => {
            let password = url::Url::parse(pg.url())
                .unwrap()
                .password()
                .unwrap()
                .to_owned();
            let file = dir.join("postgres.password");
            write(&file, &format!("{password}\n"), 0o600);
            (
                role_url(pg, "postgres"),
                format!("database_password_file = \"{}\"\n", file.display()),
            )
        }
        None => (
            format!("sqlite://{}", dir.join("m.db").display()),
            String::new(),
        ),
    };
    let billing_toml = dir.join("billing.toml");
    write(
        &billing_toml,
        &format!("database = \"{url}\"\n{password_line}{RATES}"),
        0o644,
    );

    // The accounting service on a database without the schema: refused.
    let e = Accounting::try_start(
        &rfaas_testkit::accounting::accounting_binary(),
        AccountingOptions {
            extra_config: password_line.clone(),
            ..AccountingOptions::new(&url)
        },
    )
    .expect_err("the accounting service started on a database without its schema");
    assert!(e.contains("rfaas-manager migrate"), "{e}");
    assert!(
        !has_schema(pg.as_ref(), &url),
        "the accounting service migrated"
    );

    // A report, on an existing but empty SQLite file too.
    if pg.is_none() {
        write(&dir.join("m.db"), "", 0o600);
    }
    let o = billing(&billing_toml, &["-P"]);
    assert_eq!(o.status.code(), Some(5), "{}", output_text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("rfaas-manager migrate"), "{e}");
    assert!(!has_schema(pg.as_ref(), &url), "a report migrated");
    if pg.is_none() {
        std::fs::remove_file(dir.join("m.db")).unwrap();
    }

    // The manager migrates.
    let manager_toml = dir.join("manager.toml");
    write(
        &manager_toml,
        &format!("database = \"{url}\"\n{password_line}"),
        0o644,
    );
    let o = manager(&manager_toml, &["migrate"]);
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(has_schema(pg.as_ref(), &url));
    if pg.is_none() {
        let mode = std::fs::metadata(dir.join("m.db"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the SQLite file has mode {mode:o}");
    }

    // Then both run.
    let o = billing(&billing_toml, &["-P"]);
    assert!(o.status.success(), "{}", output_text(&o));
    let _acct = Accounting::start(AccountingOptions {
        extra_config: password_line,
        ..AccountingOptions::new(&url)
    });
}
on_both!(only_the_manager_migrates);

/// Runs `sql` on `url` and returns PostgreSQL's error code, if any.
fn sql_code(rt: &tokio::runtime::Runtime, url: &str, sql: &str) -> Option<String> {
    rt.block_on(async {
        use sqlx::Connection;
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(url).await.unwrap();
        let code = match sqlx::query(sql).execute(&mut conn).await {
            Ok(_) => None,
            Err(sqlx::Error::Database(d)) => Some(d.code().unwrap_or_default().into_owned()),
            Err(e) => panic!("{sql}: {e}"),
        };
        let _ = conn.close().await;
        code
    })
}

/// A role's URL with `password`, for the test's own connections.
fn with_password(url: &str, password: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_password(Some(password)).unwrap();
    u.into()
}

/// The manager, the accounting service and reports, each as its own role
/// from `rfaas-manager db-roles`, with its password in its own file: each
/// runs, and none can do what only another may.
#[test]
fn each_component_runs_with_its_own_role() {
    let dir = TempDir::new("rfaas-roles");
    let pg = Postgres::start().unwrap_or_else(|e| panic!("{e}"));
    let roles_sql = |config: &Path| {
        let o = manager(config, &["db-roles"]);
        assert!(o.status.success(), "{}", output_text(&o));
        pg.psql(&String::from_utf8_lossy(&o.stdout))
            .unwrap_or_else(|e| panic!("{e}"));
    };
    let empty = dir.join("empty.toml");
    write(&empty, "", 0o644);
    roles_sql(&empty);
    let mut passwords = Vec::new();
    let mut config_of = std::collections::HashMap::new();
    for role in ["rfaas_manager", "rfaas_accounting", "rfaas_report"] {
        let password = format!("pw-{role}-{}", fastrand::u64(..));
        pg.psql(&format!("ALTER ROLE {role} PASSWORD '{password}'"))
            .unwrap();
        let file = dir.join(&format!("{role}.password"));
        write(&file, &format!("{password}\n"), 0o600);
        let url = role_url(&pg, role);
        config_of.insert(
            role,
            (
                url.clone(),
                format!(
                    "database = \"{url}\"\ndatabase_password_file = \"{}\"\n",
                    file.display()
                ),
                with_password(&url, &password),
            ),
        );
        passwords.push(password);
    }
    let (manager_url, manager_db, _) = config_of["rfaas_manager"].clone();
    let (accounting_url, accounting_db, accounting_conn) = config_of["rfaas_accounting"].clone();
    let (_, report_db, report_conn) = config_of["rfaas_report"].clone();

    // The manager's role migrates, and the tables it made get their grants.
    let manager_toml = dir.join("manager.toml");
    write(&manager_toml, &manager_db, 0o644);
    let o = manager(&manager_toml, &["migrate"]);
    assert!(o.status.success(), "{}", output_text(&o));
    roles_sql(&empty);
    let steps = pg.psql("SELECT COUNT(*) FROM rfaas_migrations").unwrap();

    // Each component runs with its own role.
    let mut opts = ManagerOptions {
        database: Some(manager_url),
        ..ManagerOptions::default()
    };
    opts.extra_config
        .push_str(manager_db.lines().nth(1).unwrap());
    opts.extra_config.push('\n');
    let mngr = Manager::start(opts);
    let acct = Accounting::start(AccountingOptions {
        extra_config: accounting_db.lines().nth(1).unwrap().to_owned(),
        ..AccountingOptions::new(&accounting_url)
    });
    assert_eq!(
        pg.psql(&format!(
            "SELECT COUNT(*) FROM accounting_instances WHERE name = '{}'",
            acct.name()
        ))
        .unwrap()
        .trim(),
        "1"
    );
    let billing_toml = dir.join("billing.toml");
    write(&billing_toml, &format!("{report_db}{RATES}"), 0o644);
    let o = billing(&billing_toml, &["-P", "-S", "2024-01-01"]);
    assert!(o.status.success(), "{}", output_text(&o));
    let o = billing(&billing_toml, &["budget", "list", "-P"]);
    assert!(o.status.success(), "{}", output_text(&o));

    // What each role may not do.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let denied = Some("42501".to_owned());
    for (url, sql) in [
        (&report_conn, "UPDATE budgets SET budget = 0"),
        (
            &report_conn,
            "INSERT INTO budgets (account, budget, updated_ms) VALUES ('x', 1, 1)",
        ),
        (&report_conn, "INSERT INTO credentials (id) VALUES ('x')"),
        (&report_conn, "SELECT * FROM credentials"),
        (&report_conn, "UPDATE usage SET compute_ns = 0"),
        (&report_conn, "CREATE TABLE report_made (x BIGINT)"),
        (
            &accounting_conn,
            "INSERT INTO credentials (id) VALUES ('x')",
        ),
        (&accounting_conn, "UPDATE leases SET state = 'released'"),
        (&accounting_conn, "UPDATE budgets SET budget = 0"),
        (&accounting_conn, "SELECT * FROM budgets"),
        (&accounting_conn, "DELETE FROM nodes"),
        (&accounting_conn, "UPDATE credentials SET revoked = 0"),
        (&accounting_conn, "CREATE TABLE accounting_made (x BIGINT)"),
    ] {
        assert_eq!(sql_code(&rt, url, sql), denied, "{url}: {sql}");
    }
    // ... and what they need.
    for (url, sql) in [
        (&report_conn, "SELECT COUNT(*) FROM usage_snapshots"),
        (&report_conn, "SELECT COUNT(*) FROM leases"),
        (&accounting_conn, "SELECT COUNT(*) FROM credentials"),
        (&accounting_conn, "UPDATE usage SET compute_ns = compute_ns"),
    ] {
        assert_eq!(sql_code(&rt, url, sql), None, "{url}: {sql}");
    }
    // Reports wrote nothing, the schema least of all; budgets are the
    // admin's.
    let o = billing(&billing_toml, &["budget", "set", "physics", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("permission denied"),
        "{}",
        output_text(&o)
    );
    assert_eq!(
        pg.psql("SELECT COUNT(*) FROM rfaas_migrations").unwrap(),
        steps
    );

    // A password file others may read is refused, naming the fix.
    let report_file = dir.join("rfaas_report.password");
    std::fs::set_permissions(&report_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = billing(&billing_toml, &["-P"]);
    assert_eq!(o.status.code(), Some(3), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("chmod 600"),
        "{}",
        output_text(&o)
    );
    // A wrong password fails without being repeated.
    write(&report_file, "wrong-password-x\n", 0o600);
    let o = billing(&billing_toml, &["-P"]);
    assert_eq!(o.status.code(), Some(5), "{}", output_text(&o));
    assert!(
        !output_text(&o).contains("wrong-password-x"),
        "{}",
        output_text(&o)
    );

    // No password in a log.
    let logs = [mngr.log(), acct.log()];
    for password in &passwords {
        for log in &logs {
            assert!(!log.contains(password.as_str()), "{log}");
        }
    }
}
