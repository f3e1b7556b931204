-- An event's task is written by the same statement as the event (the leader writes a whole
-- group at once), and tasks are never deleted, so the foreign key only cost a trigger query
-- per event row: under load, as many statements as every other write of a group together.
ALTER TABLE task_events DROP CONSTRAINT IF EXISTS task_events_task_id_fkey;
