//! The tokio-postgres driver's transaction: a pooled connection inside `BEGIN`.

use deadpool_postgres::Object;

use crate::error::PgError;

/// A pooled connection inside `BEGIN`. Dropped without commit, it rolls back before the pool
/// reuses the connection.
pub struct OpenTransaction {
    pub(super) client: Option<Object>,
}

impl OpenTransaction {
    pub(super) fn client(&self) -> &Object {
        self.client.as_ref().expect("an open transaction")
    }

    pub(super) async fn finish(mut self, statement: &str) -> Result<(), PgError> {
        let client = self.client.take().expect("an open transaction");
        match client.batch_execute(statement).await {
            Ok(()) => Ok(()),
            Err(err) => {
                // The connection's state is unknown: never hand it out again.
                let _ = Object::take(client);
                Err(err.into())
            }
        }
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // Dropped inside BEGIN: roll back before the pool reuses the connection; without a
        // runtime to do that, take the connection out of the pool instead.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if client.batch_execute("ROLLBACK").await.is_err() {
                        let _ = Object::take(client);
                    }
                });
            }
            Err(_) => {
                let _ = Object::take(client);
            }
        }
    }
}

impl std::fmt::Debug for OpenTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenTransaction")
            .field("open", &self.client.is_some())
            .finish()
    }
}
