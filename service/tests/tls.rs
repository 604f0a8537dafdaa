//! PostgreSQL over TLS with `sslmode=verify-full`: the throwaway server
//! (scripts/pg.sh) serves a certificate of its own test CA; a client given
//! that CA connects over TLS, and one given another CA is refused.

use rfaas_service::db;
use rfaas_testkit::postgres::Postgres;
use rfaas_testkit::tls::TestCa;
use rfaas_testkit::TempDir;
use sqlx::Row;

fn verify_full(url: &str, ca: &std::path::Path) -> String {
    format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display())
}

#[tokio::test]
async fn verify_full_connects_with_the_servers_ca_only() {
    let pg = Postgres::start().unwrap_or_else(|e| panic!("{e}"));
    pg.psql("ALTER SYSTEM SET ssl = on").unwrap();
    pg.psql("SELECT pg_reload_conf()").unwrap();
    let pool = db::open_and_migrate(&verify_full(pg.url(), &pg.ca_file()), 1)
        .await
        .unwrap_or_else(|e| panic!("verify-full with the server's CA: {e}"));
    let row = sqlx::query(
        "SELECT CASE WHEN ssl THEN 1 ELSE 0 END FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i32, _>(0), 1, "the connection is not TLS");
    pool.close().await;

    let dir = TempDir::new("pg-other-ca");
    let other = TestCa::make(&dir.path().join("ca"), &[]).unwrap();
    let refused = match db::open(&verify_full(pg.url(), &other.ca_file()), 1).await {
        Ok(pool) => sqlx::query("SELECT 1").fetch_one(&pool).await.err(),
        Err(e) => Some(sqlx::Error::Protocol(e.to_string())),
    };
    let err = refused.expect("connected with a CA that did not sign the server's certificate");
    let text = err.to_string();
    assert!(text.to_lowercase().contains("certificate"), "{text}");
    // The password is not in the message.
    let password = pg.url().split([':', '@']).nth(2).unwrap_or("");
    assert!(!password.is_empty() && !text.contains(password), "{text}");
}
