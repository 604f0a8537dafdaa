//! The migrations against real databases: a database made by the runner
//! before the migration files upgrades in place, keeping every row, to the
//! schema a fresh database gets; either process may open it first.

use rfaas_testkit::postgres::Postgres;
use rstest::rstest;
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Row};

/// What the former runner left at its last step, with rows in every table.
const LEGACY: &str = include_str!("fixtures/schema-step6.sql");

/// Two empty databases of `kind`: one to age, one to make fresh.
struct Dbs {
    legacy: String,
    fresh: String,
    _dir: Option<tempdir::Dir>,
    _pg: Option<Postgres>,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn databases(kind: &str) -> Dbs {
    match kind {
        "sqlite" => {
            let dir = std::env::temp_dir().join(format!(
                "rfaas-schema-{}-{}",
                std::process::id(),
                fastrand::u64(..)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Dbs {
                legacy: format!("sqlite://{}", dir.join("legacy.db").display()),
                fresh: format!("sqlite://{}", dir.join("fresh.db").display()),
                _dir: Some(tempdir::Dir(dir)),
                _pg: None,
            }
        }
        _ => {
            let pg = Postgres::start().unwrap_or_else(|e| panic!("{e}"));
            pg.psql("CREATE DATABASE fresh").unwrap();
            let legacy = pg.url().to_owned();
            let (base, _) = legacy.rsplit_once('/').unwrap();
            Dbs {
                fresh: format!("{base}/fresh"),
                legacy,
                _dir: None,
                _pg: Some(pg),
            }
        }
    }
}

async fn raw_pool(url: &str) -> AnyPool {
    sqlx::any::install_default_drivers();
    let url = if url.starts_with("sqlite:") {
        format!("{url}?mode=rwc")
    } else {
        url.to_owned()
    };
    AnyPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap()
}

/// Every table's columns (name, type, nullable), in order, and its row
/// count, leaving out the runners' own records.
async fn shape(pool: &AnyPool, sqlite: bool) -> Vec<(String, Vec<String>, i64)> {
    let tables: Vec<String> = if sqlite {
        sqlx::query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    } else {
        sqlx::query(
            "SELECT CAST(table_name AS TEXT) AS name FROM information_schema.tables WHERE table_schema = current_schema() ORDER BY table_name",
        )
    }
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<String, _>("name"))
    .filter(|t| t != "rfaas_schema" && t != "rfaas_migrations")
    .collect();
    let mut out = Vec::new();
    for t in tables {
        let sql = if sqlite {
            format!(
                "SELECT name || ' ' || type || ' ' || \"notnull\" AS c FROM pragma_table_info('{t}') ORDER BY cid"
            )
        } else {
            format!(
                "SELECT CAST(column_name || ' ' || data_type || ' ' || is_nullable AS TEXT) AS c FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = '{t}' ORDER BY ordinal_position"
            )
        };
        let columns = sqlx::query(&sql)
            .fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>("c"))
            .collect();
        let rows: i64 = sqlx::query(&format!("SELECT COUNT(*) AS n FROM {t}"))
            .fetch_one(pool)
            .await
            .unwrap()
            .get("n");
        out.push((t, columns, rows));
    }
    let indexes: Vec<String> = if sqlite {
        sqlx::query(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL ORDER BY name",
        )
    } else {
        sqlx::query(
            "SELECT CAST(indexname AS TEXT) AS name FROM pg_indexes WHERE schemaname = current_schema() AND indexname NOT LIKE '%_pkey' ORDER BY indexname",
        )
    }
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<String, _>("name"))
    .collect();
    out.push(("(indexes)".into(), indexes, 0));
    out
}

async fn steps(pool: &AnyPool) -> Vec<(String, i64, i64)> {
    sqlx::query("SELECT owner, version, applied_ms FROM rfaas_migrations ORDER BY owner, version")
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("owner"), r.get("version"), r.get("applied_ms")))
        .collect()
}

