//! The configuration both drivers share.

use queue_core::QueueName;

use crate::ident::TableName;

/// Where a queue lives and how it wakes workers: the configuration of both drivers
/// (`PgQueue` on sqlx, `TpQueue` on tokio-postgres).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgQueueConfig {
    /// The queue table (default `queue_jobs`, created by `queue_postgres::migrate`).
    pub table: TableName,
    /// The queue inside the table (default `default`).
    pub queue: QueueName,
    /// Send a `NOTIFY` with each enqueue, in its transaction (default true). Costs a little at
    /// commit; lets idle workers start new jobs within milliseconds instead of at their next poll.
    pub notify_on_enqueue: bool,
    /// Keep a `LISTEN` connection and wake this handle's workers on notifications (default true).
    pub listen: bool,
    /// The largest payload an enqueue accepts, as JSON text (default
    /// [`queue_core::limits::DEFAULT_MAX_PAYLOAD_BYTES`], 1 MiB); a larger one is refused with
    /// `InvalidInput::PayloadTooLarge` before anything is written.
    pub max_payload_bytes: usize,
    /// Whether a queue whose row in `<table>_queues` this handle writes first (its first
    /// limits, pause, served mark or fenced outcome) starts with room grants switched on
    /// (default true; docs/operations.md, "Room grants"). A queue that already has its row
    /// keeps its switch, which only [`PostgresQueue::set_room_grants`] (or
    /// `queuectl queue grants`) changes. Set it to false while workers of a release without
    /// the fence of room grants may still claim from new queues: the fence makes them claim
    /// nothing from a queue whose switch is on.
    ///
    /// [`PostgresQueue::set_room_grants`]: crate::PostgresQueue::set_room_grants
    pub room_grants_for_new_queues: bool,
}

impl Default for PgQueueConfig {
    fn default() -> Self {
        PgQueueConfig {
            table: TableName::default(),
            queue: QueueName::default(),
            notify_on_enqueue: true,
            listen: true,
            max_payload_bytes: queue_core::limits::DEFAULT_MAX_PAYLOAD_BYTES,
            room_grants_for_new_queues: true,
        }
    }
}

impl PgQueueConfig {
    /// The queue `queue` in the table `table`, with wake-ups on.
    pub fn new(table: TableName, queue: QueueName) -> Self {
        PgQueueConfig {
            table,
            queue,
            ..PgQueueConfig::default()
        }
    }
}
