//! The tokio-postgres driver's `LISTEN` connection travels over TLS as its pool does, on a
//! server of the test's own that refuses connections without TLS.

use std::time::{Duration, Instant};

use queue_core::{Backend, NewJob};
use queue_postgres::testing::TempCluster;
use queue_postgres::{LISTENER_APPLICATION_NAME, PgQueueConfig, TableName, TokioPostgresQueue};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_connection_uses_the_pools_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = TempCluster::start().expect("a PostgreSQL cluster of the test's own");
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    cluster
        .require_tls(
            &certified.cert.pem(),
            &certified.signing_key.serialize_pem(),
        )
        .unwrap();

    let conninfo = |sslmode: &str| -> tokio_postgres::Config {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode={sslmode}",
            cluster.port()
        )
        .parse()
        .unwrap()
    };
    // The server refuses plain connections: whatever listens below does so over TLS.
    let plain = conninfo("disable").connect(tokio_postgres::NoTls).await;
    assert!(
        plain.is_err(),
        "the server accepted a connection without TLS"
    );

    let mut roots = rustls::RootCertStore::empty();
    roots.add(certified.cert.der().clone()).unwrap();
    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let pg = conninfo("require");
    let manager = deadpool_postgres::Manager::new(pg.clone(), tls.clone());
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .build()
        .unwrap();
    TokioPostgresQueue::install_table(&pool, &TableName::default())
        .await
        .unwrap();
    let queue =
        TokioPostgresQueue::connect_with_tls(pool.clone(), PgQueueConfig::default(), pg, tls)
            .await
            .unwrap();

    // The listener is up over TLS: the server reports it among its TLS connections.
    let client = pool.get().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
                 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                 WHERE a.application_name = $1 AND a.query ILIKE 'LISTEN%'",
                &[&LISTENER_APPLICATION_NAME],
            )
            .await
            .unwrap();
        let (over_tls, plain): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(plain, 0, "a LISTEN connection without TLS");
        if over_tls == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the LISTEN connection never came up over TLS"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And it hears the enqueue's NOTIFY: the wake-up arrives without a poll.
    let woken = queue.wake_signal().expect("a queue with a listener");
    let notified = woken.notified();
    queue.enqueue(NewJob::new(&"hello").unwrap()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), notified)
        .await
        .expect("the enqueue's NOTIFY reached the listener");
}
