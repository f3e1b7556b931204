-- A task remembers the connections it is bound to: the end of a client's older connection,
-- announced after the client registered again, must not end the tasks of its newer one.
-- NULL (tasks stored before): any connection of the client.
ALTER TABLE tasks ADD COLUMN requester_connection text;
ALTER TABLE tasks ADD COLUMN executor_connection text;

-- The leadership of the session service is a lease, renewed by the leader inside every write
-- and at least every third of its length when idle. A frozen leader's lease runs out and a
-- standby takes over; the old leader's next write finds the term changed and fails. (It was a
-- session-level advisory lock, which a frozen process keeps as long as its connection.)
-- The holder's database session (pid and start) is recorded so that a standby taking over an
-- expired lease can end that session: a leader frozen halfway through sending a statement
-- keeps its transaction, and the lease row's lock, open for as long as it is frozen.
CREATE TABLE session_leader (
    name                  text PRIMARY KEY,
    holder                text NOT NULL,
    term                  bigint NOT NULL,
    expires_ms            bigint NOT NULL,
    holder_pid            integer NOT NULL,
    holder_backend_start  timestamptz
);
