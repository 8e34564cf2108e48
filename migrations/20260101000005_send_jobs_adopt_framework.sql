-- no-transaction
-- The exchange's own half of adopting the framework, after the lease columns (0004) and before
-- the rest of the generated legacy upgrade (0006-0013):
-- * the legacy status word 'sent' becomes the framework's 'completed' (finished when last
--   updated, so retention reaches those rows);
-- * legacy rows get the payload the send handler reads (new rows are written with it).
-- In batches of 10 000 ids from the lowest, each committed on its own, so that the legacy release goes on
-- writing its rows while this runs (a DO block may commit when it runs outside a transaction:
-- sqlx runs a `-- no-transaction` file as it is). Run again, it changes nothing more.
DO $adopt$
DECLARE
    adopt_after bigint := (SELECT min(id) - 1 FROM exchange_send_jobs);
    adopt_until bigint := (SELECT max(id) FROM exchange_send_jobs);
BEGIN
    WHILE adopt_after < adopt_until LOOP
        UPDATE exchange_send_jobs
        SET status = 'completed', finished_at = coalesce(finished_at, updated_at)
        WHERE id > adopt_after AND id <= adopt_after + 10000 AND status = 'sent';

        UPDATE exchange_send_jobs AS j
        SET payload = jsonb_build_object(
                'transaction_id', t.id,
                'correlation_id', t.correlation_id,
                'partner', t.partner,
                'amount_minor', t.amount_minor)
        FROM exchange_transactions AS t
        WHERE j.id > adopt_after AND j.id <= adopt_after + 10000
          AND t.id = j.transaction_id AND j.payload = '{}'::jsonb;

        adopt_after := adopt_after + 10000;
        COMMIT;
    END LOOP;
END
$adopt$;
