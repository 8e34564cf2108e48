//! Side effects that commit with the job's outcome, and only when it applied.

use queue_core::{BoxError, Finalize, FinalizeEvent, FinalizeHook, Payload};
use queue_postgres::{Driver, PostgresTx};

use crate::receipt::SendReceipt;

/// Marks the order's receipt as sent, in the transaction that completes the job. Written once
/// for both PostgreSQL drivers: `PgTx` and `TokioPostgresTx` are both a `PostgresTx<D>`.
pub struct MarkReceiptSent;

impl<D: Driver> FinalizeHook<PostgresTx<D>, SendReceipt> for MarkReceiptSent {
    fn name(&self) -> &str {
        "receipts.mark_sent"
    }

    async fn after_applied(
        &self,
        tx: &mut PostgresTx<D>,
        event: &FinalizeEvent<'_, SendReceipt>,
    ) -> Result<(), BoxError> {
        self.after_applied_batch(tx, std::slice::from_ref(event))
            .await
    }

    /// The worker writes outcomes many to a transaction: one statement for all of them.
    async fn after_applied_batch(
        &self,
        tx: &mut PostgresTx<D>,
        events: &[FinalizeEvent<'_, SendReceipt>],
    ) -> Result<(), BoxError> {
        // Retries, releases, failures: nothing to record.
        let sent: Vec<i64> = events
            .iter()
            .filter_map(|event| match (event.action, event.payload) {
                (Finalize::Complete, Payload::Parsed(receipt)) => Some(receipt.order_id),
                _ => None,
            })
            .collect();
        if sent.is_empty() {
            return Ok(());
        }
        let sql = "UPDATE orders SET receipt_sent_at = now() WHERE id = ANY($1)";
        tx.execute(sql, (&sent,)).await?;
        Ok(())
    }
}
