//! A loopback proxy in front of the test server that can hold the server's replies: a statement
//! reaches the server and runs there while its caller, held on the wire, waits as long as the
//! test likes. This turns "a caller dropped while its statement is on the wire" from a race a
//! test hopes to win into a state it sets up.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::TestDb;

/// A proxy listening on a loopback port, forwarding each connection to the test server.
pub struct Proxy {
    port: u16,
    user: String,
    hold: Arc<Hold>,
    accept: tokio::task::JoinHandle<()>,
}

struct Hold {
    /// The bytes whose next appearance in a client's message starts a hold.
    armed: Mutex<Option<Vec<u8>>>,
    /// Whether the server's bytes wait.
    holding: watch::Sender<bool>,
    /// How many times every connection was cut: a forwarding task ends when it moves.
    cuts: watch::Sender<u64>,
}

impl Proxy {
    /// A proxy in front of the server of [`queue_postgres::testing::server_url`].
    pub async fn start() -> Proxy {
        let server: sqlx::postgres::PgConnectOptions = queue_postgres::testing::server_url()
            .parse()
            .expect("a postgres:// URL");
        let upstream = format!("{}:{}", server.get_host(), server.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hold = Arc::new(Hold {
            armed: Mutex::new(None),
            holding: watch::channel(false).0,
            cuts: watch::channel(0).0,
        });
        let accept = tokio::spawn({
            let hold = hold.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let server = TcpStream::connect(&upstream)
                        .await
                        .expect("the proxy reaches the test server");
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(to_server(client_read, server_write, hold.clone()));
                    tokio::spawn(to_client(server_read, client_write, hold.clone()));
                }
            }
        });
        Proxy {
            port,
            user: server.get_username().to_owned(),
            hold,
            accept,
        }
    }

    /// The URL of `db` through this proxy (without TLS, so the proxy can read the messages).
    pub fn url(&self, db: &TestDb) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}?sslmode=disable",
            self.user, self.port, db.name
        )
    }

    /// From the next client message holding `marker` on, the server's bytes (its reply to that
    /// message first) wait until [`Proxy::release`]. The message itself goes through.
    pub fn hold_replies_after(&self, marker: &[u8]) {
        *self.hold.armed.lock().unwrap() = Some(marker.to_vec());
    }

    /// Lets the server's held bytes go, in order, and disarms.
    pub fn release(&self) {
        *self.hold.armed.lock().unwrap() = None;
        self.hold.holding.send_replace(false);
    }

    /// Closes every connection open through the proxy, held bytes dropped (a network that
    /// fails under them), and disarms; connections made after pass freely.
    pub fn cut(&self) {
        *self.hold.armed.lock().unwrap() = None;
        self.hold.cuts.send_modify(|cuts| *cuts += 1);
        self.hold.holding.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn to_server(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hold: Arc<Hold>,
) {
    let mut cuts = hold.cuts.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    // The end of the previous read, so a marker split across two reads is still seen.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let Some(n) = read_or_cut(&mut from, &mut buf, &mut cuts).await else {
            break;
        };
        {
            let mut armed = hold.armed.lock().unwrap();
            if let Some(marker) = armed.as_ref() {
                let mut seen = std::mem::take(&mut tail);
                seen.extend_from_slice(&buf[..n]);
                if seen.windows(marker.len()).any(|w| w == marker.as_slice()) {
                    // Before the message goes out, so its reply cannot slip through.
                    hold.holding.send_replace(true);
                    *armed = None;
                } else {
                    let keep = seen.len().min(marker.len().saturating_sub(1));
                    tail = seen.split_off(seen.len() - keep);
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The next bytes from `from` into `buf`: `None` at its end, on an error, or at a cut.
async fn read_or_cut(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    buf: &mut [u8],
    cuts: &mut watch::Receiver<u64>,
) -> Option<usize> {
    tokio::select! {
        read = from.read(buf) => match read {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        _ = cuts.changed() => None,
    }
}

async fn to_client(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hold: Arc<Hold>,
) {
    let mut holding = hold.holding.subscribe();
    let mut cuts = hold.cuts.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let Some(n) = read_or_cut(&mut from, &mut buf, &mut cuts).await else {
            break;
        };
        // Held bytes wait for a release, or go with the connection at a cut.
        // A cut releases the hold after it moves, so looking at the cut first drops the bytes.
        let cut = tokio::select! {
            biased;
            _ = cuts.changed() => true,
            released = holding.wait_for(|held| !held) => released.is_err(),
        };
        if cut {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
