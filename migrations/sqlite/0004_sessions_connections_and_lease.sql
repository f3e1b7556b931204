-- A task remembers the connections it is bound to: the end of a client's older connection,
-- announced after the client registered again, must not end the tasks of its newer one.
-- NULL (tasks stored before): any connection of the client.
-- (The leadership lease of PostgreSQL has no table here: one process owns a SQLite database.)
ALTER TABLE tasks ADD COLUMN requester_connection text;
ALTER TABLE tasks ADD COLUMN executor_connection text;