#[rstest]
#[case::sqlite("sqlite")]
#[case::postgres("postgres")]
fn a_database_of_the_former_runner_upgrades_in_place(#[case] kind: &str) {
    let dbs = databases(kind);
    let sqlite = kind == "sqlite";
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let raw = raw_pool(&dbs.legacy).await;
        sqlx::raw_sql(LEGACY).execute(&raw).await.unwrap();
        let before = shape(&raw, sqlite).await;
        assert!(
            before
                .iter()
                .all(|(t, _, rows)| *rows > 0 || t == "(indexes)"),
            "{before:?}"
        );
        raw.close().await;

        // Opened as the manager or the accounting service would.
        let pool = rfaas_service::db::open_and_migrate(&dbs.legacy, 2)
            .await
            .unwrap();
        // Its steps became the files they were split into, with their times;
        // the manager's steps written since (after its sixth) ran once.
        const FORMER_STEPS: i64 = 6;
        let mut want: Vec<(String, i64, i64)> = (1..=FORMER_STEPS)
            .map(|v| ("manager".to_owned(), v, 1_700_000_000_000 + v))
            .collect();
        want.insert(0, ("accounting".to_owned(), 1, 1_700_000_000_002));
        let (legacy, later): (Vec<_>, Vec<_>) = steps(&pool)
            .await
            .into_iter()
            .partition(|(owner, v, _)| owner != "manager" || *v <= FORMER_STEPS);
        assert_eq!(legacy, want);
        let want: Vec<_> = legacy.into_iter().chain(later.iter().cloned()).collect();
        let manager = rfaas_service::schema::MANAGER.migrations;
        assert_eq!(
            later.iter().map(|(_, v, _)| *v).collect::<Vec<_>>(),
            (FORMER_STEPS + 1..=manager.len() as i64).collect::<Vec<_>>()
        );
        // Nothing ran again and nothing was lost: the former shape, but for
        // the tables, columns and indexes those later steps added.
        let added: Vec<&str> = manager[FORMER_STEPS as usize..]
            .iter()
            .flat_map(|m| m.sql.split("ADD COLUMN ").skip(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        let created: Vec<&str> = manager[FORMER_STEPS as usize..]
            .iter()
            .flat_map(|m| m.sql.split("CREATE TABLE ").skip(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        let indexed: Vec<&str> = manager[FORMER_STEPS as usize..]
            .iter()
            .flat_map(|m| m.sql.split("CREATE INDEX ").skip(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        let mut after = shape(&pool, sqlite).await;
        after.retain(|(table, _, _)| !created.contains(&table.as_str()));
        for (_, columns, _) in &mut after {
            columns.retain(|c| {
                !added.iter().any(|a| c.split(' ').next() == Some(a))
                    && !indexed.contains(&c.as_str())
            });
        }
        assert_eq!(after, before);
        let spent: f64 = sqlx::query("SELECT spend FROM account_spend WHERE account = 'physics'")
            .fetch_one(&pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(spent, 0.25);
        pool.close().await;
        // Opening again changes nothing.
        let pool = rfaas_service::db::open_and_migrate(&dbs.legacy, 2)
            .await
            .unwrap();
        assert_eq!(steps(&pool).await, want);

        // The same tables and columns as a database the files made.
        let fresh = rfaas_service::db::open_and_migrate(&dbs.fresh, 2)
            .await
            .unwrap();
        let strip = |s: Vec<(String, Vec<String>, i64)>| -> Vec<(String, Vec<String>)> {
            s.into_iter().map(|(t, c, _)| (t, c)).collect()
        };
        assert_eq!(
            strip(shape(&fresh, sqlite).await),
            strip(shape(&pool, sqlite).await)
        );
        let fresh_steps: Vec<(String, i64)> = steps(&fresh)
            .await
            .into_iter()
            .map(|(o, v, _)| (o, v))
            .collect();
        let legacy_steps: Vec<(String, i64)> = want.into_iter().map(|(o, v, _)| (o, v)).collect();
        assert_eq!(fresh_steps, legacy_steps);
    });
}
