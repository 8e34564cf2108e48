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
        // Retries, releases, failures: nothing to record.
        let (Finalize::Complete, Payload::Parsed(receipt)) = (event.action, event.payload) else {
            return Ok(());
        };
        let sql = "UPDATE orders SET receipt_sent_at = now() WHERE id = $1";
        tx.execute(sql, (receipt.order_id,)).await?;
        Ok(())
    }
}
